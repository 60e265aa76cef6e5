"""limit_threads bounds torch's pools and every BLAS/OpenMP pool of the process."""

import os

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from dpmf.optim.threads import limit_threads


def test_limit_threads_sets_torch_blas_and_openmp_pools_and_the_environment(monkeypatch):
    np.dot(np.ones((4, 4)), np.ones((4, 4)))  # numpy's BLAS is loaded
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    with threadpool_limits(limits=2):  # restores the BLAS/OpenMP pools afterwards
        # every pool at 2, except single-threaded BLAS builds (cvxpy's SCS ships one), at 1
        counts = [info["num_threads"] for info in threadpool_info()]
        assert 2 in counts and set(counts) <= {1, 2}
        try:
            pools = limit_threads(1)
            assert torch.get_num_threads() == 1 and pools["torch"] == 1
            infos = threadpool_info()
            assert infos and all(info["num_threads"] == 1 for info in infos)
            assert {info["internal_api"] for info in infos} <= set(pools)
            assert os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == "1"
        finally:
            torch.set_num_threads(before)


def test_limit_threads_refuses_less_than_one():
    with pytest.raises(ValueError, match="threads=0 is invalid"):
        limit_threads(0)
