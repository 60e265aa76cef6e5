"""Batch independence, checked on the run's first batch: the probe.

The sensitivity ζ of the clipped sum holds only if each example's contribution depends on that
example alone. Refusing layer classes (BatchNorm) cannot see coupling written as tensor ops —
a "feature centring" ``x - x.mean(0)``, attention over dimension 0 of a layer built without
``batch_first=True``, a hand-written batch norm. So before the first private step the model is
probed on the first batch of at least two examples: for a watched example i (the first and
the last of a sub-batch of at most ``PROBE_EXAMPLES``), every other example of the sub-batch is
replaced by a copy of example i, and

* example i's output (every tensor of the model's output whose first dimension is the batch)
  must not change, and
* example i's per-example gradient norm under the run's clipping method must not change.

Each pass starts from the same random state (dropout draws the same masks), and the global
generators are restored afterwards, so the run's trajectory is that of a run without the probe.
A failure names the first module (in the order calls finish) whose inputs for example i were
unchanged and whose output for it changed, with the fix. Cost, once per run: three forward
passes without gradients and three forward/backward passes of at most ``PROBE_EXAMPLES``
examples.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["PROBE_EXAMPLES", "BatchCouplingError", "batch_size_of", "probe_batch_independence", "take_rows"]

#: the most examples the probe runs at once
PROBE_EXAMPLES = 8
_RTOL = 1e-4  # relative to the largest entry of the output tensor; coupling at B ≤ 8 is ≫ this


class BatchCouplingError(ValueError):
    """The model's output or per-example gradient for one example depends on the others."""


