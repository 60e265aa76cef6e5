"""Guards of the private step on the model itself: what it is, and what its forward pass changes.

Two rules, checked by ``Privatizer`` at every step, whatever door built it (``make_private``,
``dpmf train``, a distributed run):

1. **The model and the optimizer stay what the step was built for.** The noise stream has one
   coordinate per trainable entry and the optimizer's groups were checked against the
   trainable parameters once; unfreezing or freezing a parameter, replacing one, adding a
   submodule or an optimizer group afterwards would make the noise cover the wrong entries.
   ``ModelStructure`` records the model at construction and names the first change;
   ``OptimizerGroups`` records an optimizer's groups when the optimizer is bound to the step
   (the optimizer holds it: the step never refers to its optimizer).
2. **The private forward and backward change no parameter or buffer.** Anything the forward
   pass writes into the model (running statistics, ``nn.Embedding(max_norm=…)`` renormalizing
   the rows of the batch's tokens in place, a custom ``self.buf.add_(x.sum())``) is a function
   of the batch released without noise. ``state_versions`` snapshots the version counter and
   identity of every parameter and buffer; ``check_state_unchanged`` compares after the
   forward/backward. torch bumps a tensor's version at every in-place operation on it or on a
   view sharing its counter (``detach()`` included). Writes through ``.data`` bypass the
   counter (and autograd); a write of a parameter through ``.data`` inside the forward is not an
   honest model's (it is the trainer's own code, outside the threat model) and is not looked
   for. A buffer's values are compared too: a native kernel updating running statistics
   (``F.batch_norm``) writes them without bumping their version.

Both rules read the model through ``ModelWalk``: one iterative walk of the module tree (no
generator per module, no name built twice) giving every module, parameter and buffer in the
order of ``named_modules``/``named_parameters``/``named_buffers``. A walk is never kept from
one step to the next: each check walks the model again (cheap: about 30 µs for a 100-module
model), so a parameter, buffer or submodule added or replaced at any time is seen. A private
step takes one walk before its forward (the structure check, the per-example-safety check, the
trainable parameters and the state snapshot all read it) and one after.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "ModelWalk",
    "ModelChangedError",
    "ModelStateChangedError",
    "ModelStructure",
    "OptimizerGroups",
    "StateSnapshot",
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


_NAMED_MODULES = nn.Module.named_modules


def _first_of_each(named: list) -> list:
    """``named`` (name, object) pairs with each object kept under its first name only."""
    first: dict = {}  # id → its first (name, object); a dict keeps the insertion order
    keep = first.setdefault
    for pair in named:
        keep(id(pair[1]), pair)
    return list(first.values())


class ModelWalk:
    """Every module, parameter and buffer of a model, from one walk of its module tree.

    The order and names are those of ``named_modules(remove_duplicate=False)``,
    ``named_parameters(remove_duplicate=False)`` and ``named_buffers(remove_duplicate=False)``
    (a module or tensor reachable by several paths is listed under each); ``unique_modules``
    and ``unique_params`` are ``named_modules()`` and ``named_parameters()`` (first path only).
    A module class that overrides ``named_modules`` is walked through its own method.

    Args:
        model: the network.
    """

    __slots__ = ("modules", "params", "buffers", "_unique_modules", "_unique_params")

    def __init__(self, model: nn.Module):
        modules, params, buffers = [], [], []
        stack = [("", model)]
        pop, push, add_param, add_buffer = stack.pop, stack.extend, params.append, buffers.append
        while stack:
            prefix, m = pop()
            if type(m).named_modules is not _NAMED_MODULES:  # its own notion of its submodules
                for name, sub in m.named_modules(None, prefix, False):
                    modules.append((name, sub))
                    _own_tensors(name, sub, params, buffers)
                continue
            modules.append((prefix, m))
            pre = prefix + "." if prefix else ""
            if m._parameters:
                for k, p in m._parameters.items():
                    if p is not None:
                        add_param((pre + k, p))
            if m._buffers:
                for k, b in m._buffers.items():
                    if b is not None:
                        add_buffer((pre + k, b))
            if m._modules:
                push([(pre + k, c) for k, c in reversed(m._modules.items()) if c is not None])
        self.modules: list = modules
        self.params: list = params
        self.buffers: list = buffers
        self._unique_modules = None
        self._unique_params = None

    @property
    def unique_modules(self) -> list:
        """(name, module) as ``named_modules()``: each module under its first path."""
        if self._unique_modules is None:
            self._unique_modules = _first_of_each(self.modules)
        return self._unique_modules

    @property
    def unique_params(self) -> list:
        """(name, parameter) as ``named_parameters()``: each parameter under its first name."""
        if self._unique_params is None:
            self._unique_params = _first_of_each(self.params)
        return self._unique_params

    def trainable(self) -> list:
        """(name, parameter) with ``requires_grad``, as ``dpmf.optim.clipping.trainable_parameters``
        lists them (possibly empty)."""
        return [(n, p) for n, p in self.unique_params if p.requires_grad]


def _own_tensors(prefix: str, m: nn.Module, params: list, buffers: list) -> None:
    pre = f"{prefix}." if prefix else ""
    for k, p in m._parameters.items():
        if p is not None:
            params.append((pre + k, p))
    for k, b in m._buffers.items():
        if b is not None:
            buffers.append((pre + k, b))


class ModelStructure:
    """The parameters (identity, shape, trainable or frozen) and submodules of a model, as they
    were when the private step was built.

    Args:
        model: the network.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._params, self._modules = self._snapshot()

    def _snapshot(self, walk: ModelWalk | None = None) -> tuple[list, list]:
        """((name, id, shape, requires_grad) of every parameter as ``named_parameters()`` lists
        them, (name, id) of every submodule as ``named_modules()``), from ``walk`` (a walk of
        the model taken now; None: a new one)."""
        walk = ModelWalk(self.model) if walk is None else walk
        params = [(n, id(p), p.shape, p.requires_grad) for n, p in walk.unique_params]
        return params, [(n, id(m)) for n, m in walk.unique_modules]

    def check(self, when: str, walk: ModelWalk | None = None) -> None:
        """Raise if the model changed since construction.

        Args:
            when: what is refused, for the message (e.g. ``"backward"``).
            walk: a ``ModelWalk`` of the model taken now (None: a new one).

        Raises:
            ModelChangedError: naming the first change (which parameter, frozen → trainable, a
                new submodule) and the fix.
        """
        params, modules = self._snapshot(walk)
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

    def _raise_params(self, params, when: str) -> None:
        old = {n: (i, s, g) for n, i, s, g in self._params}
        for n, i, s, g in params:
            if n not in old:
                what = f"parameter {n!r} was added"
            elif old[n][1] != s:
                what = f"parameter {n!r} was replaced (shape {tuple(old[n][1])} → {tuple(s)})"
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


