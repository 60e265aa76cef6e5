"""Monte Carlo accounting: checked against closed forms, an independent deterministic
computation (lognormal-sum convolution), direct n-dimensional sampling, exact binomial bounds
and simulation of the sample-count formula."""

import functools
import math

import numpy as np
import pytest
from plan_helpers import build_event, check_run
from scipy.signal import fftconvolve
from scipy.stats import beta, binom, norm

from dpmf import account
from dpmf.accountants import (
    GaussianEvent,
    MixtureGaussianEvent,
    certified_delta,
    sample_privacy_losses,
    samples_needed,
)
from dpmf.accountants.montecarlo import delta_means
from dpmf.mechanisms import Factorization, factorize
from dpmf.mechanisms.structured import DenseLowerTriangular
from dpmf.workloads import prefix_sum

# ---------------------------------------------------------------------------------------------
# Independent truth for C = I: one epoch of balls-and-bins with b bins at noise σ.
# Under Q, S = (1/b) Σ_j exp(X_j), X_j ~ N(−μ²/2, μ²) i.i.d. (μ = 1/σ), and the loss is log S;
# δ_remove(ε) = E_Q[(S − e^ε)₊], δ_add(ε) = E_Q[(1 − e^ε S)₊].  The law of S is computed by
# discretizing each term on a grid (mass at the left or right end of its cell: lower/upper
# bounds) and convolving b copies.


@functools.lru_cache(maxsize=16)
def _lognormal_sum_pmf(sigma, b, h=2e-3, w_max=40.0, side="right"):
    mu = 1.0 / sigma
    edges = np.arange(0.0, w_max + h, h)
    # W = exp(X)/b  <=>  X = log(b W)
    with np.errstate(divide="ignore"):
        cdf = norm.cdf((np.log(b * edges) + mu**2 / 2) / mu)
    p = np.diff(cdf)
    p = np.append(p, 1.0 - cdf[-1])  # the tail, put at w_max (handled by the bound below)
    pmf = p
    for _ in range(b - 1):
        pmf = np.maximum(fftconvolve(pmf, p), 0.0)
    k = np.arange(pmf.shape[0])
    values = (k + (b if side == "right" else 0)) * h  # each of b terms rounded up (or down)
    # E[W 1{W > w_max}] per term (lognormal partial expectation), for the upper bound
    x = math.log(b * w_max)
    tail = norm.cdf((-x + mu**2 / 2) / mu) / b
    return values, pmf, b * tail


def _bnb_delta(sigma, b, eps):
    """(lower, upper) brackets of δ(ε) = max(δ_remove, δ_add) for one epoch, C = I."""
    out = []
    for side in ("left", "right"):
        s, p, tail = _lognormal_sum_pmf(sigma, b, side=side)
        d_rem = float(np.sum(p * np.maximum(s - math.exp(eps), 0.0)))
        d_add = float(np.sum(p * np.maximum(1.0 - math.exp(eps) * s, 0.0)))
        out.append((d_rem, d_add, tail))
    (lr, la, _), (ur, ua, tail) = out
    # remove is increasing in S (right end: upper), add is decreasing (left end: upper)
    return max(lr, ua), max(ur + tail, la)


def _bnb_epsilon(sigma, b, delta):
    from scipy.optimize import brentq

    lo = brentq(lambda e: _bnb_delta(sigma, b, e)[0] - delta, 0.0, 20.0)
    hi = brentq(lambda e: _bnb_delta(sigma, b, e)[1] - delta, 0.0, 20.0)
    return lo, hi


def test_independent_reference_reproduces_one_epoch_value():
    """One epoch, σ = 1, 10 bins, δ = 1e-5: ε ≈ 2.19 (the issue's reference)."""
    lo, hi = _bnb_epsilon(1.0, 10, 1e-5)
    assert hi - lo < 0.01
    assert abs(0.5 * (lo + hi) - 2.19) < 0.02


def test_epoch_balls_in_bins_one_epoch_matches_independent():
    """MC for per-epoch balls-and-bins (one epoch, σ = 1, 10 bins, δ = 1e-5) vs the convolution."""
    lo, hi = _bnb_epsilon(1.0, 10, 1e-5)
    r = account(
        "epoch_balls_in_bins",
        accountant="monte_carlo",
        noise_multiplier=1.0,
        dataset_size=1000,
        batch_size=100,
        steps=10,
        delta=1e-5,
        samples=2_000_000,
        seed=3,
        progress=False,
    )
    assert r.guarantee == "certified" and r.accountant == "monte_carlo"
    assert abs(r.epsilon_estimate - 0.5 * (lo + hi)) < 0.08
    assert r.epsilon >= r.epsilon_estimate
    assert r.epsilon >= lo - 0.01  # certified: not below the truth (99% confidence)
    assert r.confidence == 0.99 and r.samples == 2_000_000 and r.seed == 3


