"""Error of a factorization: MaxSE and MeanSE (unsquared), from the row norms of B.

    MaxSE(B, C)  = sens(C) · max_i ‖B_{i,:}‖₂          (the max over all rows)
    MeanSE(B, C) = sens(C) · ‖B‖_F / √n

with noise multiplier and clip norm 1 (Denisov et al. 2022; eq. 3 of "Learning Rate Scheduling
with Matrix Factorization for Private Training"). Squared versions are not offered here.

The row norms of B = A·C⁻¹ are computed from the structure, never from an n×n array, when C⁻¹
is ``ScaledToeplitz`` and A = Toep(a)·diag(d):

* B Toeplitz up to a column scale (d·(row scale of C⁻¹) constant): O(n log n) by cumulative
  sums or one convolution;
* A = a₀·A₁·diag(d) (learning-rate workloads) with any Toeplitz C⁻¹ = Toep(g) (no column
  scale): O(n) for an exponential d (B Toeplitz up to a column scale: a one-pole recurrence),
  O(n·R²) streamed recurrences for a polynomial or cosine d (``prefix_rows`` with
  ``shift_basis``), O(n log² n) by divide and conquer over the pairs of coefficients otherwise;
  with a column scale, row i of B is row i−1 plus d_i times a reversed copy of C⁻¹'s
  coefficients, O(n²) time and O(n) memory;
* otherwise (momentum workloads with a schedule, dense strategies) B is formed densely.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpmf.mechanisms._fft import fftconvolve, lfilter
from dpmf.mechanisms.bounds import lower_bound
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.prefix_rows import prefix_row_norms_sq
from dpmf.mechanisms.sensitivity import Sensitivity, sensitivity
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.mechanisms.toeplitz import geometric_ratio, toeplitz_product

__all__ = ["b_row_norms", "max_se", "mean_se", "Evaluation", "evaluate"]


def b_row_norms(factorization: Factorization) -> np.ndarray:
    """ℓ2 norms of the rows of B = A·C⁻¹, shape (n,), float64.

    Cost: O(n log n) when B is Toeplitz up to scaling; O(n) to O(n log² n) for learning-rate
    workloads A₁·diag(χ) with a Toeplitz C⁻¹, by the schedule's structure (module docstring;
    O(n²) time and O(n) memory when C⁻¹ has a column scale); O(n³) (dense) otherwise.
    """
    f = factorization
    G = f.C_inverse
    if f.B_matrix is not None or not isinstance(G, ScaledToeplitz):
        return np.linalg.norm(f.B_dense(), axis=1)
    a = np.asarray(f.workload.coeffs)
    w = f.workload.scale * G.rows()
    if not (np.all(w == w[0]) or np.all(a == a[0])):
        _check_dense(f)
        return np.linalg.norm(f.B_dense(), axis=1)
    v = G.cols()
    n = f.n
    if np.all(w == w[0]):
        g = G.coeffs[: G.bandwidth]
        if np.all(a == a[0]):  # the prefix sum: a running sum, O(n)
            h = np.zeros(n)
            h[: g.shape[0]] = g
            b2 = (w[0] * a[0] * np.cumsum(h)) ** 2
        else:  # direct convolution when banded
            b2 = (w[0] * toeplitz_product(a, g, n)) ** 2
        if np.all(v == v[0]):
            norms2 = np.cumsum(b2) * v[0] ** 2
        else:
            norms2 = fftconvolve(b2, v**2)[:n]
        return np.sqrt(np.maximum(norms2, 0.0))
    return abs(a[0]) * _prefix_rows(w, G.coeffs[: G.bandwidth], v)


#: the largest n for which B = A·C⁻¹ is formed densely (structures without a fast path)
DENSE_EVALUATION_MAX_STEPS = 16384


def _check_dense(f: Factorization) -> None:
    n = f.n
    if n > DENSE_EVALUATION_MAX_STEPS:
        raise ValueError(
            f"n={n} is invalid for evaluating {f.label!r} on {f.workload.name!r}: B = A·C⁻¹ has "
            f"no structure to exploit here and would be a dense n×n array ({8 * n * n / 1e9:.3g} GB, "
            f"O(n³) time), allowed up to n = {DENSE_EVALUATION_MAX_STEPS}; use a Toeplitz "
            "workload (no momentum with a schedule) or n <= the limit"
        )


def _prefix_rows(w: np.ndarray, g: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Row norms of A₁·diag(w)·Toep(g)·diag(v), g of bandwidth p = len(g).

    When w is geometric (w_i = w_0ρ^i, the exponential schedule), diag(w)·Toep(g) =
    w_0·Toep(ρ^k g_k)·diag(ρ^j) and B is Toeplitz up to a column scale: O(n log n).
    With a constant v (every Toeplitz noise without a column scale): the divide-and-conquer
    of ``prefix_rows``, O(n log² n) time, O(n) memory, for any w and bandwidth.
    Otherwise row i = row i−1 + w_i·(g_{i−j} v_j)_j changes only the p columns of the band;
    the columns left of it keep their values and enter as one running sum of squares:
    O(n·p) time, O(n) memory, element-wise numpy only (no BLAS calls, whose thread pools
    stall a loop of small calls when the cores are shared)."""
    n, p = w.shape[0], g.shape[0]
    rho = geometric_ratio(w)
    if rho is not None:
        gk = np.zeros(n)
        gk[:p] = g * rho ** np.arange(p)
        b2 = (w[0] * np.cumsum(gk)) ** 2  # first column of A₁·Toep(ρ^k g_k), squared
        if rho <= 1.0 and np.all(v == v[0]):
            # Σ_j b2_{i−j}·v²ρ^{2j}: the one-pole recurrence z_i = ρ²z_{i−1} + b2_i, O(n)
            return abs(v[0]) * np.sqrt(np.maximum(lfilter([1.0], [1.0, -rho * rho], b2), 0.0))
        u2 = (v * rho ** np.arange(n)) ** 2
        return np.sqrt(np.maximum(fftconvolve(b2, u2)[:n], 0.0))
    if np.all(v == v[0]):
        return abs(v[0]) * np.sqrt(np.maximum(prefix_row_norms_sq(w, g), 0.0))
    g_rev = g[::-1]
    row = np.zeros(n)
    out = np.empty(n)
    frozen = 0.0  # Σ_{j < i−p+1} row_j²: columns no later row changes
    for i in range(n):
        lo = i - p + 1
        if lo > 0:
            frozen += row[lo - 1] * row[lo - 1]
        else:
            lo = 0
        seg = row[lo : i + 1]
        seg += w[i] * g_rev[p - (i + 1 - lo) :] * v[lo : i + 1]
        out[i] = np.sqrt(frozen + np.einsum("i,i->", seg, seg))
    return out


