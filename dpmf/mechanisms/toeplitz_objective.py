"""Error and sensitivity of Toeplitz strategies as differentiable functions of coefficients.

Used by the optimized Toeplitz strategies (banded-optimized, BLT). The noise correlation is
C⁻¹ = Toep(y) and the strategy C = Toep(c) with c = y⁻¹ (power-series reciprocal); the workload
is A = Toep(a)·diag(d).

* Error. B = A·Toep(y). ‖B‖_F² = Σ_m Σ_m' y_m y_m' Q_{mm'} with
  Q_{m,m+ℓ} = Σ_{i=m}^{n−1−ℓ} W_{i,i+ℓ}, W = AᵀA, whose ℓ-th diagonal is
  W_{i,i+ℓ} = d_i d_{i+ℓ} Σ_{u=0}^{n−1−i−ℓ} a_u a_{u+ℓ}. When A is Toeplitz, B = Toep(h) with
  h = a∗y and ‖B‖_F² = Σ_t (n−t) h_t², while the largest row norm of B is the last,
  ‖h‖₂ (row t holds h_0..h_t), so MaxSE is smooth too.
* Sensitivity. For the participation patterns of dpmf, when the closed form of
  ``dpmf.mechanisms.sensitivity`` is valid,
  sens² = ‖v‖², v = Σ_{i<k} shift_{ib}(c), k = min(k_max, ⌈n/b⌉) (k = 1 for single
  participation): valid for single participation always, for fixed_epochs when c ≥ 0 (then the
  Gram matrix is non-negative and class 0 is the worst), for min_sep when c is non-negative and
  non-increasing (Kalinin & Lampert 2024, Theorem 2).
* Chain rule through the reciprocal: dc = −(c∗c)∗dy, so ∂f/∂y_j = −Σ_t (∂f/∂c_t)(c∗c)_{t−j}.

Every function returns (value, gradient) with gradients of the shape of the coefficient input.
"""

from __future__ import annotations

import numpy as np

from dpmf._validation import check_int
from dpmf.mechanisms._fft import fftconvolve, lfilter
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.toeplitz import is_nonincreasing_nonnegative, toeplitz_product
from dpmf.workloads.workload import Workload

__all__ = [
    "correlate",
    "frobenius_sq",
    "gram_diagonals",
    "last_row_sq",
    "sensitivity_sq",
    "closed_form_valid",
    "reciprocal_gradient",
    "banded_reciprocal",
    "banded_reciprocal_gradient",
]


def correlate(x: np.ndarray, z: np.ndarray, m: int) -> np.ndarray:
    """r_j = Σ_t x_t z_{t−j} for j = 0..m−1 (x, z of length n; z_{<0} = 0). Shape (m,)."""
    n = x.shape[0]
    if n <= 256 or m <= 16:
        return np.array([float(x[j:] @ z[: n - j]) for j in range(m)])
    full = fftconvolve(x[::-1], z)[:n][::-1]
    return full[:m]


def gram_diagonals(workload: Workload, bandwidth: int | None = None) -> tuple[np.ndarray, ...]:
    """The suffix sums of the diagonals of W = AᵀA that ``frobenius_sq`` contracts with y.

    For A = Toep(a)·diag(d) (module text): q_ℓ[m] = Q_{m,m+ℓ} = Σ_{i=m}^{n−1−ℓ} W_{i,i+ℓ} for
    lags ℓ < p and m < p − ℓ, with W_{i,i+ℓ} = d_i d_{i+ℓ} Σ_{u=0}^{n−1−i−ℓ} a_u a_{u+ℓ}. They
    depend on the workload only, so an optimizer that evaluates ‖A·Toep(y)‖_F² many times for
    one workload computes them once (O(n·p) time, p(p+1)/2 floats).

    Args:
        workload: A (any Toeplitz-with-column-scale workload).
        bandwidth: p, the number of leading entries of y that may be non-zero (default n).

    Returns:
        tuple of p float64 arrays, the ℓ-th of shape (p − ℓ,).

    Raises:
        ValueError: bandwidth < 1.
    """
    n = workload.n
    p = n if bandwidth is None else min(check_int("bandwidth", bandwidth, minimum=1), n)
    a = np.asarray(workload.coeffs)
    d = workload.scale
    constant = bool(np.all(a == a[0]))
    out = []
    for lag in range(p):
        # the lag-th diagonal of W and its suffix sums q[m] = Σ_{i ≥ m} W_{i, i+lag}
        length = n - lag
        if constant:
            inner = a[0] * a[0] * np.arange(length, 0, -1, dtype=np.float64)
        else:
            prod = a[: n - lag] * a[lag:]
            inner = np.cumsum(prod)[::-1]  # Σ_{u ≤ n−1−(i+lag)} a_u a_{u+lag}
        diag = d[:length] * d[lag:] * inner
        out.append(np.cumsum(diag[::-1])[::-1][: p - lag])  # m = 0..p−1−lag
    return tuple(out)


