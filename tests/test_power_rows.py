"""Row norms of learning-rate workloads with an inverse-power schedule (``power_rows``): the
exponential sum against t^{−γ}, the cross terms against brute force in extended precision,
the row norms against a dense B and against each row computed on its own by one correlation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import fft as sfft

from dpmf.mechanisms import prefix_rows as P
from dpmf.mechanisms.power_rows import (
    _exponential_sum,
    inverse_power_form,
    power_cross_terms,
)
from dpmf.mechanisms.toeplitz import toeplitz_roots
from dpmf.workloads import Schedule


@pytest.mark.parametrize("gamma", [0.1, 0.5, 1.0, 2.5, 8.0])
def test_exponential_sum_accuracy_summed_over_every_step(gamma):
    """Every t ≤ n: the error is below 1e-14 and its sum over t (what the row recurrence
    accumulates) below 1e-11, or the error is at round-off relative to t^{−γ}."""
    n = 100_000
    s, c, c0 = _exponential_sum(gamma, n)
    t = np.arange(1.0, n + 1.0)
    err = np.concatenate(
        [
            np.abs(c0 + np.exp(-np.outer(t[i : i + 5000], s)) @ c - t[i : i + 5000] ** -gamma)
            for i in range(0, n, 5000)
        ]
    )
    relative = np.max(err * t**gamma)
    assert (np.max(err) < 1e-14 and math.fsum(err) < 1.2e-11) or relative < 8e-15
    assert np.all(c > 0) and np.all(s > 0)  # a positive sum: no cancellation


@pytest.mark.parametrize("beta,gamma", [(0.1, 1.0), (0.01, 0.5), (0.3, 2.0)])
def test_form_recovers_the_schedule(beta, gamma):
    n = 8192
    w = Schedule("inverse_power", beta, gamma).values(n)
    f = inverse_power_form(w)
    tail = float(n) ** -gamma
    assert f.gamma == pytest.approx(gamma, rel=1e-12)
    assert f.b == pytest.approx((1 - beta) / (1 - tail), rel=1e-12)
    assert f.a == pytest.approx(beta - (1 - beta) * tail / (1 - tail), rel=1e-11, abs=1e-15)


def test_other_schedules_and_perturbed_values_have_no_form():
    n = 8192
    for name in ("cosine", "linear", "exponential", "polynomial"):
        assert inverse_power_form(Schedule(name, 0.1).values(n)) is None
    w = Schedule("inverse_power", 0.1).values(n)
    bumped = w.copy()
    bumped[1000] += 1e-9
    # a form found from w, handed values that differ at one entry: refused, not approximated
    f = inverse_power_form(w)
    assert power_cross_terms(bumped, np.ones(8), f) is None
    bumped[5000] = np.nan  # a NaN is not within any tolerance
    bumped[1000] = w[1000]
    assert power_cross_terms(bumped, np.ones(8), f) is None
    assert inverse_power_form(w[:100]) is None  # short: the divide and conquer is as fast


def _brute_cross_term(g, w, i):
    """y_i = Σ_{k<q≤i} g_k g_q w_{i−(q−k)} in extended precision, O(i²)."""
    L = np.longdouble
    gl, wl = g.astype(L), w.astype(L)
    return float(sum(gl[k] * np.dot(gl[k + 1 : i + 1], wl[k:i][::-1]) for k in range(i)))


def test_cross_terms_against_brute_force_and_divide_and_conquer():
    n = 4096
    w = Schedule("inverse_power", 0.05, 0.7).values(n)
    _, g = toeplitz_roots(w)
    y = power_cross_terms(w, g, inverse_power_form(w))
    for i in (1, 2, 17, 1023, 2500, n - 1):
        assert y[i] == pytest.approx(_brute_cross_term(g, w, i), abs=4e-15)
    assert np.max(np.abs(y - P._cross_terms(g, w))) < 1e-14
    # a short g (a banded C⁻¹): the same terms with g's tail zero
    gs = g[:300]
    ys = power_cross_terms(w, gs, inverse_power_form(w))
    assert np.max(np.abs(ys - P._cross_terms(gs, w))) < 1e-14


def test_row_norms_against_dense_b():
    n = 4097  # above the form's minimum n and the minimum bandwidth of the fast path
    w = Schedule("inverse_power", 0.1, 1.0).values(n)
    _, g = toeplitz_roots(w)
    rows = P.prefix_row_norms_sq(w, g)
    T = np.zeros((n, n))
    for k in range(n):
        T[k:, k] = g[: n - k]
    B = np.cumsum(w[:, None] * T, axis=0)  # A₁·diag(w)·Toep(g)
    dense = np.einsum("ij,ij->i", B, B)
    assert np.max(np.abs(rows / dense - 1.0)) < 1e-12


def test_large_n_rows_against_one_correlation_each():
    """n = 2¹⁸: each checked row's norm by one FFT correlation (checked against exact sums at
    sampled entries) — the streamed recurrence stays within 1e-10."""
    n = 1 << 18
    w = Schedule("inverse_power", 0.1, 1.0).values(n)
    _, g = toeplitz_roots(w)
    rows = P.prefix_row_norms_sq(w, g)
    for i in (n // 3, n - 1):
        m = i + 1
        size = sfft.next_fast_len(2 * m, real=True)
        S = sfft.irfft(sfft.rfft(w[:m], size) * np.conj(sfft.rfft(g[:m], size)), size)[:m]
        for k in (0, 7, m // 2, m - 3):
            assert S[k] == pytest.approx(math.fsum(w[k:m] * g[: m - k]), abs=1e-15)
        assert rows[i] == pytest.approx(float(np.sum(S * S)), rel=1e-10)


def test_squares_prefix_against_exact_sums():
    rng = np.random.default_rng(3)
    g = rng.standard_normal(20_000) / np.arange(1, 20_001) ** 1.5
    D = P._squares_prefix(g, 25_000)
    for i in (0, 5, 999, 19_999, 24_999):
        exact = math.fsum(g[: i + 1] ** 2)
        assert D[i] == pytest.approx(exact, rel=4e-16)


@pytest.mark.parametrize("n, p", [(1000, 1000), (3000, 3000), (3000, 700), (1025, 1025)])
def test_divide_and_conquer_at_sizes_that_are_not_powers_of_two(n, p):
    """The levels stop before the nodes beyond row n (padding to P = 2^k): every row, checked
    against brute force in extended precision at several rows and a fractional power."""
    w = Schedule("polynomial", 0.1, 1.5).values(n)
    _, g = toeplitz_roots(w)
    g = g[:p]
    y = P._cross_terms(g, w)
    gp = np.zeros(n)
    gp[:p] = g
    for i in (1, 9, n // 2, n - 2, n - 1):
        assert y[i] == pytest.approx(_brute_cross_term(gp, w, i), abs=1e-14)
