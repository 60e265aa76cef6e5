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
   counter (and autograd): the snapshot also keeps each buffer's values and a checksum of each
   parameter's entries (its bytes summed as 64-bit words, ``content_sum``), so such a write is
   seen as well (one pass over each parameter's memory per check).

Both rules read the model through ``ModelWalk``: one iterative walk of the module tree (no
generator per module, no name built twice) giving every module, parameter and buffer in the
order of ``named_modules``/``named_parameters``/``named_buffers``. A walk is never kept from
one step to the next: each check walks the model again (cheap: about 30 µs for a 100-module
model), so a parameter, buffer or submodule added or replaced at any time is seen. A private
step takes one walk before its forward (the structure check, the per-example-safety check, the
trainable parameters and the state snapshot all read it) and one after.
"""

from __future__ import annotations

import operator

import numpy as np
import torch
from torch import nn

__all__ = [
    "ModelWalk",
    "ModelChangedError",
    "ModelStateChangedError",
    "ModelStructure",
    "ContentMark",
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

    def _snapshot(self, walk: ModelWalk | None = None) -> tuple[list, list]:
        """((name, id, shape, requires_grad) of every parameter as ``named_parameters()`` lists
        them, (name, id) of every submodule as ``named_modules()``), from ``walk`` (a walk of
        the model taken now; None: a new one)."""
        walk = ModelWalk(self.model) if walk is None else walk
        params = [(n, id(p), p.shape, p.requires_grad) for n, p in walk.unique_params]
        return params, [(n, id(m)) for n, m in walk.unique_modules]

    @property
    def optimizer(self):
        """The bound optimizer (None before ``bind``)."""
        return self._optimizer

    def optimizer_params(self) -> list:
        """The parameters in the bound optimizer's groups (empty before ``bind``)."""
        if self._optimizer is None:
            return []
        return [_param_of(p) for g in self._optimizer.param_groups for p in g["params"]]

    def bind(self, optimizer) -> None:
        """Record ``optimizer``'s parameter groups too (checked by ``check``)."""
        self._optimizer = optimizer
        self._groups = _groups(optimizer)

    def check(self, when: str, walk: ModelWalk | None = None) -> None:
        """Raise if the model or the bound optimizer changed since construction.

        Args:
            when: what is refused, for the message (e.g. ``"backward"``).
            walk: a ``ModelWalk`` of the model taken now (None: a new one).

        Raises:
            ModelChangedError: naming the first change (which parameter, frozen → trainable, a
                new submodule or optimizer group) and the fix.
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
        self.check_optimizer(when)

    def check_optimizer(self, when: str) -> None:
        """Raise if the bound optimizer's parameter groups changed since ``bind`` (nothing
        without a bound optimizer).

        Raises:
            ModelChangedError: naming the change (a group added or removed, or which group's
                parameters changed) and the fix.
        """
        if self._optimizer is None:
            return
        groups = _groups(self._optimizer)
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
    ``ModelWalk`` lists them), with its version, storage address, shape, strides, dtype, lazy
    negation and conjugation bits and content (a copy of each buffer, a ``content_sum`` of each parameter)."""

    __slots__ = ("tensors", "versions", "layouts", "copies", "sums", "host")

    def __init__(self, params: list, buffers: list, views: WordViews | None):
        self.tensors = params + buffers
        plain = _plain_all(self.tensors)  # what is read below: torch's own methods, not a subclass's
        n = len(params)
        self.versions = [t._version for t in plain]
        # the layout and dtype too: ``p.data = p.data.view(...)`` keeps the address, size and
        # words (so the checksum) but changes what the model computes with
        # and the lazy negation and conjugation bits: ``p.data = torch._neg_view(p.data)`` keeps
        # the address, layout and words but negates every value the model reads
        self.layouts = [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_neg(), t.is_conj()) for t in plain]
        with torch.no_grad():
            self.copies = [b.clone() for b in plain[n:]]
            # every dtype: a frozen integer, bool or complex parameter too
            views = views if views is not None else WordViews()
            sums = views.sums(plain[:n], self.layouts[:n])
        self.sums = sums
        self.host = all(type(s) is int for s in sums)  # CPU checksums: compared as a list

    def changed(self, after: StateSnapshot) -> int | None:
        """The position (in ``tensors``) of the first tensor written, replaced, added or
        removed between this snapshot and ``after`` (``len(tensors)`` for a tensor added at the
        end), or None."""
        mine, theirs = self.tensors, after.tensors
        n_params = len(self.sums)
        if len(mine) != len(theirs) or n_params != len(after.sums):
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
        same = self.sums == after.sums if self.host and after.host else _same_sums(self.sums, after.sums)
        if not same:
            return next(k for k in range(n_params) if not _same_sums([self.sums[k]], [after.sums[k]]))
        for k, (c, c2) in enumerate(zip(self.copies, after.copies, strict=True)):
            if not _same_content(c, c2):  # a buffer written through .data
                return n_params + k
        return None


