"""Sensitivity against a brute force over every admissible participation set and sign vector."""

import itertools

import numpy as np
import pytest

from dpmf.mechanisms import (
    BANDED,
    FACTORIZATIONS,
    OPTIMIZED,
    DenseLowerTriangular,
    Participation,
    ScaledToeplitz,
    factorize,
    gram,
    sensitivity,
)
from dpmf.mechanisms.sensitivity import count_admissible_sets
from dpmf.workloads import SCHEDULES, Schedule, from_schedule, momentum, prefix_sum


def brute_min_sep(C, b, k):
    """max over π (gaps ≥ b, 1 ≤ |π| ≤ k) and u ∈ {±1}^π of ‖C u‖₂, by enumeration."""
    n = C.shape[0]
    best = 0.0
    for m in range(1, k + 1):
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=m)))
        for pi in itertools.combinations(range(n), m):
            if any(pi[i + 1] - pi[i] < b for i in range(m - 1)):
                continue
            vals = np.linalg.norm(C[:, list(pi)] @ signs.T, axis=0)
            best = max(best, vals.max())
    return best


def brute_fixed_epochs(C, b, k):
    n = C.shape[0]
    best = 0.0
    for s in range(min(b, n)):
        idx = [s + i * b for i in range(k) if s + i * b < n]
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(idx))))
        best = max(best, np.linalg.norm(C[:, idx] @ signs.T, axis=0).max())
    return best


CASES = [(8, 1, 3), (12, 2, 3), (16, 3, 4), (24, 5, 3), (24, 8, 3), (24, 2, 2)]


def toeplitz_strategies(n):
    # closed-form strategies (the optimized ones have their own sensitivity tests)
    closed = [f for f in FACTORIZATIONS if f not in OPTIMIZED]
    specs = [f for f in closed if f not in BANDED and f not in ("sqrt", "lcgd")] + [
        f"{f}:{p}" for f in BANDED if f in closed for p in (1, 2, 4)
    ]
    specs += ["lcgd:0.3", "lcgd:0.9"]
    for sched in SCHEDULES:
        w = from_schedule(Schedule(sched, 0.1), n)
        for spec in specs:
            yield f"{sched}/{spec}", factorize(w, spec).C


@pytest.mark.slow
@pytest.mark.parametrize("n, b, k", CASES)
def test_min_sep_equals_brute_force(n, b, k):
    part = Participation.separated(b, k)
    checked_closed_form = 0
    for label, C in toeplitz_strategies(n):
        s = sensitivity(C, part)
        ref = brute_min_sep(C.dense(), b, k)
        if s.exact:
            assert s.value == pytest.approx(ref, rel=1e-10), label
            checked_closed_form += s.method == "toeplitz_closed_form"
        else:
            assert s.value >= ref * (1 - 1e-12), label
    assert checked_closed_form > 10


