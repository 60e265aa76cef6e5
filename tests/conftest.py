"""Shared pytest configuration: a headless matplotlib backend and the one-thread fixture."""

import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: one torch intra-op thread avoids spinning threads on a shared machine
    (restored after the module). Modules opt in with ``pytestmark``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
