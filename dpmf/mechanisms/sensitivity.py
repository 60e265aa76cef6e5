"""Sensitivity of a strategy C under a participation pattern, for vector-valued gradients.

One example contributes a gradient g_i ∈ ℝ^d, ‖g_i‖₂ ≤ 1, at each step i of its participation
set π. Changing that example changes C·G (G ∈ ℝ^{n×d}) by Σ_{i∈π} C e_i g_iᵀ, whose squared
Frobenius norm is Σ_{i,j∈π} X_ij ⟨g_i, g_j⟩ with X = CᵀC. Hence

    sens(C)² = max over admissible π of  max { ⟨X_π, Y⟩ : Y ⪰ 0, Y_ii = 1 }          (SDP)

(Y = the Gram matrix of the unit vectors g_i; the maximum over ‖g_i‖ ≤ 1 is at ‖g_i‖ = 1 since
the objective is convex in each g_i; d ≥ |π| is assumed, as for any real model). Sign vectors
u ∈ {±1}^π are the rank-one Y = uuᵀ: they give the *scalar* sensitivity, a lower bound only.
Scalar and vector sensitivity agree when

* |π| = 1 (single participation: the largest column norm);
* X_π ≥ 0 entry-wise: ⟨X_π, Y⟩ ≤ Σ|X_ij||Y_ij| ≤ Σ X_ij = 1ᵀX_π1 (|Y_ij| ≤ 1 for a correlation
  matrix), attained at Y = 11ᵀ;
* |π| ≤ 2: a 2×2 correlation matrix is linear in Y_12 ∈ [−1, 1], extreme at ±1 (signs).

Elsewhere they can differ: X_π = [[1, −.45, −.45], [−.45, 1, −.45], [−.45, −.45, 1]] has
scalar sensitivity √3.9 = 1.9748 (u = (1, 1, −1)) but vector sensitivity √4.35 = 2.0857
(three unit vectors at 120°). There dpmf returns a **proven upper bound** with ``exact`` False,
the smallest of the valid bounds it can afford:

* ``sdp`` (per set π): the dual of (SDP) is min Σλ_i subject to diag(λ) − X_π ⪰ 0, and any
  such λ bounds ⟨X_π, Y⟩ = Σλ_i − ⟨diag(λ) − X_π, Y⟩ ≤ Σλ_i for every feasible Y. λ comes from a
  low-rank (Burer–Monteiro) coordinate ascent on the unit vectors, λ_i = X_ii + ‖Σ_{j≠i} X_ij g_j‖,
  and is made feasible by adding the most negative eigenvalue of diag(λ) − X_π (plus a
  round-off margin) to every entry, so the certificate does not depend on the ascent having
  converged. The ascent's own value is achieved by actual unit vectors (``lower_bound``).
* ``abs_gram``: ⟨X_π, Y⟩ ≤ Σ_{i,j∈π} |X_ij| (the multi-epoch matrix-factorization bound).
* the row bound, the column-norm (triangle-inequality) bound and the Toeplitz majorant below,
  each a bound on Σ_{i,j∈π}|X_ij| or on ‖Σ C e_i g_iᵀ‖_F directly.

Which algorithm ran, and whether the answer is exact, is reported in ``Sensitivity``:

===========================  ============================================================
method                       when
===========================  ============================================================
``column_norm``              single participation (max column norm, exact)
``toeplitz_closed_form``     min_sep, C = Toep(c)·diag(s) with c and s non-negative and
                             non-increasing: π = {0, b, 2b, …} is optimal (exact)
``exhaustive``               every admissible π enumerated, X_π ≥ 0 (u = 1) or |π| ≤ 2
                             (signs) (exact)
``sdp_bound``                min_sep, X has negative entries: every π enumerated, Σ|X_π| for
                             all, the SDP certificate for the largest (upper bound)
``toeplitz_majorant_bound``  min_sep, C = Toep(c)·diag(s) not monotone: the closed form of
                             the smallest non-increasing majorants of |c|, |s| (upper bound)
``gram_row_bound``           min_sep, too many sets: a proven upper bound from |CᵀC|
``column_norm_bound``        min_sep: Σ of column norms over the best π (upper bound)
``class_sdp_bound``          fixed_epochs, a class Gram with negative entries and ≥ 3
                             columns: min(SDP certificate, Σ|X_π|) (upper bound)
``class_abs_gram_bound``     fixed_epochs, a class too large for the SDP: Σ|X_π| (bound)
===========================  ============================================================

Under min_sep the reported bound is the smallest of the applicable ones (``method`` names it).

Sources: the closed form is Theorem 2 of Kalinin & Lampert, "Banded Square Root Matrix
Factorization for Differentially Private Model Training" (NeurIPS 2024), extended here to a
non-increasing column scale by the same monotonicity argument (see ``_closed_form_applies``);
the b-min-sep definition is from Choquette-Choo et al., ICML 2023, eq. (3); the Σ|X_π| bound
from Choquette-Choo et al., "Multi-Epoch Matrix Factorization Mechanisms for Private Machine
Learning" (ICML 2023); the SDP and its dual are those of the max-cut relaxation (Goemans &
Williamson, J. ACM 1995), the low-rank ascent that of Burer & Monteiro (Math. Prog. 2003).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from dpmf._memory import check_memory
from dpmf._validation import check_int
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.structured import LowerTriangular, ScaledToeplitz, as_structured
from dpmf.mechanisms.toeplitz import is_nonincreasing_nonnegative

__all__ = [
    "Sensitivity",
    "sensitivity",
    "gram",
    "count_admissible_sets",
    "correlation_sdp_bound",
    "nonincreasing_majorant",
]

_GRAM_MAX_N = 4096
_NEG_TOL = 1e-12
# a class Gram counts as non-negative when its negative entries sum to at most this fraction of
# Σ|X_π| (round-off of coefficients that are ≥ 0 up to 1e-12)
_NEG_MASS_TOL = 1e-11
# Upper bounds are inflated by this relative margin so that floating-point round-off can never
# push a reported bound below the true sensitivity.
_BOUND_MARGIN = 1e-12
# SDP certificates: the most sets π solved (the largest Σ|X_π| first), the most coordinate-ascent
# sweeps, and a cap on the work of one batch (sets · m² · rank · sweeps multiply-adds).
_SDP_MAX_SETS = 2048
_SDP_SWEEPS = 400
_SDP_MAX_WORK = 4e9


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity value and how it was obtained.

    Attributes:
        value: sens(C) ≥ 0 for vector gradients, or a proven upper bound on it when ``exact``
            is False.
        exact: True when ``value`` equals the sensitivity up to round-off (module text: single
            participation, X_π ≥ 0, or |π| ≤ 2).
        method: the algorithm (or, for a bound, the bound) used (see the module table).
        lower_bound: a value achieved by actual unit gradients (so sens(C) ≥ lower_bound), when
            one was computed; equals ``value`` when exact; None when not computed.
    """

    value: float
    exact: bool
    method: str
    lower_bound: float | None = None

    def __float__(self) -> float:
        return self.value