def test_fixed_bins_identity_equals_one_epoch_at_reduced_noise():
    """Fixed bins with C = I, k epochs: v_j = x_j are orthogonal with norm √k, so the pair is
    one-epoch balls-and-bins at σ/√k. Compare δ(ε) with the convolution at σ/√k."""
    k, b, sigma, eps = 3, 8, 2.4, 1.0
    run = check_run("balls_in_bins", 800, 100, k * b)
    event, info = build_event(run, sigma)
    assert info["sensitivity"] == 1.0
    np.testing.assert_allclose(event.gram, k * np.eye(b))
    lo, hi = _bnb_delta(sigma / math.sqrt(k), b, eps)
    m = 400_000
    mr, ma = delta_means(event, [1.0], eps, m, seed=5, progress=False)
    est = max(mr[0], ma[0])
    sd = math.sqrt(est / m)
    assert lo - 5 * sd <= est <= hi + 5 * sd
    s = sample_privacy_losses(event, m, seed=5, progress=False)
    assert s.delta_certified(eps) >= lo


def _composed_delta(sigma, b, epochs, eps, h=2e-3):
    """δ of `epochs` independent one-epoch pairs, from the convolution, on a loss grid.
    Returns an estimate (mid-point rounding) with no rigorous bracket."""
    s, p, _ = _lognormal_sum_pmf(sigma, b, side="left")
    s = s + b * h / 2
    keep = p > 0
    loss = np.log(s[keep])
    grid = 1e-3
    idx = np.round(loss / grid).astype(int)
    off = idx.min()
    q = np.bincount(idx - off, weights=p[keep])
    total, offset = q, off
    for _ in range(epochs - 1):
        total = np.maximum(fftconvolve(total, q), 0.0)
        offset += off
    L = (np.arange(total.shape[0]) + offset) * grid
    d_rem = np.sum(total * np.maximum(np.exp(L) - math.exp(eps), 0.0))
    d_add = np.sum(total * np.maximum(1.0 - np.exp(eps + L), 0.0))
    return max(d_rem, d_add)


def test_epoch_balls_in_bins_epochs_compose():
    """Per-epoch bins for 3 epochs: MC δ(ε) agrees with composing the convolution's PLD."""
    sigma, b, epochs, eps = 1.5, 6, 3, 1.0
    ref = _composed_delta(sigma, b, epochs, eps)
    run = check_run("epoch_balls_in_bins", 600, 100, epochs * b)
    event, _ = build_event(run, sigma)
    m = 400_000
    mr, ma = delta_means(event, [1.0], eps, m, seed=11, progress=False)
    est = max(mr[0], ma[0])
    assert abs(est - ref) <= 5 * math.sqrt(ref / m) + 0.02 * ref


def test_gaussian_event_matches_closed_form():
    """A Gaussian event sampled by MC (b = 1) against δ(ε) of N(μ, 1) vs N(0, 1)."""
    mu = 1.0
    event = GaussianEvent(2.0, 4)  # μ = √4/2 = 1
    eps = 0.5
    exact = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    m = 300_000
    s = sample_privacy_losses(event, m, seed=2, progress=False)
    sd = math.sqrt(exact * (1 - exact) / m)
    assert abs(s.delta_estimate(eps) - exact) < 5 * sd
    assert s.delta_certified(eps) >= exact
    assert s.delta_certified(eps) >= s.delta_estimate(eps)


def test_gram_reduction_matches_direct_sampling():
    """The b-dimensional sampler agrees with sampling y ∈ ℝⁿ directly and evaluating the
    mixture densities (small banded C, n = 12, 4 bins, 3 epochs)."""
    n, b, sigma, eps = 12, 4, 1.3, 0.6
    f = factorize(prefix_sum(n), "bsr:3")
    run = check_run("balls_in_bins", 400, 100, n, f)
    event, info = build_event(run, sigma)
    C = f.C.dense() / info["sensitivity"]
    X = np.zeros((n, b))
    X[np.arange(n), np.arange(n) % b] = 1.0
    V = C @ X  # columns v_j
    rng = np.random.default_rng(0)
    m = 200_000
    j = rng.integers(0, b, size=m)
    z = rng.standard_normal((m, n)) * sigma

    def loss(y):
        a = (y @ V - 0.5 * np.sum(V**2, axis=0)) / sigma**2
        return np.log(np.mean(np.exp(a), axis=1))

    l_rem = loss(V[:, j].T + z)
    l_add = -loss(z)
    direct = [np.mean(np.maximum(1 - np.exp(eps - x), 0.0)) for x in (l_rem, l_add)]
    mr, ma = delta_means(event, [1.0], eps, m, seed=1, progress=False)
    for d, e in zip(direct, (mr[0], ma[0]), strict=True):
        assert abs(d - e) < 5 * math.sqrt(d / m) * 1.5 + 1e-4


def test_certified_delta_dominates_clopper_pearson_and_estimate():
    """For 0/1 outcomes the bound is at least the exact Clopper–Pearson upper limit."""
    for m, k in [(1000, 0), (1000, 3), (10**6, 12), (500, 250)]:
        ub = certified_delta(k / m, m, 0.99)
        cp = beta.ppf(0.99, k + 1, m - k) if k < m else 1.0
        assert ub >= cp - 1e-12
        assert ub >= k / m
    assert certified_delta(0.0, 1000, 0.99) == pytest.approx(1 - 0.01 ** (1 / 1000))


