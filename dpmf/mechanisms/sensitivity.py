"""Sensitivity of a strategy C under a participation pattern.

sens(C) = max over admissible participation sets π and signs u ∈ [−1, 1]^π of ‖C·u‖₂, i.e.
the largest ℓ2 change of C·G when one example's (clipped, norm ≤ 1) gradients change. The
maximum over the box is attained at a vertex, so u ∈ {−1, +1}^π; when CᵀC ≥ 0 entry-wise it is
attained at u = 1.

Which algorithm runs, and whether the answer is exact, is reported in ``Sensitivity``:

===========================  ============================================================
method                       when
===========================  ============================================================
``column_norm``              single participation (max column norm, exact)
``toeplitz_closed_form``     min_sep, C = Toep(c)·diag(s) with c and s non-negative and
                             non-increasing: π = {0, b, 2b, …} is optimal (exact)
``exhaustive``               min_sep or fixed_epochs, every (π, u) enumerated (exact)
``gram_row_bound``           min_sep, too many sets: a proven upper bound from |CᵀC|
``column_norm_bound``        min_sep, n too large for CᵀC: Σ of column norms (upper bound)
``class_abs_gram_bound``     fixed_epochs, a class too large for sign search: Σ|CᵀC| (bound)
===========================  ============================================================

Sources: the closed form is Theorem 2 of Kalinin & Lampert, "Banded Square Root Matrix
Factorization for Differentially Private Model Training" (NeurIPS 2024), extended here to a
non-increasing column scale by the same monotonicity argument (see ``_closed_form_applies``);
the b-min-sep definition is from Choquette-Choo et al., ICML 2023, eq. (3).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_int
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.structured import LowerTriangular, ScaledToeplitz, as_structured
from dpmf.mechanisms.toeplitz import is_nonincreasing_nonnegative

__all__ = ["Sensitivity", "sensitivity", "gram", "count_admissible_sets"]

_GRAM_MAX_N = 4096
_SIGN_SEARCH_MAX = 16
_NEG_TOL = 1e-12
# Upper bounds are inflated by this relative margin so that floating-point round-off can never
# push a reported bound below the true sensitivity.
_BOUND_MARGIN = 1e-12


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity value and how it was obtained.

    Attributes:
        value: sens(C) ≥ 0 (or an upper bound on it when ``exact`` is False).
        exact: True when ``value`` equals the sensitivity up to round-off.
        method: the algorithm used (see the module table).
    """

    value: float
    exact: bool
    method: str

    def __float__(self) -> float:
        return self.value


def sensitivity(
    C, participation: Participation | None = None, *, search_limit: int = 2_000_000
) -> Sensitivity:
    """sens(C) under ``participation`` (default: single).

    Args:
        C: n×n lower-triangular strategy: a ``ScaledToeplitz``, ``DenseLowerTriangular`` or array.
        participation: ``Participation`` pattern.
        search_limit: the most (set, sign) combinations the exact search may enumerate before
            falling back to a proven upper bound.

    Returns:
        ``Sensitivity(value, exact, method)``.

    Raises:
        ValueError: an invalid matrix, or n incompatible with the pattern (``fixed_epochs``
            needs n ≤ b·k).
    """
    C = as_structured(C)
    participation = participation or Participation.single()
    search_limit = check_int("search_limit", search_limit, minimum=1)
    n = participation.check_steps(C.n)
    k = participation.participations(n)
    b = participation.min_sep
    if participation.kind == "single" or k == 1:
        return Sensitivity(float(np.max(C.column_norms())), True, "column_norm")
    if participation.kind == "fixed_epochs":
        return _fixed_epochs(C, b, k)
    if _closed_form_applies(C):
        return Sensitivity(_closed_form(C, b, k), True, "toeplitz_closed_form")
    if n > _GRAM_MAX_N:
        return Sensitivity(_column_norm_bound(C, b, k) * (1 + _BOUND_MARGIN), False, "column_norm_bound")
    X = gram(C)
    nonneg = bool(np.all(X >= -_NEG_TOL * np.max(np.abs(X))))
    if count_admissible_sets(n, b, k, signed=not nonneg) <= search_limit:
        return Sensitivity(_exhaustive(X, b, k, nonneg), True, "exhaustive")
    return Sensitivity(_gram_row_bound(X, b, k) * (1 + _BOUND_MARGIN), False, "gram_row_bound")


