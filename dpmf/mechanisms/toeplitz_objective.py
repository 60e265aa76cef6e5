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
from scipy.signal import fftconvolve

from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.toeplitz import is_nonincreasing_nonnegative, toeplitz_product
from dpmf.workloads.workload import Workload

__all__ = [
    "correlate",
    "frobenius_sq",
    "last_row_sq",
    "sensitivity_sq",
    "closed_form_valid",
    "reciprocal_gradient",
]


def correlate(x: np.ndarray, z: np.ndarray, m: int) -> np.ndarray:
    """r_j = Σ_t x_t z_{t−j} for j = 0..m−1 (x, z of length n; z_{<0} = 0). Shape (m,)."""
    n = x.shape[0]
    if n <= 256 or m <= 16:
        return np.array([float(x[j:] @ z[: n - j]) for j in range(m)])
    full = fftconvolve(x[::-1], z)[:n][::-1]
    return full[:m]


def frobenius_sq(workload: Workload, y: np.ndarray, bandwidth: int | None = None):
    """‖A·Toep(y)‖_F² and its gradient with respect to y (shape (n,)).

    ``bandwidth`` p: y is zero beyond its first p entries (only those get a gradient; the rest
    of the returned gradient is zero). Cost O(n log n) for Toeplitz A, O(n·p) otherwise.
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
    a = np.asarray(workload.coeffs)
    d = workload.scale
    Qy = np.zeros(n)
    value = 0.0
    yp = y[:p]
    for lag in range(p):
        # the lag-th diagonal of W and its suffix sums q[m] = Σ_{i ≥ m} W_{i, i+lag}
        length = n - lag
        if np.all(a == a[0]):
            inner = a[0] * a[0] * np.arange(length, 0, -1, dtype=np.float64)
        else:
            prod = a[: n - lag] * a[lag:]
            inner = np.cumsum(prod)[::-1]  # Σ_{u ≤ n−1−(i+lag)} a_u a_{u+lag}
        diag = d[:length] * d[lag:] * inner
        q = np.cumsum(diag[::-1])[::-1][: p - lag]  # m = 0..p−1−lag
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
