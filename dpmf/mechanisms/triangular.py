"""Square root of a dense lower-triangular matrix with a positive diagonal.

Used for the square-root factorization of workloads that are not Toeplitz (A_χ = A₁·diag(χ)),
where power-series algebra does not apply.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import solve_triangular
from scipy.linalg.lapack import dtrsyl

__all__ = ["sqrtm_lower_triangular"]

_BASE = 64


def sqrtm_lower_triangular(T) -> np.ndarray:
    """The principal square root X of a lower-triangular T with positive diagonal: X² = T,
    X lower-triangular with X_jj = √T_jj. Shape (n, n), float64.

    Algorithm: the triangular recurrence X_ij = (T_ij − Σ_{j<l<i} X_il X_lj)/(X_ii + X_jj)
    (Björck & Hammarling, "A Schur method for the square root of a matrix", 1983), applied
    recursively in blocks: X₁₁ = √T₁₁, X₂₂ = √T₂₂ and the off-diagonal block from the triangular
    Sylvester equation X₂₂X₂₁ + X₂₁X₁₁ = T₂₁ (solved recursively, Jonsson & Kågström 2002), so
    the O(n³) work is matrix products. n = 4096 takes about a second on 2 cores.

    Raises:
        ValueError: not square, not lower-triangular, non-finite, or a diagonal entry ≤ 0.
    """
    T = np.asarray(T, dtype=np.float64)
    if T.ndim != 2 or T.shape[0] != T.shape[1]:
        raise ValueError(f"T is invalid: must be square, got shape {T.shape}")
    if not np.all(np.isfinite(T)):
        raise ValueError("T is invalid: contains NaN or infinite entries")
    if np.any(np.triu(T, 1) != 0):
        raise ValueError("T is invalid: must be lower-triangular")
    if np.any(np.diag(T) <= 0):
        raise ValueError("T is invalid: its diagonal must be > 0 for a real principal square root")
    return _sqrt(T)


def _sqrt(T: np.ndarray) -> np.ndarray:
    n = T.shape[0]
    if n <= _BASE:
        return _sqrt_by_rows(T)
    h = n // 2
    X = np.zeros_like(T)
    X[:h, :h] = _sqrt(T[:h, :h])
    X[h:, h:] = _sqrt(T[h:, h:])
    X[h:, :h] = _sylvester_lower(X[h:, h:], X[:h, :h], T[h:, :h])
    return X


def _sqrt_by_rows(T: np.ndarray) -> np.ndarray:
    """Row i solves x·(X[:i,:i] + X_ii·I) = T[i,:i], a triangular system."""
    n = T.shape[0]
    X = np.zeros_like(T)
    for i in range(n):
        X[i, i] = np.sqrt(T[i, i])
        if i:
            M = X[:i, :i] + X[i, i] * np.eye(i)
            X[i, :i] = solve_triangular(M, T[i, :i], trans="T", lower=True)
    return X


def _sylvester_lower(P: np.ndarray, R: np.ndarray, Q: np.ndarray) -> np.ndarray:
    """Solve P·Y + Y·R = Q for lower-triangular P (m×m) and R (h×h) with positive diagonals."""
    m, h = Q.shape
    if m <= _BASE and h <= _BASE:
        # Transposed to LAPACK's upper-triangular form: Rᵀ·Z + Z·Pᵀ = Qᵀ with Z = Yᵀ.
        Z, scale, info = dtrsyl(np.ascontiguousarray(R.T), np.ascontiguousarray(P.T), Q.T.copy())
        if info < 0:
            raise RuntimeError(f"dtrsyl failed with info={info}")
        return (Z / scale).T
    if m >= h:
        k = m // 2
        Y1 = _sylvester_lower(P[:k, :k], R, Q[:k])
        Y2 = _sylvester_lower(P[k:, k:], R, Q[k:] - P[k:, :k] @ Y1)
        return np.vstack([Y1, Y2])
    k = h // 2
    Yb = _sylvester_lower(P, R[k:, k:], Q[:, k:])
    Ya = _sylvester_lower(P, R[:k, :k], Q[:, :k] - Yb @ R[k:, :k])
    return np.hstack([Ya, Yb])
