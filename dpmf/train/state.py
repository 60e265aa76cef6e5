"""The run state of a private run: one format, written and read by both doors.

``dpmf train`` (``Trainer``) and ``make_private`` (``PrivateTraining.save``/``resume``) keep
the same state, built, checked, written and restored by the functions of this module:

========================  ==================================================================
key                       what
========================  ==================================================================
``format``                ``FORMAT`` (``"dpmf.run/2"``)
``door``                  ``"train"`` or ``"make_private"``: who wrote it
``plan``                  ``PrivatePlan.to_dict()`` (N, B, n, scheme, strategy, σ, …)
``run_identity``          the settings a resume must repeat (``TrainConfig.run_identity()``;
                          ``{}`` for ``make_private``, whose plan and data say it all)
``data``                  SHA-256 (16 hex digits) of the training tensors, or None
``secret``                ``{"seed": key, "given": bool, "forks": [[step, key], …],
                          "siblings": m, "children": c}``: the noise key and the keys of
                          its forks (secret), the family size m and the forks made from
                          this file (``dpmf.train.continuation``)
``step``, ``epoch``       private steps taken; completed epochs
``model``                 the weights (``dpmf.train.hf.model_state``)
``optimizer``             the optimizer's ``state_dict()``
``sampler``               the sampler's state at the privatized step
``noise``                 the noise stream (``noise_state``)
``rng``                   the global generators (``rng_state``; restored by ``dpmf train``)
``metrics``               one row per epoch (``dpmf train``; ``[]`` for ``make_private``)
``empty_batches``         steps without any example (``dpmf train``; None: not counted)
``lookahead``             DiSK's lookahead state, or None
``fsdp``                  a fully_shard run only: ``{"folder"}``, the DCP folder of its
                          weights and optimizer state (``model`` is then empty)
========================  ==================================================================

So a checkpoint of ``dpmf train`` resumes in ``make_private(...).resume(path)`` with the same
plan and data (the model and optimizer built as the run built them), and continues the same
trajectory. ``dpmf train`` resumes only its own files: their ``run_identity`` is its config.

Writing: ``write_run_state`` goes through ``dpmf.train.checkpoint.save_checkpoint`` (0600 from
creation, atomic, SHA-256 of every entry) or, in a run over several processes, through
``dpmf.train.shards.save_sharded``; reading: ``read_run_state`` (digests checked, shards
merged, the format checked). The key is never compared in clear across processes: the noise
and sampler states carry salted digests of it (``dpmf.seeds.key_digest``).
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from dpmf import seeds
from dpmf.train.checkpoint import as_numpy, load_checkpoint, save_checkpoint
from dpmf.train.dcp import check_frozen_rows, load_dcp, remove_old_folders, save_dcp
from dpmf.train.hf import check_model_state, load_model_state, model_state
from dpmf.train.private_loader import TransformedDataset
from dpmf.train.shards import merge_shards, save_sharded

__all__ = [
    "FORMAT",
    "DOORS",
    "KEYS",
    "check_run_state",
    "data_digest",
    "dataset_digest",
    "hyperparameter_change",
    "hyperparameters",
    "keep_own_optimizer_state",
    "load_noise_state",
    "noise_state",
    "read_run_state",
    "restore_run_state",
    "resumed_key",
    "rng_state",
    "run_state",
    "sampled_dataset_digest",
    "set_rng_state",
    "write_run_state",
]

FORMAT = "dpmf.run/2"
DOORS = ("train", "make_private")
KEYS = (
    "format",
    "door",
    "plan",
    "run_identity",
    "data",
    "secret",
    "step",
    "epoch",
    "model",
    "optimizer",
    "sampler",
    "noise",
    "rng",
    "metrics",
    "empty_batches",
    "lookahead",
)
# formats of earlier versions: who wrote them
_OLD_FORMATS = {1: "dpmf train", "dpmf.make_private/1": "make_private"}


# -- digests of the data -------------------------------------------------------------------------
def _tensors_digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def data_digest(data) -> str:
    """SHA-256 (first 16 hex digits) of a ``dpmf.train.Dataset``'s training tensors (shapes,
    dtypes, bytes): part of a run state, so that a resume on other data is refused. Equal to
    ``dataset_digest`` of ``TensorDataset(data.train_x, data.train_y)``."""
    return _tensors_digest((data.train_x, data.train_y))


#: examples hashed by the sampled digest of earlier versions (``"sample-…"`` in their states)
DIGEST_SAMPLE = 16


def dataset_digest(dataset) -> str | None:
    """A digest of the data set a run trains on, compared on resume (``check_run_state``).

    A ``TensorDataset`` (also behind ``make_private``'s ``TransformedDataset``): ``data_digest``
    of its tensors. Any other map-style data set (e.g. a Hugging Face data set of dicts):
    SHA-256 (first 16 hex digits, prefixed ``all-``) of its length and of **every** example in
    index order, streamed one at a time and fetched before any per-example ``transform``;
    tensors and numpy arrays are hashed by shape, dtype and bytes, dicts by sorted keys,
    lists/tuples in order, numbers/strings/bytes by value. So one example replaced, the same
    examples in another order, or other examples are refused on resume. A data set whose
    examples change from one fetch to the next (random augmentation inside ``__getitem__``: put
    it in ``make_private``'s ``transform`` instead) is refused on resume too. None: an example
    holds something else (not compared). Cost: one fetch and hash per example (1.2–1.4 s for
    60,000 examples of 28×28 float32 tensors with labels on one core).
    """
    return _examples_digest(dataset, "all-", range)


def sampled_dataset_digest(dataset) -> str | None:
    """The digest earlier versions stored (``"sample-…"``): length and ``DIGEST_SAMPLE``
    examples at indices ⌊k·(N − 1)/15⌋; only to compare with their states on resume."""
    return _examples_digest(
        dataset,
        "sample-",
        lambda n: sorted({(k * (n - 1)) // (DIGEST_SAMPLE - 1) for k in range(DIGEST_SAMPLE)}) if n else [],
    )


def _examples_digest(dataset, prefix: str, indices) -> str | None:
    """``prefix`` + SHA-256 (16 hex digits) of the length and the examples ``indices(N)``."""
    found = _tensor_digest_of(dataset)
    if found is not None:
        return found
    dataset = _stored(dataset)
    try:
        n = len(dataset)
    except TypeError:
        return None
    h = hashlib.sha256(f"len={n}".encode())
    for i in indices(n):
        if not _hash_example(h, dataset[i]):
            return None
    return prefix + h.hexdigest()[:16]


def _tensor_digest_of(dataset) -> str | None:
    inner = getattr(dataset, "dataset", None)
    tensors = getattr(dataset, "tensors", None) or getattr(inner, "tensors", None)
    if tensors and all(isinstance(t, torch.Tensor) for t in tensors):
        return _tensors_digest(tensors)
    return None


def _stored(dataset):
    """The stored examples behind a ``TransformedDataset`` (not their, possibly random, transform)."""
    return dataset.dataset if isinstance(dataset, TransformedDataset) else dataset


# -- the optimizer's hyperparameters -------------------------------------------------------------
def hyperparameters(param_groups) -> list[dict]:
    """Each parameter group's hyperparameters (lr, momentum, betas, weight decay, …): the
    group's entries other than ``params`` whose values are plain numbers, strings, None or
    tuples of them (a tensor-valued lr as its float)."""
    out = []
    for g in param_groups:
        row = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = float(v)
            if (
                v is None
                or isinstance(v, bool | int | float | str)
                or (isinstance(v, tuple | list) and all(isinstance(e, bool | int | float) for e in v))
            ):
                row[k] = tuple(v) if isinstance(v, list) else v
        out.append(row)
    return out


def hyperparameter_change(saved: list[dict], current: list[dict]) -> str | None:
    """The first difference between two ``hyperparameters`` lists (``"group 0's lr: 0.1 →
    0.05"``), or None when they agree."""
    if len(saved) != len(current):
        return f"{len(saved)} parameter groups → {len(current)}"
    for i, (a, b) in enumerate(zip(saved, current, strict=True)):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"group {i}'s {k}: {a.get(k)!r} → {b.get(k)!r}"
    return None


def _hash_example(h, x) -> bool:
    """Feed one example into ``h``; False when it holds a value with no stable bytes."""
    if isinstance(x, torch.Tensor):
        _update_tensor(h, x)
    elif isinstance(x, np.ndarray) and x.dtype != object:
        h.update(f"nd{x.shape}{x.dtype}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, dict):
        h.update(b"{")
        for k in sorted(x, key=repr):
            h.update(repr(k).encode())
            if not _hash_example(h, x[k]):
                return False
        h.update(b"}")
    elif isinstance(x, list | tuple):
        h.update(f"[{len(x)}".encode())
        return all(_hash_example(h, v) for v in x)
    elif x is None or isinstance(x, bool | int | float | complex | str | bytes | np.generic):
        h.update(f"{type(x).__name__}:{x!r}".encode())
    else:
        return False
    return True


def _update_tensor(h, t: torch.Tensor) -> None:
    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


# -- parts ---------------------------------------------------------------------------------------
def noise_state(noise) -> dict | list:
    """What a state keeps of a noise stream: its ``state_dict()`` for single-stream keys, a
    one-element list of its ``parameter_state()`` for coordinate keys (the form shards hold)."""
    return noise.state_dict() if noise.keys is None else [noise.parameter_state()]


def load_noise_state(noise, saved, where: str) -> None:
    """Restore ``noise_state`` (or the merged list of a manifest's shards) into ``noise``.

    Raises:
        ValueError: the saved noise is keyed otherwise than ``noise`` (``where`` names the file),
            or it belongs to another generator or key.
    """
    chunked = isinstance(saved, list)
    if chunked != (noise.keys is not None):
        have, want = ("coordinate", "single-stream") if chunked else ("single-stream", "coordinate")
        raise ValueError(
            f"{where} holds {have}-keyed noise and this run has {want}-keyed noise: resume it with "
            f"noise_keys={'chunked' if chunked else 'stream'} (--noise-keys)"
        )
    if chunked:
        noise.load_parameter_state(saved)
    else:
        noise.load_state_dict(saved)


def keep_own_optimizer_state(optimizer, privatizer) -> None:
    """Drop the optimizer state of parameters another rank owns (after loading a merged state:
    each rank keeps its share); nothing for a one-process privatizer."""
    written = getattr(privatizer, "written_parameters", None)
    if written is None:
        return
    mine = {id(p) for p in written()}
    for p in [p for p in optimizer.state if id(p) not in mine]:
        del optimizer.state[p]


def rng_state() -> dict:
    """The global generators' states: Python ``random``, NumPy's legacy global, torch CPU and
    (when available) every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``."""
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- the state -----------------------------------------------------------------------------------
def run_state(
    *,
    door: str,
    plan: dict | None,
    privatizer,
    model,
    optimizer,
    key: int | None,
    given: bool,
    run_identity: dict | None = None,
    data: str | None = None,
    epoch: int = 0,
    metrics=(),
    empty_batches: int | None = None,
    lookahead=None,
    siblings: int = 1,
) -> dict:
    """The run state (the keys ``KEYS``) of a run at ``privatizer.step``.

    Args:
        door: ``"train"`` or ``"make_private"``.
        plan: ``PrivatePlan.to_dict()`` (None: a loop built without a plan).
        privatizer: the private step; its ``drawn`` batches give the sampler's state at the
            privatized step, its noise stream the noise state.
        model, optimizer: the torch module and optimizer.
        key, given: the run's noise key and whether it was given (None: not kept).
        run_identity, data, epoch, metrics, empty_batches, lookahead: see the module.
        siblings: the run's family of forks (``dpmf.train.continuation``; 1: never forked).
    """
    step = int(privatizer.step)
    return {
        "format": FORMAT,
        "door": door,
        "plan": plan,
        "run_identity": dict(run_identity or {}),
        "data": data,
        "secret": {}
        if key is None
        else {
            "seed": int(key),
            "given": bool(given),
            "forks": privatizer.noise.forks,
            "siblings": int(siblings),
            "children": 0,
        },
        "step": step,
        "epoch": int(epoch),
        "model": {} if getattr(privatizer, "shards_parameters", False) else model_state(model),
        "optimizer": optimizer.state_dict(),
        # the sampler at the privatized step, not where a prefetching loader has drawn to
        "sampler": privatizer.drawn.sampler_state(step),
        "noise": noise_state(privatizer.noise),
        "rng": rng_state(),
        "metrics": list(metrics),
        "empty_batches": empty_batches,
        "lookahead": None if lookahead is None else lookahead.state_dict(),
    }


def _check_format(state, where: str) -> None:
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt == FORMAT:
        return
    if isinstance(fmt, int | str) and not isinstance(fmt, bool) and fmt in _OLD_FORMATS:
        raise ValueError(
            f"{where} is invalid: it is in the format {fmt!r} of an earlier dpmf's "
            f"{_OLD_FORMATS[fmt]} (this version reads {FORMAT!r}); finish that run with the dpmf "
            "version that wrote it, or start a new run"
        )
    raise ValueError(f"{where} is invalid: format {fmt!r} is not a dpmf run state (expected {FORMAT!r})")


def check_run_state(
    state: dict,
    where: str,
    *,
    door: str,
    plan: dict | None = None,
    run_identity: dict | None = None,
    data: str | None = None,
    model=None,
) -> None:
    """Refuse, before anything is loaded, a state this run cannot continue.

    Args:
        state: a run state (``read_run_state``).
        where: how messages name it (``checkpoint '…/checkpoint.pt'``, ``state``).
        door: the reader: ``"train"`` reads only states written by ``dpmf train`` (their
            ``run_identity`` is its config); ``"make_private"`` reads both doors' states.
        plan: the run's ``PrivatePlan.to_dict()`` (None: not compared).
        run_identity: the reader's identity; every key of either must agree (None: not compared).
        data: the reader's data digest (None, or a state without one: not compared).
        model: the reader's model: a trainable-only state must come from its frozen weights
            (None: not compared).

    Raises:
        ValueError: one line: an old or foreign format, another door, another run (the fields
            that differ, never the key), another plan, other data or other frozen weights.
    """
    _check_format(state, where)
    if door == "train" and state.get("door") != "train":
        raise ValueError(
            f"{where} is invalid for dpmf train: it was written by {state.get('door')!r}; resume it "
            "with make_private(...).resume(path)"
        )
    if run_identity is not None:
        theirs = state.get("run_identity") or {}
        diff = sorted(k for k in set(theirs) | set(run_identity) if theirs.get(k) != run_identity.get(k))
        if diff:
            detail = ", ".join(f"{k}: {theirs.get(k)!r} → {run_identity.get(k)!r}" for k in diff)
            raise ValueError(f"{where} belongs to another run ({detail})")
    saved = state.get("data")
    if data is not None and saved is not None and saved != data:
        raise ValueError(
            f"{where} is invalid for this data set: the training data differ (another --data-dir "
            f"or file?): data {saved!r} → {data!r} (resuming on other data would reuse the run's "
            "noise, so the two models' difference would be noiseless); resume on the same data, or "
            "start a new run"
        )
    if plan is not None and state.get("plan") != plan:
        raise ValueError(
            f"{where} is invalid: it belongs to another plan (data size, batches, steps, scheme, "
            "strategy or σ); resume with the settings of the run that wrote it"
        )
    if model is not None:
        check_model_state(model, state.get("model"), where)


def resumed_key(state: dict, policy: seeds.SeedPolicy, where: str) -> seeds.SeedPolicy:
    """The key policy of a resumed run: a given seed must be the state's key; a run without
    one adopts the state's key (secret or given).

    Raises:
        ValueError: no key in the state, or another key than the given seed (never shown).
    """
    secret = state.get("secret")
    key = secret.get("seed") if isinstance(secret, dict) else None
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise ValueError(f"{where} is invalid: it holds no noise key to resume with")
    if not policy.is_secret:
        if key != policy.key:
            raise ValueError(
                f"{where} is invalid for this run: it was saved under another key than the given seed "
                "(give that run's seed, or seed=None to adopt the saved key)"
            )
        return policy
    return seeds.SeedPolicy.adopt(key, given=bool(secret.get("given", False)))


def restore_run_state(state: dict, *, model, optimizer, sampler, privatizer, where: str) -> None:
    """Load a checked state (``check_run_state``) into the run's parts: the noise stream, the
    model, the optimizer (each rank keeps its share) and the sampler; the privatizer's earlier
    draws are void.

    Raises:
        ValueError: another noise keying or generator, other frozen weights, or a sampler and a
            noise stream at different steps.
    """
    sharded = _check_sharding(state, privatizer, where)
    if sharded:  # other frozen weights: refused before any loading
        check_frozen_rows(state, model, privatizer.collectives, where)
    else:
        check_model_state(model, state["model"], where)
    load_noise_state(privatizer.noise, state["noise"], where)
    if sharded:  # the shards through DCP, resharded to this run's processes
        load_dcp(state, model, optimizer, privatizer.collectives)
    else:
        load_model_state(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(as_numpy(state["sampler"]))
    privatizer.drawn.reset()  # earlier draws and loader iterations are void
    keep_own_optimizer_state(optimizer, privatizer)
    if sampler.step != privatizer.noise.step or sampler.step != state["step"]:
        raise ValueError(f"{where} is inconsistent: sampler and noise stream are at different steps")


def _check_sharding(state: dict, privatizer, where: str) -> bool:
    """Whether ``state`` is a fully_shard run's (its weights in a DCP folder); refuse it for a
    run whose parameters are whole, and a whole-weights state for a fully_shard run.

    Raises:
        ValueError: the two differ, naming the fix.
    """
    saved = state.get("fsdp") is not None
    here = bool(getattr(privatizer, "shards_parameters", False))
    if saved != here:
        have, want = ("fully_shard", "whole") if saved else ("whole", "fully_shard")
        raise ValueError(
            f"{where} holds a {have}-parameter run and this run's parameters are {want}: resume a "
            "fully_shard checkpoint into the model sharded with fully_shard (at any number of "
            "processes: dpmf train --distributed --fsdp under torchrun, or make_private(process_group=…) "
            "on the fully_shard model), and a whole-model checkpoint into the model before fully_shard "
            "(dpmf train without --fsdp)"
        )
    return saved


def write_run_state(path: str, state: dict, privatizer, collectives=None) -> None:
    """Write ``state`` to ``path``: one private file (``save_checkpoint``), or, with
    ``collectives``, this rank's shard and (rank 0) the manifest (``save_sharded``; every rank
    calls it); a fully_shard run's weights and optimizer state first through DCP
    (``dpmf.train.dcp``)."""
    if collectives is None:
        save_checkpoint(path, state)
        return
    sharded = getattr(privatizer, "shards_parameters", False)
    if sharded:
        state = save_dcp(path, state, privatizer.model, collectives)
    save_sharded(path, state, collectives, mode=privatizer.mode, seed_digest=privatizer.seed_digest)
    if sharded and collectives.rank == 0:
        remove_old_folders(path, state["fsdp"]["folder"])


def read_run_state(path: str) -> dict:
    """The run state at ``path`` (with its shards merged when a distributed run wrote it).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a corrupted, truncated or foreign file, a missing shard, or an old format
            (one line saying what to do).
    """
    state = load_checkpoint(path)
    _check_format(state, f"checkpoint {str(path)!r}")
    return merge_shards(state, path)
