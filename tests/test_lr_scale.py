"""Learning-rate-aware strategies at scale: O(n log² n) row norms, fast roots, refusals."""

import numpy as np
import pytest
from scipy.linalg import toeplitz

from dpmf.mechanisms import evaluate, factorize
from dpmf.mechanisms.prefix_rows import prefix_row_norms_sq
from dpmf.mechanisms.toeplitz import inverse_sqrt_coefficients, toeplitz_product, toeplitz_roots
from dpmf.workloads import Schedule, from_schedule, lr_scheduled, schedule
from dpmf.workloads.workload import momentum

# (n, strategy, schedule (β = 0.1), MaxSE, MeanSE) from the row-by-row O(n²) evaluation and
# the previous Newton iterations (before the O(n log² n) path), recorded
REFERENCE = [
    (16384, "lr_aware", "constant", 4.155169398353513, 3.992879269643294),
    (16384, "lr_aware", "exponential", 3.1079797551373196, 2.305037888942354),
    (16384, "lr_aware", "linear", 3.3413805117359288, 2.7026196386162975),
    (16384, "lr_aware", "cosine", 3.542317130752167, 2.8161379150561676),
    (16384, "lr_aware", "polynomial", 3.160872797997171, 2.3603493541743403),
    (16384, "lr_aware", "inverse_power", 1.1776324136604428, 1.1430301829935468),
    (8192, "lr_bsr:16", "constant", 28.220928573832442, 19.98687900736122),
    (8192, "lr_bsr:16", "exponential", 13.094942804299485, 11.682928269240584),
    (8192, "lr_bsr:16", "linear", 17.15999965198257, 14.62033575256193),
    (8192, "lr_bsr:16", "cosine", 17.91891411248037, 15.531598663674462),
    (8192, "lr_bsr:16", "polynomial", 13.599735039551971, 12.166839914973108),
    (8192, "lr_bsr:16", "inverse_power", 4.503248480645036, 3.2824475545073377),
    (8192, "lr_bisr:16", "constant", 19.08997742641774, 13.562263574773418),
    (8192, "lr_bisr:16", "exponential", 8.876448592282074, 7.94899244980038),
    (8192, "lr_bisr:16", "linear", 11.601583002204077, 9.92448628239112),
    (8192, "lr_bisr:16", "cosine", 12.102135106510906, 10.529911106224978),
    (8192, "lr_bisr:16", "polynomial", 9.212093027023116, 8.271821792651116),
    (8192, "lr_bisr:16", "inverse_power", 4.069715392551287, 2.9811902374608237),
    (8192, "lr_bisr:8192", "constant", 3.9345289412700937, 3.772085521000517),
    (8192, "lr_bisr:8192", "exponential", 2.9041007660825158, 2.1959577376355086),
    (8192, "lr_bisr:8192", "linear", 3.135278288452931, 2.566008126514676),
    (8192, "lr_bisr:8192", "cosine", 3.3290404817029238, 2.6739895526422672),
    (8192, "lr_bisr:8192", "polynomial", 2.956296813987817, 2.2480085733862656),
    (8192, "lr_bisr:8192", "inverse_power", 1.1679884397524634, 1.124616570159834),
]


@pytest.mark.parametrize("n,spec,name,max_se,mean_se", REFERENCE)
def test_values_equal_the_quadratic_evaluation(n, spec, name, max_se, mean_se):
    ev = evaluate(factorize(from_schedule(Schedule(name, 0.1), n), spec), with_lower_bound=False)
    assert ev.max_se == pytest.approx(max_se, rel=1e-9)
    assert ev.mean_se == pytest.approx(mean_se, rel=1e-9)


@pytest.mark.parametrize("n,p", [(1, 1), (2, 2), (3, 1), (37, 37), (100, 7), (520, 520), (700, 300)])
def test_row_norms_against_dense(n, p):
    """‖row_i(A₁·diag(w)·Toep(g))‖² formed densely; every block size of the recursion, direct
    and FFT levels, a banded g and n not a power of two."""
    rng = np.random.default_rng(n + p)
    w = rng.uniform(0.1, 1.0, n)
    g = rng.normal(size=p) / np.arange(1, p + 1)
    T = np.zeros((n, n))
    for k in range(p):
        T += np.diag(np.full(n - k, g[k]), -k)
    B = np.tril(np.ones((n, n))) @ np.diag(w) @ T
    assert np.allclose(prefix_row_norms_sq(w, g), np.sum(B * B, axis=1), rtol=1e-12, atol=0)


def test_geometric_roots_in_closed_form():
    n = 5000
    chi = schedule("exponential", n, 0.1)
    root, inv_root = toeplitz_roots(chi)
    y = inverse_sqrt_coefficients(chi)
    assert np.allclose(inv_root, y, rtol=1e-11, atol=1e-14)
    assert np.allclose(toeplitz_product(root, root, n), chi, rtol=1e-11, atol=1e-14)
    assert np.allclose(toeplitz_product(root, inv_root, n), np.eye(1, n)[0], atol=1e-12)


def test_dense_paths_refuse_with_the_size_needed():
    n = 8193
    with pytest.raises(ValueError, match=r"n=8193 is invalid for factorization='sqrt'.*GB.*lr_aware"):
        factorize(lr_scheduled(schedule("linear", n, 0.1)), "sqrt")
    with pytest.raises(ValueError, match=r"n=8193 is invalid for the dense strategy.*GB"):
        factorize(lr_scheduled(schedule("linear", n, 0.1)), "dense")
    w = momentum(16385, 0.9, chi=schedule("linear", 16385, 0.1))
    with pytest.raises(ValueError, match=r"n=16385 is invalid for evaluating.*GB"):
        evaluate(factorize(w, "lr_aware"), with_lower_bound=False)


def test_row_norms_in_chunks(monkeypatch):
    """The batched FFT levels split into chunks of nodes (as at large n) give the same sums."""
    from dpmf.mechanisms import prefix_rows

    rng = np.random.default_rng(7)
    n = 1500
    w, g = rng.uniform(0.1, 1.0, n), rng.normal(size=n) / np.arange(1, n + 1)
    whole = prefix_row_norms_sq(w, g)
    monkeypatch.setattr(prefix_rows, "_CHUNK", 64)
    assert np.allclose(prefix_row_norms_sq(w, g), whole, rtol=1e-13, atol=0)
    B = np.cumsum(w[:, None] * toeplitz(g, np.zeros(n)), axis=0)
    assert np.allclose(whole, np.sum(B * B, axis=1), rtol=1e-11, atol=0)
