"""Checkpoints written atomically, and the global random generators' states.

A checkpoint is written to a temporary file in the same folder, then renamed over the old
one (``dpmf._io.atomic_path``): a resumed run after a kill sees either the previous or the new
complete checkpoint, never a partial one. It holds only tensors and plain data (numpy arrays
are stored as tensors), so it loads with ``torch.load(weights_only=True)``: a crafted file
cannot run code. A corrupted, truncated, empty or foreign file is refused in one line.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from dpmf._io import atomic_path

__all__ = [
    "as_numpy",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]


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


def save_checkpoint(path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically (temporary file in the same folder, fsync,
    rename), so a kill during the write leaves the previous checkpoint intact. Numpy arrays are
    stored as tensors (``weights_only`` loading)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            torch.save(_plain(state), f)
            f.flush()
            os.fsync(f.fileno())


def load_checkpoint(path) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` (tensors on CPU), with
    ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an empty, truncated, corrupted or foreign file (one line; the file is left
            as it is).
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
    return state


def rng_state() -> dict:
    """The global generators' states: Python ``random``, NumPy's legacy global, torch CPU and
    (when available) every CUDA device."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
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
