"""Which batch a private step may privatize: the one the plan's sampler drew for that step, once.

The accounting of a run (amplification by sampling, a banded strategy's min-sep, balls-in-bins)
holds only if step t privatizes exactly the batch the plan's sampler drew for step t, and no
other batch: not the user's own shuffled loader, not the whole data set, not the same batch
twice (gradient accumulation by two backward calls, or the same batch in adjacent steps).
``DrawnBatches`` ties the two ends together:

- ``draw()`` takes the sampler's next batch of indices for step t (the sampler's step) and keeps
  the sampler's state before that draw, so that a checkpoint written while a DataLoader has
  drawn ahead (prefetching) still holds the sampler at the privatized step
  (``sampler_state``);
- ``record(t, batch=…, ids=…)`` notes what the door handed out for step t: the batch's tensors
  and their version counters (``make_private``'s data loader; their per-example fingerprints
  are computed when first needed) or its dataset indices (``dpmf train``, which gathers the
  batch itself);
- ``check(t, inputs, targets, example_ids)``, called by ``Privatizer.privatize`` before any
  work, refuses anything else, with the reason (the tensors handed out, received as they are,
  are matched by object and version counter without reading a value; only a copy — another
  device, dtype or layout — is compared by fingerprints); ``consume(t)`` after the step makes a second
  privatization of the same batch fail.

Fingerprints: each tensor of a batch with one row per example is reduced to two random
projections per example, f_i = x_i·W (x_i flattened, W ∈ R^{D×2} a fixed N(0, 1) matrix,
float64), and its norm r_i = ‖x_i‖₂. A received tensor matches a recorded one if its
projections agree within the rounding of its dtype: converting x_i to a dtype of machine
epsilon eps moves each entry by at most eps/2·|x_ij|, so f_i by at most
eps/2·Σ_j|W_jk||x_ij| ≤ eps/2·‖W_k‖₂·r_i (Cauchy–Schwarz); the test is
|f_ik − f'_ik| ≤ (eps + 10⁻¹⁰)·‖W_k‖₂·r_i, plus the smallest normal number times ‖W_k‖₁ for
flushed subnormals. So moving a batch to another device or dtype (float32 → bfloat16, uint8 →
float32) is accepted, while any other change of an example's values, order or count is refused
(two different examples agree on both projections with probability about
(eps·‖x‖₂·√D/‖x − x'‖₂)², per example: about 10⁻¹⁰ in float32). The cost is a float64 copy,
two projections and a norm per example and tensor, O(B·D), against the forward and backward of
B examples (``benchmarks/bench_door_checks.py``). It is a guard against mistakes in a loop, not
against a user who forges batches: whoever runs the loop can always break the guarantee on
purpose.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BatchCheckError", "DrawnBatches", "batch_fingerprints"]

_PROJECTIONS = 2
_SLACK = 1e-10  # float64 accumulation over up to ~10⁶ entries, in either order
_FIX = (
    "privatize exactly the batches the private data loader yields, each once and in order (move "
    "them to a device or dtype if needed; per-example transformations go into make_private(transform=))"
)


class BatchCheckError(RuntimeError):
    """A private step was given a batch other than the one the plan's sampler drew for it.

    The message names the step, what differs and the fix; it never names examples (batch
    membership is secret under amplified sampling).
    """


@dataclass(frozen=True, eq=False)
class _Leaf:
    """One batched tensor of a batch: D entries per example, its projections (float64, CPU)."""

    width: int
    f: torch.Tensor  # (n, 2) projections
    r: torch.Tensor  # (n, 1) ℓ2 norms of the examples


@dataclass(eq=False)
class _Record:
    """What the door handed out for one step: the loader's batch (its batched tensors, their
    version counters and, computed when first needed, their fingerprints) or dataset indices."""

    step: int
    n: int
    leaves: tuple | None  # of _Leaf (the loader's batch), or None until needed
    ids: np.ndarray | None  # dataset indices (the loop's batch), or None
    handed: dict | None = None  # id(tensor) → (tensor, its version when handed out)

    def is_handed(self, tensors: list[torch.Tensor]) -> bool:
        """Every tensor is one handed out, unchanged since (same object, same version: the
        common case, decided without reading a value)."""
        h = self.handed
        if not h:
            return False
        for t in tensors:
            entry = h.get(id(t))
            if entry is None or entry[0] is not t or _version(t) != entry[1]:
                return False
        return True

    def fingerprints(self) -> tuple | None:
        """The handed-out batch's fingerprints, computed on first use from its tensors that are
        unchanged since they were handed out (one changed in place matches nothing); None when
        there are none."""
        if self.leaves is None and self.handed:
            unchanged = [t for t, v in self.handed.values() if _version(t) == v]
            if not unchanged:
                return None
            self.leaves = batch_fingerprints(unchanged, self.n)
        return self.leaves


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), or None (inference tensors
    keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


_WEIGHTS: dict = {}


def _weights(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed projection matrix W (width × 2, float64) on ``device``, with its columns' ℓ2
    and ℓ1 norms (CPU), cached."""
    key = (width, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(0x5EED0000 + width)
        cpu = torch.randn(width, _PROJECTIONS, generator=gen, dtype=torch.float64)
        w = (cpu.to(device), torch.linalg.vector_norm(cpu, dim=0), cpu.abs().sum(0))
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        _WEIGHTS[key] = w
    return w


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors of a batch (a tensor, or nested tuples/lists/dicts), in order; other
    leaves (strings, numbers) are skipped."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (n, D) float64 on its device (D = entries per example)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(n, math.prod(t.shape[1:])).to(torch.float64)


def batch_fingerprints(batch, n: int | None = None) -> tuple:
    """The per-example fingerprints of every tensor of ``batch`` with ``n`` rows (dimension 0).

    Args:
        batch: a tensor or a (nested) tuple/list/dict of tensors, as a data loader yields it.
        n: the number of examples (default: dimension 0 of the first tensor).

    Returns:
        a tuple of fingerprints (internal), one per batched tensor.
    """
    tensors = [t for t in _tensors(batch) if t.ndim >= 1]
    if n is None:
        n = int(tensors[0].shape[0]) if tensors else 0
    out = []
    with torch.no_grad():
        for t in tensors:
            if int(t.shape[0]) != n:
                continue
            x = _rows(t, n)
            w = _weights(x.shape[1], x.device)[0]
            r = torch.linalg.vector_norm(x, dim=1, keepdim=True)
            out.append(_Leaf(int(x.shape[1]), (x @ w).cpu(), r.cpu()))
    return tuple(out)


def _received(
    tensors: list[torch.Tensor], n: int
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(D, f, relative tolerance per projection, absolute slack per projection) of each
    received tensor."""
    out = []
    with torch.no_grad():
        for t in tensors:
            x = _rows(t, n)
            w, l2, l1 = _weights(x.shape[1], x.device)
            info = torch.finfo(t.dtype) if t.is_floating_point() else None
            rel = ((info.eps if info is not None else 0.0) + _SLACK) * l2
            floor = (info.smallest_normal if info is not None else 0.0) * l1
            out.append((int(x.shape[1]), (x @ w).cpu(), rel, floor))
    return out


def _matches(received, leaves) -> bool:
    """Every received tensor equals (up to its dtype's rounding) one recorded tensor; a
    non-finite projection (an example holding NaN or ∞) matches the same non-finite value, so
    that such an example reaches the step's own non-finite check with its own message.

    The usual case — each received tensor the recorded one at its position — is decided by one
    read of all the comparisons together; only a batch that fails it is searched tensor by
    tensor."""
    same_place = []
    for k, (width, f, rel, floor) in enumerate(received):
        leaf = leaves[k] if k < len(leaves) else None
        if leaf is None or leaf.width != width or leaf.f.shape != f.shape:
            same_place = None
            break
        same_place.append(_close(leaf.f, f, leaf.r * rel + floor).all())
    if same_place is not None and (not same_place or bool(torch.stack(same_place).all())):
        return True
    for k, (width, f, rel, floor) in enumerate(received):
        # the recorded tensor at the same position first (the usual match), then the others
        order = leaves[k : k + 1] + leaves[:k] + leaves[k + 1 :]
        if not any(
            leaf.width == width and bool(_close(leaf.f, f, leaf.r * rel + floor).all()) for leaf in order
        ):
            return False
    return True


def _close(a: torch.Tensor, b: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """|a − b| ≤ tol entry-wise, with NaN matching NaN and ∞ matching the same ∞ (not read:
    no host synchronisation)."""
    near = (a - b).abs() <= tol
    return near | (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))


class DrawnBatches:
    """The batches the plan's sampler drew, step by step, and the check that each private step
    privatizes its own (see the module).

    Args:
        sampler: the run's batch sampler (``dpmf.plan.samplers.BatchSampler``, or a
            ``dpmf.distributed.RankSlices`` of one): ``next()``, ``step``, ``steps``,
            ``steps_per_epoch``, ``state_dict()`` and ``load_state_dict()``.
        step: the private step the run is at (the noise stream's ``step``); must equal the
            sampler's step.

    Raises:
        ValueError: the sampler is at another step than the noise stream.
    """

    def __init__(self, sampler, step: int):
        if int(sampler.step) != int(step):
            raise ValueError(
                f"sampler is invalid: it is at step {sampler.step} and the noise stream at step {step}; "
                "build both from the same plan at the same step (or load both from one checkpoint)"
            )
        self.sampler = sampler
        self.generation = 0
        self._before: dict[int, dict] = {}  # step → sampler state before its draw
        self._unrecorded: deque[int] = deque()  # drawn steps not yet handed out
        self._sizes: dict[int, int] = {}  # drawn step → examples drawn
        self._records: dict[int, _Record] = {}
        self._last: _Record | None = None  # the last privatized step's batch

    # -- drawing ------------------------------------------------------------------------------
    def draw(self) -> tuple[int, np.ndarray]:
        """(t, indices): the sampler's batch for its next step t, with the state before it kept.

        Raises:
            RuntimeError: the sampler is exhausted.
        """
        t = int(self.sampler.step)
        state = self.sampler.state_dict()
        idx = self.sampler.next()
        self._before[t] = state
        self._sizes[t] = int(idx.shape[0])
        self._unrecorded.append(t)
        return t, idx

    def begin(self) -> int:
        """Start a new iteration (a data loader's epoch): steps an earlier iteration drew but
        never handed out (prefetched, then abandoned) are forgotten and the sampler returns to
        its state before them, so they are drawn again; iterations started before refuse their
        next batch. Returns the iteration's token (for ``epoch`` and ``record_next``)."""
        if self._unrecorded:
            self.sampler.load_state_dict(self._before[self._unrecorded[0]])
            for u in self._unrecorded:
                self._before.pop(u, None)
                self._sizes.pop(u, None)
            self._unrecorded.clear()
        self.generation += 1
        return self.generation

    def epoch(self, token: int):
        """The batches (index arrays) of the rest of the current epoch, drawn one by one, for
        the iteration ``token`` (a ``torch.utils.data.DataLoader`` ``batch_sampler``'s
        iteration).

        Raises:
            RuntimeError: every step of the run was drawn, or a newer iteration began.
        """
        s = self.sampler
        if s.step >= s.steps:
            raise RuntimeError(
                f"sampler exhausted: the run has {s.steps} steps and all were drawn (make a new plan "
                "for more steps: its accounting covers only these)"
            )
        end = min(s.steps, (s.step // s.steps_per_epoch + 1) * s.steps_per_epoch)
        while s.step < end:
            self._check_token(token)
            yield self.draw()[1]

    def _check_token(self, token: int) -> None:
        if token != self.generation:
            raise RuntimeError(
                "this data loader iterator is stale: a newer iteration or a resume/load_state_dict "
                "started after it; start a new epoch with iter(private.data_loader)"
            )

    def reset(self) -> None:
        """Forget every draw and record (after the sampler and noise were loaded from a
        checkpoint); iterations started before refuse their next batch."""
        self._before.clear()
        self._sizes.clear()
        self._unrecorded.clear()
        self._records.clear()
        self._last = None
        self.generation += 1

    # -- what was handed out ------------------------------------------------------------------
    def record(self, step: int, *, batch=None, ids=None, n: int | None = None) -> None:
        """Note what the door handed out for ``step``: the collated ``batch`` (its fingerprints)
        and/or the dataset indices ``ids``; ``n``: its number of examples (default: the number
        drawn).

        Raises:
            RuntimeError: ``step`` is not the oldest drawn step not yet handed out.
        """
        if not self._unrecorded or self._unrecorded[0] != step:
            raise RuntimeError(
                f"step {step} is not the next drawn batch to hand out: batches are handed out in the "
                "order the sampler drew them"
            )
        self._unrecorded.popleft()
        drawn = self._sizes.pop(step)
        if ids is not None:
            ids = np.asarray(ids, dtype=np.int64).copy()
        if n is None:
            n = drawn
        leaves, handed = None, None
        if batch is not None:
            batched = [t for t in _tensors(batch) if t.ndim and int(t.shape[0]) == n]
            handed = {id(t): (t, _version(t)) for t in batched}
            if any(v is None for _, v in handed.values()):  # no version counters: fingerprint now
                leaves, handed = batch_fingerprints(batched, n), None
        self._records[step] = _Record(step, int(n), leaves, ids, handed)

    def record_next(self, batch, token: int) -> None:
        """``record`` the oldest drawn step with ``batch`` (a data loader's yield, in order).

        Raises:
            RuntimeError: the iteration ``token`` is stale (a newer one began, or a reset).
        """
        self._check_token(token)
        if not self._unrecorded:
            raise RuntimeError("no drawn batch to hand out: batches come from DrawnBatches.epoch")
        self.record(self._unrecorded[0], batch=batch)

    # -- the check ----------------------------------------------------------------------------
    def check(self, step: int, inputs, targets, example_ids=None) -> None:
        """Raise unless (inputs, targets) is the batch handed out for ``step``, not yet privatized.

        Raises:
            BatchCheckError: no batch handed out for ``step`` (another loader, the whole data set,
                a batch not yet drawn), a batch of another size, other examples or content, the
                batch of another step, or a batch already privatized.
        """
        tensors = [t for t in _tensors(inputs) + _tensors(targets)]
        if not tensors or any(t.ndim == 0 for t in tensors):
            raise BatchCheckError(
                f"backward refused at step {step}: inputs and target must be tensors batched along "
                f"dimension 0; {_FIX}"
            )
        n = int(tensors[0].shape[0])
        if any(int(t.shape[0]) != n for t in tensors):
            raise BatchCheckError(
                f"backward refused at step {step}: the tensors of the batch differ in dimension 0 "
                f"({sorted({int(t.shape[0]) for t in tensors})}); {_FIX}"
            )
        rec = self._records.get(step)
        received = None

        def same_as(other: _Record | None) -> bool:
            nonlocal received
            if other is None or other.n != n:
                return False
            if other.ids is not None and example_ids is not None:
                return np.array_equal(other.ids, _as_ids(example_ids))
            if other.is_handed(tensors):  # the handed-out tensors themselves, unchanged
                return True
            leaves = other.fingerprints()  # moved to another device or dtype: compare values
            if leaves is None:
                return False
            if received is None:
                received = _received(tensors, n)
            return _matches(received, leaves)

        if rec is None or not same_as(rec):
            if same_as(self._last):
                raise BatchCheckError(
                    f"backward refused at step {step}: this batch was already privatized at step "
                    f"{self._last.step} (a second backward on one batch, e.g. gradient accumulation, or "
                    "a batch re-used in another step); call backward once per batch (micro_batch_size= "
                    "bounds the memory of a large one)"
                )
            later = [r.step for r in self._records.values() if r.step > step and same_as(r)]
            if later:
                raise BatchCheckError(
                    f"backward refused at step {step}: this is the batch drawn for step {later[0]}; "
                    f"the batch of step {step} was skipped; {_FIX}"
                )
            if rec is None:
                where = (
                    "was drawn but not yet yielded by the data loader"
                    if step in self._before
                    else "has not been drawn (no data loader iteration reached it)"
                )
                raise BatchCheckError(
                    f"backward refused at step {step}: the plan's batch for step {step} {where}, so this "
                    f"batch of {n} examples (another loader, the whole data set?) is not it; {_FIX}"
                )
            if rec.n != n:
                raise BatchCheckError(
                    f"backward refused at step {step}: the batch has {n} examples, not the number the "
                    f"plan's sampler drew for step {step} (a split or merged batch, or one from another "
                    f"loader?); {_FIX}"
                )
            if rec.ids is not None and example_ids is None:
                raise BatchCheckError(
                    f"backward refused at step {step}: example_ids is required (the batch was handed out "
                    "by dataset indices); pass the indices the sampler drew"
                )
            raise BatchCheckError(
                f"backward refused at step {step}: the batch is not the one the plan's sampler drew for "
                f"step {step} (other examples, another order or altered values: another loader, or a "
                f"transformation in the loop?); {_FIX}"
            )

    def consume(self, step: int) -> None:
        """Mark ``step``'s batch as privatized (a second privatization of it is refused) and
        forget what earlier steps no longer need."""
        self._last = self._records.pop(step, None)
        for t in [t for t in self._before if t <= step]:
            del self._before[t]
        for t in [t for t in self._records if t < step]:
            del self._records[t]

    # -- checkpoints --------------------------------------------------------------------------
    def sampler_state(self, step: int) -> dict:
        """The sampler's state at private step ``step`` (before drawing it): what a checkpoint
        of the run at ``step`` must hold, even when a data loader has drawn ahead.

        Raises:
            RuntimeError: the state at ``step`` is no longer known.
        """
        if step in self._before:
            return self._before[step]
        if int(self.sampler.step) == step:
            return self.sampler.state_dict()
        raise RuntimeError(
            f"the sampler's state at step {step} is unknown (it is at step {self.sampler.step}); save "
            "between private steps"
        )


def _as_ids(ids) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64)
