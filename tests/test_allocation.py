"""Deterministic random-allocation (balls-in-bins) accounting against independent references.

References: the analytic Gaussian mechanism (one bin), a one-dimensional quadrature of the
exact hockey-stick divergences for two bins (the inner integral in closed form), the certified
Monte Carlo sampler of ``dpmf.accountants.montecarlo`` (a lower confidence bound on δ), and
dp-accounting's Poisson-subsampling PLD at the same rate.
"""

import math

import numpy as np
import pytest
from plan_helpers import build_event, check_run
from scipy import integrate
from scipy.stats import norm

from dpmf.accountants import (
    ComposedEvent,
    GaussianEvent,
    MixtureGaussianEvent,
    PLDAccountant,
    PoissonGaussianEvent,
    gaussian_epsilon,
    gaussian_mu,
)
from dpmf.accountants.allocation import (
    AllocationPLDAccountant,
    calibrate_allocation,
    independent_classes,
    is_orthogonal_mixture,
)
from dpmf.accountants.montecarlo import kl_bernoulli, sample_privacy_losses
from dpmf.mechanisms import factorize
from dpmf.workloads import prefix_sum

ACC = AllocationPLDAccountant()


def _delta_lower(mean: float, samples: int, confidence: float = 0.99) -> float:
    """The lower confidence bound on a [0, 1] mean: min{p ≤ mean : kl(mean‖p) ≤ ln(1/α)/m}."""
    level = math.log(1.0 / (1.0 - confidence)) / samples
    lo, hi = 0.0, mean
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if kl_bernoulli(mean, mid) <= level:
            hi = mid
        else:
            lo = mid
    return lo


def _two_bin_deltas(sigma: float, epsilon: float) -> tuple[float, float]:
    """Exact (remove, add) δ(ε) of one epoch with b = 2 bins, by quadrature over z₁.

    L = (X₁ + X₂)/2 with X = exp(μz − μ²/2): δ_R = E[(L − e^ε)₊], δ_A = E[(1 − e^ε L)₊]. Given
    X₁ the expectation over X₂ is a Black–Scholes call / put on a log-normal with mean 1.
    """
    mu = 1.0 / sigma

    def call(k):  # E[(X - k)+]
        if k <= 0:
            return 1.0 - k
        d1 = (-math.log(k) + mu * mu / 2) / mu
        return norm.cdf(d1) - k * norm.cdf(d1 - mu)

    def put(k):  # E[(k - X)+]
        if k <= 0:
            return 0.0
        d1 = (-math.log(k) + mu * mu / 2) / mu
        return k * norm.cdf(-(d1 - mu)) - norm.cdf(-d1)

    def x1(z):
        return math.exp(mu * z - mu * mu / 2)

    rem = integrate.quad(
        lambda z: norm.pdf(z) * 0.5 * call(2 * math.exp(epsilon) - x1(z)),
        -12,
        12,
        points=[(math.log(2 * math.exp(epsilon)) + mu * mu / 2) / mu],
        epsabs=1e-15,
        epsrel=1e-10,
        limit=400,
    )[0]
    add = integrate.quad(
        lambda z: norm.pdf(z) * math.exp(epsilon) / 2 * put(2 * math.exp(-epsilon) - x1(z)),
        -12,
        12,
        points=[(math.log(2 * math.exp(-epsilon)) + mu * mu / 2) / mu],
        epsabs=1e-15,
        epsrel=1e-10,
        limit=400,
    )[0]
    return rem, add


def test_one_bin_general_path_matches_the_gaussian_mechanism():
    # b = 1: the mixture is one Gaussian with μ = 1/σ; the discretized PLD must bound it
    for sigma in (1.0, 2.0, 4.0):
        event = MixtureGaussianEvent(sigma, np.eye(1), 1)
        eps = float(ACC.pld(event, tail=1e-11).get_epsilon_for_delta(1e-5))
        exact = gaussian_epsilon(1.0 / sigma, 1e-5)
        assert exact <= eps <= exact + 0.02
        # the accountant reports the smaller valid bound: here the exact Gaussian one
        assert ACC.epsilon(event, 1e-5).epsilon == pytest.approx(exact, rel=1e-12)


def test_two_bins_bound_the_exact_quadrature_tightly():
    for sigma in (0.7, 1.5):
        pld = ACC.pld(MixtureGaussianEvent(sigma, np.eye(2), 1), tail=1e-13)
        for eps in (0.0, 0.5, 1.5):
            rem, add = _two_bin_deltas(sigma, eps)
            exact = max(rem, add)
            ours = float(pld.get_delta_for_epsilon(eps))
            assert ours >= exact * (1 - 1e-9)
            assert ours <= exact * 1.01 + 1e-10


def test_two_bins_are_more_private_than_one_bin_but_not_free():
    # amplification: ε(b = 2) < ε(b = 1) at the same σ
    e1 = gaussian_epsilon(1.0, 1e-5)
    e2 = ACC.epsilon(MixtureGaussianEvent(1.0, np.eye(2), 1), 1e-5).epsilon
    assert 0.0 < e2 < e1