def frobenius_sq(
    workload: Workload,
    y: np.ndarray,
    bandwidth: int | None = None,
    *,
    diagonals: tuple[np.ndarray, ...] | None = None,
):
    """‖A·Toep(y)‖_F² and its gradient with respect to y (shape (n,)).

    ``bandwidth`` p: y is zero beyond its first p entries (only those get a gradient; the rest
    of the returned gradient is zero). Cost O(n log n) for Toeplitz A, O(n·p) otherwise, or
    O(p²) when ``diagonals`` (``gram_diagonals(workload, p)``, computed once) are given: the
    same sums in the same order, so the same floating-point result.

    Raises:
        ValueError: ``diagonals`` that are not those of a bandwidth p.
    """
    n = workload.n
    y = np.asarray(y, dtype=np.float64)
    if workload.is_toeplitz:
        a = workload.toeplitz_coeffs
        h = toeplitz_product(a, y, n)
        w = np.arange(n, 0, -1, dtype=np.float64)  # row count of each diagonal: n − t
        value = float(np.sum(w * h * h))
        p = n if bandwidth is None else min(bandwidth, n)
        grad = np.zeros(n)
        grad[:p] = 2.0 * correlate(w * h, a, p)
        return value, grad
    p = n if bandwidth is None else min(bandwidth, n)
    if diagonals is None:
        diagonals = gram_diagonals(workload, p)
    elif len(diagonals) != p:
        raise ValueError(
            f"diagonals is invalid: {len(diagonals)} diagonals given for bandwidth {p}; "
            "pass gram_diagonals(workload, bandwidth)"
        )
    Qy = np.zeros(n)
    value = 0.0
    yp = y[:p]
    for lag, q in enumerate(diagonals):
        left, right = yp[: p - lag], yp[lag:p]
        if lag == 0:
            value += float(q @ (left * right))
            Qy[:p] += q * right
        else:
            value += 2.0 * float(q @ (left * right))
            Qy[: p - lag] += q * right
            Qy[lag:p] += q * left
    return value, 2.0 * Qy


def last_row_sq(workload: Workload, y: np.ndarray, bandwidth: int | None = None):
    """‖h‖² = the largest squared row norm of B = A·Toep(y) for Toeplitz A, and its gradient.

    Raises:
        ValueError: A is not Toeplitz (its largest row norm is not smooth in y).
    """
    if not workload.is_toeplitz:
        raise ValueError(
            f"workload {workload.name!r} is invalid for objective='max_se' with a Toeplitz "
            "strategy: A must be Toeplitz (for A·diag(χ) the worst row moves); use mean_se"
        )
    n = workload.n
    a = workload.toeplitz_coeffs
    h = toeplitz_product(a, y, n)
    p = n if bandwidth is None else min(bandwidth, n)
    grad = np.zeros(n)
    grad[:p] = 2.0 * correlate(h, a, p)
    return float(h @ h), grad


def _pattern(participation: Participation, n: int) -> tuple[int, int]:
    k = participation.participations(n)
    return (1, 1) if participation.kind == "single" or k == 1 else (k, participation.min_sep)


def closed_form_valid(c: np.ndarray, participation: Participation) -> bool:
    """Whether sens² = ‖Σ_i shift_{ib}(c)‖² is the exact sensitivity of Toep(c) (module text)."""
    n = c.shape[0]
    k, _ = _pattern(participation, n)
    if k == 1:
        return True
    tol = 1e-12 * float(np.max(np.abs(c)))
    if participation.kind == "fixed_epochs":
        return bool(np.all(c >= -tol))
    return is_nonincreasing_nonnegative(c)


def sensitivity_sq(c: np.ndarray, participation: Participation, bandwidth: int | None = None):
    """sens² = ‖Σ_{i<k} shift_{ib}(c)‖² and its gradient in c (valid per ``closed_form_valid``).

    ``bandwidth`` p limits the gradient to the first p coefficients.
    """
    n = c.shape[0]
    k, b = _pattern(participation, n)
    v = np.zeros(n)
    for i in range(k):
        v[i * b :] += c[: n - i * b]
    p = n if bandwidth is None else min(bandwidth, n)
    grad = np.zeros(n)
    for i in range(k):
        grad[: max(0, min(p, n - i * b))] += 2.0 * v[i * b : i * b + p]
    return float(v @ v), grad


def reciprocal_gradient(grad_c: np.ndarray, c: np.ndarray, m: int) -> np.ndarray:
    """∂f/∂y_j for j < m, given ∂f/∂c and c = y⁻¹: −Σ_t (∂f/∂c_t)(c∗c)_{t−j}. Shape (m,)."""
    n = c.shape[0]
    cc = toeplitz_product(c, c, n)
    return -correlate(grad_c, cc, m)


def banded_reciprocal(b: np.ndarray, n: int) -> np.ndarray:
    """The first n coefficients of 1/b(x) for a short series b (p = len(b) ≤ n taps, b_0 ≠ 0).

    Toep(b)·Toep(c) = I is the linear recurrence c_t = (δ_{t0} − Σ_{l=1}^{p−1} b_l c_{t−l})/b_0,
    run as an all-pole filter (``scipy.signal.lfilter``): O(n·p), against the O(n²) of the
    reciprocal by Newton iteration on all n coefficients (``dpmf.mechanisms.toeplitz``).
    The same series up to round-off. Shape (n,); non-finite entries where the recurrence
    overflows (the optimizers treat those points as infeasible).
    """
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter([1.0], np.asarray(b, dtype=np.float64), impulse)


def banded_reciprocal_gradient(grad_c: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """``reciprocal_gradient(grad_c, c, m)`` for c = 1/b with b a short series (p taps).

    −Σ_t (∂f/∂c_t)(c∗c)_{t−j} = −(Toep(c)ᵀ·Toep(c)ᵀ·∂f/∂c)_j, and Toep(c)ᵀx solves the upper
    triangular banded system Toep(b)ᵀu = x: a backward recurrence, i.e. the all-pole filter on
    the reversed vector. O(n·p) instead of the O(n²) product c∗c. Shape (m,).
    """
    b = np.asarray(b, dtype=np.float64)
    u = lfilter([1.0], b, np.asarray(grad_c, dtype=np.float64)[::-1])  # reversed Toep(c)ᵀx
    v = lfilter([1.0], b, u)  # reversed Toep(c)ᵀToep(c)ᵀx
    return -v[::-1][:m]