def _leaves(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _leaves(v)
    elif hasattr(obj, "to_tuple") and callable(obj.to_tuple):  # a Hugging Face ModelOutput
        yield from _leaves(obj.to_tuple())


def batch_size_of(inputs) -> int:
    """B: dimension 0 of the first tensor of ``inputs`` (a tensor, tuple or dict); 0 if none."""
    for t in _leaves(inputs):
        return int(t.shape[0]) if t.dim() else 0
    return 0


def take_rows(obj, index: torch.Tensor, batch: int):
    """``obj`` with every tensor of first dimension ``batch`` indexed by ``index`` along it."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() and obj.shape[0] == batch:
            return obj.index_select(0, index.to(obj.device))
        return obj
    if isinstance(obj, Mapping):
        return {k: take_rows(v, index, batch) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(take_rows(v, index, batch) for v in obj)
    if isinstance(obj, list):
        return [take_rows(v, index, batch) for v in obj]
    return obj


def _call(model, inputs):
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _rows(obj, i: int, batch: int) -> list[torch.Tensor]:
    """Row i of every floating or integer tensor in ``obj`` whose first dimension is ``batch``."""
    return [t[i].detach().double() for t in _leaves(obj) if t.dim() and t.shape[0] == batch]


def _same(a: list, b: list, scales: list | None = None) -> bool:
    if len(a) != len(b):
        return False
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.shape != y.shape:
            return False
        scale = scales[k] if scales is not None else max(float(x.abs().max()) if x.numel() else 0.0, 1e-30)
        if x.numel() and float((x - y).abs().max()) > _RTOL * scale:
            return False
    return True


class _Calls:
    """Forward hooks on every submodule recording, per call, example i's input and output rows."""

    def __init__(self, model: nn.Module, i: int, batch: int):
        self.calls: list[tuple[str, nn.Module, list, list]] = []
        self.handles = []
        for name, m in model.named_modules():
            self.handles.append(
                m.register_forward_hook(self._hook(name or "(the model)", i, batch), with_kwargs=True)
            )

    def _hook(self, name, i, batch):
        def hook(module, args, kwargs, output):
            self.calls.append((name, module, _rows((args, kwargs), i, batch), _rows(output, i, batch)))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _culprit(first: list, second: list) -> tuple[str, nn.Module] | None:
    """The first call whose inputs agree and whose output differs between two passes."""
    for (name, m, a_in, a_out), (_, _, b_in, b_out) in zip(first, second, strict=False):
        if _same(a_in, b_in) and not _same(a_out, b_out):
            return name, m
    return None


def _fix(module: nn.Module | None) -> str:
    kind = type(module).__name__ if module is not None else ""
    if isinstance(
        module,
        nn.MultiheadAttention
        | nn.TransformerEncoderLayer
        | nn.TransformerDecoderLayer
        | nn.TransformerEncoder
        | nn.TransformerDecoder
        | nn.Transformer,
    ):
        return (
            f"{kind} was built with batch_first=False and is fed (batch, sequence, features): it "
            "attends across the batch; build it with batch_first=True"
        )
    if "norm" in kind.lower():
        return f"{kind} normalizes over the batch: use GroupNorm or LayerNorm (statistics of each example)"
    return (
        "a statistic over the batch (x.mean(0), a batch norm, attention over dimension 0) mixes the "
        "examples: compute it from each example alone (LayerNorm/GroupNorm, batch_first=True)"
    )


def _rng_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def probe_batch_independence(model: nn.Module, inputs, targets, norms_of, *, whole: bool = False) -> None:
    """Refuse a model whose examples influence each other (see the module docstring).

    Args:
        model: the run's module (left as it was; the global random generators restored).
        inputs, targets: the first batch (B ≥ 2), as the private step receives them.
        norms_of: ``norms_of(inputs, targets)`` → per-example gradient norms, shape (b,), under
            the run's clipping method.
        whole: run every pass before raising the first coupling found or error raised by
            ``norms_of`` (the passes of a fully_shard model are collectives every rank joins);
            False: stop at the first.

    Raises:
        BatchCouplingError: one line naming the coupling module (or the model), the example
            index in the probe's sub-batch, and the fix.
    """
    batch = batch_size_of(inputs)
    b = min(batch, PROBE_EXAMPLES)
    if b < 2:
        return
    head = torch.arange(b)
    x, y = take_rows(inputs, head, batch), take_rows(targets, head, batch)
    devices = _rng_devices(model)
    with torch.random.fork_rng(devices=devices):
        state = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]

        def fresh():
            torch.set_rng_state(state)
            for d, s in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(s, d)

        found: list[Exception] = []

        def refuse(err: Exception) -> None:
            if not whole:
                raise err
            found.append(err)

        def norms(xb, yb):
            try:
                return norms_of(xb, yb)
            except Exception as err:  # a gradient check (NaN): the passes go on, the first raised
                if not whole:
                    raise
                found.append(err)
                return None

        for i in (0, b - 1):
            same = torch.full((b,), i, dtype=torch.long)
            xs, ys = take_rows(x, same, b), take_rows(y, same, b)
            passes = []
            for batch_in in (x, xs):
                calls = _Calls(model, i, b)
                try:
                    fresh()
                    with torch.no_grad():
                        out = _call(model, batch_in)
                finally:
                    calls.remove()
                passes.append((calls.calls, _rows(out, i, b)))
            (calls_a, out_a), (calls_b, out_b) = passes
            if not _same(out_a, out_b):
                at = _culprit(calls_a, calls_b)
                where = "the model" if at is None else f"module {at[0]!r} ({type(at[1]).__name__})"
                refuse(BatchCouplingError(
                    f"model is invalid: example {i}'s output changes when the other examples of its batch "
                    f"change (first at {where}), so one example moves the others' gradients and the clipped "
                    f"sum's sensitivity exceeds ζ; {_fix(None if at is None else at[1])}"
                ))  # fmt: skip
            fresh()
            n_a = norms(x, y)
            fresh()
            n_b = norms(xs, ys)
            if n_a is None or n_b is None:  # whole: a pass failed (its error kept)
                continue
            a, c = float(n_a[i]), float(n_b[i])
            if abs(a - c) > _RTOL * max(abs(a), abs(c), 1e-30) and not found:
                refuse(BatchCouplingError(
                    f"model is invalid: example {i}'s per-example gradient norm changes with the other "
                    f"examples of its batch ({a:.6g} → {c:.6g}) under this clipping method, so the clipped "
                    f"sum's sensitivity exceeds ζ; its output does not change, so either the backward "
                    "mixes the examples or this method's per-layer records do not follow them (e.g. a "
                    "layer's output shared by the batch and indexed rather than broadcast): "
                    f"{_fix(None)}, or use clipping='vmap' (each example's gradient alone)"
                ))  # fmt: skip
        if found:
            raise found[0]
