"""dpmf.audit.estimators: values recorded from jax-privacy 2.0.0 (benchmarks/bench_audit_estimators.py,
where dpmf and jax-privacy agree to 0 relative difference), and closed-form / brute-force checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from dpmf.audit import estimators as E

# dpmf's values on the score sets of ``_score_sets`` (δ = 1e-5, α = 0.05), equal to those of
# jax_privacy.auditing.CanaryScoreAuditor (benchmarks/bench_audit_estimators.py: relative
# difference 0) except epsilon_from_gdp on gauss_mu1_m200, gauss_mu0.5_m5000 and separated,
# where jax-privacy's largest |μ| comes from the reverse direction (see epsilon_from_gdp): its
# values there are 4.37160231461, 4.6074395056, 0.366952698322.
JAX_PRIVACY = {
    "gauss_mu1_m200": {
        "epsilon_one_run": 0.3797085907718429,
        "epsilon_one_run_split": 0.34194600985237267,
        "epsilon_one_run_fdp": 0.5658170958810044,
        "epsilon_clopper_pearson": 0.2552101105662199,
        "epsilon_clopper_pearson_two_sided": 0.326687358783619,
        "epsilon_clopper_pearson_split": 0.05117142630829774,
        "epsilon_clopper_pearson_explicit": 0.3673982297513736,
        "epsilon_from_gdp": 1.1406706131501263,
        "attack_auroc": 0.7666000000000001,
        "tpr_at_fpr_0.01": 0.09,
        "tpr_at_fpr_0.1": 0.37111111111111117,
    },
    "gauss_mu2_m1000": {
        "epsilon_one_run": 2.8071392875528423,
        "epsilon_one_run_split": 2.818693778890626,
        "epsilon_one_run_fdp": 4.109569668759814,
        "epsilon_clopper_pearson": 2.674547336319348,
        "epsilon_clopper_pearson_two_sided": 2.6745857726424687,
        "epsilon_clopper_pearson_split": 2.504111926947539,
        "epsilon_clopper_pearson_explicit": 1.2568859677697004,
        "epsilon_from_gdp": 7.966827485606491,
        "attack_auroc": 0.9220799999999999,
        "tpr_at_fpr_0.01": 0.458,
        "tpr_at_fpr_0.1": 0.7421538461538462,
    },
    "gauss_mu0.5_m5000": {
        "epsilon_one_run": 0.6347271225542449,
        "epsilon_one_run_split": 1.1336488439562395,
        "epsilon_one_run_fdp": 1.2200175308886945,
        "epsilon_clopper_pearson": 0.70674648800984,
        "epsilon_clopper_pearson_two_sided": 0.813710229897727,
        "epsilon_clopper_pearson_split": 0.696536206040645,
        "epsilon_clopper_pearson_explicit": 0.4742556706125005,
        "epsilon_from_gdp": 1.5367386562910172,
        "attack_auroc": 0.6455564102564102,
        "tpr_at_fpr_0.01": 0.04493406593406593,
        "tpr_at_fpr_0.1": 0.22445241199478486,
    },
    "ties_int": {
        "epsilon_one_run": 2.1154849084351306,
        "epsilon_one_run_split": 1.9160655995933065,
        "epsilon_one_run_fdp": 3.0381499583553624,
        "epsilon_clopper_pearson": 1.5995881803673484,
        "epsilon_clopper_pearson_two_sided": 1.5996959277794645,
        "epsilon_clopper_pearson_split": 1.287608719065835,
        "epsilon_clopper_pearson_explicit": 0.048097317938120936,
        "epsilon_from_gdp": 3.1791594606040627,
        "attack_auroc": 0.6183571428571428,
        "tpr_at_fpr_0.01": 0.1510990990990991,
        "tpr_at_fpr_0.1": 0.250990990990991,
    },
    "separated": {
        "epsilon_one_run": 0.5813412758002368,
        "epsilon_one_run_split": 0.0,
        "epsilon_one_run_fdp": 0.7571930996258922,
        "epsilon_clopper_pearson": 0.0,
        "epsilon_clopper_pearson_two_sided": 0.0,
        "epsilon_clopper_pearson_split": 0.0,
        "epsilon_clopper_pearson_explicit": 0.0,
        "epsilon_from_gdp": 0.0,
        "attack_auroc": 0.595,
        "tpr_at_fpr_0.01": 0.11,
        "tpr_at_fpr_0.1": 0.2,
    },
}


def _score_sets():
    rng = np.random.default_rng(20260)
    return {
        "gauss_mu1_m200": (rng.normal(1.0, 1, 100), rng.normal(0.0, 1, 100)),
        "gauss_mu2_m1000": (rng.normal(2.0, 1, 500), rng.normal(0.0, 1, 500)),
        "gauss_mu0.5_m5000": (rng.normal(0.5, 1, 2600), rng.normal(0.0, 1, 2400)),
        "ties_int": (rng.integers(0, 8, 300).astype(float) + 1, rng.integers(0, 8, 280).astype(float)),
        "separated": (np.arange(100) + 9.5, np.arange(100.0)),
    }


def _ours(ins, outs):
    d = 1e-5
    return {
        "epsilon_one_run": lambda: E.epsilon_one_run(ins, outs, delta=d),
        "epsilon_one_run_split": lambda: E.epsilon_one_run(
            ins, outs, delta=d, threshold_strategy=E.Split(0.5, seed=7)
        ),
        "epsilon_one_run_fdp": lambda: E.epsilon_one_run_fdp(ins, outs, delta=d),
        "epsilon_clopper_pearson": lambda: E.epsilon_clopper_pearson(ins, outs, delta=d),
        "epsilon_clopper_pearson_two_sided": lambda: E.epsilon_clopper_pearson(ins, outs, one_sided=False),
        "epsilon_clopper_pearson_split": lambda: E.epsilon_clopper_pearson(
            ins, outs, delta=d, threshold_strategy=E.Split(0.5, seed=7)
        ),
        "epsilon_clopper_pearson_explicit": lambda: E.epsilon_clopper_pearson(
            ins, outs, delta=d, threshold_strategy=E.Explicit(1.0)
        ),
        "epsilon_from_gdp": lambda: E.epsilon_from_gdp(ins, outs, delta=d),
        "attack_auroc": lambda: E.attack_auroc(ins, outs),
        "tpr_at_fpr_0.01": lambda: E.tpr_at_given_fpr(ins, outs, 0.01),
        "tpr_at_fpr_0.1": lambda: E.tpr_at_given_fpr(ins, outs, 0.1),
    }


@pytest.mark.parametrize("name", sorted(JAX_PRIVACY))
def test_matches_recorded_jax_privacy_values(name):
    ins, outs = _score_sets()[name]
    for key, fn in _ours(ins, outs).items():
        assert fn() == pytest.approx(JAX_PRIVACY[name][key], rel=1e-6, abs=1e-9), key


def _brute_hull(ins, outs):
    """(fpr, tpr) of every threshold, then the upper hull by scipy.spatial.ConvexHull."""
    from scipy.spatial import ConvexHull

    th = np.concatenate([np.unique(np.concatenate([ins, outs])), [np.inf]])
    pts = np.array([[np.mean(outs >= t), np.mean(ins >= t)] for t in th] + [[1.0, 0.0]])
    hull = ConvexHull(pts)
    v = pts[hull.vertices]
    v = v[~((v[:, 0] == 1.0) & (v[:, 1] == 0.0))]  # drop the helper corner
    v = v[np.lexsort((v[:, 1], v[:, 0]))]
    return v


def test_roc_hull_is_the_convex_hull_and_auroc_its_area():
    rng = np.random.default_rng(3)
    ins, outs = rng.integers(0, 30, 80).astype(float) + 2, rng.integers(0, 30, 70).astype(float)
    _, fpr, tpr = E.roc_hull(ins, outs)
    ref = _brute_hull(ins, outs)
    np.testing.assert_allclose(np.c_[fpr, tpr], ref, atol=1e-12)
    area = np.trapezoid(ref[:, 1], ref[:, 0]) if hasattr(np, "trapezoid") else np.trapz(ref[:, 1], ref[:, 0])
    assert E.attack_auroc(ins, outs) == pytest.approx(area, abs=1e-12)


def test_auroc_against_the_brute_force_pair_count():
    # the empirical ROC is a staircase; the hull's area is the pair count where the staircase has
    # no dent (separated, all tied), never below it, and close to it for many continuous scores
    pairs = lambda a, b: np.mean((a[:, None] > b[None, :]) + 0.5 * (a[:, None] == b[None, :]))  # noqa: E731
    assert E.attack_auroc(np.arange(5.0) + 10, np.arange(7.0)) == 1.0
    assert E.attack_auroc(np.ones(5), np.ones(7)) == pytest.approx(0.5, abs=1e-15)
    rng = np.random.default_rng(5)
    for _ in range(20):
        a, b = rng.normal(0.3, 1, 40).round(1), rng.normal(0, 1, 50).round(1)
        assert E.attack_auroc(a, b) >= pairs(a, b) - 1e-12
    a, b = rng.normal(1.0, 1, 3000), rng.normal(0, 1, 3000)
    assert E.attack_auroc(a, b) == pytest.approx(pairs(a, b), abs=0.01)
    assert pairs(a, b) == pytest.approx(scipy.stats.norm.cdf(1 / math.sqrt(2)), abs=0.02)


def test_clopper_pearson_upper_is_the_beta_quantile_and_covers():
    assert E.clopper_pearson_upper(3, 20, 0.05) == pytest.approx(scipy.stats.beta.ppf(0.95, 4, 17), rel=1e-14)
    # definition: P[Bin(n, p_ub) <= k] = alpha
    p = float(E.clopper_pearson_upper(7, 50, 0.025))
    assert scipy.stats.binom.cdf(7, 50, p) == pytest.approx(0.025, rel=1e-9)
    assert E.clopper_pearson_upper(50, 50, 0.025) == 1.0


def test_clopper_pearson_epsilon_at_an_explicit_threshold_is_the_closed_form():
    ins = np.r_[np.ones(90), np.zeros(10)]
    outs = np.r_[np.ones(5), np.zeros(95)]
    eps = E.epsilon_clopper_pearson(
        ins, outs, delta=0.0, significance=0.1, threshold_strategy=E.Explicit(0.5)
    )
    tpr_lb = 1 - scipy.stats.beta.ppf(0.95, 11, 90)
    fpr_ub = scipy.stats.beta.ppf(0.95, 6, 95)
    assert eps == pytest.approx(math.log(tpr_lb / fpr_ub), rel=1e-12)


def test_bonferroni_divides_by_the_number_of_hull_thresholds():
    ins = np.r_[np.ones(90), np.zeros(10)]
    outs = np.r_[np.ones(5), np.zeros(95)]
    # hull thresholds: 0 (everything), 1, +inf → 3; test level α/3
    assert len(E.roc_hull(ins, outs)[0]) == 3
    eps = E.epsilon_clopper_pearson(ins, outs, delta=0.0, significance=0.1)
    tpr_lb = 1 - scipy.stats.beta.ppf(1 - 0.1 / 6, 11, 90)
    fpr_ub = scipy.stats.beta.ppf(1 - 0.1 / 6, 6, 95)
    assert eps == pytest.approx(math.log(tpr_lb / fpr_ub), rel=1e-12)


def test_one_run_at_delta_zero_limit_is_the_binomial_tail():
    # one explicit threshold: ε̂ solves P[Bin(r, expit(ε)) ≥ v] = α (δ → 0 part dominates)
    ins, outs = np.r_[np.ones(80), np.zeros(20)], np.r_[np.ones(20), np.zeros(80)]
    eps = E.epsilon_one_run(ins, outs, delta=1e-300, significance=0.05, threshold_strategy=E.Explicit(0.5))
    q = 1 / (1 + math.exp(-eps))
    assert scipy.stats.binom.sf(79, 100, q) == pytest.approx(0.05, rel=1e-4)


def test_gdp_epsilon_converts_the_mu_bound_with_the_gaussian_profile():
    from dpmf.accountants.gaussian import gaussian_delta

    rng = np.random.default_rng(1)
    ins, outs = rng.normal(1.5, 1, 4000), rng.normal(0, 1, 4000)
    mu = E.gdp_mu_lower_bound(ins, outs, significance=0.05)
    eps = E.epsilon_from_gdp(ins, outs, delta=1e-5, significance=0.05, eps_tol=1e-10)
    assert 1.2 < mu < 1.5  # a lower bound near the true μ = 1.5
    assert gaussian_delta(mu, eps) == pytest.approx(1e-5, rel=1e-6)


@pytest.mark.parametrize("one_sided", [True, False])
def test_gdp_bound_has_no_false_alarms_on_scores_without_signal(one_sided):
    # jax-privacy 2.0.0's |μ| gives ε̂ of 2-6 on every one of these draws
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.normal(0, 1, 2000), rng.normal(0, 1, 2000)
        assert E.epsilon_from_gdp(a, b, delta=1e-5, one_sided=one_sided) < 0.5


def test_two_sided_gdp_sees_the_reversed_signal():
    rng = np.random.default_rng(2)
    a, b = rng.normal(-1.5, 1, 3000), rng.normal(0, 1, 3000)  # "in" scores LOWER
    assert E.epsilon_from_gdp(a, b, delta=1e-5) == 0.0
    mu = E.gdp_mu_lower_bound(a, b, one_sided=False)
    assert 1.2 < mu < 1.5


def test_tpr_at_fpr_interpolates_on_the_hull():
    ins = np.array([5.0, 4.0, 3.0, 1.0])
    outs = np.array([4.5, 2.0, 0.0, -1.0])
    _, fpr, tpr = E.roc_hull(ins, outs)
    for f in (0.0, 0.1, 0.25, 0.6, 1.0):
        assert E.tpr_at_given_fpr(ins, outs, f) == pytest.approx(np.interp(f, fpr, tpr), abs=1e-12)
    np.testing.assert_allclose(E.tpr_at_given_fpr(ins, outs, [0.25, 0.6]), np.interp([0.25, 0.6], fpr, tpr))


def test_no_signal_gives_no_bound():
    rng = np.random.default_rng(0)
    ins, outs = rng.normal(0, 1, 2000), rng.normal(0, 1, 2000)
    assert E.epsilon_clopper_pearson(ins, outs, delta=1e-5) < 0.3
    assert E.epsilon_one_run(ins, outs, delta=1e-5) < 0.3
    assert E.attack_auroc(ins, outs) == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: E.epsilon_one_run([], [1.0], delta=1e-5), "in_scores"),
        (lambda: E.epsilon_one_run([[1.0]], [1.0], delta=1e-5), "in_scores"),
        (lambda: E.epsilon_one_run([1.0], [np.nan], delta=1e-5), "out_scores"),
        (lambda: E.epsilon_one_run([1.0], [0.0], delta=0.0), "delta"),
        (lambda: E.epsilon_one_run([1.0], [0.0], delta=1e-5, significance=1.0), "significance"),
        (lambda: E.epsilon_clopper_pearson([1.0], [0.0], significance=0.5), "significance"),
        (lambda: E.epsilon_from_gdp([1.0], [0.0], delta=2.0), "delta"),
        (lambda: E.tpr_at_given_fpr([1.0], [0.0], 1.5), "fpr"),
        (lambda: E.Split(fraction=1.0), "fraction"),
    ],
)
def test_bad_input_is_one_line_naming_the_parameter(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_unknown_threshold_strategy_is_a_type_error():
    with pytest.raises(TypeError, match="threshold_strategy"):
        E.epsilon_one_run([1.0], [0.0], delta=1e-5, threshold_strategy="bonferroni")
