"""Mechanism-level audit (dpmf.audit.mechanism): the score is the likelihood ratio, the audit of
dpmf's accounting is tight (≥ 0.8× the claimed ε) without amplification, planted bugs are caught,
and correct runs are not flagged."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats

from dpmf.audit import mechanism as M
from dpmf.plan import schemes as S
from dpmf.plan.plan import PrivatePlan

DELTA = 1e-5


def _plan(strategy, scheme="fixed_order", epochs=4, **kw):
    return PrivatePlan(1000, 100, epochs=epochs, scheme=scheme, strategy=strategy, **kw)


def test_identity_precision_is_the_sum_of_projections_and_bsr_is_C_transpose_C():
    p = _plan("identity").with_noise(2.0)
    std = p.noise_std(1.0)
    np.testing.assert_allclose(M.precision_matrix(p, std), np.eye(p.steps) / std**2)
    # the identity's score ⟨Pv, ĝ⟩/√(vᵀPv) with v = 1_π is Σ_{t∈π} ĝ_t/(std·√|π|)
    v = np.zeros(p.steps)
    v[[3, 13, 23, 33]] = 1
    g = np.random.default_rng(0).normal(size=p.steps)
    P = M.precision_matrix(p, std)
    assert (P @ v) @ g / np.sqrt(v @ P @ v) == pytest.approx(g[v > 0].sum() / (std * 2), rel=1e-12)
    b = _plan("bsr:4").with_noise(2.0)
    C = b.strategy.C.dense()
    np.testing.assert_allclose(M.precision_matrix(b, 3.0), C.T @ C / 9.0, rtol=1e-12)


@pytest.mark.parametrize("strategy", ["identity", "bsr:4"])
def test_scores_are_unit_gaussians_shifted_by_the_claimed_mu(strategy):
    # "out" ~ N(0, 1) only if the noise is σζs·C⁻¹Z; "in" ~ N(μ, 1) with μ = ‖C1_π‖/(σs) = 1/σ
    p = _plan(strategy).with_noise(1.5)
    ins, outs, mu = M.mechanism_scores(p, runs=30, seed=3)
    assert mu == pytest.approx(1 / 1.5, rel=1e-9)  # the worst-case canary meets the sensitivity
    assert np.std(outs) == pytest.approx(1.0, abs=0.02)
    assert np.mean(outs) == pytest.approx(0.0, abs=0.03)
    assert np.mean(ins) == pytest.approx(mu, abs=0.03)


@pytest.mark.parametrize("strategy", ["identity", "bsr:4"])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_gdp_audit_is_tight_without_amplification(strategy, epsilon):
    # DP-SGD without amplification (fixed order, 4 participations) and bsr:4 in fixed order
    plan = _plan(strategy).calibrate(epsilon, DELTA)
    res = M.audit_mechanism(plan, delta=DELTA, runs=100, method="gdp", seed=1)
    assert res.claimed_epsilon == pytest.approx(epsilon, rel=1e-6)
    assert 0.8 * epsilon <= res.epsilon_lower_bound <= epsilon, res.tightness


def test_empirical_whitening_is_tight_too():
    plan = _plan("bsr:4").calibrate(4.0, DELTA)
    res = M.audit_mechanism(plan, delta=DELTA, runs=60, method="gdp", seed=2, score="empirical")
    assert 0.8 * 4.0 <= res.epsilon_lower_bound <= 4.0


# -- planted bugs: the audit's lower bound exceeds the claimed ε at α = 0.05 ------------------


def _flagged(plan, claimed=None, **kw):
    kw.setdefault("runs", 40)
    res = M.audit_mechanism(
        plan, delta=DELTA, method="gdp", significance=0.05, seed=5, claimed_epsilon=claimed, **kw
    )
    assert res.claimed_epsilon <= 8.0
    return res


def test_bug_half_sigma_is_caught(monkeypatch):
    plan = _plan("bsr:4").calibrate(4.0, DELTA)
    real = PrivatePlan.noise_std
    monkeypatch.setattr(PrivatePlan, "noise_std", lambda self, z: real(self, z) / 2)
    res = _flagged(plan)
    assert res.epsilon_lower_bound > res.claimed_epsilon


def test_bug_clipping_skipped_is_caught(monkeypatch):
    plan = _plan("identity").calibrate(4.0, DELTA)
    monkeypatch.setattr(M, "_clip", lambda norm, clip_norm: norm)  # the canary's gradient unclipped
    res = _flagged(plan, canary_norm=3.0)
    assert res.epsilon_lower_bound > res.claimed_epsilon


def test_bug_C_and_C_inverse_swapped_in_the_noise_is_caught(monkeypatch):
    # dense in fixed order: max_π ‖C⁻¹1_π‖ = 9.6·s, so noise C·Z instead of C⁻¹Z leaks; the
    # auditor whitens the noise it sees (score="empirical")
    plan = _plan("dense").calibrate(4.0, DELTA)
    ok = _flagged(plan, score="empirical", runs=10)
    assert ok.epsilon_lower_bound <= ok.claimed_epsilon
    monkeypatch.setattr(M, "_correlated_noise", lambda f, n, d, rng: f.C.matmul(rng.standard_normal((n, d))))
    res = _flagged(plan, score="empirical", runs=10)
    assert res.epsilon_lower_bound > res.claimed_epsilon


def test_bug_sensitivity_halved_is_caught(monkeypatch):
    plan = _plan("bsr:4").calibrate(4.0, DELTA)
    claimed = plan.account(delta=DELTA).epsilon
    s = plan.sensitivity
    monkeypatch.setattr(PrivatePlan, "sensitivity", property(lambda self: s / 2))
    res = _flagged(plan, claimed=claimed)
    assert res.epsilon_lower_bound > res.claimed_epsilon


def test_bug_fixed_order_accounted_as_poisson_is_caught(monkeypatch):
    # the fixed-order scheme's accounting replaced by Poisson's (q = B/N, sensitivity 1): the
    # batches stay fixed and public
    monkeypatch.setattr(S.FixedOrder, "event", lambda self, run, sigma: S.Poisson().event(run, sigma))
    plan = _plan("identity").with_noise(1.0)
    res = _flagged(plan)
    assert res.claimed_epsilon == pytest.approx(4.688, abs=0.01)  # Poisson's ε at σ = 1
    assert res.epsilon_lower_bound > res.claimed_epsilon


def test_bug_one_noise_draw_reused_for_two_steps_is_caught(monkeypatch):
    plan = _plan("bsr:4").calibrate(4.0, DELTA)
    real = M._correlated_noise

    def reused(f, n, d, rng):
        z = rng.standard_normal((n, d))
        z[1] = z[0]
        return f.C.inverse().matmul(z)

    monkeypatch.setattr(M, "_correlated_noise", reused)
    res = _flagged(plan, score="empirical")
    assert res.epsilon_lower_bound > res.claimed_epsilon
    monkeypatch.setattr(M, "_correlated_noise", real)
    assert _flagged(plan, score="empirical").epsilon_lower_bound <= 4.0


# -- correct runs are not flagged --------------------------------------------------------------

# amplified schemes: the exact likelihood-ratio score (the strongest single-canary attack) and
# Clopper–Pearson (valid for any trade-off curve); fixed order: the linear score and GDP
FALSE_ALARM_CONFIGS = [
    ("identity", "poisson", "clopper-pearson", None),
    ("bsr:4", "cyclic_poisson", "clopper-pearson", None),
    ("dense", "fixed_order", "gdp", None),
    pytest.param("blt:2", "balls_in_bins", "clopper-pearson", 3.0, marks=pytest.mark.slow),
]
_SCORE = {"clopper-pearson": "likelihood", "gdp": "strategy"}


@pytest.mark.parametrize("strategy, scheme, method, sigma", FALSE_ALARM_CONFIGS)
def test_correct_runs_are_not_flagged(strategy, scheme, method, sigma):
    plan = _plan(strategy, scheme=scheme)
    plan = plan.calibrate(2.0, DELTA) if sigma is None else plan.with_noise(sigma)
    claimed = plan.account(delta=DELTA).epsilon  # balls-in-bins: Monte Carlo, certified
    seeds = 20
    alarms = 0
    for seed in range(seeds):
        res = M.audit_mechanism(
            plan,
            delta=DELTA,
            runs=8,
            method=method,
            seed=100 + seed,
            claimed_epsilon=claimed,
            canaries="all",
            score=_SCORE[method],
        )
        alarms += res.epsilon_lower_bound > claimed
    # a valid audit at α = 0.05 alarms with probability ≤ 0.05 per seed
    assert scipy.stats.binomtest(alarms, seeds, 0.05, alternative="greater").pvalue > 0.01, alarms


@pytest.mark.parametrize("strategy", ["bsr:4", "blt:2", "bisr:4"])
def test_the_training_noise_generator_gives_the_claimed_privacy(strategy):
    # noise="stream": dpmf's streaming generator of the private step (BandedSqrtNoise, BLTNoise,
    # ToeplitzInverseNoise) instead of a triangular solve: out-scores N(0, 1), in-scores N(1/σ, 1)
    p = _plan(strategy).with_noise(1.5)
    ins, outs, mu = M.mechanism_scores(p, runs=40, seed=4, noise="stream")
    assert mu == pytest.approx(1 / 1.5, rel=1e-6)
    # four standard errors of each statistic (a wrong σ, C or sensitivity moves them by far more)
    assert np.std(outs) == pytest.approx(1.0, abs=4 / np.sqrt(2 * outs.size))
    assert np.mean(ins) == pytest.approx(mu, abs=4 / np.sqrt(ins.size))
    assert np.mean(outs) == pytest.approx(0.0, abs=4 / np.sqrt(outs.size))


def test_likelihood_score_closed_forms():
    # Poisson, C = I: Σ_t log(1 − q + q·exp(c·ĝ_t/std² − c²/(2std²)))
    p = _plan("identity", scheme="poisson").with_noise(2.0)
    std = p.noise_std(1.0)
    P = M.precision_matrix(p, std)
    g = np.random.default_rng(1).normal(0, std, size=(p.steps, 3))
    q = p.sampling_rate
    got = M.likelihood_scores(p, None, g, np.ones_like(g, dtype=bool), 1.0, P)
    want = np.log(1 - q + q * np.exp(g / std**2 - 1 / (2 * std**2))).sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-10)
    # balls-in-bins: log of the mean over bins of the Gaussian likelihood ratios
    b = _plan("blt:2", scheme="balls_in_bins").with_noise(3.0)
    std = b.noise_std(1.0)
    P = M.precision_matrix(b, std)
    g = np.random.default_rng(2).normal(0, std, size=(b.steps, 2))
    bins = b.steps_per_epoch
    want = []
    for k in range(2):
        lr = [np.exp(P[:, j::bins].sum(1) @ g[:, k] - P[j::bins][:, j::bins].sum() / 2) for j in range(bins)]
        want.append(np.log(np.mean(lr)))
    got = M.likelihood_scores(b, None, g, np.ones_like(g, dtype=bool), 1.0, P)
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_likelihood_score_is_stronger_than_the_linear_one_under_poisson():
    plan = _plan("identity", scheme="poisson").calibrate(2.0, DELTA)
    kw = dict(delta=DELTA, runs=60, method="clopper-pearson", seed=3, canaries="all", claimed_epsilon=2.0)
    lin = M.audit_mechanism(plan, score="strategy", **kw)
    lik = M.audit_mechanism(plan, score="likelihood", **kw)
    assert lik.auroc > lin.auroc and lik.epsilon_lower_bound > lin.epsilon_lower_bound
    assert lik.epsilon_lower_bound <= 2.0


# -- a threshold fixed by the claim (pre-registered), for the Clopper–Pearson test -----------------


def test_claim_threshold_maximises_the_expected_bound_and_keeps_the_level():
    from scipy import stats as st

    from dpmf.audit import estimators as E
    from dpmf.audit.mechanism import claim_threshold

    mu, n, delta = 1.0, 5_000, 1e-5
    tau = claim_threshold(mu, n, n, delta=delta)

    def expected_bound(t):  # brute force at the expected counts, scipy's beta quantiles
        tp, fp = round(n * st.norm.sf(t - mu)), round(n * st.norm.sf(t))
        lb = st.beta.ppf(0.025, tp, n - tp + 1)
        ub = st.beta.ppf(0.975, fp + 1, n - fp)
        return np.log(lb - delta) - np.log(ub)

    grid = np.linspace(0.5, 4.0, 351)
    assert expected_bound(tau) >= max(expected_bound(t) for t in grid) - 0.01  # counts are rounded
    assert 1.5 < tau < 3.5
    # the claim met exactly (in ~ N(μ, 1), out ~ N(0, 1)): the pre-registered test's bound
    # exceeds the claimed ε in at most α of 100 draws (binomial test at 0.05)
    from scipy.optimize import brentq

    def gdp_delta(e):  # δ(ε) of μ-GDP (Dong, Roth & Su 2022, Corollary 2.13)
        return st.norm.cdf(-e / mu + mu / 2) - np.exp(e) * st.norm.cdf(-e / mu - mu / 2) - delta

    eps_claim = brentq(gdp_delta, 0.01, 20)  # the true ε of the scores' mechanism at δ
    rng = np.random.default_rng(0)
    flags = sum(
        E.epsilon_clopper_pearson(
            rng.normal(mu, 1, n), rng.normal(0, 1, n), delta=delta, threshold_strategy=E.Explicit(tau)
        )
        > eps_claim
        for _ in range(100)
    )
    assert st.binom.sf(flags - 1, 100, 0.05) >= 0.05
    with pytest.raises(ValueError, match="mu"):
        claim_threshold(0.0, n, n, delta=delta)


def test_repeats_are_more_canaries_of_the_same_mechanism():
    # k canaries per example and draw: k times the trials, each "out" N(0, 1) and "in" N(μ, 1)
    p = _plan("bsr:4").with_noise(1.5)
    one_in, one_out, _ = M.mechanism_scores(p, runs=10, seed=3)
    ins, outs, mu = M.mechanism_scores(p, runs=10, seed=3, repeats=6)
    assert ins.size + outs.size == 6 * (one_in.size + one_out.size)
    assert mu == pytest.approx(1 / 1.5, rel=1e-9)
    assert np.std(outs) == pytest.approx(1.0, abs=0.02) and np.mean(outs) == pytest.approx(0.0, abs=0.03)
    assert np.mean(ins) == pytest.approx(mu, abs=0.03) and np.std(ins) == pytest.approx(1.0, abs=0.02)
    with pytest.raises(ValueError, match="repeats=0 is invalid"):
        M.mechanism_scores(p, runs=1, repeats=0)


def test_claim_threshold_audit_is_clopper_pearson_at_the_claims_threshold():
    from dpmf.audit import estimators as E

    plan = _plan("identity").calibrate(4.0, DELTA)
    res = M.audit_mechanism(
        plan, delta=DELTA, runs=20, method="clopper-pearson", threshold="claim", seed=4, repeats=2
    )
    ins, outs = res.in_scores, res.out_scores
    tau = M.claim_threshold(res.mu_claimed, ins.size, outs.size, delta=DELTA)
    want = E.epsilon_clopper_pearson(ins, outs, delta=DELTA, threshold_strategy=E.Explicit(tau))
    assert res.epsilon_lower_bound == want
    # by hand at τ: log((TPR_lb − δ)/FPR_ub), one-sided Clopper–Pearson at α/2 each
    tp, fp = int((ins >= tau).sum()), int((outs >= tau).sum())
    tpr_lb = scipy.stats.beta.ppf(0.025, tp, ins.size - tp + 1)
    fpr_ub = scipy.stats.beta.ppf(0.975, fp + 1, outs.size - fp)
    assert want == pytest.approx(max(0.0, np.log((tpr_lb - DELTA) / fpr_ub)), rel=1e-9)
    for kw in (dict(method="gdp"), dict(method="clopper-pearson", score="empirical"), dict(method="x")):
        with pytest.raises(ValueError, match="invalid"):
            M.audit_mechanism(plan, delta=DELTA, runs=1, threshold="claim", **kw)
    with pytest.raises(ValueError, match="threshold='best' is invalid"):
        M.audit_mechanism(plan, delta=DELTA, runs=1, method="clopper-pearson", threshold="best")


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_clopper_pearson_at_the_claims_threshold_reaches_0_8_with_3e7_canaries(epsilon):
    # the counts at the claim's threshold are binomial: over 2000 draws of them (each side
    # 1.5·10⁷ canaries, the scores N(0, 1) and N(μ, 1) of a claim met exactly, as in
    # test_scores_are_unit_gaussians_shifted_by_the_claimed_mu), the bound stays ≥ 0.8·ε;
    # with 10⁷ canaries it falls below in 4–8 % of the draws (the few "out" canaries above τ)
    from scipy.stats import beta, norm

    plan = _plan("identity").calibrate(epsilon, DELTA)
    mu = 1 / plan.noise_multiplier
    rng = np.random.default_rng(0)
    low = {}
    for n in (5_000_000, 15_000_000):
        tau = M.claim_threshold(mu, n, n, delta=DELTA)
        tp = rng.binomial(n, norm.sf(tau - mu), 2000)
        fp = rng.binomial(n, norm.sf(tau), 2000)
        bound = np.log((beta.ppf(0.025, tp, n - tp + 1) - DELTA) / beta.ppf(0.975, fp + 1, n - fp))
        assert np.mean(bound > epsilon) <= 0.05  # the test's level: the claim holds exactly
        low[n] = float(np.mean(bound < 0.8 * epsilon))
    assert low[15_000_000] < 0.005 and 0.01 < low[5_000_000] < 0.15, low