@pytest.mark.parametrize(
    "sigma,bins,epochs",
    [(0.8, 4, 1), (1.0, 8, 3), (0.7, 16, 2), (1.5, 32, 4)],
)
def test_never_below_the_monte_carlo_lower_confidence_bound(sigma, bins, epochs):
    delta = 1e-3
    event = MixtureGaussianEvent(sigma, np.eye(bins), epochs)
    eps = ACC.epsilon(event, delta).epsilon
    m = 250_000
    sample = sample_privacy_losses(event, m, seed=7, progress=False)
    # at our ε, the Monte Carlo δ (its 99% lower confidence bound) must not exceed δ
    est = sample.delta_estimate(eps)
    assert _delta_lower(est, m) <= delta
    # and the bound is tight: the point estimate of ε is within 3% of ours
    assert sample.epsilon_estimate(delta) == pytest.approx(eps, rel=0.03)


@pytest.mark.parametrize(
    "sigma,bins,epochs,delta",
    [(0.8, 235, 10, 1e-5), (1.0, 50, 5, 1e-8), (1.5, 16, 3, 1e-5), (2.0, 8, 2, 1e-8)],
)
def test_at_most_the_poisson_pld_at_the_same_rate(sigma, bins, epochs, delta):
    ours = ACC.epsilon(MixtureGaussianEvent(sigma, np.eye(bins), epochs), delta).epsilon
    poisson = PLDAccountant().epsilon(PoissonGaussianEvent(sigma, 1.0 / bins, bins * epochs), delta)
    assert ours <= poisson.epsilon


def test_epsilon_decreases_with_the_noise():
    eps = [ACC.epsilon(MixtureGaussianEvent(s, np.eye(20), 3), 1e-6).epsilon for s in (0.8, 1.0, 1.3, 2.0)]
    assert all(a > b for a, b in zip(eps, eps[1:], strict=False))


def test_delta_query_is_consistent_with_the_epsilon_query():
    event = MixtureGaussianEvent(1.2, np.eye(30), 4)
    eps = ACC.epsilon(event, 1e-6).epsilon
    d = ACC.delta(event, eps)
    assert d.guarantee == "upper_bound" and d.accountant == "allocation_pld"
    assert d.delta <= 1.05e-6
    assert ACC.delta(event, eps * 0.9).delta > 1e-6


def test_scheme_events_partial_epochs_and_compositions():
    # 2.5 epochs of 10 bins: a composed event with a partial last epoch (empty bins)
    run = check_run("epoch_balls_in_bins", 100, 10, 25)
    event, _ = build_event(run, 1.0)
    assert isinstance(event, ComposedEvent)
    assert ACC.supports(event)
    e_partial = ACC.epsilon(event, 1e-5).epsilon
    e2 = ACC.epsilon(MixtureGaussianEvent(1.0, np.eye(10), 2), 1e-5).epsilon
    e3 = ACC.epsilon(MixtureGaussianEvent(1.0, np.eye(10), 3), 1e-5).epsilon
    assert e2 < e_partial < e3
    # a Gaussian release composed with an epoch is bounded by both parts' sum of costs
    mixed = ComposedEvent((MixtureGaussianEvent(1.0, np.eye(10), 2), GaussianEvent(5.0)))
    assert e2 < ACC.epsilon(mixed, 1e-5).epsilon < e2 + gaussian_epsilon(0.2, 1e-6) + 0.3
    # fixed bins for C = I: G = diag(participations) is orthogonal too
    fixed, _ = build_event(check_run("balls_in_bins", 100, 10, 25), 1.0)
    assert is_orthogonal_mixture(fixed) and ACC.supports(fixed)
    e_fixed = ACC.epsilon(fixed, 1e-5).epsilon
    # the same bin in every epoch is less private than a fresh bin each epoch
    assert e_fixed > e_partial


def _banded_event(dataset_size, batch_size, steps, spec, sigma):
    f = factorize(prefix_sum(steps), spec)
    return build_event(check_run("balls_in_bins", dataset_size, batch_size, steps, f), sigma)[0]


def test_classes_of_a_banded_strategy_are_uncorrelated_and_cover_the_bins():
    event = _banded_event(60, 4, 45, "bsr:3", 1.0)  # 15 bins, 3 epochs, bands 3
    G = event.gram
    classes = independent_classes(G)
    assert sorted(np.concatenate(classes).tolist()) == list(range(15))
    for members in classes:
        sub = G[np.ix_(members, members)]
        assert not np.any(sub - np.diag(np.diag(sub)))
    # bands 3 reach 2 bins either way (across the epoch boundary too): 15 // 3 = 5 per class
    assert [m.size for m in classes] == [5, 5, 5]
    # diagonal: one class; all bins correlated: singletons
    assert len(independent_classes(np.eye(7))) == 1
    assert len(independent_classes(np.ones((6, 6)) + np.eye(6))) == 6