class OptimizerGroups:
    """The parameter groups of an optimizer as they were when it was bound to a private step
    (held by the optimizer side: ``DPOptimizer.bind``, ``PrivateOptimizer``; the private step
    itself never refers to an optimizer).

    Args:
        optimizer: a ``torch.optim.Optimizer`` (its groups may hold (name, tensor) pairs).
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._groups = _groups(optimizer)

    def params(self) -> list:
        """The parameters in the optimizer's groups now."""
        return [_param_of(p) for g in self.optimizer.param_groups for p in g["params"]]

    def check(self, when: str) -> None:
        """Raise if the groups changed since construction.

        Raises:
            ModelChangedError: naming the change (a group added or removed, or which group's
                parameters changed) and the fix.
        """
        groups = _groups(self.optimizer)
        if groups == self._groups:
            return
        if len(groups) > len(self._groups):
            what = (
                f"the optimizer has {len(groups)} parameter groups, {len(self._groups)} when it was "
                "bound (add_param_group after make_private?)"
            )
        elif len(groups) < len(self._groups):
            what = f"the optimizer has {len(groups)} parameter groups, {len(self._groups)} when it was bound"
        else:
            i = next(i for i, (a, b) in enumerate(zip(groups, self._groups, strict=True)) if a != b)
            what = f"the parameters of optimizer group {i} changed"
        raise ModelChangedError(f"{when} refused: {what}; {_FIX_STRUCTURE}")


