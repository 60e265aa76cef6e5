"""Where the training loop evaluates the per-example gradients of a step: the hook through
which DiSK's prediction gets its extra forward/backward pass.

A plan is a tuple of ``EvaluationPoint(weight, shift)``: the per-example vector of example ξ
at parameters θ is Σ_j weight_j · ∇ℓ(θ + shift_j; ξ) (shift None: θ itself). The loop
clips **that vector** to ζ, sums over the batch and adds the step's noise once, so a plan
changes what is released but not its sensitivity or the number of releases: the privacy
accounting of the run is unchanged (``dpmf.optim.filters``, DiSK, for the argument). The
plain plan is one point of weight 1 at θ.

``DiskLookahead`` gives DiSK's plan (Zhang et al., "DiSK: Differentially Private Optimizer
with Simplified Kalman Filter for Noise Reduction", arXiv:2410.03883):

    step 1:  {(1, θ_1)}
    step t:  {(1 − c, θ_t), (c, θ_t + γ·(θ_t − θ_{t−1}))},   c = (1−κ)/(κγ),

dropping a point of weight 0 (c = 1 for γ = (1−κ)/κ: one pass; c = 0 for κ = 1).
It keeps θ_{t−1} (one copy of the trainable parameters), which it takes at each call, so the
loop calls ``points`` exactly once per step, before computing the gradients, and saves
``state_dict()`` in its checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from dpmf._validation import check_real

__all__ = ["EvaluationPoint", "DiskLookahead", "named_tensors"]


@dataclass(frozen=True, eq=False)
class EvaluationPoint:
    """One term of a step's per-example vector: ``weight`` · ∇ℓ(θ + ``shift``; ξ).

    Attributes:
        weight: a finite real (may be negative).
        shift: parameter name → tensor of that parameter's shape, device and dtype, added to
            it; None for θ itself. Names are those of the trainable parameters.
    """

    weight: float
    shift: dict | None = None


def named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of ``params``: an nn.Module (its trainable parameters) or an
    iterable of (name, tensor) pairs.

    Raises:
        TypeError: anything else.
    """
    if isinstance(params, nn.Module):
        return [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    if isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        named = list(params)
        for i, item in enumerate(named):
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    f"params is invalid: item {i} is {type(item).__name__}; expected an "
                    "nn.Module or (name, tensor) pairs such as model.named_parameters()"
                )
        return named
    raise TypeError(
        f"params={type(params).__name__} is invalid: expected an nn.Module or (name, tensor) pairs"
    )


class DiskLookahead:
    """DiSK's evaluation plan (module docstring), with θ_{t−1} as its state.

    Args:
        kappa: Kalman gain κ in (0, 1], as the ``Disk`` filter stage.
        gamma: extrapolation length γ > 0, as the ``Disk`` filter stage.

    Raises:
        ValueError: kappa outside (0, 1], gamma <= 0.
    """

    def __init__(self, kappa: float = 0.7, gamma: float = 0.5):
        from dpmf.optim.filters import disk_extrapolation_weight

        self.kappa = check_real("kappa", kappa, low=0.0, high=1.0, low_inclusive=False)
        self.gamma = check_real("gamma", gamma, low=0.0, low_inclusive=False)
        self.weight = disk_extrapolation_weight(self.kappa, self.gamma)
        self._previous: dict[str, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"DiskLookahead(kappa={self.kappa!r}, gamma={self.gamma!r})"

    @property
    def passes(self) -> int:
        """Forward/backward passes per step from the second step on (1 or 2)."""
        return sum(1 for w in (1.0 - self.weight, self.weight) if w != 0.0)

    @torch.no_grad()
    def points(self, params) -> tuple[EvaluationPoint, ...]:
        """The plan of the current step at the parameters θ_t = ``params``; records θ_t as
        the previous point of the next call.

        Args:
            params: the model (its trainable parameters) or (name, tensor) pairs.

        Returns:
            one or two ``EvaluationPoint``s (module docstring); shifts γ·(θ_t − θ_{t−1}) are
            new tensors of each parameter's device and dtype.

        Raises:
            ValueError: the parameters' names or shapes differ from those of the last call.
        """
        named = named_tensors(params)
        previous = self._previous
        if previous is None:
            plan = (EvaluationPoint(1.0, None),)
        else:
            self._check_same(named, previous)
            shift = {
                n: (p.detach() - previous[n].to(device=p.device, dtype=p.dtype)).mul_(self.gamma)
                for n, p in named
            }
            terms = ((1.0 - self.weight, None), (self.weight, shift))
            plan = tuple(EvaluationPoint(w, s) for w, s in terms if w != 0.0)
        self._previous = {n: p.detach().clone() for n, p in named}
        return plan

    @staticmethod
    def _check_same(named, previous) -> None:
        names = [n for n, _ in named]
        if names != list(previous):
            raise ValueError(
                f"params is invalid: names {names} differ from those of the previous step {list(previous)}"
            )
        for n, p in named:
            if p.shape != previous[n].shape:
                raise ValueError(
                    f"params is invalid: {n!r} has shape {tuple(p.shape)}, "
                    f"previously {tuple(previous[n].shape)}"
                )

    def state_dict(self) -> dict:
        """κ, γ and θ_{t−1} (tensors on their devices), for checkpoints."""
        prev = None if self._previous is None else {n: v.clone() for n, v in self._previous.items()}
        return {"kappa": self.kappa, "gamma": self.gamma, "previous": prev}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``.

        Raises:
            ValueError: κ or γ differ from this object's.
        """
        for key in ("kappa", "gamma"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state is invalid: {key}={state.get(key)!r} differs from {getattr(self, key)!r}"
                )
        prev = state.get("previous")
        self._previous = None if prev is None else {n: v.clone() for n, v in prev.items()}
