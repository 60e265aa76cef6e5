"""Lower bounds on the error of every factorization of a workload.

For any factorization A = B·C and any participation pattern in which the n steps split into
b* classes of admissible participation sets (each class a set the pattern allows), averaging
‖C·u‖² over random signs gives sens(C)² ≥ ‖C‖_F²/b*, and ‖A‖_* ≤ ‖B‖_F‖C‖_F (Hölder), so

    MaxSE ≥ MeanSE = sens(C)·‖B‖_F/√n ≥ ‖A‖_* / √(n·b*).

* single participation: b* = n, the nuclear-norm bound ‖A‖_*/n (Theorem 3 of "Learning Rate
  Scheduling with Matrix Factorization for Private Training");
* min_sep(b, k): b* = min(n, max(b, ⌈n/k⌉)) (classes t ≡ s mod b* have gaps ≥ b and at most
  k members); for n = k·b this is √k·‖A‖_*/n;
* fixed_epochs(b, k): b* = min(n, b).

The nuclear norm of the learning-rate workloads A = a₀·A₁·diag(d) is computed in O(n) memory
and O(n·m) time with m ≈ 4·(24 + log κ(A)) quadrature nodes, vectorized over the nodes
(``nuclear_norm``): A⁻¹ is lower bidiagonal, ‖A‖_* = Σ_i λ_i^{−1/2} over the eigenvalues λ_i
of T = A⁻¹A⁻ᵀ, and

    Σ_i λ_i^{−1/2} = (2/π) ∫_{−∞}^{∞} eᵘ tr((T + e^{2u} I)⁻¹) du,

evaluated by the trapezoidal rule in u. Each λ contributes (1/(2√λ))·sech(u − log √λ), whose
trapezoidal sum with step h has relative error about 2/cosh(π²/h) (≈ 3e-17 at h = 1/4) for
every λ (Poisson summation; Trefethen & Weideman, "The exponentially convergent trapezoidal
rule", SIAM Review 2014, §5), so the error of the sum is relative and uniform in the spectrum.
Beyond 12 units below log σ_min(A⁻¹) and above log σ_max(A⁻¹) the integrand is e^u·tr(T⁻¹)
and n·e^{−u} up to a relative e^{−24}, and the tails are summed in closed form. The trace of
each shifted inverse is tr((T + sI)⁻¹) = ∂_s log det(T + sI) = Σ_i ∂_s D⁺_i / D⁺_i, with D⁺
the pivots of T + sI = L⁺D⁺L⁺ᵀ from the bidiagonal factor by the differential stationary qd
transform (Dhillon & Parlett, "Orthogonal eigenvectors and relative gaps", SIAM J. Matrix
Anal. Appl. 2004, §4) and its derivative in s: for s ≥ 0 every operation adds, multiplies or
divides positive numbers, so the result has high relative accuracy for any n.
For the prefix sum the singular values are known: σ_k(A₁) = 1/(2 sin((2k−1)π/(2(2n+1)))).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import svdvals

from dpmf.mechanisms.participation import Participation
from dpmf.workloads.workload import Workload

__all__ = ["nuclear_norm", "lower_bound", "bound_classes"]


def nuclear_norm(workload: Workload) -> float:
    """‖A‖_*, the sum of the singular values of A.

    Learning-rate workloads A = a₀·A₁·diag(d) (A⁻¹ lower bidiagonal): the prefix sum
    (constant d) by the closed form Σ_k |a₀d|/(2 sin((2k−1)π/(2(2n+1)))), any other d by the
    quadrature of the module docstring, O(n) memory and about 150 vectorized passes over n
    (relative error ≲ 1e-14). Other workloads: a dense SVD (O(n³)).
    """
    a = np.asarray(workload.coeffs)
    n = workload.n
    if np.all(a == a[0]):
        d = abs(a[0]) * workload.scale
        if np.all(d == d[0]):
            k = np.arange(1, n + 1)
            return float(d[0] * np.sum(0.5 / np.sin((2 * k - 1) * np.pi / (2 * (2 * n + 1)))))
        return _bidiagonal_inverse_nuclear_norm(d)
    return float(np.sum(svdvals(workload.dense())))


_STEP = 0.25  # trapezoidal step in u: relative quadrature error ≈ 2/cosh(π²/h) ≈ 3e-17
_TAIL = 12.0  # nodes this far beyond log σ_min, log σ_max; tails summed in closed form
_NODE_BUDGET = 4_000_000  # entries of the (chunk of nodes) working vectors per pass


def _bidiagonal_inverse_nuclear_norm(d: np.ndarray) -> float:
    """‖A₁·diag(d)‖_* for d > 0 (module docstring): A⁻¹ = diag(1/d)(I − S), T = A⁻¹A⁻ᵀ =
    L·diag(D)·Lᵀ with D_i = 1/d_i² and unit L with D_iL_i² = D_{i+1}."""
    n = d.shape[0]
    scale = float(np.max(d))  # ‖A₁·diag(d)‖_* is homogeneous in d: work with d/max(d) ≤ 1
    if scale != 1.0:
        return scale * _bidiagonal_inverse_nuclear_norm(d / scale)
    D = 1.0 / d**2
    c = D[1:]  # D_i·L_i², i < n − 1
    # σ_max(A⁻¹) ≤ ‖A⁻¹‖_F; σ_min(A⁻¹) = 1/‖A‖₂ ≥ 1/min(‖A‖_F, √(‖A‖₁‖A‖_∞))
    col = d * np.arange(n, 0, -1)
    norm_a = min(math.sqrt(float(np.sum(d * col))), math.sqrt(float(np.max(col) * np.sum(d))))
    log_hi = 0.5 * math.log(float(np.sum(D) + np.sum(c))) + _TAIL
    log_lo = -math.log(norm_a) - _TAIL
    m = int(math.ceil((log_hi - log_lo) / _STEP)) + 1
    u = log_lo + _STEP * np.arange(m)
    shifts = np.exp(2.0 * u)
    traces = np.empty(m)
    chunk = max(8, _NODE_BUDGET // max(n, 1))
    for lo in range(0, m, chunk):
        traces[lo : lo + chunk] = _shifted_inverse_traces(D, c, shifts[lo : lo + chunk])
    trace0 = float(_shifted_inverse_traces(D, c, np.zeros(1))[0])
    geometric = _STEP / math.expm1(_STEP)  # h·Σ_{k≥1} e^{−kh}
    total = _STEP * float(np.sum(np.exp(u) * traces))
    total += trace0 * math.exp(log_lo) * geometric  # e^u tr(T⁻¹) below the nodes
    total += n * math.exp(-u[-1]) * geometric  # n e^{−u} above them
    return 2.0 / math.pi * total


def _shifted_inverse_traces(D: np.ndarray, c: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """tr((L·diag(D)·Lᵀ + sI)⁻¹) for each s ≥ 0 in ``shifts`` (shape (m,)), given D (n,) and
    c_i = D_iL_i² (n − 1,), by the stationary qd transform and its s-derivative:
    x_1 = s, D⁺_i = D_i + x_i, x_{i+1} = c_i x_i / D⁺_i + s; x′_1 = 1,
    x′_{i+1} = 1 + c_i D_i x′_i / (D⁺_i)²; the trace is Σ_i x′_i / D⁺_i."""
    x = shifts.astype(np.float64).copy()
    dx = np.ones_like(x)
    acc = np.zeros_like(x)
    n = D.shape[0]
    for i in range(n - 1):
        piv = D[i] + x
        r = dx / piv
        acc += r
        x = (c[i] / piv) * x + shifts
        dx = 1.0 + (c[i] * D[i]) * (r / piv)
    acc += dx / (D[n - 1] + x)
    return acc


def bound_classes(n: int, participation: Participation) -> int:
    """b*, the number of classes of admissible participation sets used by ``lower_bound``."""
    participation.check_steps(n)
    if participation.kind == "single":
        return n
    b, k = participation.min_sep, participation.max_participations
    if participation.kind == "fixed_epochs":
        return min(n, b)
    return min(n, max(b, math.ceil(n / k)))


def lower_bound(workload: Workload, participation: Participation | None = None) -> float:
    """‖A‖_* / √(n·b*): below MeanSE (hence MaxSE) of every factorization of ``workload``
    under ``participation`` (default single; see the module docstring for b*)."""
    participation = participation or Participation.single()
    n = workload.n
    return nuclear_norm(workload) / math.sqrt(n * bound_classes(n, participation))