def state_versions(
    model: nn.Module, walk: ModelWalk | None = None, views: WordViews | None = None
) -> StateSnapshot:
    """The snapshot ``check_state_unchanged`` compares with: the version counter, storage
    address and content of every parameter and buffer of ``model``. The content is a copy of a
    buffer, and a checksum of a parameter's entries (writes through ``.data`` keep the version):
    see ``content_sum``.

    Args:
        walk: a ``ModelWalk`` of ``model`` taken now (None: the module tree is walked again).
        views: a ``WordViews`` kept from one check to the next (the same sums, without making
            the parameters' word views again); None: made for this call.
    """
    params, buffers = _state_tensors(model, walk)
    return StateSnapshot(params, buffers, views)


# Tensor types whose methods are torch's own: a parameter of another subclass may override
# data_ptr, is_contiguous, clone, … (a data_ptr that never changes made the kept word view of the
# old memory read as the parameter's after ``spy.data = …`` in the forward); it is read through a
# plain alias of it (same memory, version counter and layout)
_PLAIN = (torch.Tensor, nn.Parameter)
_TB = torch._C.TensorBase


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a plain ``torch.Tensor`` alias of it when its type is another subclass."""
    if type(t) in _PLAIN:
        return t
    with torch._C.DisableTorchFunctionSubclass():  # nor the subclass's __torch_function__
        return _TB.as_subclass(_TB.detach(t), torch.Tensor)


def _plain_all(tensors: list) -> list:
    if all(type(t) in _PLAIN for t in tensors):
        return tensors
    return [_plain(t) for t in tensors]


_WORD = np.dtype(np.uint64)
_REDUCE = np.add.reduce


def content_sum(p: torch.Tensor):
    """A checksum of the entries of ``p`` that a write of any one entry changes.

    On CPU (a strided tensor, any dtype): the sum, modulo 2⁶⁴, of its bytes read as 64-bit
    words (a last partial word as an integer of its bytes), an ``int``. Two values of one word
    differ by a non-zero amount below 2⁶⁴, so changing the entries of a single word always
    changes the sum — where a float64 sum of float32 entries misses a change smaller than its
    last bit — and it reads the memory once without converting it (half the time of numpy's
    float64 reduction of float32 entries, a fifth of ``sum(dtype=float64)``). Writes that change
    several words by amounts summing to 0 mod 2⁶⁴ are not seen (as with any sum; a swap of two
    entries at the same offset within their words, for example). On another device: the
    float64 sum, a 0-d tensor (no copy to the host); of an integer or bool tensor the int64 sum
    (exact modulo 2⁶⁴), of a complex one the float64 sum of its real and imaginary parts.
    """
    if p.device.type != "cpu" or p.layout != torch.strided:
        if p.is_complex():
            return torch.view_as_real(p.detach()).sum(dtype=torch.float64)
        if not p.is_floating_point():
            return p.detach().sum(dtype=torch.int64)
        return p.sum(dtype=torch.float64)
    return _sum_words(*_words(p))


def _words(p: torch.Tensor) -> tuple:
    """(the whole 64-bit words of a CPU tensor's bytes as a uint64 array, its last bytes)."""
    x = p.detach() if p.requires_grad else p
    if x.is_neg() or x.is_conj():  # a lazy negated or conjugated view: its values, materialized
        x = x.resolve_neg().resolve_conj()
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dtype in _NUMPY:
        a = x.numpy().reshape(-1)
    else:  # bfloat16 and others numpy has no type for: their bytes
        a = x.reshape(-1).view(torch.uint8).numpy()
    whole = a.nbytes - a.nbytes % 8
    if whole == a.nbytes:
        return a.view(_WORD), None
    raw = a.view(np.uint8)
    return raw[:whole].view(_WORD), raw[whole:]


def _sum_words(words, tail) -> int:
    head = int(np.add.reduce(words)) if words.size else 0
    if tail is None:
        return head
    return (head + int.from_bytes(tail.tobytes(), "little")) % (1 << 64)


class ContentMark:
    """A tensor's version, storage address, shape, strides, dtype, negation and conjugation bits
    and ``content_sum``, taken now; its word view is kept (a CPU tensor), so that checking the
    tensor again reads its memory once more without making the view again.

    Args:
        t: the tensor (e.g. a private gradient just written).
    """

    __slots__ = ("_meta", "_sum", "_view")

    def __init__(self, t: torch.Tensor):
        t = _plain(t)
        self._meta = (t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_neg(), t.is_conj())
        if t.is_cpu and t.layout == torch.strided and t.is_contiguous() and not (t.is_neg() or t.is_conj()):
            self._view = _words(t)
            self._sum = _sum_words(*self._view)
        else:
            self._view = None
            self._sum = content_sum(t)

    def unchanged(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (the tensor marked) has the same version, address, layout, dtype and
        content as when marked — a write through ``t.data`` keeps the version but not the
        content."""
        t = _plain(t)
        if (t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_neg(), t.is_conj()) != self._meta:
            return False
        if self._view is not None and t.is_cpu and t.is_contiguous():
            return _sum_words(*self._view) == self._sum
        return _same_sums([content_sum(t)], [self._sum])


class WordViews:
    """``content_sum`` with each CPU parameter's word view kept between calls: a view is
    reused while the parameter is the same tensor on the same memory (contiguous, at the same
    address, of the same size), else made again; views of tensors not summed since the last
    ``prune`` are dropped then (nothing replaced stays alive)."""

    __slots__ = ("_views", "_seen", "_last")

    def __init__(self):
        self._views: dict = {}
        self._seen: set = set()
        # the last ``sums`` with layouts: (tensors, layouts, each one's kept entry or None,
        # the ids of the kept ones, every kept words array when none has a tail, else None)
        self._last: tuple | None = None

    def _kept(self, t: torch.Tensor):
        """(t, address, size in bytes, words, tail) of a strided contiguous CPU tensor — the kept
        entry while it is exactly ``t``'s memory, else made again — or None for any other tensor."""
        if t.layout != torch.strided or not t.is_cpu or not t.is_contiguous() or t.is_neg() or t.is_conj():
            return None
        k = id(t)
        e = self._views.get(k)
        if e is None or e[0] is not t or e[1] != t.data_ptr() or e[2] != t.nbytes:
            e = self._views[k] = (t, t.data_ptr(), t.nbytes, *_words(t))
        self._seen.add(k)
        return e

    def sum(self, p: torch.Tensor):
        """``content_sum(p)``."""
        return self._summed(p)[0]

    def _summed(self, p: torch.Tensor) -> tuple:
        """(``content_sum(p)``, the kept entry read, or None when ``p`` has no word view)."""
        e = self._kept(p)
        if e is None:
            return content_sum(p), None
        return (int(_REDUCE(e[3])) if e[4] is None else _sum_words(e[3], e[4])), e

    def sums(self, tensors: list, layouts: list | None = None) -> list:
        """``[content_sum(t) for t in tensors]``, one sum per tensor listed several times (a
        tied parameter under each of its names).

        Args:
            layouts: each tensor's (address, shape, strides, dtype, negation and conjugation
                bits) taken now, or None. When
                the tensors are those of the last call with layouts (the same objects, in the
                same order) and their layouts are unchanged, every kept view is still exactly
                its tensor's memory (the rule of ``sum``): the views are read without checking
                each tensor again.
        """
        last = self._last
        if (
            layouts is not None
            and last is not None
            and last[1] == layouts
            and len(last[0]) == len(tensors)
            and all(map(operator.is_, last[0], tensors))
        ):
            self._seen.update(last[3])
            if last[4] is not None:
                return [int(_REDUCE(w)) for w in last[4]]
            kept = zip(tensors, last[2], strict=True)
            return [content_sum(t) if e is None else _sum_words(e[3], e[4]) for t, e in kept]
        once: dict = {}
        out, entries = [], []
        for t in tensors:
            got = once.get(id(t))
            if got is None:
                got = once[id(t)] = self._summed(t)
            out.append(got[0])
            entries.append(got[1])  # the entry read now (None: no view; never an older one)
        if layouts is not None:
            plain = None if any(e is None or e[4] is not None for e in entries) else [e[3] for e in entries]
            ids = tuple(id(t) for t, e in zip(tensors, entries, strict=True) if e is not None)
            self._last = (list(tensors), list(layouts), entries, ids, plain)
        return out

    def prune(self) -> None:
        """Drop the views of tensors not summed since the last ``prune``."""
        for k in [k for k in self._views if k not in self._seen]:
            del self._views[k]
        if self._last is not None and not all(k in self._seen for k in self._last[3]):
            self._last = None
        self._seen = set()


_NUMPY = {
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
}


def _same_sums(a: list, b: list) -> bool:
    """Whether two lists of ``content_sum`` values are equal (device sums: NaN equals NaN)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and _same_content(x, y)):
                return False
        elif x != y:
            return False
    return True


def _same_content(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else (a == b)).all())


def check_state_unchanged(
    model: nn.Module,
    before: StateSnapshot,
    during: str,
    step: int | None = None,
    views: WordViews | None = None,
) -> None:
    """Raise if a parameter or buffer of ``model`` was written, replaced or added since
    ``before = state_versions(model)``.

    The module tree is walked again (a tensor added or replaced during the forward is seen);
    names are built only to report a change.

    Args:
        during: what ran in between, for the message (e.g. ``"the private forward/backward"``).
        step: the step, for the message.
        views: the ``WordViews`` ``before`` was taken with (None: made for this call).

    Raises:
        ModelStateChangedError: naming the tensor, why it matters and the fix.
    """
    params, buffers = _state_tensors(model)
    position = before.changed(StateSnapshot(params, buffers, views))
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
