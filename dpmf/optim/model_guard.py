"""Guards of the private step on the model itself: what it is, and what its forward pass changes.

Two rules, checked by ``Privatizer`` at every step, whatever door built it (``make_private``,
``dpmf train``, a distributed run):

1. **The model and the optimizer stay what the step was built for.** The noise stream has one
   coordinate per trainable entry and the optimizer's groups were checked against the
   trainable parameters once; unfreezing or freezing a parameter, replacing one, adding a
   submodule or an optimizer group afterwards would make the noise cover the wrong entries.
   ``ModelStructure`` records them at construction and names the first change.
2. **The private forward and backward change no parameter or buffer.** Anything the forward
   pass writes into the model (running statistics, ``nn.Embedding(max_norm=…)`` renormalizing
   the rows of the batch's tokens in place, a custom ``self.buf.add_(x.sum())``) is a function
   of the batch released without noise. ``state_versions`` snapshots the version counter and
   identity of every parameter and buffer; ``check_state_unchanged`` compares after the
   forward/backward. torch bumps a tensor's version at every in-place operation on it or on a
   view sharing its counter (``detach()`` included). Writes through ``.data`` bypass the
   counter (and autograd): the snapshot also keeps each buffer's values and a float64 sum of
   each parameter, so such a write is seen as well (one reduction per parameter per step).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "ModelChangedError",
    "ModelStateChangedError",
    "ModelStructure",
    "state_versions",
    "check_state_unchanged",
]

_FIX_STRUCTURE = (
    "call make_private (or build the private step) again after changing the model or the optimizer"
)


class ModelChangedError(RuntimeError):
    """The model or optimizer changed after the private step was built for it."""


class ModelStateChangedError(RuntimeError):
    """The private forward/backward changed a parameter or buffer (a release without noise)."""


def _param_of(p):
    return p[1] if isinstance(p, tuple) else p  # dpmf DP optimizers may hold (name, p)


def _groups(optimizer) -> tuple:
    return tuple(tuple(id(_param_of(p)) for p in g["params"]) for g in optimizer.param_groups)


class ModelStructure:
    """The parameters (identity, shape, trainable or frozen) and submodules of a model, and the
    parameter groups of a bound optimizer, as they were when the private step was built.

    Args:
        model: the network.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._params, self._modules = self._snapshot()
        self._optimizer = None
        self._groups: tuple = ()

    def _snapshot(self) -> tuple[tuple, tuple]:
        """((name, id, shape, requires_grad) of every parameter as ``named_parameters()`` lists
        them, (name, id) of every submodule as ``named_modules()``) in one walk of the model."""
        params, modules, seen = [], [], set()
        for prefix, m in self.model.named_modules():
            modules.append((prefix, id(m)))
            for k, p in m._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                params.append(
                    (f"{prefix}.{k}" if prefix else k, id(p), tuple(p.shape), bool(p.requires_grad))
                )
        return tuple(params), tuple(modules)

    def bind(self, optimizer) -> None:
        """Record ``optimizer``'s parameter groups too (checked by ``check``)."""
        self._optimizer = optimizer
        self._groups = _groups(optimizer)

    def check(self, when: str) -> None:
        """Raise if the model or the bound optimizer changed since construction.

        Args:
            when: what is refused, for the message (e.g. ``"backward"``).

        Raises:
            ModelChangedError: naming the first change (which parameter, frozen → trainable, a
                new submodule or optimizer group) and the fix.
        """
        params, modules = self._snapshot()
        if params != self._params:
            self._raise_params(params, when)
        if modules != self._modules:
            old = dict(self._modules)
            new = dict(modules)
            added = [n for n in new if n not in old or old[n] != new[n]]
            removed = [n for n in old if n not in new]
            what = (
                f"submodule {added[0]!r} was added or replaced"
                if added
                else f"submodule {removed[0]!r} was removed"
            )
            raise ModelChangedError(
                f"{when} refused: {what} after the private step was built (its forward would run "
                f"unchecked); {_FIX_STRUCTURE}"
            )
        if self._optimizer is not None:
            groups = _groups(self._optimizer)
            if groups != self._groups:
                if len(groups) > len(self._groups):
                    what = (
                        f"the optimizer has {len(groups)} parameter groups, {len(self._groups)} when it was "
                        "bound (add_param_group after make_private?)"
                    )
                elif len(groups) < len(self._groups):
                    what = (
                        f"the optimizer has {len(groups)} parameter groups, {len(self._groups)} when it "
                        "was bound"
                    )
                else:
                    i = next(i for i, (a, b) in enumerate(zip(groups, self._groups, strict=True)) if a != b)
                    what = f"the parameters of optimizer group {i} changed"
                raise ModelChangedError(f"{when} refused: {what}; {_FIX_STRUCTURE}")

    def _raise_params(self, params, when: str) -> None:
        old = {n: (i, s, g) for n, i, s, g in self._params}
        for n, i, s, g in params:
            if n not in old:
                what = f"parameter {n!r} was added"
            elif old[n][1] != s:
                what = f"parameter {n!r} was replaced (shape {old[n][1]} → {s})"
            elif old[n][0] != i:
                what = f"parameter {n!r} was replaced by another tensor"
            elif old[n][2] != g:
                change = "frozen → trainable" if g else "trainable → frozen"
                what = f"parameter {n!r} changed {change} (requires_grad={g})"
            else:
                continue
            break
        else:
            gone = [n for n in old if n not in {p[0] for p in params}]
            what = f"parameter {gone[0]!r} was removed" if gone else "the parameters were reordered"
        raise ModelChangedError(
            f"{when} refused: {what} after the private step was built (its noise and clipping cover "
            f"the trainable parameters of that time); {_FIX_STRUCTURE}"
        )


