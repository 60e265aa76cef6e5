"""Sensitivity for vector-valued gradients: never below the truth, exact only where proven.

References: the SDP value by cvxpy (an independent solver) and by a brute force over the angles
of unit vectors; brute force over every participation set; jax-privacy's closed form
(``jax_privacy.matrix_factorization.toeplitz.minsep_sensitivity_squared``) evaluated on the
non-increasing majorant of |c|, recorded below (jax is not needed to run these tests).
"""

import itertools

import numpy as np
import pytest
from scipy.optimize import minimize

from dpmf.mechanisms import (
    DenseLowerTriangular,
    Participation,
    ScaledToeplitz,
    factorize,
    gram,
    sensitivity,
)
from dpmf.mechanisms.sensitivity import (
    _column_norm_bound,
    _toeplitz_majorant_bound,
    correlation_sdp_bound,
)
from dpmf.workloads import Schedule, from_schedule

cp = pytest.importorskip("cvxpy")

X3 = np.array([[1.0, -0.45, -0.45], [-0.45, 1.0, -0.45], [-0.45, -0.45, 1.0]])
SQRT_435 = np.sqrt(4.35)  # three unit vectors at 120°: 3 + 6·0.45·0.5


def lower_factor(X):
    """Lower-triangular C with CᵀC = X (reverse Cholesky)."""
    J = np.eye(X.shape[0])[::-1]
    return (J @ np.linalg.cholesky(J @ X @ J) @ J).T


def sdp_cvxpy(Q):
    """max ⟨Q, Y⟩ over correlation matrices Y, by cvxpy."""
    m = Q.shape[0]
    Y = cp.Variable((m, m), PSD=True)
    prob = cp.Problem(cp.Maximize(cp.trace(Q @ Y)), [cp.diag(Y) == 1])
    prob.solve(solver="CLARABEL")
    return float(prob.value)


def sdp_angles(Q):
    """max over three planar unit vectors (angles 0, a, b) of Σ Q_ij cos(θ_i − θ_j): a 3×3 SDP
    has an optimal Y of rank ≤ 2 (r(r+1)/2 ≤ 3), so planar vectors suffice. Grid + polish."""
    assert Q.shape == (3, 3)

    def f(t):
        th = np.array([0.0, t[0], t[1]])
        return -float(np.sum(Q * np.cos(th[:, None] - th[None, :])))

    grid = np.linspace(-np.pi, np.pi, 73)
    best = min(((f((a, b)), (a, b)) for a in grid for b in grid), key=lambda t: t[0])
    return -minimize(f, best[1], method="Nelder-Mead", options={"xatol": 1e-12, "fatol": 1e-15}).fun


def brute_vector(C, sets):
    """Vector sensitivity: max over the given sets of the SDP (cvxpy), pruned by Σ|X_π| ≥ it."""
    X = gram(C)
    items = sorted(((np.abs(X[np.ix_(p, p)]).sum(), p) for p in sets), key=lambda t: -t[0])
    best = 0.0
    for bound, p in items:
        if bound <= best:
            break
        Q = X[np.ix_(p, p)]
        best = max(best, sdp_cvxpy(Q) if len(p) > 2 else float(np.max([u @ Q @ u for u in _signs(len(p))])))
    return float(np.sqrt(best))


def _signs(m):
    return [np.array(u) for u in itertools.product((1.0, -1.0), repeat=m)]


def min_sep_sets(n, b, k):
    for m in range(1, k + 1):
        for p in itertools.combinations(range(n), m):
            if all(p[i + 1] - p[i] >= b for i in range(m - 1)):
                yield list(p)


def test_three_steps_at_120_degrees_are_not_understated():
    C = lower_factor(X3)
    assert np.allclose(np.tril(C), C) and np.allclose(C.T @ C, X3)
    # an example at all three steps with unit gradients at 120° moves C·G by √4.35
    g = np.array([[np.cos(a), np.sin(a)] for a in (0.0, 2 * np.pi / 3, 4 * np.pi / 3)])
    assert np.linalg.norm(C @ g) == pytest.approx(SQRT_435, rel=1e-14)
    signs = max(np.linalg.norm(C @ u) for u in _signs(3))
    assert signs == pytest.approx(np.sqrt(3.9), rel=1e-14) and signs < 1.975 < SQRT_435
    for part in (Participation.fixed_epochs(1, 3), Participation.separated(1, 3)):
        s = sensitivity(DenseLowerTriangular(C), part)
        assert s.value >= SQRT_435 and not s.exact, part.label
        assert s.method in ("class_sdp_bound", "sdp_bound"), part.label
        assert s.value <= SQRT_435 * (1 + 1e-9)
        assert SQRT_435 * (1 - 1e-9) <= s.lower_bound <= s.value