def test_closed_form_only_under_its_condition():
    # coefficients with a negative entry: the closed form would under-report
    c = np.array([1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    C = ScaledToeplitz(c)
    part = Participation.separated(2, 2)
    s = sensitivity(C, part)
    ref = brute_min_sep(C.dense(), 2, 2)
    first_set = np.linalg.norm(C.dense()[:, [0, 2]].sum(axis=1))
    assert first_set == pytest.approx(np.sqrt(2)) and ref == pytest.approx(np.sqrt(6))
    assert s.method == "exhaustive" and s.exact
    assert s.value == pytest.approx(ref, rel=1e-12)
    # increasing coefficients: non-monotone
    C2 = ScaledToeplitz(np.array([1.0, 2.0, 0.5, 0.1, 0, 0, 0, 0, 0, 0]))
    s2 = sensitivity(C2, Participation.separated(3, 3))
    assert s2.method != "toeplitz_closed_form"
    assert s2.value == pytest.approx(brute_min_sep(C2.dense(), 3, 3), rel=1e-12)


def test_bound_when_search_too_large():
    rng = np.random.default_rng(5)
    M = np.tril(rng.normal(size=(20, 20)))
    np.fill_diagonal(M, 1.0)
    C = DenseLowerTriangular(M)
    part = Participation.separated(3, 3)
    ref = brute_min_sep(M, 3, 3)
    full = sensitivity(C, part)
    bound = sensitivity(C, part, search_limit=10)
    # CᵀC has negative entries and |π| = 3: signs (ref) only bound the vector sensitivity from
    # below, so the full search returns a certified upper bound with an achieved lower bound
    assert not full.exact and full.value >= full.lower_bound >= ref * (1 - 1e-12)
    assert full.value <= full.lower_bound * (1 + 1e-8)
    assert not bound.exact and bound.method in ("gram_row_bound", "column_norm_bound")
    assert bound.value >= full.lower_bound * (1 + 1e-13)
    big = factorize(from_schedule(Schedule("cosine", 0.1), 5000), "lr_aware").C
    s = sensitivity(big, Participation.separated(500, 10))
    assert s.method in ("toeplitz_closed_form", "toeplitz_majorant_bound", "column_norm_bound")
    if not s.exact:  # a triangle-inequality bound is at least the value of the set {0, b, 2b, ...}
        first = sum(big.columns([i * 500])[:, 0] for i in range(10))
        assert s.value >= np.linalg.norm(first)


@pytest.mark.parametrize("n, b, k", [(12, 4, 3), (12, 3, 4), (10, 5, 2), (9, 4, 3)])
def test_fixed_epochs_equals_brute_force(n, b, k):
    part = Participation.fixed_epochs(b, k)
    rng = np.random.default_rng(n + b)
    mats = [factorize(prefix_sum(n), "sqrt_prefix").C, factorize(prefix_sum(n), "bisr:2").C]
    M = np.tril(rng.normal(size=(n, n)))
    np.fill_diagonal(M, 2.0)
    mats.append(DenseLowerTriangular(M))
    for i, C in enumerate(mats):
        s = sensitivity(C, part)
        ref = brute_fixed_epochs(C.dense(), b, k)
        if i < 2 or k == 2:  # CᵀC ≥ 0 or ≤ 2 columns per class: signs are vectors, exact
            assert s.exact and s.value == pytest.approx(ref, rel=1e-12)
        elif s.exact:  # the best class is one of ≤ 2 columns, no 3-column class can beat it
            assert s.value == pytest.approx(ref, rel=1e-12) and n % b
        else:  # negative entries, 3+ columns per class: certified SDP bound, ≥ the sign value
            assert not s.exact and s.method == "class_sdp_bound"
            assert s.value >= s.lower_bound >= ref * (1 - 1e-12)
            assert s.value <= s.lower_bound * (1 + 1e-8)


def test_fixed_epochs_needs_enough_epochs():
    with pytest.raises(ValueError, match="fixed_epochs"):
        sensitivity(factorize(prefix_sum(20), "sqrt_prefix").C, Participation.fixed_epochs(4, 3))


def test_single_is_max_column_norm():
    w = from_schedule(Schedule("exponential", 0.1), 40)
    for spec in ["identity", "output", "sqrt", "sqrt_prefix_scaled", "bisr:3", "lr_aware"]:
        C = factorize(w, spec).C
        s = sensitivity(C)
        assert s.exact and s.method == "column_norm"
        assert s.value == pytest.approx(np.linalg.norm(C.dense(), axis=0).max(), rel=1e-12)
    # with k = 1 every pattern is single participation
    C = factorize(w, "sqrt").C
    assert sensitivity(C, Participation.separated(3, 1)).value == pytest.approx(sensitivity(C).value)


def test_known_value_prefix_sum_sqrt_n1000():
    """sens(A₁^{1/2}) = ‖r‖₂ = 1.8069 at n = 1000 (accounting issue's reference value)."""
    s = sensitivity(factorize(prefix_sum(1000), "sqrt_prefix").C)
    assert round(s.value, 4) == 1.8069


def test_gram_matches_dense():
    w = from_schedule(Schedule("exponential", 0.1), 30)
    for spec in ["sqrt_prefix", "sqrt_prefix_scaled", "bisr:4", "sqrt"]:
        C = factorize(w, spec).C
        np.testing.assert_allclose(gram(C), C.dense().T @ C.dense(), atol=1e-12)
    C = factorize(momentum(30, 0.9), "bsr:3").C
    np.testing.assert_allclose(gram(C), C.dense().T @ C.dense(), atol=1e-12)


@pytest.mark.parametrize("n, b, k", [(7, 1, 7), (10, 2, 3), (11, 3, 2), (6, 10, 3)])
def test_count_admissible_sets(n, b, k):
    sets = [
        pi
        for m in range(1, k + 1)
        for pi in itertools.combinations(range(n), m)
        if all(pi[i + 1] - pi[i] >= b for i in range(m - 1))
    ]
    assert count_admissible_sets(n, b, k) == len(sets)
    assert count_admissible_sets(n, b, k, signed=True) == sum(2 ** (len(p) - 1) for p in sets)


def test_bad_participation():
    with pytest.raises(ValueError, match="min_sep"):
        Participation.separated(0, 2)
    with pytest.raises(ValueError, match="max_participations"):
        Participation.separated(2, 0)
    with pytest.raises(ValueError, match="participation"):
        Participation("sometimes")
    with pytest.raises(ValueError, match="search_limit"):
        sensitivity(np.eye(3), search_limit=0)
    with pytest.raises(ValueError, match="lower-triangular"):
        sensitivity(np.ones((3, 3)))
