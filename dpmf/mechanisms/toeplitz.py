"""Power-series algebra on the coefficient vectors of lower-triangular Toeplitz matrices.

``Toep(c)`` — the n×n lower-triangular Toeplitz matrix with first column ``c`` — is the
truncation of the power series c(x) = Σ_j c_j x^j: ``Toep(a)·Toep(b) = Toep(a*b mod xⁿ)``, its
inverse is the reciprocal series, its square root the series square root. Every function here
takes and returns coefficient vectors of shape (n,), float64, and never forms an n×n array.

Cost: products are exact direct convolutions up to ``_DIRECT_MAX`` coefficients and FFT
convolutions beyond (O(n log n)); inverse and (inverse) square root use Newton iteration with
those products (O(M(n)), i.e. O(n log n) for large n), each Newton step computing only the
coefficients it needs (middle products at the smallest FFT size free of wrap-around, the
transform of y reused for y² and for the correction).

References:
    Brent & Kung, "Fast algorithms for manipulating formal power series", J. ACM 25 (1978):
    Newton iteration for reciprocal and square root of power series.
"""

from __future__ import annotations

import numpy as np
from scipy import fft as _sfft

from dpmf._validation import check_int, check_real, check_vector
from dpmf.mechanisms._fft import fftconvolve, lfilter
from dpmf.mechanisms.shift_basis import ShiftSeparable, shift_separable

__all__ = [
    "binomial_series",
    "toeplitz_product",
    "inverse_coefficients",
    "sqrt_coefficients",
    "inverse_sqrt_coefficients",
    "band",
    "is_nonincreasing_nonnegative",
    "geometric_ratio",
    "arithmetic_step",
    "toeplitz_roots",
    "toeplitz_inverse_root",
]

_DIRECT_MAX = 8192
_BANDED_MAX = 64  # reciprocals of series with at most this many terms use their recurrence,
_RECURRENCE_MIN_STEPS = 1 << 16  # from this n on (below, Newton is fast and scipy.signal unneeded)


def binomial_series(exponent: float, n: int, ratio: float = 1.0) -> np.ndarray:
    """Coefficients of (1 − ratio·x)^exponent, shape (n,).

    c_0 = 1, c_j = c_{j−1}·ratio·(j − 1 − exponent)/j. With exponent = −1/2 these are
    r_j = binom(2j, j)/4^j (the square root of the prefix sum, A₁^{1/2} = Toep(r)); with
    exponent = 1/2 they are 1, −1/2, −1/8, −1/16, −5/128, … (A₁^{−1/2}). With ratio = α they
    are α^j·r_j, the square root of Toep(α^j) (exponential learning-rate decay).

    Raises:
        ValueError: n < 1 or a non-finite exponent/ratio.
    """
    n = check_int("n", n, minimum=1)
    e = check_real("exponent", exponent)
    ratio = check_real("ratio", ratio)
    j = np.arange(1, n, dtype=np.float64)
    steps = ratio * (j - 1.0 - e) / j
    out = np.empty(n)
    out[0] = 1.0
    out[1:] = np.cumprod(steps)
    return out


