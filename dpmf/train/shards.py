"""Checkpoints of a run spread over W processes: one shard per rank and a manifest.

Each rank r writes ``checkpoint.pt.rank{r}-of-{W}.step{S}`` with what only it holds: the
correlated-noise state of the parameters it owns (``CorrelatedNoise.parameter_state``) and
their optimizer state. After all shards are on disk (a barrier), rank 0 writes the manifest
``checkpoint.pt`` atomically: everything the ranks share (model, sampler, metrics, RNG states,
the optimizer's hyperparameters, the secret seed), and ``"distributed"``: W, the mode, the
seed digest, the step, the noise keys and the shard file names. Only then are older shards
removed. A stop at any moment leaves a manifest whose shards all exist.

``merge_shards`` turns a manifest into the state of one whole run (noise state per
parameter, the union of the optimizer states), which any number of processes can load: each
takes the parameters it owns.
"""

from __future__ import annotations

import glob
import os

from dpmf.train.checkpoint import load_checkpoint, save_checkpoint

__all__ = [
    "save_sharded",
    "merge_shards",
    "remove_shards",
]


def _shard_name(path: str, rank: int, world_size: int, step: int) -> str:
    return f"{os.path.basename(path)}.rank{rank}-of-{world_size}.step{step}"


def save_sharded(path: str, state: dict, collectives, *, mode: str, seed_digest: str) -> None:
    """Write this rank's shard of ``state`` and (rank 0) the manifest at ``path``.

    Args:
        path: the manifest's path (``…/checkpoint.pt``).
        state: the run's state on this rank, with ``"noise"`` a list of parameter states and
            ``"optimizer"`` a torch optimizer state dict holding this rank's parameters' state.
        collectives: the run's ``dpmf.distributed.Collectives`` (all ranks call this).
        mode: the distributed mode; seed_digest: the noise seed's digest (recorded).
    """
    rank, world = collectives.rank, collectives.world_size
    folder = os.path.dirname(path) or "."
    name = _shard_name(path, rank, world, state["step"])
    save_checkpoint(
        os.path.join(folder, name),
        {"noise": state["noise"], "optimizer_state": state["optimizer"]["state"], "step": state["step"]},
    )
    collectives.barrier()
    names = [_shard_name(path, r, world, state["step"]) for r in range(world)]
    if rank == 0:
        manifest = dict(state)
        manifest.pop("noise")
        manifest["optimizer"] = {k: v for k, v in state["optimizer"].items() if k != "state"}
        manifest["distributed"] = {
            "world_size": world,
            "mode": mode,
            "seed_digest": seed_digest,
            "step": state["step"],
            "noise_keys": "chunked",
            "shards": names,
        }
        save_checkpoint(path, manifest)
        remove_shards(path, keep=names)
    collectives.barrier()


def remove_shards(path: str, keep=()) -> None:
    """Delete the shard files of the manifest ``path`` except those named in ``keep`` (after a
    newer manifest or a one-process checkpoint replaced them)."""
    folder = os.path.dirname(path) or "."
    keep = set(keep)
    for old in glob.glob(os.path.join(folder, f"{os.path.basename(path)}.rank*-of-*.step*")):
        if os.path.basename(old) not in keep:
            os.remove(old)


def merge_shards(state: dict, path: str) -> dict:
    """The whole-run state of a manifest (``save_sharded``); a plain checkpoint unchanged.

    Returns:
        ``state`` with ``"noise"`` the list of every shard's parameter states and
        ``"optimizer"`` holding the union of the shards' optimizer states.

    Raises:
        ValueError: a shard missing, unreadable, or of another step than the manifest.
    """
    info = state.get("distributed")
    if info is None:
        return state
    folder = os.path.dirname(path) or "."
    noise, opt_state = [], {}
    for name in info["shards"]:
        shard_path = os.path.join(folder, name)
        if not os.path.isfile(shard_path):
            raise ValueError(
                f"checkpoint {str(path)!r} is incomplete: its shard {name!r} is missing (copy all "
                "checkpoint.pt.rank* files together with checkpoint.pt)"
            )
        shard = load_checkpoint(shard_path)
        if shard.get("step") != info["step"]:
            raise ValueError(
                f"checkpoint shard {name!r} is invalid: step {shard.get('step')} ≠ {info['step']}"
            )
        noise.extend(shard["noise"])
        opt_state.update(shard["optimizer_state"])
    merged = dict(state)
    merged["noise"] = noise
    merged["optimizer"] = dict(state["optimizer"], state=opt_state)
    if state.get("fsdp") is not None:  # a fully_shard run: its DCP folder, beside the manifest
        merged["fsdp"] = dict(
            state["fsdp"], folder=os.path.join(folder, state["fsdp"]["folder"]), manifest=path
        )
    return merged
