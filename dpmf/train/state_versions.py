"""The model's state between private steps, by version counters.

A parameter or buffer written between two private steps in the user's loop (a buffer set from
the raw batch, ``m.seen_mean.copy_(x.mean(0))``) would leave the run in the exported weights
without noise. ``StateVersions`` records torch's version counter of every parameter and buffer
after each optimizer step (and after ``make_private`` and ``resume``) and refuses the next
``backward`` or ``export`` when one changed. It costs one Python read per tensor, no
synchronisation. A write through ``.data`` or under ``torch.no_grad`` on ``.data`` keeps the
version and is not seen (an honest loop does not write that way; ``docs/threat_model.md``).
"""

from __future__ import annotations

from torch import nn

from dpmf.optim.model_guard import ModelStateChangedError

__all__ = ["StateVersions"]


class StateVersions:
    """The version counters of ``model``'s parameters and buffers at the last ``record()``.

    Args:
        model: the run's module (its tensors are re-listed at each call: a module swapped in is
            refused by the private step's own structure check).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._seen: dict[int, tuple[str, object, int]] = {}
        self.record()

    def _tensors(self):
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()

    def record(self) -> None:
        """Take the current versions as the accepted state."""
        self._seen = {id(t): (name, t, t._version) for name, t in self._tensors()}

    def check(self, when: str, step: int) -> None:
        """Raise if a recorded parameter or buffer was written since ``record()``.

        Raises:
            ModelStateChangedError: names the tensor, ``when`` and the fix.
        """
        for name, t in self._tensors():
            seen = self._seen.get(id(t))
            if seen is not None and seen[1] is t and t._version != seen[2]:
                raise ModelStateChangedError(
                    f"{when} refused at step {step}: {name!r} was written between private steps (outside "
                    "backward and optimizer.step); a parameter or buffer set from the data there leaves "
                    "the run without noise. Compute such statistics inside the model's forward from "
                    "each example alone, or, for post-processing of the released weights only, write "
                    "inside `with private.post_processing():`"
                )
