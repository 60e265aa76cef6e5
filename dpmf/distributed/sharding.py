"""Who owns which parameter, and which examples of a global batch a process handles.

In a sharded private step each trainable parameter has one owner process: the owner receives
the parameter's clipped-gradient sum, adds its coordinates' correlated noise and runs the
optimizer update on it (Newton–Schulz needs whole matrices, so parameters are never split).
Owners are assigned to balance the per-process work by the longest-processing-time rule
(Graham, "Bounds on Multiprocessing Timing Anomalies", SIAM J. Appl. Math. 1969: each
parameter, largest cost first, goes to the least loaded process; makespan ≤ 4/3 of optimal).

Pure Python and numpy; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpmf._validation import check_int

__all__ = ["RankSlices", "assign_owners", "owned_by", "parameter_cost", "rank_slice"]


def parameter_cost(shape: Sequence[int], *, newton_schulz: bool = False) -> int:
    """The work of one parameter in units of entries: its size d_j for the noise, the
    communication and an element-wise update; d_j·(1 + min(m, k)) for a matrix of view m×k
    orthogonalized by Newton–Schulz (each iteration costs O(m·k·min(m, k)) flops).

    Args:
        shape: the parameter's shape; its matrix view is (shape[0], ∏ shape[1:]).
        newton_schulz: the parameter is updated by a Newton–Schulz (Muon) rule.
    """
    size = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if newton_schulz and len(shape) >= 2:
        rows = int(shape[0])
        cols = size // max(rows, 1)
        return size * (1 + min(rows, cols))
    return size


def assign_owners(costs: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The owner rank of every parameter: largest cost first to the least loaded rank (ties:
    the lower parameter index first, the lower rank first). Deterministic, so every process
    computes the same assignment.

    Args:
        costs: shape (P,), each parameter's cost (``parameter_cost``), ≥ 1.
        world_size: W ≥ 1 processes.

    Returns:
        shape (P,): the owner in [0, W) of each parameter.

    Raises:
        ValueError: W < 1, no parameter, or a cost < 1.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    costs = [check_int(f"costs[{j}]", c, minimum=1) for j, c in enumerate(costs)]
    if not costs:
        raise ValueError("costs is invalid: at least one parameter is needed")
    load = [0] * world_size
    owner = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[j] = r
        load[r] += costs[j]
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
    global batches, their accounting and their checkpoints stay those of one process."""

    def __init__(self, sampler, rank: int, world_size: int):
        self.sampler = sampler
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for batch in self.sampler:
            yield rank_slice(batch, self.rank, self.world_size)

    def next(self) -> np.ndarray:
        return rank_slice(self.sampler.next(), self.rank, self.world_size)

    def __getattr__(self, name):
        if name == "sampler":  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.sampler, name)
