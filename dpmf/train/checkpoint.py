"""Checkpoints written atomically, and the global random generators' states.

A checkpoint is written to a temporary file in the same folder, then renamed over the old
one (``dpmf._io.atomic_path``): a resumed run after a kill sees either the previous or the new
complete checkpoint, never a partial one.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from dpmf._io import atomic_path

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]


def save_checkpoint(path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically (temporary file in the same folder, fsync,
    rename), so a kill during the write leaves the previous checkpoint intact."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def load_checkpoint(path) -> dict:
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
