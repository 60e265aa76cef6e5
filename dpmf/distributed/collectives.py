"""The few collective operations a distributed private step needs, behind one small interface.

``TorchCollectives`` runs them on a ``torch.distributed`` process group (gloo on CPU, NCCL on
GPUs). ``simulate`` runs W ranks as threads of one process with in-memory collectives of the
same meaning (sums taken in rank order), so the whole distributed pipeline can be tested
without starting processes. Both count the bytes each rank sends, for the benchmark.

Operations (all ranks call each one in the same order):

==========================  ===============================================================
``reduce(t, dst)``          t on rank ``dst`` ← Σ_r t_r (other ranks' t unspecified after)
``all_reduce(t)``           t on every rank ← Σ_r t_r
``reduce_scatter(out, t)``  out on rank r ← (Σ_q t_q)'s r-th of W equal flat parts
``broadcast(t, src)``       t on every rank ← t_src
``all_gather_object(obj)``  [obj_0, …, obj_{W−1}] on every rank (small plain data)
``barrier()``               wait for all ranks
==========================  ===============================================================
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["Collectives", "TorchCollectives", "ThreadCollectives", "simulate"]


class Collectives:
    """Common part: ``rank``, ``world_size`` and ``bytes_sent`` (tensor payload this rank has
    put on the wire so far, counting a reduce or broadcast as its tensor's size for each rank
    that sends it, an all-reduce as 2(W−1)/W of it, the ring algorithm's share)."""

    rank: int
    world_size: int

    def __init__(self):
        self.bytes_sent = 0

    def _count(self, t: torch.Tensor, factor: float = 1.0) -> None:
        self.bytes_sent += int(t.numel() * t.element_size() * factor)

    def reduce(self, t: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """``out`` (t.numel()/W entries) ← this rank's part of Σ_r t_r (its share sent: (W−1)/W
        of t). Raises ValueError when t does not split into W parts of out's size."""
        raise NotImplementedError

    def _check_split(self, out: torch.Tensor, t: torch.Tensor) -> None:
        if t.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter is invalid: {t.numel()} entries do not split into {self.world_size} "
                f"parts of {out.numel()}"
            )

    def all_gather_object(self, obj) -> list:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class TorchCollectives(Collectives):
    """Collectives on a ``torch.distributed`` process group (``None``: the default group).

    Raises:
        ValueError: torch.distributed is not initialized.
        TypeError: ``group`` is not a process group.
    """

    def __init__(self, group=None):
        super().__init__()
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "process_group is invalid: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"process_group={group!r} is invalid: must be a torch.distributed ProcessGroup "
                "(torch.distributed.group.WORLD for the default group) or a dpmf Collectives"
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def reduce(self, t, dst):
        if self.world_size > 1:
            self._count(t)
            self._dist.reduce(t, dst=self._global(dst), op=self._dist.ReduceOp.SUM, group=self.group)

    def all_reduce(self, t):
        if self.world_size > 1:
            self._count(t, 2 * (self.world_size - 1) / self.world_size)
            self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)

    def broadcast(self, t, src):
        if self.world_size > 1:
            if self.rank == src:
                self._count(t)
            self._dist.broadcast(t, src=self._global(src), group=self.group)

    def reduce_scatter(self, out, t):
        self._check_split(out, t)
        if self.world_size == 1:
            out.copy_(t.reshape(out.shape))
            return
        self._count(t, (self.world_size - 1) / self.world_size)
        self._dist.reduce_scatter_single(out, t, op=self._dist.ReduceOp.SUM, group=self.group)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        self._dist.barrier(group=self.group)


class _Room:
    """What W simulated ranks share: one slot each and a barrier."""

    def __init__(self, world_size: int, timeout: float):
        self.slots = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)


class ThreadCollectives(Collectives):
    """In-memory collectives between W threads (made by ``simulate``); sums in rank order."""

    def __init__(self, room: _Room, rank: int):
        super().__init__()
        self._room = room
        self.rank = rank
        self.world_size = len(room.slots)

    def _exchange(self, value) -> list:
        room = self._room
        room.slots[self.rank] = value
        room.barrier.wait()
        out = list(room.slots)
        room.barrier.wait()
        return out

    def reduce(self, t, dst):
        if self.world_size > 1:
            self._count(t)
        parts = self._exchange(t.detach().clone())
        if self.rank == dst:
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            t.copy_(total)

    def all_reduce(self, t):
        if self.world_size > 1:
            self._count(t, 2 * (self.world_size - 1) / self.world_size)
        parts = self._exchange(t.detach().clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        t.copy_(total)

    def broadcast(self, t, src):
        if self.rank == src and self.world_size > 1:
            self._count(t)
        parts = self._exchange(t.detach().clone() if self.rank == src else None)
        if self.rank != src:
            t.copy_(parts[src])

    def reduce_scatter(self, out, t):
        self._check_split(out, t)
        if self.world_size > 1:
            self._count(t, (self.world_size - 1) / self.world_size)
        parts = self._exchange(t.detach().clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        out.copy_(total.reshape(self.world_size, -1)[self.rank].view(out.shape))

    def all_gather_object(self, obj):
        return self._exchange(obj)

    def barrier(self):
        self._exchange(None)


def simulate(world_size: int, fn: Callable[[Collectives], object], *, timeout: float = 300.0) -> list:
    """Run ``fn(collectives)`` for W simulated ranks, one thread each, and return their results
    in rank order. An exception on any rank stops all of them and is raised here.

    Raises:
        ValueError: W < 1.
        Exception: the first exception a rank raised.
    """
    from dpmf._validation import check_int

    world_size = check_int("world_size", world_size, minimum=1)
    room = _Room(world_size, timeout)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCollectives(room, rank))
        except threading.BrokenBarrierError as exc:
            errors[rank] = exc
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            room.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    broken = [e for e in errors if e is not None]
    if broken:
        raise broken[0]
    return results