def test_certified_delta_coverage_by_simulation():
    """P(true mean > certified bound) ≤ α, simulated with Bernoulli outcomes."""
    rng = np.random.default_rng(7)
    p, m, alpha = 2e-3, 20_000, 0.05
    k = rng.binomial(m, p, size=4000)
    bounds = np.array([certified_delta(x / m, m, 1 - alpha) for x in k])
    assert np.mean(bounds < p) <= alpha
    assert np.all(bounds >= k / m)


def test_samples_needed_by_simulation():
    """At m = samples_needed(δ_t, ratio, confidence, power), runs whose true δ is ratio·δ_t
    certify δ_t with probability ≥ power; with 4× fewer samples they mostly do not."""
    dt, ratio, conf, power = 1e-3, 0.5, 0.99, 0.9
    m = samples_needed(dt, ratio=ratio, confidence=conf, power=power)
    rng = np.random.default_rng(3)

    def success(mm):
        k = rng.binomial(mm, ratio * dt, size=3000)
        return np.mean([certified_delta(x / mm, mm, conf) <= dt for x in k])

    assert success(m) >= power
    assert success(m // 4) < 0.5
    # ratio = 0: the minimum, ln(1/α)/(−ln(1 − δ)), which certifies only with zero hits
    m0 = samples_needed(dt, ratio=0.0, confidence=conf)
    assert certified_delta(0.0, m0, conf) <= dt < certified_delta(0.0, m0 - 1, conf)
    # the expected count at the target grows like 1/δ
    assert samples_needed(1e-5) == pytest.approx(100 * samples_needed(1e-3), rel=0.05)


def test_binomial_tail_used_by_samples_needed():
    """Chernoff bound behind samples_needed is valid: binomial upper tail ≤ its bound."""
    from dpmf.accountants import kl_bernoulli

    m, p, d = 50_000, 1e-3, 1.6e-3
    tail = binom.sf(math.floor(d * m), m, p)
    assert tail <= math.exp(-m * kl_bernoulli(d, p))


def test_balls_in_bins_reproducible_and_seeded():
    f = factorize(prefix_sum(40), "bisr:4")
    kw = dict(
        noise_multiplier=0.8,
        dataset_size=1000,
        batch_size=100,
        steps=40,
        delta=1e-3,
        factorization=f,
        samples=50_000,
        progress=False,
    )
    a = account("balls_in_bins", seed=1, **kw)
    b = account("balls_in_bins", seed=1, **kw)
    c = account("balls_in_bins", seed=2, **kw)
    assert a.epsilon == b.epsilon and a.epsilon != c.epsilon
    assert a.epsilon >= a.epsilon_estimate >= 0
    assert a.details["bins"] == 10 and a.details["participations"] == 4
    # never worse than no amplification by more than the Monte Carlo slack: the Gaussian bound
    gauss = account(
        "fixed_order",
        noise_multiplier=0.8,
        dataset_size=1000,
        batch_size=100,
        steps=40,
        delta=1e-3,
        factorization=f,
    )
    assert a.epsilon_estimate <= gauss.epsilon * gauss.sensitivity / a.sensitivity + 1e-9


def test_balls_in_bins_rejects_negative_gram():
    M = np.array([[1.0, 0.0, 0.0], [-0.9, 1.0, 0.0], [0.0, -0.9, 1.0]])
    C = DenseLowerTriangular(M)
    f = Factorization("sqrt", None, prefix_sum(3), C, C.inverse())
    with pytest.raises(ValueError, match="CᵀC"):
        account(
            "balls_in_bins",
            noise_multiplier=1.0,
            dataset_size=30,
            batch_size=10,
            steps=3,
            delta=1e-3,
            factorization=f,
            samples=1000,
        )


def test_too_few_samples_is_a_clear_error():
    with pytest.raises(ValueError, match="samples=1000 is too few"):
        account(
            "epoch_balls_in_bins",
            accountant="monte_carlo",
            noise_multiplier=1.0,
            dataset_size=100,
            batch_size=10,
            steps=10,
            delta=1e-5,
            samples=1000,
        )


def test_mixture_event_validation():
    with pytest.raises(ValueError, match="gram"):
        MixtureGaussianEvent(1.0, np.array([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="noise_multiplier"):
        MixtureGaussianEvent(0.0, np.eye(2))


def test_threaded_chunks_give_the_same_numbers_as_one_thread(monkeypatch):
    """Chunks run on several cores but each has its own stream and they are summed in order."""
    import os

    from dpmf.accountants import montecarlo

    ev = MixtureGaussianEvent(1.3, np.array([[1.0, 0.4, 0.0], [0.4, 1.0, 0.4], [0.0, 0.4, 1.0]]), 2)
    scales = np.array([0.9, 1.0, 1.2])
    many = montecarlo.delta_means(ev, scales, 1.0, 3_000_000, seed=3, progress=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    one = montecarlo.delta_means(ev, scales, 1.0, 3_000_000, seed=3, progress=False)
    np.testing.assert_array_equal(many[0], one[0])
    np.testing.assert_array_equal(many[1], one[1])
