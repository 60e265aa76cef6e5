"""A model whose parameters ``fully_shard`` (FSDP2) split across ranks, as the private step sees it.

FSDP2 keeps each parameter as a DTensor sharded along dim 0 (``Shard(0)`` on a one-dimensional
mesh): rank r holds rows [r·⌈R/W⌉, min(R, (r+1)·⌈R/W⌉)) of a parameter with R rows (torch.chunk's
split; the last ranks may hold none). Before a unit's forward it all-gathers the unit's
parameters into unsharded ones, registered on the modules in place of the shards, and after the
forward frees them again. Everything the per-example clipping reads — the activations and the
output gradients of each layer — is that of the rank's own examples with the whole weights, so
per-example norms and clipped sums are computed on each rank as in one process; the clipped sum
is then reduce-scattered to the shards (``dpmf.distributed.step.FullyShard``).

This module reads the FSDP2 objects of torch 2.13 (``FSDPModule``, its state's ``FSDPParam``s):
which tensors are a shard's unsharded parameter (a use of it outside its module must be seen by
the clipping's watch) and which coordinates a shard holds.
"""

from __future__ import annotations

import torch
from torch import nn

from dpmf.optim.clipping_layers.registry import clipping_handler

__all__ = [
    "check_fully_sharded",
    "gathered",
    "is_sharded",
    "local_part",
    "orthogonalized_by_owners",
    "owners_by_cost",
    "reshard",
    "shard_span",
    "sharded_gradient",
    "sharded_names",
    "scattered",
    "unsharded_aliases",
    "zeros_of",
]


def _dtensor_type():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (a shard of a ``fully_shard`` or tensor-parallel parameter)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def sharded_names(model: nn.Module) -> list[str]:
    """The names of the model's parameters that are DTensors."""
    return [name for name, p in model.named_parameters() if is_sharded(p)]


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_fully_sharded(model: nn.Module, world_size: int) -> None:
    """Refuse a model the sharded private step cannot take: trainable parameters that are not
    all FSDP2 shards along dim 0 of one W-rank mesh, or FSDP mixed precision (which casts the
    parameters, the outputs or the reduced gradients: norms and sums would not be those of the
    parameters' dtype), or a trainable layer without a clipping handler (the whole-parameter
    torch.func path needs whole parameters).

    Raises:
        ValueError: naming the parameter or setting and the fix.
    """
    from torch.distributed.tensor import Shard

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plain = [n for n, p in trainable if not is_sharded(p)]
    if plain:
        raise ValueError(
            f"model is invalid for the sharded private step: its trainable parameters {', '.join(plain[:3])} "
            "are not sharded; apply fully_shard to the root module too (fully_shard(model) after its blocks)"
        )
    for n, p in trainable:
        if tuple(p.placements) != (Shard(0),) or p.device_mesh.ndim != 1:
            raise ValueError(
                f"model is invalid for the sharded private step: parameter {n} has placements "
                f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh; the step takes fully_shard's "
                "Shard(0) on a one-dimensional mesh (no tensor parallelism, no HSDP)"
            )
        if p.device_mesh.size() != world_size:
            raise ValueError(
                f"model is invalid for the sharded private step: parameter {n} is sharded over "
                f"{p.device_mesh.size()} ranks and the process group has {world_size}; shard over the "
                "process group given to make_private"
            )
    for name, m in model.named_modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            handler, why = clipping_handler(m)
            if handler is None:
                raise ValueError(
                    f"model is invalid for the sharded private step: layer {name or '<model>'} ({why}); "
                    "under fully_shard every trainable layer is clipped by its clipping handler "
                    "(dpmf.ClippingHandler): register one for the layer, or freeze it"
                )
    for m in _fsdp_modules(model):
        policy = m._get_fsdp_state()._mp_policy
        if (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) != (None, None, None):
            raise ValueError(
                f"model is invalid for the sharded private step: fully_shard's mp_policy={policy} casts "
                "the parameters, outputs or reduced gradients; shard without a MixedPrecisionPolicy "
                "(cast the model itself, or train under torch.autocast)"
            )


def unsharded_aliases(model: nn.Module, *, materialize: bool = False) -> dict[int, torch.Tensor]:
    """id(sharded parameter) → the unsharded parameter FSDP2 registers in its place during a
    forward (the same tensor object every step). With ``materialize``, every unit is unsharded
    and resharded once first (an all-gather per unit, on every rank), so that the unsharded
    parameters exist before the first forward."""
    modules = _fsdp_modules(model)
    if materialize:
        for m in modules:
            m.unshard()
            m.reshard()
    out = {}
    for m in modules:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                live = getattr(fp, "_unsharded_param", None)
                if live is not None:
                    out[id(fp.sharded_param)] = live
    return out


def reshard(model: nn.Module) -> None:
    """Put every ``fully_shard`` unit's shards back on its modules (a forward without a backward,
    e.g. an evaluation, leaves the root unit's parameters unsharded); a no-op where they are."""
    for m in _fsdp_modules(model):
        m.reshard()