def test_sdp_certificate_equals_cvxpy_and_the_angle_brute_force():
    rng = np.random.default_rng(3)
    mats = [X3]
    for _ in range(3):
        G = rng.normal(size=(3, 5))
        mats.append(G @ G.T)
    for Q in mats:
        upper, lower = correlation_sdp_bound(Q)
        ref_cvx, ref_angles = sdp_cvxpy(Q), sdp_angles(Q)
        assert ref_cvx == pytest.approx(ref_angles, rel=1e-6)
        assert upper >= ref_angles * (1 - 1e-12) and lower <= upper
        assert upper == pytest.approx(ref_angles, rel=1e-8) and lower == pytest.approx(ref_angles, rel=1e-8)
    assert 4.35 <= correlation_sdp_bound(X3)[0] <= 4.35 * (1 + 1e-8)
    # larger, indefinite-off-diagonal Grams: the certificate never falls below cvxpy's optimum
    for m in (5, 8):
        G = rng.normal(size=(m, m))
        Q = G @ G.T
        upper, lower = correlation_sdp_bound(Q)
        ref = sdp_cvxpy(Q)
        assert upper >= ref * (1 - 1e-7) and lower <= ref * (1 + 1e-7)
        assert upper <= ref * (1 + 1e-6)


@pytest.mark.parametrize("n, b, k", [(9, 2, 3), (10, 3, 3)])
def test_min_sep_matches_vector_brute_force_on_small_n(n, b, k):
    rng = np.random.default_rng(n * 10 + b)
    M = np.tril(rng.normal(size=(n, n)))
    np.fill_diagonal(M, 1.5)
    C = DenseLowerTriangular(M)
    part = Participation.separated(b, k)
    ref = brute_vector(C, list(min_sep_sets(n, b, k)))
    s = sensitivity(C, part)
    assert not s.exact and s.method in ("sdp_bound", "gram_row_bound")
    assert s.value >= ref * (1 - 1e-7) and s.value <= ref * (1 + 1e-6)
    assert s.lower_bound <= ref * (1 + 1e-7)
    for limit in (1, 10):  # fallback bounds are still upper bounds
        assert sensitivity(C, part, search_limit=limit).value >= ref * (1 - 1e-7)


# Built-in strategies with CᵀC ≥ 0: exact, the same values as the scalar (sign-vector) rule.
# The recorded values hold to 1e-7 across CPUs (BLT's and LCGD's coefficients come from an
# optimiser whose last digits follow the machine's rounding); on the machine's own C the value
# equals the all-ones brute force over every participation set to 1e-12.
UNCHANGED = [
    ("constant", "sqrt_prefix", "min_sep", 5, 4, 4.411255544500255, "toeplitz_closed_form"),
    ("constant", "sqrt_prefix", "fixed_epochs", 10, 4, 3.8813174427331667, "exhaustive"),
    ("cosine", "lr_aware", "min_sep", 5, 4, 3.71148331691866, "exhaustive"),
    ("cosine", "lr_aware", "fixed_epochs", 10, 4, 3.215523928202172, "exhaustive"),
    ("cosine", "lr_aware", "min_sep", 13, 3, 2.618467563898155, "exhaustive"),
    ("constant", "bsr:4", "min_sep", 5, 4, 2.439902661992892, "toeplitz_closed_form"),
    ("exponential", "bisr:3", "fixed_epochs", 10, 4, 2.4919615043939607, "exhaustive"),
    ("constant", "blt:2", "min_sep", 5, 4, 3.0419106206156465, "toeplitz_closed_form"),
    ("constant", "blt:2", "fixed_epochs", 10, 4, 3.040875591361174, "exhaustive"),
    ("cosine", "lcgd:0.5", "min_sep", 13, 3, 2.0001627624858007, "toeplitz_closed_form"),
    ("constant", "identity", "fixed_epochs", 10, 4, 2.0, "exhaustive"),
]


