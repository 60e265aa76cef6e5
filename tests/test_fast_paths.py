"""The O(n·p) and O(n·k) paths of the optimizers and the sensitivity against direct computation
(dense matrices, exhaustive signs) and against the optima of the previous O(n²) objectives."""

import itertools

import numpy as np
import pytest

from dpmf.mechanisms.banded_opt import optimize_banded
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.sensitivity import sensitivity
from dpmf.mechanisms.structured import DenseLowerTriangular, ScaledToeplitz
from dpmf.mechanisms.toeplitz import inverse_coefficients
from dpmf.mechanisms.toeplitz_objective import (
    banded_reciprocal,
    banded_reciprocal_gradient,
    frobenius_sq,
    gram_diagonals,
    reciprocal_gradient,
)
from dpmf.workloads import Schedule, from_schedule


def _toeplitz(c):
    n = c.shape[0]
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)


def _brute_fixed_epochs(M, b, k):
    """max over classes s and signs u of ‖M u‖ with u on the columns s, s+b, … (< n)."""
    n = M.shape[0]
    best = 0.0
    for s in range(min(b, n)):
        idx = [s + i * b for i in range(k) if s + i * b < n]
        for signs in itertools.product((1.0, -1.0), repeat=len(idx)):
            best = max(best, float(np.linalg.norm(M[:, idx] @ np.array(signs))))
    return best


@pytest.mark.parametrize(
    "n,b,k,scaled", [(12, 4, 3, False), (13, 4, 4, True), (9, 5, 2, True), (7, 3, 3, False)]
)
def test_toeplitz_fixed_epochs_sensitivity_is_the_exhaustive_maximum(n, b, k, scaled):
    rng = np.random.default_rng(n * 100 + b)
    for c in (rng.normal(size=n), np.abs(rng.normal(size=n))):  # mixed signs: sign search
        c[0] = 1.0
        d = rng.uniform(0.5, 2.0, size=n) if scaled else None
        C = ScaledToeplitz(c, None, d)
        part = Participation.fixed_epochs(b, k)
        fast = sensitivity(C, part)
        generic = sensitivity(DenseLowerTriangular(C.dense()), part)
        assert fast.exact == generic.exact and fast.method == generic.method
        ref = _brute_fixed_epochs(C.dense(), b, k)
        if fast.exact:  # CᵀC ≥ 0 within every class, or classes of at most 2 columns
            assert fast.value == pytest.approx(ref, rel=1e-12)
        else:  # signs only bound the vector sensitivity from below: a certified bound above it
            assert fast.value >= fast.lower_bound >= ref * (1 - 1e-12)
        assert fast.value == pytest.approx(generic.value, rel=1e-9)


@pytest.mark.parametrize("n,p", [(1, 1), (40, 1), (40, 5), (300, 17)])
def test_banded_reciprocal_and_its_gradient_match_the_power_series(n, p):
    rng = np.random.default_rng(p)
    b = np.concatenate([[1.7], rng.uniform(-0.4, 0.2, p - 1) / np.arange(1, p)])
    full = np.zeros(n)
    full[:p] = b
    c = inverse_coefficients(full)
    assert np.allclose(banded_reciprocal(b, n), c, rtol=0, atol=1e-14 * np.max(np.abs(c)))
    assert np.allclose(_toeplitz(full) @ _toeplitz(banded_reciprocal(b, n)), np.eye(n), atol=1e-12)
    g = rng.normal(size=n)
    ref = reciprocal_gradient(g, c, p)
    assert np.allclose(banded_reciprocal_gradient(g, b, p), ref, rtol=0, atol=1e-13 * np.max(np.abs(ref)))


def test_frobenius_with_cached_gram_diagonals_is_the_same_number_and_the_dense_norm():
    n, p = 60, 9
    w = from_schedule(Schedule("cosine", 0.05), n)
    y = np.zeros(n)
    y[:p] = np.random.default_rng(3).normal(size=p)
    direct = frobenius_sq(w, y, p)
    cached = frobenius_sq(w, y, p, diagonals=gram_diagonals(w, p))
    assert direct[0] == cached[0] and np.array_equal(direct[1], cached[1])
    assert direct[0] == pytest.approx(np.sum((w.dense() @ _toeplitz(y)) ** 2), rel=1e-12)
    with pytest.raises(ValueError, match="diagonals"):
        frobenius_sq(w, y, p, diagonals=gram_diagonals(w, p - 1))


# optima of optimize_banded with the previous objectives (Newton reciprocal, O(n²) products,
# Gram diagonals recomputed per evaluation), n = 200
PREVIOUS = [
    ("exponential", 0.1, "bisr_opt", 16, Participation.fixed_epochs(25, 8), 5.220281796187367),
    ("cosine", 0.05, "bisr_opt", 16, Participation.single(), 1.8589704835977896),
    ("exponential", 0.1, "bsr_opt", 16, Participation.single(), 1.925163898964141),
    ("linear", 0.2, "bsr_opt", 8, Participation.separated(25, 8), 8.66654194323399),
    ("constant", 1.0, "bisr_opt", 16, Participation.separated(25, 8), 8.917160906118948),
]


@pytest.mark.parametrize("schedule,beta,name,p,part,value", PREVIOUS)
def test_banded_optimum_is_the_previous_implementations(schedule, beta, name, p, part, value):
    res = optimize_banded(from_schedule(Schedule(schedule, beta), 200), name, p, part)
    assert res.converged and res.improved and res.sensitivity_exact
    if name == "bisr_opt" and part.participations(200) > 1:
        # the constrained solve on the edge of the closed-form region continues from there
        assert res.value <= value * (1 + 1e-6)
    else:
        assert res.value == pytest.approx(value, rel=1e-6)