def max_se(factorization: Factorization, sens: float | Sensitivity) -> float:
    """MaxSE = sens · max_i ‖B_i,:‖₂ (unsquared; noise multiplier and clip norm 1)."""
    return float(float(sens) * np.max(b_row_norms(factorization)))


def mean_se(factorization: Factorization, sens: float | Sensitivity) -> float:
    """MeanSE = sens · ‖B‖_F/√n (unsquared; noise multiplier and clip norm 1)."""
    r = b_row_norms(factorization)
    return float(float(sens) * np.sqrt(np.mean(r**2)))


@dataclass(frozen=True)
class Evaluation:
    """Sensitivity and error of one factorization under one participation pattern.

    Attributes:
        factorization: label, e.g. ``bisr:16``.
        n: steps.
        sensitivity: sens(C) (or an upper bound when ``sensitivity_exact`` is False, in which
            case MaxSE and MeanSE are upper bounds too).
        sensitivity_exact: whether ``sensitivity`` is exact.
        sensitivity_method: the algorithm (see ``dpmf.mechanisms.sensitivity``).
        max_se, mean_se: the errors, unsquared.
        lower_bound: a bound below MeanSE (hence MaxSE) for every factorization of A, or None
            when it was not computed.
    """

    factorization: str
    n: int
    sensitivity: float
    sensitivity_exact: bool
    sensitivity_method: str
    max_se: float
    mean_se: float
    lower_bound: float | None


def evaluate(
    factorization: Factorization,
    participation: Participation | None = None,
    *,
    with_lower_bound: bool = True,
) -> Evaluation:
    """Sensitivity, MaxSE, MeanSE and the lower bound of ``factorization`` under
    ``participation`` (default single).

    Raises:
        ValueError: n incompatible with ``participation`` (see ``sensitivity``).
    """
    participation = participation or Participation.single()
    s = sensitivity(factorization.C, participation)
    rows = b_row_norms(factorization)
    lb = lower_bound(factorization.workload, participation) if with_lower_bound else None
    return Evaluation(
        factorization=factorization.label,
        n=factorization.n,
        sensitivity=s.value,
        sensitivity_exact=s.exact,
        sensitivity_method=s.method,
        max_se=float(s.value * np.max(rows)),
        mean_se=float(s.value * np.sqrt(np.mean(rows**2))),
        lower_bound=lb,
    )
