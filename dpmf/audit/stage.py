"""The white-box canaries of a run as a stage of its private step (``dpmf.optim.privatize.
StepStage``): the audits of ``make_private`` (``dpmf.audit.private_audit``), ``dpmf audit``
(``dpmf.audit.runner``) and ``dpmf fl`` (``dpmf.audit.federated``) set it on the run's
privatizer; training has no canary option.

Source: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
2023), §6 (white-box gradient canaries).
"""

from __future__ import annotations

import numpy as np
import torch

from dpmf.optim.batch_probe import take_rows
from dpmf.optim.privatize import StepStage

__all__ = ["CanaryStage"]


class CanaryStage(StepStage):
    """The white-box canaries of a run, as a stage of its private step (``StepStage``): canary
    slots removed from the batch, "in" canaries added once to the global clipped sum, the
    release projected on the canary directions.

    Args:
        privatizer: the run's ``Privatizer`` or ``DistributedPrivatizer`` (its B̄ and, in a
            distributed run, its collectives).
        sampler: the run's global sampler; every batch it draws is recorded (step → indices).
        directions: shape (m, d), the canary gradients (norm ζ).
        included: shape (m,), boolean: which canaries are "in".
        real_size: N, the real examples; slots N … N + m − 1 are the canaries'.
        slots_in_batch: the batches the step receives hold the slots' rows, which ``select``
            removes (``make_private``'s loader yields them); False: the door gives the real
            examples only (``dpmf audit``'s loop).
    """

    def __init__(self, privatizer, sampler, directions, included, real_size: int, *, slots_in_batch=True):
        comm = getattr(privatizer, "collectives", None)
        self.comm = comm
        self.sharded = comm is not None and getattr(privatizer, "mode", None) == "sharded"
        self.expected_batch_size = privatizer.expected_batch_size
        self.canaries = directions
        self._unit = directions / directions.norm(dim=1, keepdim=True)
        self._included = included
        self._real_size = real_size
        self._slots_in_batch = slots_in_batch
        self._rank, self._world = (0, 1) if comm is None else (comm.rank, comm.world_size)
        self._draws: dict[int, np.ndarray] = {}  # step → the global batch's indices
        sampler.watch(self._draws.__setitem__)
        self.step_canaries = np.zeros(0, dtype=np.int64)
        self.projections: list[np.ndarray] = []
        # one process: each step's clipped sum of the real examples projected likewise, before
        # the canaries and the noise (what an auditor who knows the other examples subtracts)
        self.known_projections: list[np.ndarray] = []
        self.canary_steps: dict[int, np.ndarray] = {}  # step → the canary slots drawn

    def select(self, step, inputs, targets, example_ids):
        from dpmf.distributed.sharding import rank_slice

        glob = self._draws.get(step)
        if glob is None:
            raise RuntimeError(
                f"audited step {step} refused: no batch was drawn for it by the run's data loader; "
                "privatize the batches run.private.data_loader yields"
            )
        local = rank_slice(glob, self._rank, self._world) if self._world > 1 else glob
        slots = glob[glob >= self._real_size] - self._real_size
        self.canary_steps[step] = slots
        self.step_canaries = slots[self._included[slots]]
        if not self._slots_in_batch:
            return inputs, targets, example_ids
        keep = torch.from_numpy(local < self._real_size)
        n = int(local.shape[0])
        if not bool(keep.all()):
            rows = keep.nonzero().flatten()
            inputs = take_rows(inputs, rows, n)
            targets = take_rows(targets, rows, n)
            if example_ids is not None:
                example_ids = take_rows(example_ids, rows, n)
        return inputs, targets, example_ids

    def before_release(self, step, params, sums):
        idx = np.asarray(self.step_canaries, dtype=np.int64)
        if self.comm is None:
            flat = torch.cat([g.reshape(-1) for g in sums]).to(self._unit.dtype)
            self.known_projections.append((self._unit @ flat).double().cpu().numpy())
        if idx.size and (self.comm is None or self.comm.rank == 0):  # once on the global clipped sum
            added = self.canaries[torch.from_numpy(idx)].sum(dim=0)
            offset = 0
            for p, s in zip(params, sums, strict=True):
                k = p.numel()
                s.add_(added[offset : offset + k].view_as(s).to(s.dtype))
                offset += k

    def after_release(self, step, params, written):
        mine = {id(p) for p in written}
        proj = torch.zeros(self._unit.shape[0], dtype=torch.float64, device=self._unit.device)
        offset = 0
        for p in params:
            k = p.numel()
            if id(p) in mine and p.grad is not None:
                g = p.grad.reshape(-1).to(self._unit.dtype)
                proj += (self._unit[:, offset : offset + k] @ g).double()
            offset += k
        if self.sharded:
            self.comm.all_reduce(proj)  # each parameter's gradient lives on its owner only
        self.projections.append(proj.cpu().numpy() * self.expected_batch_size)
        self.step_canaries = np.zeros(0, dtype=np.int64)
