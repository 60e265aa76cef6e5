"""Who owns which parameter, and which examples of a global batch a process handles.

In a sharded private step each trainable parameter has one owner process: the owner receives
the parameter's clipped-gradient sum, adds its coordinates' correlated noise and runs the
optimizer update on it (Newton–Schulz needs whole matrices, so parameters are never split).
Owners are assigned to balance the per-process noise state and Newton–Schulz work together,
by the longest-processing-time rule generalized to several costs (Graham, "Bounds on
Multiprocessing Timing Anomalies", SIAM J. Appl. Math. 1969: with one cost, each parameter,
largest first, goes to the least loaded process; makespan ≤ 4/3 of optimal).

Pure Python and numpy; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpmf._validation import check_int

__all__ = ["RankSlices", "assign_owners", "owned_by", "parameter_cost", "rank_slice"]


def parameter_cost(shape: Sequence[int], *, newton_schulz: bool = False) -> tuple[int, int]:
    """The work of one parameter: (d_j, f_j) with d_j its size — the noise state, the
    communication and an element-wise update scale with it — and f_j = d_j·min(m, k) for a
    matrix of view m×k orthogonalized by Newton–Schulz (each iteration costs O(m·k·min(m, k))
    flops), else 0.

    Args:
        shape: the parameter's shape; its matrix view is (shape[0], ∏ shape[1:]).
        newton_schulz: the parameter is updated by a Newton–Schulz (Muon) rule.
    """
    size = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if newton_schulz and len(shape) >= 2:
        rows = int(shape[0])
        return size, size * min(rows, size // max(rows, 1))
    return size, 0


def assign_owners(costs: Sequence, world_size: int) -> tuple[int, ...]:
    """The owner rank of every parameter, balancing every kind of cost at once: parameters in
    decreasing order of their largest share of a cost's total go, one by one, to the rank whose
    largest share after adding them is smallest (ties: lower rank). With one kind of cost this
    is the longest-processing-time rule. Deterministic, so every process computes the same.

    Args:
        costs: shape (P,) of numbers ≥ 0, or (P, K) — each parameter's K costs
            (``parameter_cost``: size and Newton–Schulz work); each parameter's first cost ≥ 1.
        world_size: W ≥ 1 processes.

    Returns:
        shape (P,): the owner in [0, W) of each parameter.

    Raises:
        ValueError: W < 1, no parameter, or a negative cost.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim == 1:
        c = c[:, None]
    if c.ndim != 2 or c.shape[0] == 0:
        raise ValueError("costs is invalid: give one cost (or one row of costs) per parameter")
    if not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(c[:, 0] < 1):
        raise ValueError("costs is invalid: costs must be finite and ≥ 0, the first ≥ 1")
    share = c[:, c.sum(0) > 0] / c.sum(0)[c.sum(0) > 0]
    load = np.zeros((world_size, share.shape[1]))
    owner = [0] * c.shape[0]
    for j in sorted(range(c.shape[0]), key=lambda j: (-share[j].max(), j)):
        r = min(range(world_size), key=lambda r: ((load[r] + share[j]).max(), r))
        owner[j] = r
        load[r] += share[j]
    return tuple(owner)


def owned_by(owners: Sequence[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """For each rank, the increasing indices of the parameters it owns."""
    return tuple(tuple(j for j, r in enumerate(owners) if r == rank) for rank in range(world_size))


def rank_slice(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's part of a global batch: the ``rank``-th of W contiguous, nearly equal pieces
    (``numpy.array_split``), so the W parts together are the batch, each example once.

    Args:
        indices: shape (B,), the global batch's example indices (B may be 0).
        rank, world_size: 0 ≤ rank < W.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=world_size - 1)
    return np.array_split(np.asarray(indices), world_size)[rank]


class RankSlices:
    """A batch sampler yielding this rank's slice (``rank_slice``) of each global batch of
    ``sampler``; everything else (``len``, ``step``, ``state_dict``, …) is the sampler's, so the
    global batches, their accounting and their checkpoints stay those of one process.

    With ``pad`` (a ``fully_shard`` model, whose forward and backward are collectives every rank
    must join), a rank whose slice of a non-empty global batch is empty (fewer examples than
    ranks) gets the batch's first example as **padding** instead: it runs the forward and backward
    with the others, and ``is_padding(t)`` tells its step to count nothing of it (its clipped sum,
    loss and figures are zeroed before they leave the rank). An empty global batch stays empty
    on every rank (no rank runs a forward)."""

    def __init__(self, sampler, rank: int, world_size: int, *, pad: bool = False):
        self.sampler = sampler
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        self.pad = bool(pad)
        self._padding: set[int] = set()  # steps whose slice here is padding

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for batch in self.sampler:  # the sampler's epoch; its step is past the batch now
            yield self._part(int(self.sampler.step) - 1, batch)

    def next(self) -> np.ndarray:
        t = int(self.sampler.step)
        return self._part(t, self.sampler.next())

    def _part(self, t: int, batch) -> np.ndarray:
        part = rank_slice(batch, self.rank, self.world_size)
        self._padding.discard(t)
        if self.pad and not len(part) and len(batch):
            self._padding.add(t)
            part = np.asarray(batch)[:1]
        return part

    def is_padding(self, step: int) -> bool:
        """Whether this rank's slice of step ``step``'s batch is padding (see the class)."""
        return int(step) in self._padding

    def __getattr__(self, name):
        if name == "sampler":  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.sampler, name)
