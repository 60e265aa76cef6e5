"""The model and optimizer shards of a ``fully_shard`` run, through ``torch.distributed.checkpoint``.

A run whose parameters are FSDP2 shards (``dpmf.distributed.step.FullyShard``) cannot put its
weights in the manifest: no rank holds them whole. Every rank writes its shards of the
trainable weights and of the optimizer state with DCP into a new private folder
``checkpoint.pt.dcp.step{S}.{token}`` (0700, its files 0600: as secret as the checkpoint)
beside the manifest; the rest of the run state (noise state per shard, sampler, key) takes the
usual sharded form (``dpmf.train.shards``), and the manifest names the folder. Only after the
manifest is in place does rank 0 remove the older folders, so a stop at any moment leaves a
manifest whose folder is complete. DCP reshards on load and the noise state is kept by
coordinate ranges, so a run resumes at any number of processes over a ``fully_shard`` model.

Frozen weights (a LoRA's base) are not saved: resume into the model built the same way. The
manifest keeps a digest of them that does not depend on the split (``frozen_rows_digest``: a
sum of per-row SHA-256 values, each rank hashing the rows it holds), so a resume into another
base model is refused at any number of processes.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil

import torch

__all__ = ["FOLDER", "check_frozen_rows", "frozen_rows_digest", "save_dcp", "load_dcp", "remove_old_folders"]

FOLDER = "{name}.dcp.step{step}.{token}"


def _folder(path: str, step: int, token: str) -> str:
    return FOLDER.format(name=os.path.basename(path), step=int(step), token=token)


def _trainable(model) -> dict:
    params = {id(p) for p in model.parameters() if p.requires_grad}
    named = dict(model.named_parameters())
    return {k: v for k, v in model.state_dict().items() if k in named and id(named[k]) in params}


def frozen_rows_digest(model, collectives) -> str | None:
    """A digest of the model's frozen parameters that is the same at any split over ranks: each
    row (dim 0) of each frozen parameter is hashed with the parameter's name, global shape and
    dtype and the row's global index (SHA-256), and the values are summed modulo 2¹²⁸ over the
    rows and the ranks (a DTensor's rows by the rank that holds them, a whole tensor's by rank
    0); None when nothing is frozen. Every rank calls it (one all-gather of one number).

    Detects a resume into another base model (an honest mistake); a sum of hashes is not meant
    to resist rows chosen to collide."""
    import hashlib

    from dpmf.optim.fsdp import is_sharded, local_part, shard_span

    total, frozen = 0, False
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        frozen = True
        if not is_sharded(p) and collectives.rank != 0:
            continue
        local = local_part(p).detach().cpu().contiguous()
        rows = local.reshape(local.shape[0], -1) if local.dim() else local.reshape(1, -1)
        width = max(1, p.numel() // (int(p.shape[0]) if p.dim() else 1))
        first = shard_span(p)[0] // width if is_sharded(p) else 0
        tag = f"{name}:{tuple(p.shape)}:{p.dtype}:"
        for i, row in enumerate(rows):
            h = hashlib.sha256(f"{tag}{first + i};".encode())
            h.update(row.view(torch.uint8).numpy().tobytes() if row.numel() else b"")
            total += int.from_bytes(h.digest()[:16], "big")
    if not frozen:
        return None
    return format(sum(collectives.all_gather_object(total % (1 << 128))) % (1 << 128), "032x")


def check_frozen_rows(state: dict, model, collectives, where: str) -> None:
    """Refuse, before anything is loaded, a ``save_dcp`` state saved from other frozen weights
    (every rank calls it).

    Raises:
        ValueError: the frozen weights' ``frozen_rows_digest`` differs from the saved one.
    """
    saved = (state.get("model") or {}).get("frozen_rows_sha256")
    if saved != frozen_rows_digest(model, collectives):
        raise ValueError(
            f"{where} is invalid for this model: its frozen weights differ from the saved run's "
            "(another base model, or another set of trainable parameters); resume into the model it "
            "was saved from, sharded with fully_shard"
        )


def save_dcp(path: str, state: dict, model, collectives) -> dict:
    """Write the model's trainable shards and ``state``'s optimizer state (its DTensors) with DCP
    (every rank) and return ``state`` without them: ``"model"`` empty, the optimizer's
    ``"state"`` empty, and ``"fsdp"`` naming the folder (beside the manifest)."""
    import torch.distributed.checkpoint as dcp

    # a new folder every time (rank 0's token): the manifest in place names a complete one
    token = collectives.all_gather_object(secrets.token_hex(4) if collectives.rank == 0 else None)[0]
    folder = os.path.join(os.path.dirname(path) or ".", _folder(path, state["step"], token))
    if collectives.rank == 0:
        os.makedirs(folder, mode=0o700)
    collectives.barrier()
    tensors: dict = {}
    skeleton = _split(state["optimizer"]["state"], "", tensors)
    dcp.save(
        {"model": _trainable(model), "optimizer": tensors},
        storage_writer=dcp.FileSystemWriter(folder),
        process_group=getattr(collectives, "group", None),
    )
    collectives.barrier()
    if collectives.rank == 0:
        for f in os.listdir(folder):
            os.chmod(os.path.join(folder, f), 0o600)
    digest = frozen_rows_digest(model, collectives)
    frozen = {} if digest is None else {"frozen_rows_sha256": digest}
    out = dict(state, model=frozen, fsdp={"folder": os.path.basename(folder)})
    out["optimizer"] = dict(state["optimizer"], state=skeleton)
    return out


_SLOT = "dcp:"  # a tensor's place in an optimizer state's skeleton: "dcp:<its key in the folder>"


def _split(tree, where: str, tensors: dict):
    """``tree`` (an optimizer's state: dicts and lists of tensors and numbers) with each tensor
    replaced by ``"dcp:<key>"`` and put in ``tensors[key]`` (keys: the path, "/"-separated)."""
    if isinstance(tree, torch.Tensor):
        tensors[where] = tree
        return _SLOT + where
    if isinstance(tree, dict):
        return {k: _split(v, f"{where}/{k}" if where else str(k), tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split(v, f"{where}/{i}", tensors) for i, v in enumerate(tree))
    return tree


def _joined(tree, tensors: dict):
    """``_split``'s inverse: the skeleton with its slots filled from ``tensors``."""
    if isinstance(tree, str) and tree.startswith(_SLOT):
        return tensors[tree[len(_SLOT) :]]
    if isinstance(tree, dict):
        return {k: _joined(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_joined(v, tensors) for v in tree)
    return tree


def remove_old_folders(path: str, keep: str) -> None:
    """Delete the DCP folders beside ``path`` except ``keep`` (the one its manifest names)."""
    pattern = FOLDER.format(name=os.path.basename(path), step="*", token="*")
    for old in glob.glob(os.path.join(os.path.dirname(path) or ".", pattern)):
        if os.path.basename(old) != keep:
            shutil.rmtree(old, ignore_errors=True)


def load_dcp(state: dict, model, optimizer, collectives) -> None:
    """Load a ``save_dcp`` folder into the (fully_shard) ``model`` and ``optimizer`` of this run,
    resharded to its processes.

    Raises:
        ValueError: the folder is missing, or it holds parameters or optimizer state this model
            has not (another model, or other trainable parameters).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, zeros

    folder = state["fsdp"]["folder"]  # made absolute by dpmf.train.shards.merge_shards
    path = state["fsdp"].get("manifest", folder)

    if not os.path.isdir(folder):
        raise ValueError(
            f"checkpoint {str(path)!r} is incomplete: its folder {os.path.basename(folder)!r} is missing "
            "(copy it together with checkpoint.pt and its shards)"
        )
    reader = dcp.FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    weights = _trainable(model)
    theirs = {k.split(".", 1)[1] for k in saved if k.startswith("model.")}
    if theirs != set(weights):
        extra, missing = sorted(theirs - set(weights))[:3], sorted(set(weights) - theirs)[:3]
        raise ValueError(
            f"checkpoint {str(path)!r} is invalid for this model: its trainable weights differ (saved only: "
            f"{extra}, here only: {missing}); resume into the model it was saved from"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    params = [p[1] if isinstance(p, tuple) else p for p in params]
    targets: dict = {}
    for key, meta in saved.items():
        if not key.startswith("optimizer."):
            continue
        path_ = key[len("optimizer.") :]  # "<parameter index>/<path in its state>"
        p = params[int(path_.split("/", 1)[0])]
        size = tuple(meta.size)
        if isinstance(p, DTensor) and size == tuple(p.shape):  # sharded as its parameter
            mesh, placements = p.device_mesh, p.placements
            targets[path_] = zeros(size, dtype=meta.properties.dtype, device_mesh=mesh, placements=placements)
        else:
            targets[path_] = torch.zeros(size, dtype=meta.properties.dtype, device=_device_of(p))
    loaded = {"model": weights, "optimizer": targets}
    dcp.load(loaded, storage_reader=reader, process_group=getattr(collectives, "group", None))
    with torch.no_grad():
        for k, v in weights.items():  # DCP wrote into the shards in place; the same tensors
            if v is not loaded["model"][k]:
                v.copy_(loaded["model"][k])
    optimizer_state = _joined(state["optimizer"]["state"], loaded["optimizer"])
    optimizer.load_state_dict(dict(state["optimizer"], state=optimizer_state))


def _device_of(p) -> torch.device:
    return p.to_local().device if hasattr(p, "to_local") else p.device