@pytest.mark.parametrize("schedule, spec, kind, b, k, value, method", UNCHANGED)
def test_builtin_strategies_with_nonnegative_gram_are_unchanged(schedule, spec, kind, b, k, value, method):
    part = Participation(kind, b, k)
    f = factorize(from_schedule(Schedule(schedule, 0.1), 40), spec, participation=part)
    X = gram(f.C)
    assert np.all(X >= -1e-12 * np.max(X))  # ≥ 0 up to the round-off of the coefficients
    s = sensitivity(f.C, part)
    assert s.exact and s.method == method
    n = X.shape[0]
    if kind == "min_sep":
        sets = min_sep_sets(n, b, k)
    else:
        sets = ([i + b * j for j in range(k) if i + b * j < n] for i in range(b))
    brute = max(X[np.ix_(p, p)].sum() for p in sets)  # X ≥ 0: the all-ones sign vector is the worst
    assert s.value == pytest.approx(np.sqrt(brute), rel=1e-12, abs=0)
    assert s.value == pytest.approx(value, rel=1e-7, abs=0)


_T = np.arange(64.0)
MAJORANT_CASES = {
    "osc": (1.0 + 0.5 * np.cos(_T)) / np.sqrt(_T + 1.0),
    "signed": np.cos(0.7 * _T) / (_T + 1.0) ** 0.3,
    "bump": np.exp(-0.05 * _T) * (1 + (_T % 5 == 3)),
}
# jax_privacy.matrix_factorization.toeplitz.minsep_sensitivity_squared(majorant, b, k, n=64) ** 0.5
JAX_MAJORANT = {
    ("osc", 4, 8): 18.13655609145595,
    ("osc", 7, 5): 11.382252839600978,
    ("osc", 16, 4): 8.059446544107077,
    ("signed", 4, 8): 20.931874210461014,
    ("signed", 7, 5): 13.040418226638538,
    ("signed", 16, 4): 8.90774606421143,
    ("bump", 4, 8): 37.13483923168607,
    ("bump", 7, 5): 23.001034675145764,
    ("bump", 16, 4): 15.660545832382624,
}


@pytest.mark.parametrize("name, b, k", sorted(JAX_MAJORANT))
def test_non_monotone_toeplitz_bound_at_least_as_tight_as_the_majorant(name, b, k):
    C = ScaledToeplitz(MAJORANT_CASES[name])
    part = Participation.separated(b, k)
    ref = JAX_MAJORANT[(name, b, k)]
    assert _toeplitz_majorant_bound(C, b, k) == pytest.approx(ref, rel=1e-12)
    fallback = sensitivity(C, part, search_limit=1)  # no set search: the bounds alone
    assert not fallback.exact and fallback.value <= ref * (1 + 1e-11)
    # a valid bound: at least the value of an actual participation (unit vectors at the sets
    # {s, s+b, …} with signs following the columns' correlation)
    lower = max(np.linalg.norm(C.columns(np.arange(s, 64, b)[:k]).sum(axis=1)) for s in range(b))
    assert fallback.value >= lower


@pytest.mark.parametrize("scaled", [False, True])
def test_majorant_bound_is_valid_for_vectors_by_brute_force(scaled):
    n, b, k = 10, 2, 3
    rng = np.random.default_rng(11 + scaled)
    c = rng.normal(size=n)
    c[0] = 1.0
    s = rng.uniform(-2.0, 2.0, size=n) if scaled else None
    C = ScaledToeplitz(c, None, s)
    ref = brute_vector(C, list(min_sep_sets(n, b, k)))
    maj = _toeplitz_majorant_bound(C, b, k)
    assert maj >= ref * (1 - 1e-7)
    full = sensitivity(C, Participation.separated(b, k))
    assert ref * (1 - 1e-7) <= full.value <= min(maj * (1 + 1e-11), ref * (1 + 1e-6))


def test_large_non_monotone_toeplitz_uses_the_majorant():
    """n above the Gram limit: only the column-norm bound existed; the majorant is tighter."""
    f = factorize(from_schedule(Schedule("cosine", 0.1), 5000), "lr_aware")
    part = Participation.separated(500, 10)
    s = sensitivity(f.C, part)
    maj = _toeplitz_majorant_bound(f.C, 500, 10)
    assert s.value == pytest.approx(maj, rel=1e-11) and s.method == "toeplitz_majorant_bound"
    assert s.value < _column_norm_bound(f.C, 500, 10)