def _exact(value: float, method: str) -> Sensitivity:
    return Sensitivity(float(value), True, method, float(value))


def sensitivity(
    C, participation: Participation | None = None, *, search_limit: int = 2_000_000
) -> Sensitivity:
    """sens(C) under ``participation`` (default: single), for vector-valued gradients.

    Args:
        C: n×n lower-triangular strategy: a ``ScaledToeplitz``, ``DenseLowerTriangular`` or array.
        participation: ``Participation`` pattern.
        search_limit: the most participation sets π (min_sep) the exhaustive search may
            enumerate before falling back to a proven upper bound.

    Returns:
        ``Sensitivity(value, exact, method, lower_bound)``; ``value`` is never below the
        sensitivity (an upper bound when not ``exact``).

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
        return _exact(np.max(C.column_norms()), "column_norm")
    if participation.kind == "fixed_epochs":
        kk = min(k, -(-n // b))
        check_memory(
            f"the fixed_epochs sensitivity at n={n}, b={b}, k={k}",
            8.0 * 3 * min(b, n) * kk * kk,  # the class Grams, (classes, k, k), and their copies
            "use fewer epochs (smaller k) or fewer steps",
        )
        return _fixed_epochs(C, b, k)
    if _closed_form_applies(C):
        return _exact(_closed_form(C.coeffs, C.cols(), b, k), "toeplitz_closed_form")
    return _min_sep(C, b, k, search_limit)


def _min_sep(C: LowerTriangular, b: int, k: int, search_limit: int) -> Sensitivity:
    n = C.n
    bounds: list[tuple[float, str, float | None]] = []  # (value, method, lower bound)
    majorant = _toeplitz_majorant_bound(C, b, k)
    if majorant is not None:
        bounds.append((majorant, "toeplitz_majorant_bound", None))
    if n <= _GRAM_MAX_N:
        X = gram(C)
        scale = float(np.max(np.abs(X)))
        nonneg = bool(np.all(X >= -_NEG_TOL * scale))
        kk = min(k, -(-n // b))  # the largest admissible set
        if count_admissible_sets(n, b, k) <= search_limit:
            if nonneg:
                # Σ|X_π| ≥ the truth ≥ 1ᵀX_π1, equal up to the round-off tolerated above
                return _exact(np.sqrt(_exhaustive(np.abs(X), b, k, True)), "exhaustive")
            if kk <= 2:
                return _exact(np.sqrt(_exhaustive(X, b, k, False)), "exhaustive")
            upper, lower = _exhaustive_vector(X, b, k)
            bounds.append((np.sqrt(upper), "sdp_bound", np.sqrt(lower)))
        bounds.append((np.sqrt(_gram_row_bound(X, b, k)), "gram_row_bound", None))
    bounds.append((_column_norm_bound(C, b, k), "column_norm_bound", None))
    value, method, lower = min(bounds, key=lambda t: t[0])
    lowers = [t[2] for t in bounds if t[2] is not None]
    lower = float(max(lowers)) if lowers else None
    return Sensitivity(float(value) * (1 + _BOUND_MARGIN), False, method, lower)


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


def nonincreasing_majorant(v) -> np.ndarray:
    """The smallest non-increasing non-negative sequence m ≥ |v|: m_t = max_{u ≥ t} |v_u|."""
    a = np.abs(np.asarray(v, dtype=np.float64))
    return np.maximum.accumulate(a[::-1])[::-1]


def _closed_form_applies(C: LowerTriangular) -> bool:
    """C = Toep(c)·diag(s) with c ≥ 0 non-increasing and s ≥ 0 non-increasing.

    Then X_ij = s_i s_j K(max(i,j), |i−j|) with K non-increasing in both arguments and all terms
    non-negative. Mapping any admissible π = {p_1 < … < p_m} to {0, b, …, (m−1)b} lowers every
    max(p_i, p_j) and |p_i − p_j| (gaps ≥ b) and raises every s, so 1ᵀX_π1 can only grow; u = 1
    (Y = 11ᵀ, also for vectors) is optimal since X ≥ 0. Hence π* = {0, b, 2b, …} with
    min(k, ⌈n/b⌉) elements.
    """
    if not isinstance(C, ScaledToeplitz) or C.row_scale is not None:
        return False
    if not is_nonincreasing_nonnegative(C.coeffs):
        return False
    return C.col_scale is None or is_nonincreasing_nonnegative(C.col_scale)


def _closed_form(c: np.ndarray, s: np.ndarray, b: int, k: int) -> float:
    """‖Σ_{i<k} s_{ib}·shift_{ib}(c)‖₂ (the value of π = {0, b, …})."""
    n = c.shape[0]
    v = np.zeros(n)
    for i in range(k):
        j = i * b
        if j >= n:
            break
        v[j:] += s[j] * c[: n - j]
    return float(np.linalg.norm(v))


def _toeplitz_majorant_bound(C: LowerTriangular, b: int, k: int) -> float | None:
    """Upper bound for C = Toep(c)·diag(s) under min_sep(b, k), any signs and shapes of c, s.

    With m = ``nonincreasing_majorant(c)`` and σ = ``nonincreasing_majorant(s)``, the bound is
    ‖Σ_{i<k} σ_{ib}·shift_{ib}(m)‖₂, the closed form of Toep(m)·diag(σ).

    Proof (vector gradients): for i ≤ j, |X_ij| = |s_i s_j Σ_{u ≤ n−1−j} c_u c_{u+j−i}|
    ≤ σ_i σ_j Σ_{u ≤ n−1−j} m_u m_{u+j−i} = X̃_ij, the Gram of C̃ = Toep(m)·diag(σ) (every term
    is bounded term by term; the sums have the same range). For any admissible π and unit g_i,
    ‖Σ_{i∈π} C e_i g_iᵀ‖_F² = Σ_{i,j∈π} X_ij⟨g_i, g_j⟩ ≤ Σ_{i,j∈π} |X_ij| ≤ 1ᵀX̃_π1, and C̃
    satisfies the closed form's conditions (m, σ non-negative and non-increasing), so
    max_π 1ᵀX̃_π1 is attained at π = {0, b, …}. When c and s already are non-negative and
    non-increasing this is the exact closed form. O(n·k). None unless C is a column-scaled
    Toeplitz matrix.
    """
    if not isinstance(C, ScaledToeplitz) or C.row_scale is not None:
        return None
    return _closed_form(nonincreasing_majorant(C.coeffs), nonincreasing_majorant(C.cols()), b, k)


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


def _sign_vectors(m: int) -> np.ndarray:
    return np.array([(1.0,) + u for u in itertools.product((1.0, -1.0), repeat=m - 1)])


def _exhaustive(X: np.ndarray, b: int, k: int, nonneg: bool) -> float:
    """max over admissible π and signs u (u = 1 when ``nonneg``) of uᵀX_πu (squared)."""
    n = X.shape[0]
    best = 0.0
    for sets in _admissible_sets(n, b, k):
        m = sets.shape[1]
        signs = np.ones((1, m)) if nonneg else _sign_vectors(m)
        chunk = max(1, 4_000_000 // (m * m * signs.shape[0]))
        for start in range(0, sets.shape[0], chunk):
            S = sets[start : start + chunk]
            Q = X[S[:, :, None], S[:, None, :]]  # (N, m, m)
            vals = np.einsum("ui,nij,uj->nu", signs, Q, signs, optimize=True)
            best = max(best, float(vals.max()))
    return max(best, 0.0)


def _exhaustive_vector(X: np.ndarray, b: int, k: int) -> tuple[float, float]:
    """(upper, lower) bounds on max_π max_Y ⟨X_π, Y⟩ (squared vector sensitivity).

    Σ|X_π| bounds every set; the ``_SDP_MAX_SETS`` sets with the largest Σ|X_π| get the SDP
    certificate instead, and the bound is max(largest certificate, largest Σ|X_π| of the sets
    not certified). Sets are padded to k with a zero row and column (index n), which changes
    neither the SDP value nor Σ|X_π|."""
    n = X.shape[0]
    Xp = np.zeros((n + 1, n + 1))
    Xp[:n, :n] = X
    top_abs = np.zeros(0)
    top_sets = np.zeros((0, k), dtype=np.int64)
    rest = 0.0  # the largest Σ|X_π| among the sets dropped from the top list
    for sets in _admissible_sets(n, b, k):
        m = sets.shape[1]
        chunk = max(1, 4_000_000 // (m * m))
        for start in range(0, sets.shape[0], chunk):
            S = sets[start : start + chunk]
            A = np.abs(X[S[:, :, None], S[:, None, :]]).sum(axis=(1, 2))
            padded = np.full((S.shape[0], k), n, dtype=np.int64)
            padded[:, :m] = S
            top_abs = np.concatenate([top_abs, A])
            top_sets = np.concatenate([top_sets, padded])
            if top_abs.shape[0] > _SDP_MAX_SETS:
                keep = np.argpartition(-top_abs, _SDP_MAX_SETS)
                rest = max(rest, float(top_abs[keep[_SDP_MAX_SETS:]].max()))
                top_abs, top_sets = top_abs[keep[:_SDP_MAX_SETS]], top_sets[keep[:_SDP_MAX_SETS]]
    Q = Xp[top_sets[:, :, None], top_sets[:, None, :]]
    upper, lower = correlation_sdp_bound(Q)
    upper = np.minimum(upper, top_abs)
    return max(float(upper.max()), rest), float(lower.max())


def correlation_sdp_bound(Q) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on max {⟨Q_a, Y⟩ : Y ⪰ 0, Y_ii = 1} for each symmetric Q_a of a batch.

    Args:
        Q: shape (N, m, m) (or (m, m)), symmetric, float64.

    Returns:
        (upper, lower), each shape (N,) (or scalars for one matrix): ``upper`` a dual
        certificate (module text), ``lower`` the value ⟨Q_a, VVᵀ⟩ of unit vectors V found by
        coordinate ascent (achieved, so lower ≤ max ≤ upper). A batch whose ascent would exceed
        the work cap gets the certificate of λ_i = Σ_j |Q_ij| (Gershgorin) instead.
    """
    Q = np.asarray(Q, dtype=np.float64)
    single = Q.ndim == 2
    if single:
        Q = Q[None]
    N, m, _ = Q.shape
    Q = 0.5 * (Q + np.swapaxes(Q, 1, 2))
    diag = np.diagonal(Q, axis1=1, axis2=2).copy()
    Qoff = Q.copy()
    Qoff[:, np.arange(m), np.arange(m)] = 0.0
    r = min(m, int(np.ceil(np.sqrt(2.0 * m))) + 1)
    if N * m * m * r * _SDP_SWEEPS > _SDP_MAX_WORK or m == 0:
        lam = diag + np.abs(Qoff).sum(axis=2)  # diag(λ) − Q is diagonally dominant
        upper = lam.sum(axis=1)
        lower = diag.sum(axis=1)  # orthogonal unit vectors
    else:
        rng = np.random.default_rng(0)
        V = rng.normal(size=(N, m, r))
        V /= np.linalg.norm(V, axis=2, keepdims=True)
        prev = None
        for _ in range(_SDP_SWEEPS):
            for i in range(m):
                w = np.einsum("nj,njr->nr", Qoff[:, i, :], V)
                nw = np.linalg.norm(w, axis=1)
                ok = nw > 0
                V[ok, i] = w[ok] / nw[ok, None]
            val = np.einsum("nij,nir,njr->n", Q, V, V)
            if prev is not None and np.all(np.abs(val - prev) <= 1e-14 * np.maximum(np.abs(val), 1e-300)):
                break
            prev = val
        W = np.einsum("nij,njr->nir", Qoff, V)
        lam = diag + np.linalg.norm(W, axis=2)
        lower = np.einsum("nij,nir,njr->n", Q, V, V)
        upper = lam.sum(axis=1)
    M = -Q
    M[:, np.arange(m), np.arange(m)] += lam
    mu = np.linalg.eigvalsh(M)[:, 0]
    # eigvalsh's backward error is a small multiple of eps·‖M‖; cover it generously
    slack = 16.0 * m * np.finfo(np.float64).eps * np.linalg.norm(M, axis=(1, 2))
    upper = upper + m * (np.maximum(-mu, 0.0) + slack)
    lower = np.minimum(lower, upper)
    if single:
        return float(upper[0]), float(lower[0])
    return upper, lower