@pytest.mark.parametrize(
    "dataset_size,steps,spec,sigma",
    [(64, 48, "bsr:2", 2.0), (96, 48, "bsr:3", 2.5), (64, 32, "bsr:2", 1.5)],
)
def test_banded_strategies_never_below_the_monte_carlo_lower_confidence_bound(
    dataset_size, steps, spec, sigma
):
    delta = 1e-3
    event = _banded_event(dataset_size, 4, steps, spec, sigma)
    eps = ACC.epsilon(event, delta).epsilon
    m = 300_000
    sample = sample_privacy_losses(event, m, seed=11, progress=False)
    assert _delta_lower(sample.delta_estimate(eps), m) <= delta
    # a valid but looser bound than the sampled value: within 25% of it (about 20% seen),
    # and far below the Gaussian bound without amplification
    est = sample.epsilon_estimate(delta)
    assert est <= eps <= 1.25 * est
    assert eps < 0.5 * gaussian_epsilon(event.max_norm / sigma, delta)


def test_correlated_bins_and_other_events_are_refused_by_name():
    gram = np.array([[1.0, 0.5], [0.5, 1.0]])
    event = MixtureGaussianEvent(1.0, gram, 1)
    assert not ACC.supports(event)
    with pytest.raises(ValueError, match="monte_carlo"):
        ACC.epsilon(event, 1e-5)
    with pytest.raises(ValueError, match="PoissonGaussianEvent"):
        ACC.epsilon(PoissonGaussianEvent(1.0, 0.1, 10), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        ACC.epsilon(MixtureGaussianEvent(1.0, np.eye(3), 1), 1.5)
    with pytest.raises(ValueError, match="resolution"):
        AllocationPLDAccountant(resolution=0.0)


def test_calibration_meets_the_target_and_beats_poisson_sampling():
    event1 = MixtureGaussianEvent(1.0, np.eye(50), 5)
    sigma, meas, details = calibrate_allocation(event1, 2.0, 1e-5, rtol=1e-3)
    assert meas.epsilon <= 2.0
    assert ACC.epsilon(MixtureGaussianEvent(sigma, np.eye(50), 5), 1e-5).epsilon <= 2.0
    # 1% less noise no longer meets it (within the search tolerance and grid pessimism)
    assert ACC.epsilon(MixtureGaussianEvent(sigma * 0.99, np.eye(50), 5), 1e-5).epsilon > 2.0
    # Poisson sampling at q = 1/b needs more noise for the same target
    poisson = PLDAccountant().epsilon(PoissonGaussianEvent(sigma, 1 / 50, 250), 1e-5).epsilon
    assert poisson > 2.0
    assert details["evaluations"] >= 2


@pytest.mark.slow
def test_calibration_of_ten_epochs_of_the_reference_run():
    # N = 60000, B = 256 (235 bins), 10 epochs, ε = 3, δ = 1e-5
    event1, _ = build_event(check_run("epoch_balls_in_bins", 60000, 256, 2350), 1.0)
    sigma, meas, _ = calibrate_allocation(event1, 3.0, 1e-5)
    assert meas.epsilon <= 3.0
    # dp-accounting's Poisson PLD at q = 1/235 is above the target at this σ
    poisson = PLDAccountant().epsilon(PoissonGaussianEvent(sigma, 1 / 235, 2350), 1e-5).epsilon
    assert poisson > 3.0
    assert 0.6 < sigma < 0.7


@pytest.mark.slow
def test_calibration_of_the_reference_banded_run():
    # N = 60000, B = 256, 10 epochs, bsr:16 under fixed bins: 14 or 11 bins per class
    event1 = _banded_event(60000, 256, 2350, "bsr:16", 1.0)
    assert sorted({m.size for m in independent_classes(event1.gram)}) == [11, 14]
    sigma, meas, _ = calibrate_allocation(event1, 3.0, 1e-5)
    assert meas.epsilon <= 3.0
    gauss = event1.max_norm / gaussian_mu(3.0, 1e-5)
    # between the certified Monte Carlo answer (2.1654) and the Gaussian bound (4.40)
    assert 2.1654 < sigma < 0.65 * gauss


def test_the_generic_monotone_search_of_the_api_works_with_this_accountant():
    # the calibration contract: ε(σ) non-increasing, events rescaled by calibration.rescaled
    from dpmf.accountants.calibration import _smallest_feasible
    from dpmf.accountants.calibration import rescaled as _rescaled

    event1 = MixtureGaussianEvent(1.0, np.eye(20), 3)
    acc = AllocationPLDAccountant(value_discretization_interval=1e-3, resolution=0.1)
    sigma, eps, evaluated = _smallest_feasible(
        lambda s: acc.epsilon(_rescaled(event1, s), 1e-5).epsilon, 2.0, 1.0, 1e-3
    )
    assert eps <= 2.0 and evaluated[sigma] == eps
    ours, _, _ = calibrate_allocation(event1, 2.0, 1e-5, accountant=acc)
    assert ours == pytest.approx(sigma, rel=5e-3)