def state_versions(model: nn.Module) -> list:
    """(name, tensor, version, storage address, content) of every parameter and buffer of
    ``model``: the snapshot ``check_state_unchanged`` compares with. The content is a copy of a
    buffer, and a float64 sum of a parameter (writes through ``.data`` keep the version)."""
    params, buffers = _named_tensors(model)
    out = [(n, p, p._version, p.data_ptr(), None) for n, p in params]
    with torch.no_grad():
        out += [(n, b, b._version, b.data_ptr(), b.clone()) for n, b in buffers]
        once: dict[int, torch.Tensor] = {}  # a tied tensor listed under several names: one sum
        sums = []
        for _, p in params:
            if p.dtype.is_floating_point:
                if id(p) not in once:
                    once[id(p)] = p.sum(dtype=torch.float64)
                sums.append(once[id(p)])
        out.append(("", None, 0, 0, torch.stack(sums) if sums else None))
    return out


def _named_tensors(model: nn.Module) -> tuple[list, list]:
    """``named_parameters(remove_duplicate=False)`` and ``named_buffers(remove_duplicate=False)``
    in one walk of the model (the same names, tensors and order)."""
    params, buffers = [], []
    for prefix, m in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        params += [(pre + k, p) for k, p in m._parameters.items() if p is not None]
        buffers += [(pre + k, b) for k, b in m._buffers.items() if b is not None]
    return params, buffers


def _same_content(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else (a == b)).all())


def _changed_parameter(model: nn.Module, before, after) -> str:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_floating_point()]
    for n, a, b in zip(names, before, after, strict=False):
        if not _same_content(a.reshape(1), b.reshape(1)):
            return n
    return "a parameter"


def check_state_unchanged(model: nn.Module, before: list, during: str, step: int | None = None) -> None:
    """Raise if a parameter or buffer of ``model`` was written, replaced or added since
    ``before = state_versions(model)``.

    Args:
        during: what ran in between, for the message (e.g. ``"the private forward/backward"``).
        step: the step, for the message.

    Raises:
        ModelStateChangedError: naming the tensor, why it matters and the fix.
    """
    after = state_versions(model)
    changed = None
    if len(after) != len(before):
        names = {n for n, *_ in before}
        changed = next((n for n, *_ in after if n not in names), "a tensor")
    else:
        for (n, t, v, ptr, _c), (n2, t2, v2, ptr2, _c2) in zip(before, after, strict=True):
            if n != n2 or t is not t2 or v != v2 or ptr != ptr2:
                changed = n2
                break
        else:
            for (n, *_, c), (*_, c2) in zip(before, after, strict=True):
                if not _same_content(c, c2):  # a write through .data
                    changed = n or _changed_parameter(model, before[-1][4], after[-1][4])
                    break
    if changed is None:
        return
    at = "" if step is None else f" at step {step}"
    raise ModelStateChangedError(
        f"private step refused{at}: {during} changed the model's {changed!r} in place (running statistics, "
        "nn.Embedding(max_norm=...), or a forward that writes a parameter or buffer): that change is a "
        "function of the batch released without noise, so the model now leaks it; do not use or release "
        "this model state (reload a checkpoint), and remove the write from the forward (max_norm=None, "
        "GroupNorm/LayerNorm, track_running_stats=False)"
    )