def _max_weight_admissible(w: np.ndarray, b: int, k: int) -> float:
    """max Σ_{i∈π} w_i over sets with gaps ≥ b and |π| ≤ k (w ≥ 0), by dynamic programming."""
    n = w.shape[0]
    f = np.zeros((n + b + 1, k + 1))  # f[i, m]: best using elements >= i, at most m of them
    for i in range(n - 1, -1, -1):
        f[i, 1:] = np.maximum(f[i + 1, 1:], w[i] + f[i + b, :-1])
    return float(f[0, k])


def _gram_row_bound(X: np.ndarray, b: int, k: int) -> float:
    """Upper bound on max_π Σ_{i,j∈π}|X_ij| (≥ the squared vector sensitivity): Σ_{i∈π} R_i
    with R_i = |X_ii| + the k−1 largest |X_ij|, |i−j| ≥ b; then the best admissible π for the
    weights R by dynamic programming."""
    n = X.shape[0]
    A = np.abs(X)
    diag = np.diag(A).copy()
    i, j = np.indices((n, n))
    A[np.abs(i - j) < b] = 0.0
    del i, j
    m = min(k - 1, n)
    top = np.partition(A, n - m, axis=1)[:, n - m :].sum(axis=1) if m > 0 else np.zeros(n)
    return _max_weight_admissible(diag + top, b, k)