def toeplitz_product(a, b, n: int | None = None) -> np.ndarray:
    """First n coefficients of a(x)·b(x): ``Toep(a)·Toep(b) = Toep(result)``.

    Args:
        a, b: coefficient vectors, shapes (len_a,), (len_b,).
        n: length of the result (default ``max(len_a, len_b)``).

    Returns:
        float64 array of shape (n,).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if n is None:
        n = max(a.shape[0], b.shape[0])
    a, b = a[:n], b[:n]
    if a.size == 0 or b.size == 0:
        return np.zeros(n)
    if min(a.shape[0], b.shape[0]) <= 64 or max(a.shape[0], b.shape[0]) <= _DIRECT_MAX:
        full = np.convolve(a, b)
    else:
        full = fftconvolve(a, b)
    out = np.zeros(n)
    m = min(n, full.shape[0])
    out[:m] = full[:m]
    return out


def inverse_coefficients(c) -> np.ndarray:
    """Coefficients g of the reciprocal series, ``Toep(c)⁻¹ = Toep(g)``, shape (n,).

    Newton iteration g ← g·(2 − c·g), doubling the number of correct terms each step; for a
    banded c (at most 64 non-zero terms, n ≥ 65536) the recurrence of 1/c(x), O(n·p).

    Raises:
        ValueError: c empty, non-finite, or c[0] = 0 (singular matrix).
    """
    c = check_vector("c", c)
    if c[0] == 0:
        raise ValueError("c is invalid: c[0] must be non-zero for Toep(c) to be invertible")
    n = c.shape[0]
    nz = np.flatnonzero(c)
    p = int(nz[-1]) + 1
    if p <= _BANDED_MAX and n >= _RECURRENCE_MIN_STEPS:
        # a banded c: the reciprocal's linear recurrence g_t = −Σ_{0<l<p} c_l g_{t−l}/c_0 as an
        # all-pole filter, O(n·p)
        impulse = np.zeros(n)
        impulse[0] = 1.0
        return lfilter([1.0], c[:p], impulse)
    g = np.empty(n)
    g[0] = 1.0 / c[0]
    k = 1
    while k < n:
        m = min(2 * k, n)
        if m <= _DIRECT_MAX:
            e = toeplitz_product(c[:m], g[:k], m)  # c·g = 1 + O(x^k)
            g[k:m] = -toeplitz_product(g[: m - k], e[k:m], m - k)
        else:
            e = _middle_product(c[:m], g[:k], k, m)
            g[k:m] = -_low_product(g[: m - k], e, m - k)
        k = m
    return g


def _middle_product(a: np.ndarray, b: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Coefficients lo..hi−1 of a·b by one real FFT of the smallest size that keeps them free
    of wrap-around (len(a) + len(b) − 1 − lo)."""
    size = _sfft.next_fast_len(a.shape[0] + b.shape[0] - 1 - lo, real=True)
    return _sfft.irfft(_sfft.rfft(a, size) * _sfft.rfft(b, size), size)[lo:hi]


