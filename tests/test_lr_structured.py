"""Learning-rate schedules with structure: shift-separable row norms and closed-form roots.

Checked against dense brute force (B = A₁·diag(χ)·Toep(g) formed as an n×n array, Toep(y)
squared against Toep(χ)) and against the Newton iteration the closed forms replace.
"""

import numpy as np
import pytest
from scipy.linalg import toeplitz

from dpmf.mechanisms import evaluate, factorize, prefix_rows
from dpmf.mechanisms.prefix_rows import prefix_row_norms_sq
from dpmf.mechanisms.sensitivity import sensitivity
from dpmf.mechanisms.shift_basis import shift_separable
from dpmf.mechanisms.toeplitz import (
    arithmetic_step,
    inverse_sqrt_coefficients,
    toeplitz_inverse_root,
    toeplitz_product,
    toeplitz_roots,
)
from dpmf.workloads import Schedule, from_schedule

STRUCTURED = [
    ("constant", None, "polynomial", 1),
    ("linear", None, "polynomial", 2),
    ("polynomial", None, "polynomial", 3),
    ("polynomial", 3.0, "polynomial", 4),
    ("polynomial", 1.0, "polynomial", 2),
    ("cosine", None, "cosine", 3),
]


def _dense_rows_sq(w, g):
    n = w.shape[0]
    gp = np.zeros(n)
    gp[: g.shape[0]] = g
    B = np.cumsum(w[:, None] * toeplitz(gp, np.zeros(n)), axis=0)
    return np.sum(B * B, axis=1)


@pytest.mark.parametrize("name,gamma,kind,rank", STRUCTURED)
def test_shift_separable_families(name, gamma, kind, rank):
    chi = Schedule(name, 0.1, gamma).values(5000)
    form = shift_separable(chi)
    assert form is not None and form.kind == kind and form.rank == rank
    assert form.max_residual < 1e-14
    # w_{m+a} = Σ_r φ_r(m)ψ_r(a) on a few (m, a)
    terms = list(form.terms(5000))
    for m, a in [(0, 0), (17, 4000), (2500, 2499), (4999, 0)]:
        assert sum(phi[m] * psi[a] for phi, psi in terms) == pytest.approx(chi[m + a], rel=1e-13)


@pytest.mark.parametrize(
    "chi",
    [
        Schedule("inverse_power", 0.1).values(3000),
        Schedule("polynomial", 0.1, 1.5).values(3000),
        Schedule("exponential", 0.1).values(3000),
        np.random.default_rng(0).uniform(0.5, 1.0, 3000),
    ],
)
def test_shift_separable_refuses_other_shapes(chi):
    assert shift_separable(chi) is None


@pytest.mark.parametrize("name,gamma,kind,rank", STRUCTURED)
@pytest.mark.parametrize("p", [700, 37])
def test_separable_row_norms_against_dense(monkeypatch, name, gamma, kind, rank, p):
    """Every row of A₁·diag(χ)·Toep(g) against the dense product; small chunks so that the
    running sums are carried across many chunk boundaries; a full and a banded g."""
    monkeypatch.setattr(prefix_rows, "_STREAM", 64)
    n = 700
    chi = Schedule(name, 1e-3, gamma).values(n)
    g = inverse_sqrt_coefficients(chi)[:p]
    form = shift_separable(chi)
    got = prefix_rows._row_norms_separable(g, form)
    np.testing.assert_allclose(got, _dense_rows_sq(chi, g), rtol=1e-12, atol=0)
    np.testing.assert_allclose(prefix_row_norms_sq(chi, g), got, rtol=0, atol=0)


def test_separable_path_is_the_one_taken(monkeypatch):
    """A linear or cosine schedule never reaches the O(n log² n) divide and conquer."""

    def fail(*a, **k):
        raise AssertionError("divide and conquer called")

    monkeypatch.setattr(prefix_rows, "_cross_terms", fail)
    for name in ("linear", "cosine", "polynomial"):
        ev = evaluate(factorize(from_schedule(Schedule(name, 0.1), 4096), "lr_aware"), with_lower_bound=False)
        assert np.isfinite(ev.max_se)


@pytest.mark.parametrize("beta", [0.1, 1e-4, 0.99])
def test_linear_roots_in_closed_form(beta):
    n = 3000
    chi = Schedule("linear", beta).values(n)
    assert arithmetic_step(chi) == pytest.approx(-(1 - beta) / (n - 1), rel=1e-12)
    s, y = toeplitz_roots(chi)
    y_newton = inverse_sqrt_coefficients(chi)
    np.testing.assert_allclose(y, y_newton, rtol=0, atol=1e-14)
    np.testing.assert_allclose(toeplitz_product(chi, y_newton, n), s, rtol=0, atol=1e-13)
    np.testing.assert_allclose(toeplitz_product(s, s, n), chi, rtol=0, atol=1e-12)
    np.testing.assert_allclose(toeplitz_product(s, y, n), np.eye(1, n)[0], rtol=0, atol=1e-13)
    np.testing.assert_allclose(toeplitz_inverse_root(chi), y, rtol=0, atol=0)


def test_arithmetic_step_refuses_other_shapes():
    assert arithmetic_step(Schedule("cosine", 0.1).values(100)) is None
    assert arithmetic_step(np.arange(1.0, 101.0)) is None  # increasing
    assert arithmetic_step(Schedule("linear", 0.1).values(100) + 1e-9 * np.sin(np.arange(100))) is None


@pytest.mark.parametrize("name", ["exponential", "linear", "cosine", "polynomial", "inverse_power"])
@pytest.mark.parametrize("spec", ["lr_aware", "lr_bsr:16", "lr_bisr:16"])
def test_evaluation_against_dense_brute_force(name, spec):
    """MaxSE and MeanSE of the structured paths against B = A·C⁻¹ and C formed densely."""
    n = 800
    f = factorize(from_schedule(Schedule(name, 0.1), n), spec)
    ev = evaluate(f, with_lower_bound=False)
    A = f.workload.dense()
    C = f.C.dense()
    B = A @ np.linalg.inv(C)
    sens = float(np.max(np.linalg.norm(C, axis=0)))
    assert sensitivity(f.C).value == pytest.approx(sens, rel=1e-12)
    rows = np.linalg.norm(B, axis=1)
    assert ev.max_se == pytest.approx(sens * rows.max(), rel=1e-9)
    assert ev.mean_se == pytest.approx(sens * np.sqrt(np.mean(rows**2)), rel=1e-9)


def test_separable_row_norms_stay_accurate_at_large_n():
    """A constant w through the separable path at n = 2·10⁵: B = A₁·A₁^{−1/2} = A₁^{1/2} = Toep(r),
    so ‖B_i‖² = Σ_{j≤i} r_j² exactly (r_j = binom(2j, j)/4^j). The running sum of increments
    (the divide and conquer's form) is 4e-8 off here; the direct sums of squares stay at
    round-off."""
    from dpmf.mechanisms.toeplitz import binomial_series

    n = 200_000
    w = np.ones(n)
    g = binomial_series(0.5, n)
    exact = np.cumsum(binomial_series(-0.5, n) ** 2)
    got = prefix_rows._row_norms_separable(g, shift_separable(w))
    np.testing.assert_allclose(got, exact, rtol=1e-12, atol=0)
