"""How many threads the training process uses: torch's pools and every BLAS/OpenMP pool.

On a machine shared with other processes, more threads than free cores make every parallel
operation wait for its slowest thread (a descheduled one), and many small operations — the
per-example work of a private step — pay that wait each time. ``limit_threads`` sets one
bound for all the pools of the process at once: torch's intra-op pool
(``torch.set_num_threads``), its inter-op pool where it has not started yet, and, through
``threadpoolctl``, the OpenMP, OpenBLAS and MKL pools that torch and numpy/scipy have loaded
(the accounting and the noise generation use numpy's BLAS). The ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` variables are set too, for processes started
afterwards (data-loading workers).
"""

from __future__ import annotations

import os

import torch

from dpmf._validation import check_int

__all__ = ["limit_threads"]

_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_threads(threads: int) -> dict[str, int]:
    """Use at most ``threads`` threads in every thread pool of this process.

    Args:
        threads: ≥ 1.

    Returns:
        pool name → its limit afterwards: ``torch`` (intra-op), ``torch_interop`` (unchanged
        once torch's inter-op pool has started), and one entry per BLAS/OpenMP library that
        ``threadpoolctl`` found (e.g. ``openmp``, ``openblas``, ``mkl``).

    Raises:
        ValueError: ``threads`` < 1.
    """
    threads = check_int("threads", threads, minimum=1)
    from threadpoolctl import threadpool_info, threadpool_limits

    for name in _ENV:
        os.environ[name] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # the inter-op pool has already started: it keeps its size
        pass
    threadpool_limits(limits=threads)
    pools = {"torch": torch.get_num_threads(), "torch_interop": torch.get_num_interop_threads()}
    for info in threadpool_info():
        pools[info["internal_api"]] = info["num_threads"]
    return pools
