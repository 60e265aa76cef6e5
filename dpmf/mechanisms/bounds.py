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
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import eigh_tridiagonal, svdvals

from dpmf.mechanisms.participation import Participation
from dpmf.workloads.workload import Workload

__all__ = ["nuclear_norm", "lower_bound", "bound_classes"]


def nuclear_norm(workload: Workload) -> float:
    """‖A‖_*, the sum of the singular values of A.

    For A = a₀·A₁·diag(d) (prefix sum and learning-rate workloads) A⁻¹ is lower bidiagonal
    (diagonal 1/(a₀d_i), sub-diagonal −1/(a₀d_i)); its singular values are the positive
    eigenvalues of the 2n×2n Golub–Kahan tridiagonal matrix (zero diagonal, off-diagonal
    interleaving the two bidiagonals; Golub & Kahan 1965), found in O(n²) by LAPACK's MRRR with
    high relative accuracy, and ‖A‖_* = Σ 1/σ_i(A⁻¹). Other workloads use a dense SVD (O(n³)).
    """
    a = np.asarray(workload.coeffs)
    n = workload.n
    if np.all(a == a[0]):
        if n == 1:
            return float(abs(a[0]) * workload.scale[0])
        inv_diag = 1.0 / (a[0] * workload.scale)
        off = np.empty(2 * n - 1)
        off[0::2] = inv_diag
        off[1::2] = -inv_diag[1:]
        ev = eigh_tridiagonal(np.zeros(2 * n), off, eigvals_only=True)
        sv = np.abs(ev[n:])  # the n largest eigenvalues are +σ_i
        return float(np.sum(1.0 / sv))
    return float(np.sum(svdvals(workload.dense())))


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