def gram(C) -> np.ndarray:
    """CᵀC as an n×n array. For Toeplitz-with-column-scale C it is built lag by lag in O(n²)
    time (X_ij = s_i s_j Σ_{u ≤ n−1−max(i,j)} c_u c_{u+|i−j|}); otherwise by a dense product."""
    C = as_structured(C)
    if isinstance(C, ScaledToeplitz) and C.row_scale is None:
        n, c = C.n, C.coeffs
        X = np.empty((n, n))
        for lag in range(n):
            p = np.cumsum(c[: n - lag] * c[lag:])[::-1]  # p[i] = X[i, i+lag] (unscaled)
            i = np.arange(n - lag)
            X[i, i + lag] = p
            X[i + lag, i] = p
        s = C.cols()
        return s[:, None] * X * s[None, :]
    M = C.dense()
    return M.T @ M


def count_admissible_sets(n: int, b: int, k: int, *, signed: bool = False) -> float:
    """Number of non-empty sets π ⊂ {0..n−1} with |π| ≤ k and gaps ≥ b; with ``signed``, the
    number of (π, u) pairs up to a global sign, Σ_π 2^{|π|−1}. Float (inf when huge)."""
    # f[i, m]: number of admissible sets of size m whose smallest element is >= i
    f = np.zeros((n + b + 1, k + 1))
    f[:, 0] = 1.0
    with np.errstate(over="ignore"):
        for i in range(n - 1, -1, -1):
            f[i, 1:] = f[i + 1, 1:] + f[i + b, :-1]
        m = np.arange(1, k + 1, dtype=np.float64)
        weight = 2.0 ** (m - 1) if signed else np.ones(k)
        return float(np.sum(weight * f[0, 1:]))


def _closed_form_applies(C: LowerTriangular) -> bool:
    """C = Toep(c)·diag(s) with c ≥ 0 non-increasing and s ≥ 0 non-increasing.

    Then X_ij = s_i s_j K(max(i,j), |i−j|) with K non-increasing in both arguments and all terms
    non-negative. Mapping any admissible π = {p_1 < … < p_m} to {0, b, …, (m−1)b} lowers every
    max(p_i, p_j) and |p_i − p_j| (gaps ≥ b) and raises every s, so 1ᵀX_π1 can only grow; u = 1
    is optimal since X ≥ 0. Hence π* = {0, b, 2b, …} with min(k, ⌈n/b⌉) elements.
    """
    if not isinstance(C, ScaledToeplitz) or C.row_scale is not None:
        return False
    if not is_nonincreasing_nonnegative(C.coeffs):
        return False
    return C.col_scale is None or is_nonincreasing_nonnegative(C.col_scale)


def _closed_form(C: ScaledToeplitz, b: int, k: int) -> float:
    n, c, s = C.n, C.coeffs, C.cols()
    v = np.zeros(n)
    for i in range(k):
        j = i * b
        v[j:] += s[j] * c[: n - j]
    return float(np.linalg.norm(v))


def _admissible_sets(n: int, b: int, k: int):
    """Yield arrays of shape (count, m) holding every admissible set of size m = 1..k."""
    sets = np.arange(n)[:, None]
    for m in range(1, k + 1):
        if sets.shape[0] == 0:
            return
        yield sets
        if m == k:
            return
        last = sets[:, -1]
        reps = np.maximum(n - (last + b), 0)
        parent = np.repeat(np.arange(sets.shape[0]), reps)
        offsets = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
        new = last[parent] + b + offsets
        sets = np.concatenate([sets[parent], new[:, None]], axis=1)


