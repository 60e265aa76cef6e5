"""Atomic files and checkpoints: write to a temporary file in the same folder, then rename.

A reader (or a resumed run after a kill) sees either the previous complete file or the new
complete file, never a partial one: ``os.replace`` is atomic on POSIX and Windows within one
file system.
"""

from __future__ import annotations

import io
import os
import random
import tempfile

import numpy as np
import torch

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def save_checkpoint(path: str, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically."""
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` (tensors on CPU).

    Raises:
        FileNotFoundError: no such file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint={path!r} is invalid: no such file")
    return torch.load(path, map_location="cpu", weights_only=False)


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
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