def _low_product(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """The first m coefficients of a·b by one real FFT."""
    size = _sfft.next_fast_len(a.shape[0] + b.shape[0] - 1, real=True)
    return _sfft.irfft(_sfft.rfft(a, size) * _sfft.rfft(b, size), size)[:m]


def inverse_sqrt_coefficients(c, structure: ShiftSeparable | None = None) -> np.ndarray:
    """Coefficients y with ``Toep(y) = Toep(c)^{−1/2}`` (y_0 = c_0^{−1/2} > 0), shape (n,).

    Newton iteration y ← y − y·(c·y² − 1)/2, from 1 to n correct terms through the lengths
    ⌈n/2^j⌉ (``_newton_steps``: the last step ends at n). With ``structure`` (the
    shift-separable form of c, ``shift_basis``) the products c·y² are R running sums instead
    of FFTs (two real FFTs per step fewer: about half the work).

    Raises:
        ValueError: c empty, non-finite, or c[0] ≤ 0.
    """
    c = check_vector("c", c)
    if c[0] <= 0:
        raise ValueError(f"c is invalid: c[0]={c[0]!r} must be > 0 for a real square root")
    n = c.shape[0]
    y = np.empty(n)
    y[0] = 1.0 / np.sqrt(c[0])
    for k, m in _newton_steps(n):
        if m <= _DIRECT_MAX:
            yy = np.concatenate([y[:k], np.zeros(m - k)])
            e = toeplitz_product(c[:m], toeplitz_product(yy, yy, m), m)  # 1 + O(x^k)
            y[k:m] = -0.5 * toeplitz_product(y[: m - k], e[k:m], m - k)
        else:
            size = _sfft.next_fast_len(2 * k - 1, real=True)
            Y = _sfft.rfft(y[:k], size)
            y2 = _sfft.irfft(Y * Y, size, overwrite_x=True)[: min(m, 2 * k - 1)]  # y², no wrap
            if structure is None:
                e = _middle_product(c[:m], y2, k, m)  # c·y² = 1 + O(x^k): its terms k..m−1
            else:
                padded = np.zeros(m)
                padded[: y2.shape[0]] = y2[:m]
                e = structure.product(padded)[k:m]
            # the correction's first m − k ≤ k terms from ŷ (y·e has length < 2k: no wrap)
            E = _sfft.rfft(e, size)
            E *= Y
            y[k:m] = -0.5 * _sfft.irfft(E, size, overwrite_x=True)[: m - k]
    return y


def _newton_steps(n: int) -> list[tuple[int, int]]:
    """The (k, m) of each Newton step from 1 to n terms, m ≤ 2k: the lengths are n, ⌈n/2⌉,
    ⌈n/4⌉, … read backwards, so every step nearly doubles and the last one ends at n (doubling
    from 1 would end with a step from the power of two below n at almost the cost of a full
    one, whatever the few terms it adds)."""
    sizes = [n]
    while sizes[-1] > 1:
        sizes.append((sizes[-1] + 1) // 2)
    sizes.reverse()
    return list(zip(sizes[:-1], sizes[1:], strict=True))


def sqrt_coefficients(c) -> np.ndarray:
    """Coefficients s with ``Toep(s) = Toep(c)^{1/2}`` (the principal root, s_0 = √c_0 > 0).

    Computed as c·c^{−1/2}. Shape (n,).

    Raises:
        ValueError: c empty, non-finite, or c[0] ≤ 0.
    """
    y = inverse_sqrt_coefficients(c)
    return toeplitz_product(np.asarray(c, dtype=np.float64), y, y.shape[0])


def band(c, p: int) -> np.ndarray:
    """Keep the first p coefficients (p diagonals) of c and zero the rest; shape of c.

    ``Toep(band(c, p))`` is the p-banded truncation band_p(Toep(c)). p ≥ n keeps everything.

    Raises:
        ValueError: p < 1.
    """
    c = check_vector("c", c)
    p = check_int("bands", p, minimum=1)
    out = c.copy()
    out[p:] = 0.0
    return out


def is_nonincreasing_nonnegative(c, *, rtol: float = 1e-12) -> bool:
    """True when c_0 ≥ c_1 ≥ … ≥ 0, up to round-off of ``rtol·max|c|``.

    This is the condition under which the Toeplitz min_sep sensitivity closed form holds.
    """
    c = np.asarray(c, dtype=np.float64)
    tol = rtol * float(np.max(np.abs(c))) if c.size else 0.0
    return bool(np.all(c >= -tol) and np.all(np.diff(c) <= tol))


def geometric_ratio(w) -> float | None:
    """ρ when w_i = w_0·ρ^i to 1e-13 (relative) for every i, else None (n < 3: None)."""
    w = np.asarray(w, dtype=np.float64)
    n = w.shape[0]
    if n < 3 or w[0] == 0 or np.any(w / w[0] <= 0):
        return None
    log_rho = float(np.log(w[-1] / w[0])) / (n - 1)
    probe = np.unique(np.linspace(0, n - 1, 65).astype(np.int64))  # a cheap refusal first
    if np.max(np.abs(w[0] * np.exp(probe * log_rho) - w[probe]) / np.abs(w[probe])) > 1e-13:
        return None
    fit = w[0] * np.exp(np.arange(n) * log_rho)
    if np.max(np.abs(fit - w) / np.abs(w)) > 1e-13:
        return None
    return float(np.exp(log_rho))


def arithmetic_step(w) -> float | None:
    """δ ≤ 0 when w_i = w_0 + δ·i to 1e-13·max|w| for every i (a linear decay), else None
    (n < 3: None). O(n)."""
    w = np.asarray(w, dtype=np.float64)
    n = w.shape[0]
    if n < 3 or w[0] <= 0:
        return None
    delta = float(w[-1] - w[0]) / (n - 1)
    if delta > 0:
        return None
    scale = float(np.max(np.abs(w)))
    tol = 1e-13 * scale
    probe = np.unique(np.linspace(0, n - 1, 65).astype(np.int64))  # a cheap refusal first
    if np.max(np.abs(w[0] + delta * probe - w[probe])) > tol:
        return None
    chunk = 1 << 20
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        fit = w[0] + delta * np.arange(lo, hi, dtype=np.float64)
        if np.max(np.abs(fit - w[lo:hi])) > tol:
            return None
    return delta


def _arithmetic_roots(c0: float, delta: float, n: int, want_root: bool):
    """Roots of Σ_j (c_0 + δj)x^j = c_0(1 − ρx)/(1 − x)², ρ = 1 − δ/c_0 ≥ 1:

        c^{−1/2} = c_0^{−1/2}·(1 − x)·(1 − ρx)^{−1/2},
        c^{1/2}  = c_0^{1/2}·(1 − ρx)·(1 − ρx)^{−1/2}/(1 − x),

    with b = (1 − ρx)^{−1/2} = (ρ^j r_j) (``binomial_series``, positive), y_j = b_j − b_{j−1}
    written as b_{j−1}·(−(δ/c_0)j − ρ/2)/j (no difference of close numbers), and the root from
    the running sum B of b: s_j = b_j + (δ/c_0)·B_{j−1}. O(n)."""
    eta = delta / c0  # ≤ 0, |η| < 1/(n − 1) for a positive c
    rho = 1.0 - eta
    b = binomial_series(-0.5, n, rho)
    j = np.arange(1, n, dtype=np.float64)
    y = np.empty(n)
    y[0] = 1.0
    y[1:] = b[:-1] * ((-eta) * j - rho / 2.0) / j
    y /= np.sqrt(c0)
    if not want_root:
        return None, y
    s = b.copy()
    s[1:] += eta * np.cumsum(b[:-1])
    return s * np.sqrt(c0), y


def _structured_roots(c: np.ndarray, want_root: bool):
    """Closed-form roots for geometric or arithmetic c, else None."""
    n = c.shape[0]
    if geometric_ratio(c) is not None:
        root = float(np.sqrt(c[0]))
        powers = np.exp(np.arange(n) * (float(np.log(c[-1] / c[0])) / (n - 1)))  # ρ^j
        s = root * binomial_series(-0.5, n) * powers if want_root else None
        return s, binomial_series(0.5, n) * powers / root
    delta = arithmetic_step(c)
    if delta is not None and delta * (n - 1) > -c[0]:  # stays positive: 1 ≤ ρ < 1 + 1/(n − 1)
        return _arithmetic_roots(float(c[0]), delta, n, want_root)
    form = shift_separable(c) if n > _DIRECT_MAX else None
    if form is not None:  # polynomial or cosine: Newton with O(n·R) products by c
        y = inverse_sqrt_coefficients(c, form)
        return (form.product(y) if want_root else None), y
    return None


def toeplitz_roots(c) -> tuple[np.ndarray, np.ndarray]:
    """(s, y) with Toep(s) = Toep(c)^{1/2} and Toep(y) = Toep(c)^{−1/2}, shapes (n,).

    For geometric c (c_j = c_0ρ^j, an exponential learning-rate decay) in closed form:
    s_j = √c_0·ρ^j·r_j, y_j = ρ^j·binom(1/2)_j/√c_0 (``binomial_series``), O(n); for
    arithmetic c (c_j = c_0 + δj, δ ≤ 0, a linear decay) from c(x) = c_0(1 − ρx)/(1 − x)²
    (``_arithmetic_roots``), O(n); otherwise y by Newton iteration and s = c·y, O(n log n),
    the products by c as running sums when c is shift-separable (polynomial, cosine).

    Raises:
        ValueError: c empty, non-finite, or c[0] ≤ 0.
    """
    c = check_vector("c", c)
    if c[0] <= 0:
        raise ValueError(f"c is invalid: c[0]={c[0]!r} must be > 0 for a real square root")
    n = c.shape[0]
    fast = _structured_roots(c, True)
    if fast is not None:
        return fast
    y = inverse_sqrt_coefficients(c)
    return toeplitz_product(c, y, n), y


def toeplitz_inverse_root(c) -> np.ndarray:
    """y with Toep(y) = Toep(c)^{−1/2}, shape (n,): ``toeplitz_roots(c)[1]`` without the root
    (one series product fewer).

    Raises:
        ValueError: c empty, non-finite, or c[0] ≤ 0.
    """
    c = check_vector("c", c)
    if c[0] <= 0:
        raise ValueError(f"c is invalid: c[0]={c[0]!r} must be > 0 for a real square root")
    fast = _structured_roots(c, False)
    return fast[1] if fast is not None else inverse_sqrt_coefficients(c)