def _column_norm_bound(C: LowerTriangular, b: int, k: int) -> float:
    """Upper bound by the triangle inequality: ‖Σ C e_i g_iᵀ‖_F ≤ Σ_{i∈π} ‖C e_i‖."""
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
    """max over the classes π = {s, s+b, …} of the class's vector sensitivity (squared).

    A class with X_π ≥ 0 or at most 2 columns is solved exactly; the others are bounded by
    min(SDP certificate, Σ|X_π|) (certificates for the ``_SDP_MAX_SETS`` classes with the largest
    Σ|X_π|). The result is exact when no bounded class can exceed the best exact class."""
    exact_best = 0.0
    pending: dict[int, list[np.ndarray]] = {}
    for _, G in _class_grams(C, b, k):
        m = G.shape[0]
        absum = float(np.abs(G).sum())
        if -float(np.minimum(G, 0.0).sum()) <= _NEG_MASS_TOL * absum:
            # X_π ≥ 0 up to round-off: the truth lies in [1ᵀX_π1, Σ|X_π|], which agree to
            # 2·_NEG_MASS_TOL; the upper end is reported
            exact_best = max(exact_best, absum)
        elif m <= 2:
            signs = _sign_vectors(m)
            exact_best = max(exact_best, float(np.einsum("ui,ij,uj->u", signs, G, signs).max()))
        elif absum > exact_best:
            pending.setdefault(m, []).append(G)
    bound_best, lower_best, method = 0.0, exact_best, "class_abs_gram_bound"
    for _m, grams in pending.items():
        Q = np.stack(grams)
        A = np.abs(Q).sum(axis=(1, 2))
        keep = A > exact_best
        Q, A = Q[keep], A[keep]
        if Q.shape[0] == 0:
            continue
        if Q.shape[0] > _SDP_MAX_SETS:
            order = np.argsort(-A)
            bound_best = max(bound_best, float(A[order[_SDP_MAX_SETS]]))
            Q, A = Q[order[:_SDP_MAX_SETS]], A[order[:_SDP_MAX_SETS]]
        upper, lower = correlation_sdp_bound(Q)
        if np.any(upper < A):
            method = "class_sdp_bound"
        bound_best = max(bound_best, float(np.minimum(upper, A).max()))
        lower_best = max(lower_best, float(lower.max()))
    if bound_best <= exact_best:
        return _exact(np.sqrt(exact_best), "exhaustive")
    value = float(np.sqrt(bound_best))
    majorant = _toeplitz_majorant_bound(C, b, k)
    if majorant is not None and majorant < value:
        value, method = majorant, "toeplitz_majorant_bound"
    return Sensitivity(value * (1 + _BOUND_MARGIN), False, method, float(np.sqrt(lower_best)))