def _exhaustive(X: np.ndarray, b: int, k: int, nonneg: bool) -> float:
    n = X.shape[0]
    best = 0.0
    for sets in _admissible_sets(n, b, k):
        m = sets.shape[1]
        if nonneg:
            signs = np.ones((1, m))
        else:
            signs = np.array([(1,) + u for u in itertools.product((1.0, -1.0), repeat=m - 1)])
        chunk = max(1, 4_000_000 // (m * m * signs.shape[0]))
        for start in range(0, sets.shape[0], chunk):
            S = sets[start : start + chunk]
            Q = X[S[:, :, None], S[:, None, :]]  # (N, m, m)
            vals = np.einsum("ui,nij,uj->nu", signs, Q, signs, optimize=True)
            best = max(best, float(vals.max()))
    return float(np.sqrt(max(best, 0.0)))


def _max_weight_admissible(w: np.ndarray, b: int, k: int) -> float:
    """max Σ_{i∈π} w_i over sets with gaps ≥ b and |π| ≤ k (w ≥ 0), by dynamic programming."""
    n = w.shape[0]
    f = np.zeros((n + b + 1, k + 1))  # f[i, m]: best using elements >= i, at most m of them
    for i in range(n - 1, -1, -1):
        f[i, 1:] = np.maximum(f[i + 1, 1:], w[i] + f[i + b, :-1])
    return float(f[0, k])


def _gram_row_bound(X: np.ndarray, b: int, k: int) -> float:
    """Upper bound: uᵀX_πu ≤ Σ_{i∈π} R_i with R_i = |X_ii| + the k−1 largest |X_ij|, |i−j| ≥ b;
    then the best admissible π for the weights R by dynamic programming."""
    n = X.shape[0]
    A = np.abs(X)
    diag = np.diag(A).copy()
    i, j = np.indices((n, n))
    A[np.abs(i - j) < b] = 0.0
    del i, j
    m = min(k - 1, n)
    top = np.partition(A, n - m, axis=1)[:, n - m :].sum(axis=1) if m > 0 else np.zeros(n)
    return float(np.sqrt(_max_weight_admissible(diag + top, b, k)))


def _column_norm_bound(C: LowerTriangular, b: int, k: int) -> float:
    """Upper bound by the triangle inequality: ‖Σ u_i C e_i‖ ≤ Σ_{i∈π} ‖C e_i‖."""
    return _max_weight_admissible(C.column_norms(), b, k)


def _class_grams(C: LowerTriangular, b: int, k: int):
    """(class s, the Gram matrix X_π = C_πᵀC_π of its columns π = s, s+b, … < n) for s < b.

    For C = Toep(c)·diag(d) the Gram entries are partial autocorrelations,
    ⟨C e_i, C e_j⟩ = d_i d_j Σ_{u=0}^{n−1−j} c_u c_{u+j−i} (i ≤ j), so only the lags
    0, b, …, (k−1)b are needed: O(n·k) for all classes, instead of O(n·k) per class from the
    columns themselves (any other C)."""
    n = C.n
    if isinstance(C, ScaledToeplitz) and C.row_scale is None:
        c = C.coeffs
        d = C.cols()
        classes = min(b, n)
        kk = min(k, -(-n // b))  # the most columns a class has
        lags = [np.cumsum(c[: n - m * b] * c[m * b :]) for m in range(kk)]
        first = np.arange(classes)
        X = np.zeros((classes, kk, kk))  # X[s] for every class at once (rows past n stay 0)
        for j in range(kk):
            cols = first + j * b
            have = cols < n
            for i in range(j + 1):
                X[have, i, j] = X[have, j, i] = lags[j - i][n - 1 - cols[have]]
        for s in range(classes):
            idx = s + b * np.arange(kk)
            idx = idx[idx < n]
            m = idx.shape[0]
            yield s, d[idx][:, None] * X[s, :m, :m] * d[idx][None, :]
        return
    for s in range(min(b, n)):
        idx = s + b * np.arange(k)
        idx = idx[idx < n]
        cols = C.columns(idx)
        yield s, cols.T @ cols


def _fixed_epochs(C: LowerTriangular, b: int, k: int) -> Sensitivity:
    best, exact = 0.0, True
    for _, G in _class_grams(C, b, k):
        if np.all(G >= -_NEG_TOL * np.max(np.abs(G))):
            val = float(G.sum())
        elif G.shape[0] <= _SIGN_SEARCH_MAX:
            m = G.shape[0]
            signs = np.array([(1,) + u for u in itertools.product((1.0, -1.0), repeat=m - 1)])
            val = float(np.einsum("ui,ij,uj->u", signs, G, signs).max())
        else:
            val, exact = float(np.abs(G).sum()) * (1 + _BOUND_MARGIN) ** 2, False
        best = max(best, val)
    return Sensitivity(float(np.sqrt(best)), exact, "exhaustive" if exact else "class_abs_gram_bound")
