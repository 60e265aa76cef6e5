"""Power-series algebra against dense linear algebra and closed forms."""

import numpy as np
import pytest
from scipy.linalg import solve_triangular, sqrtm, toeplitz
from scipy.special import comb

from dpmf.mechanisms.toeplitz import (
    band,
    binomial_series,
    inverse_coefficients,
    inverse_sqrt_coefficients,
    is_nonincreasing_nonnegative,
    sqrt_coefficients,
    toeplitz_product,
)


def T(c):
    c = np.asarray(c, dtype=float)
    return toeplitz(c, np.zeros_like(c))


def test_binomial_series_closed_forms():
    j = np.arange(40)
    r = comb(2 * j, j, exact=False) / 4.0**j
    np.testing.assert_allclose(binomial_series(-0.5, 40), r, rtol=1e-14)
    np.testing.assert_allclose(binomial_series(0.5, 5), [1, -1 / 2, -1 / 8, -1 / 16, -5 / 128], rtol=1e-15)
    np.testing.assert_allclose(binomial_series(-1.0, 6, ratio=0.5), 0.5 ** np.arange(6))


def test_product_matches_dense():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=30), rng.normal(size=30)
    np.testing.assert_allclose(T(toeplitz_product(a, b)), T(a) @ T(b), atol=1e-12)


def test_fft_product_matches_direct():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=20000), rng.normal(size=20000)
    direct = np.convolve(a, b)[:20000]
    np.testing.assert_allclose(toeplitz_product(a, b), direct, atol=1e-9 * np.abs(direct).max())


def test_inverse_matches_triangular_solve():
    rng = np.random.default_rng(2)
    c = rng.uniform(0.1, 1.0, size=60)
    c[0] = 2.0
    ref = solve_triangular(T(c), np.eye(60), lower=True)[:, 0]
    np.testing.assert_allclose(inverse_coefficients(c), ref, rtol=1e-10, atol=1e-13)


def test_inverse_large_n_is_reciprocal():
    n = 50000
    r = binomial_series(-0.5, n)
    g = inverse_coefficients(r)
    np.testing.assert_allclose(g, binomial_series(0.5, n), rtol=1e-8, atol=1e-14)


def test_sqrt_matches_dense_and_closed_form():
    rng = np.random.default_rng(3)
    c = np.abs(rng.normal(size=25)) + 0.1
    s = sqrt_coefficients(c)
    np.testing.assert_allclose(T(s) @ T(s), T(c), atol=1e-11)
    np.testing.assert_allclose(T(s), np.real(sqrtm(T(c))), atol=1e-8)
    np.testing.assert_allclose(T(inverse_sqrt_coefficients(c)) @ T(s), np.eye(25), atol=1e-11)


@pytest.mark.parametrize("n", [2, 64, 1000, 20000])
def test_exponential_lr_aware_closed_form(n):
    """Toep(α^j)^{1/2} = Toep(α^j r_j) for α = β^{1/(n−1)} (LR-scheduling paper, eq. 8)."""
    alpha = 0.1 ** (1.0 / (n - 1))
    s = sqrt_coefficients(alpha ** np.arange(n))
    ref = binomial_series(-0.5, n, ratio=alpha)
    np.testing.assert_allclose(s, ref, rtol=1e-12, atol=1e-12)


def test_prefix_sum_roots():
    n = 100
    np.testing.assert_allclose(sqrt_coefficients(np.ones(n)), binomial_series(-0.5, n), rtol=1e-13)
    np.testing.assert_allclose(
        inverse_sqrt_coefficients(np.ones(n)), binomial_series(0.5, n), rtol=1e-12, atol=1e-15
    )


def test_band():
    c = np.arange(1.0, 6.0)
    np.testing.assert_array_equal(band(c, 1), [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(band(c, 3), [1, 2, 3, 0, 0])
    np.testing.assert_array_equal(band(c, 5), c)
    np.testing.assert_array_equal(band(c, 99), c)
    with pytest.raises(ValueError, match="bands"):
        band(c, 0)


def test_monotone_condition():
    assert is_nonincreasing_nonnegative([3, 2, 2, 0, 0])
    assert not is_nonincreasing_nonnegative([1, 2])
    assert not is_nonincreasing_nonnegative([1, -0.5])


def test_bad_input():
    with pytest.raises(ValueError, match="c"):
        inverse_coefficients([0.0, 1.0])
    with pytest.raises(ValueError, match="c"):
        sqrt_coefficients([-1.0, 1.0])
    with pytest.raises(ValueError, match="c"):
        sqrt_coefficients([1.0, np.nan])
    with pytest.raises(ValueError, match="n"):
        binomial_series(0.5, 0)
