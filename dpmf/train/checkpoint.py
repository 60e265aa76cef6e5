"""Checkpoint files: written atomically, private, with the SHA-256 of every entry.

What a run's checkpoint holds is ``dpmf.train.state``'s; this module only stores and loads it.

A checkpoint is written to a temporary file in the same folder, then renamed over the old
one (``dpmf._io.atomic_path``): a resumed run after a kill sees either the previous or the new
complete checkpoint, never a partial one. It holds only tensors and plain data (numpy arrays
are stored as tensors), so it loads with ``torch.load(weights_only=True)``: a crafted file
cannot run code. A corrupted, truncated, empty or foreign file is refused in one line.

A checkpoint holds the run's secrets (the noise seed, the noise buffers, the sampler's state):
it is created 0600 and stays so (``atomic_path(private=True)``), whatever the umask.

Integrity: ``save_checkpoint`` stores under ``"digests"`` the SHA-256 of every tensor (by its
entry's name, e.g. ``model/fc1.weight``) and of the plain data around them (numbers, strings,
the structure); ``load_checkpoint`` recomputes them and refuses a file where one differs,
naming the file and the entry, never a value. Bits flipped inside a tensor's bytes, which
``torch.load`` itself does not notice, are caught this way; a file without digests is refused.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from dpmf._io import atomic_path

__all__ = [
    "DIGESTS",
    "as_numpy",
    "save_checkpoint",
    "load_checkpoint",
]


DIGESTS = "digests"


def _plain(obj):
    """``obj`` with numpy arrays as tensors and numpy scalars as Python numbers (tuples kept)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def as_numpy(obj):
    """``obj`` with tensors back as numpy arrays (the inverse of the saving conversion, for
    numpy-side states such as a sampler's)."""
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: as_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(as_numpy(v) for v in obj)
    return obj


def _tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (any dtype, 0-d included)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _digests(state: dict) -> dict:
    """``{"tensors": {entry: sha256}, "plain": sha256}`` of a (plain) state: one digest per
    tensor, named by its path of keys, and one of everything else (the structure with each
    tensor replaced by its name)."""
    tensors: dict[str, str] = {}

    def skeleton(obj, name: str):
        if isinstance(obj, torch.Tensor):
            tensors[name] = _tensor_digest(obj)
            return ("tensor", name)
        if isinstance(obj, dict):
            return (
                "dict",
                [(repr(k), skeleton(v, f"{name}/{k}" if name else str(k))) for k, v in obj.items()],
            )
        if isinstance(obj, list | tuple):
            return (type(obj).__name__, [skeleton(v, f"{name}/{i}") for i, v in enumerate(obj)])
        return repr(obj)

    plain = hashlib.sha256(repr(skeleton(state, "")).encode()).hexdigest()
    return {"tensors": tensors, "plain": plain}


def save_checkpoint(path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically (temporary file in the same folder, fsync,
    rename), so a kill during the write leaves the previous checkpoint intact. Numpy arrays are
    stored as tensors (``weights_only`` loading). The file is 0600 from its creation (it holds
    secrets) and carries the SHA-256 of every entry (``"digests"``), checked by
    ``load_checkpoint``.

    Raises:
        ValueError: ``state`` uses the reserved key ``"digests"``.
        dpmf._io.WriteError: the file could not be written (disk full, …): one line naming it;
            the previous checkpoint is kept.
    """
    if DIGESTS in state:
        raise ValueError(f"state is invalid: the key {DIGESTS!r} is reserved for the checkpoint's digests")
    plain = _plain(state)
    plain[DIGESTS] = _digests(plain)
    with atomic_path(path, private=True) as tmp:
        with open(tmp, "wb") as f:
            torch.save(plain, f)
            f.flush()
            os.fsync(f.fileno())


def _verify(state: dict, path) -> dict:
    """``state`` without its digests, after checking them (``ValueError`` naming the entry)."""
    where = f"checkpoint={str(path)!r} is invalid"
    saved = state.pop(DIGESTS, None)
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        raise ValueError(
            f"{where}: it holds no digests of its entries, so its integrity cannot be checked "
            "(written by an older dpmf, or not a dpmf checkpoint); start a new run"
        )
    now = _digests(state)
    names = set(saved["tensors"]) | set(now["tensors"])
    for name in sorted(names):
        if saved["tensors"].get(name) != now["tensors"].get(name):
            what = "is missing" if name not in now["tensors"] else "does not match its digest"
            raise ValueError(
                f"{where}: its entry {name!r} {what} (the file is corrupted); it was not changed: "
                "restore the file from a copy or start a new run"
            )
    if saved.get("plain") != now["plain"]:
        raise ValueError(
            f"{where}: its plain data (step, metrics, seed, structure) do not match their digest "
            "(the file is corrupted); it was not changed: restore the file from a copy or start a new run"
        )
    return state


def load_checkpoint(path) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` (tensors on CPU), with
    ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an empty, truncated, corrupted or foreign file, or an entry whose SHA-256
            differs from the one saved (one line naming the entry, never its value; the file
            is left as it is).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint={path!r} is invalid: no such file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"checkpoint={path!r} is invalid: the file is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is one message
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"checkpoint={path!r} is invalid: it is truncated, corrupted or not a dpmf checkpoint "
            f"({type(exc).__name__}: {reason}); it was not changed"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint={path!r} is invalid: not a dpmf checkpoint (no state mapping)")
    return _verify(state, path)