def _state_tensors(model: nn.Module, walk: ModelWalk | None = None) -> tuple[list, list]:
    """(parameters, buffers) of every module, listed as ``ModelWalk`` lists them (a tensor
    reachable by several paths under each), without building their names."""
    if walk is not None:
        return [p for _, p in walk.params], [b for _, b in walk.buffers]
    params, buffers = [], []
    stack = [model]
    pop, push = stack.pop, stack.extend
    while stack:
        m = pop()
        if type(m).named_modules is not _NAMED_MODULES:  # its own notion of its submodules
            for _, sub in m.named_modules(None, "", False):
                _add_own(sub, params, buffers)
            continue
        _add_own(m, params, buffers)
        if m._modules:
            push([c for c in reversed(m._modules.values()) if c is not None])
    return params, buffers


def _add_own(m: nn.Module, params: list, buffers: list) -> None:
    if m._parameters:
        params += [p for p in m._parameters.values() if p is not None]
    if m._buffers:
        buffers += [b for b in m._buffers.values() if b is not None]


class StateSnapshot:
    """What ``check_state_unchanged`` compares: every parameter and buffer of a model (as
    ``ModelWalk`` lists them), with its version, storage address, shape, strides and dtype, and a
    copy of each buffer (a native kernel that updates running statistics, ``F.batch_norm``,
    writes its buffers without bumping their version)."""

    __slots__ = ("tensors", "versions", "layouts", "copies")

    def __init__(self, params: list, buffers: list):
        self.tensors = params + buffers
        self.versions = [t._version for t in self.tensors]
        self.layouts = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in self.tensors]
        with torch.no_grad():
            self.copies = [b.clone() for b in buffers]

    def changed(self, after: StateSnapshot) -> int | None:
        """The position (in ``tensors``) of the first tensor written, replaced, added or
        removed between this snapshot and ``after`` (``len(tensors)`` for a tensor added at the
        end), or None. One host synchronisation at most (the buffers' values, compared at once)."""
        mine, theirs = self.tensors, after.tensors
        if len(mine) != len(theirs) or len(self.copies) != len(after.copies):
            return next(
                (k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a is not b),
                min(len(mine), len(theirs)),
            )
        if (
            self.versions != after.versions
            or self.layouts != after.layouts
            or any(a is not b for a, b in zip(mine, theirs, strict=True))
        ):
            return next(
                k
                for k, (a, b) in enumerate(zip(mine, theirs, strict=True))
                if a is not b or self.versions[k] != after.versions[k] or self.layouts[k] != after.layouts[k]
            )
        if not self.copies:
            return None
        differs = torch.stack([_differs(c, c2) for c, c2 in zip(self.copies, after.copies, strict=True)])
        if not bool(differs.any()):
            return None
        return len(mine) - len(self.copies) + int(differs.nonzero()[0, 0])


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: whether two copies of one buffer differ (NaN equals NaN; no sync)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.tensor(True, device=a.device)
    if a.numel() == 0:
        return torch.tensor(False, device=a.device)
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same = same | (a.isnan() & b.isnan())
    return ~same.all()


def state_versions(model: nn.Module, walk: ModelWalk | None = None) -> StateSnapshot:
    """The snapshot ``check_state_unchanged`` compares with: the version counter, storage
    address and layout of every parameter and buffer of ``model``, and each buffer's values.

    Args:
        walk: a ``ModelWalk`` of ``model`` taken now (None: the module tree is walked again).
    """
    params, buffers = _state_tensors(model, walk)
    return StateSnapshot(params, buffers)


def check_state_unchanged(
    model: nn.Module,
    before: StateSnapshot,
    during: str,
    step: int | None = None,
) -> None:
    """Raise if a parameter or buffer of ``model`` was written, replaced or added since
    ``before = state_versions(model)``.

    The module tree is walked again (a tensor added or replaced during the forward is seen);
    names are built only to report a change.

    Args:
        during: what ran in between, for the message (e.g. ``"the private forward/backward"``).
        step: the step, for the message.

    Raises:
        ModelStateChangedError: naming the tensor, why it matters and the fix.
    """
    params, buffers = _state_tensors(model)
    position = before.changed(StateSnapshot(params, buffers))
    if position is None:
        return
    walk = ModelWalk(model)
    names = [n for n, _ in walk.params] + [n for n, _ in walk.buffers]
    changed = names[position] if position < len(names) else "a tensor"
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
