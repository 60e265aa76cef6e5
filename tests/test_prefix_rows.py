"""The divide and conquer of ``prefix_rows`` where row n cuts the levels: a node alone in its
chunk whose rows stop at n (``_within_exact``), one whose next block is cut
(``_node_cut_feed``, with and without the running sum of earlier nodes), nodes past row n
skipped — every cross term against brute force in extended precision — and the Newton
steps of the inverse square root that end at n."""

from __future__ import annotations

import numpy as np
import pytest

from dpmf.mechanisms import prefix_rows as P
from dpmf.mechanisms import toeplitz as T
from dpmf.mechanisms.toeplitz import inverse_sqrt_coefficients, toeplitz_product, toeplitz_roots
from dpmf.workloads import Schedule


def _brute_cross_terms(g, w, rows):
    """y_i = Σ_δ w_{i−δ}·Σ_{q=δ..i} g_{q−δ}g_q in extended precision, O(i²) per row."""
    L = np.longdouble
    gl, wl = g.astype(L), w.astype(L)
    out = []
    for i in rows:
        tot = L(0)
        for d in range(1, i + 1):
            tot += wl[i - d] * np.dot(gl[: i + 1 - d], gl[d : i + 1])
        out.append(float(tot))
    return np.array(out)


@pytest.mark.parametrize("n, p", [(3000, 3000), (2600, 2600), (1900, 700), (4097, 4097)])
def test_cut_nodes_against_brute_force(monkeypatch, n, p):
    """Chunks of 64 elements make every node of 32 or more alone in its chunk, so the cut
    paths run at small n; the sums equal brute force and the batched levels."""
    w = Schedule("polynomial", 0.1, 1.5).values(n)
    g = toeplitz_roots(w)[1][:p]
    batched = P._cross_terms(g, w)
    calls = {"within": 0, "feed": 0, "feed_carry": 0}
    within, feed = P._within_exact, P._node_cut_feed

    def count_within(*a):
        calls["within"] += 1
        within(*a)

    def count_feed(g_, w_, y_, lo, s, m, carry):
        calls["feed" if carry is None else "feed_carry"] += 1
        feed(g_, w_, y_, lo, s, m, carry)

    monkeypatch.setattr(P, "_CHUNK", 64)
    monkeypatch.setattr(P, "_within_exact", count_within)
    monkeypatch.setattr(P, "_node_cut_feed", count_feed)
    y = P._cross_terms(g, w)
    if p == n:  # a banded g is recursed over [0, 2^k) ⊇ [0, p) whole: nothing is cut
        assert calls["within"] > 0 and calls["feed"] > 0 and calls["feed_carry"] > 0
    rows = [1, 9, 40, n // 2, n - 300, n - 2, n - 1]
    gp = np.zeros(n)
    gp[:p] = g
    exact = _brute_cross_terms(gp, w, rows)
    np.testing.assert_allclose(y[rows], exact, rtol=0, atol=2e-15)
    np.testing.assert_allclose(batched[rows], exact, rtol=0, atol=1e-14)
    assert np.max(np.abs(y - batched)) < 1e-14


def test_row_norms_at_a_cut_equal_a_dense_b(monkeypatch):
    """The row norms through the cut paths against B = A₁·diag(w)·Toep(g) formed densely."""
    monkeypatch.setattr(P, "_CHUNK", 64)
    n = 1500
    rng = np.random.default_rng(11)
    w = rng.uniform(0.1, 1.0, n)
    g = rng.normal(size=n) / np.arange(1, n + 1)
    Tg = np.zeros((n, n))
    for k in range(n):
        Tg[k:, k] = g[: n - k]
    B = np.cumsum(w[:, None] * Tg, axis=0)
    np.testing.assert_allclose(P.prefix_row_norms_sq(w, g), np.sum(B * B, axis=1), rtol=1e-11, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 8193, 20_001, 65_537])
def test_newton_steps_end_at_n(n):
    steps = T._newton_steps(n)
    assert [k for k, _ in steps[:1]] in ([], [1])
    assert all(k < m <= 2 * k for k, m in steps)
    assert all(a[1] == b[0] for a, b in zip(steps, steps[1:], strict=False))
    assert (steps[-1][1] if steps else 1) == n


def test_inverse_square_root_at_lengths_that_are_not_powers_of_two():
    """Past the direct products (n > 8192) with steps of odd lengths: Toep(y)²·Toep(c) = I."""
    n = 20_001
    c = Schedule("polynomial", 0.1, 1.5).values(n)
    y = inverse_sqrt_coefficients(c)
    e = toeplitz_product(toeplitz_product(y, y, n), c, n)
    assert abs(e[0] - 1.0) < 1e-14 and np.max(np.abs(e[1:])) < 1e-13
