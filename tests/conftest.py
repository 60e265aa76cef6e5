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


@pytest.fixture(scope="module")
def one_thread_everywhere():
    """One thread in torch and in every BLAS/OpenMP pool numpy and scipy loaded (threadpoolctl),
    restored after the module: results recorded bit for bit depend on the number of threads
    that split a reduction. Modules opt in with ``pytestmark``."""
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(before)