def shard_span(p) -> tuple[int, int]:
    """(start, stop): the flat (row-major) coordinates of the DTensor ``p``'s global value that
    this rank's shard holds, for ``Shard(0)`` (torch.chunk's split of the rows).

    Raises:
        ValueError: the local shard is not the rows this split gives (another sharding).
    """
    rows = int(p.shape[0]) if p.dim() else 1
    width = p.numel() // rows if rows else 0
    size, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    per = -(-rows // size)
    start = min(rows, rank * per)
    stop = min(rows, start + per)
    local = p.to_local()
    if int(local.shape[0] if local.dim() else 1) != stop - start:
        raise ValueError(
            f"parameter of shape {tuple(p.shape)} is sharded unevenly ({tuple(local.shape)} on rank {rank}); "
            "the step takes fully_shard's default Shard(0) split"
        )
    return start * width, stop * width


def zeros_of(p) -> torch.Tensor:
    """A contiguous plain tensor of zeros with ``p``'s global shape, dtype and (local) device."""
    if is_sharded(p):
        return torch.zeros(tuple(p.shape), dtype=p.dtype, device=p.to_local().device)
    return torch.zeros_like(p, memory_format=torch.contiguous_format)


def local_part(p) -> torch.Tensor:
    """The local tensor of a DTensor (``p`` itself otherwise)."""
    return p.to_local() if is_sharded(p) else p


def sharded_gradient(local: torch.Tensor, p) -> torch.Tensor:
    """A DTensor with ``p``'s mesh, placements and global shape whose local part is ``local``
    (this rank's rows of the gradient)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (an all-gather of its shards, on every rank); ``t`` itself
    when it is a plain tensor."""
    return t.full_tensor() if is_sharded(t) else t


def scattered(whole: torch.Tensor, like) -> torch.Tensor:
    """``whole`` (the global value) as a DTensor sharded as ``like``: this rank keeps its rows
    (no communication); ``whole`` itself when ``like`` is a plain tensor."""
    if not is_sharded(like):
        return whole
    a, b = shard_span(like)
    local = whole.reshape(-1)[a:b].view(like.to_local().shape).clone()
    return sharded_gradient(local, like)


def owners_by_cost(shapes: list[tuple], world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest cost (m·n·min(m, n), Newton–Schulz's)
    first, each to the least loaded rank (ties to the lowest rank, so every rank computes the
    same assignment). Shapes are the matrices' global shapes (a kernel as rows × the rest)."""
    costs = []
    for shape in shapes:
        m = int(shape[0])
        n = 1
        for s in shape[1:]:
            n *= int(s)
        costs.append(m * n * min(m, n))
    load = [0] * world_size
    owners = [0] * len(shapes)
    for j in sorted(range(len(shapes)), key=lambda j: (-costs[j], j)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[j] = r
        load[r] += costs[j]
    return owners


def orthogonalized_by_owners(updates: list, fn) -> list:
    """``fn`` (a map of one whole matrix, e.g. Newton–Schulz) applied to each DTensor of
    ``updates`` by one owner rank (``owners_by_cost``), the result kept as each rank's rows.

    Every gather to an owner is issued first (asynchronously), then each rank, in the matrices'
    order, orthogonalises the matrices it owns as their rows arrive and scatters the rows back,
    so the ranks orthogonalise different matrices at the same time, and a rank's computation
    overlaps the gathers still in flight. A rank holds whole only the matrices it owns (≈ 1/W of
    them); bytes sent per rank are ≈ 2·(W−1)/W² of the matrices' (against (W−1)/W for an
    all-gather of every matrix to every rank). Every rank issues the same collectives in the
    same order (a gather, then a scatter per matrix).

    Args:
        updates: DTensors sharded ``Shard(0)`` on one one-dimensional mesh (fully_shard's), the
            same list on every rank.
        fn: whole tensor → whole tensor of the same shape.

    Returns:
        One DTensor per update, sharded as it, of ``fn`` of its whole value.
    """
    import torch.distributed as dist

    if not updates:
        return []
    mesh = updates[0].device_mesh
    group, W, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    owners = owners_by_cost([tuple(u.shape) for u in updates], W)
    gathers, blocks = [], []
    for u, owner in zip(updates, owners, strict=True):
        local = u.to_local()
        rows = int(u.shape[0])
        per = -(-rows // W)
        block = local.new_zeros((per, *u.shape[1:]))
        block[: local.shape[0]].copy_(local)
        into = [torch.empty_like(block) for _ in range(W)] if rank == owner else None
        dst = dist.get_global_rank(group, owner)
        gathers.append((dist.gather(block, into, dst=dst, group=group, async_op=True), into))
        blocks.append(block)
    scatters = []
    for u, owner, (work, into), block in zip(updates, owners, gathers, blocks, strict=True):
        parts = None
        if rank == owner:
            work.wait()
            whole = torch.cat(into)[: int(u.shape[0])]
            out = fn(whole)
            padded = out.new_zeros(block.shape[0] * W, *out.shape[1:])
            padded[: out.shape[0]].copy_(out)
            parts = list(padded.split(block.shape[0]))
        got = torch.empty_like(block)
        src = dist.get_global_rank(group, owner)
        scatters.append((dist.scatter(got, parts, src=src, group=group, async_op=True), got))
    for work, _ in gathers:  # a non-owner's blocks were sent (kept alive until now)
        work.wait()
    results = []
    for u, (work, got) in zip(updates, scatters, strict=True):
        work.wait()
        results.append(sharded_gradient(got[: u.to_local().shape[0]].contiguous(), u))
    return results
