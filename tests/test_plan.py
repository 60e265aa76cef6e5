"""PrivatePlan and the scheme registry: one object per run, checked against dp-accounting
events built by hand, closed forms, and schemes and strategies registered by the test."""

import math
from dataclasses import dataclass
from typing import ClassVar

import dp_accounting
import numpy as np
import pytest

from dpmf.accountants import GaussianEvent, gaussian_epsilon
from dpmf.mechanisms import STRATEGIES, Strategy, evaluate, factorize, register_strategy
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.plan import SCHEMES, PrivatePlan, Scheme, account, calibrate, register_scheme
from dpmf.plan.schemes import EventInfo
from dpmf.workloads import Schedule, prefix_sum


def _pld_epsilon(event, delta):
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def test_poisson_plan_equals_a_hand_built_dp_accounting_event():
    plan = PrivatePlan(10_000, 100, steps=1000)
    ref = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 1000
    )
    assert plan.to_dp_event(1.0) == ref
    assert plan.sampling_rate == 0.01 and plan.sensitivity == 1.0 and plan.expected_batch_size == 100
    assert math.isclose(account(plan, 1.0, delta=1e-5).epsilon, 1.828244, abs_tol=1e-5)


def test_cyclic_poisson_plan_is_dpsgd_with_fewer_steps_at_a_higher_rate():
    plan = PrivatePlan(1000, 10, steps=40, scheme="cyclic_poisson", strategy="bsr:4")
    assert plan.bands == 4 and plan.sampling_rate == pytest.approx(0.04)
    ref = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.04, dp_accounting.GaussianDpEvent(1.3)), 10
    )
    assert plan.to_dp_event(1.3) == ref
    assert account(plan, 1.3, delta=1e-5).epsilon == pytest.approx(_pld_epsilon(ref, 1e-5), rel=1e-6)
    # its sampler separates an example's participations by at least 4 steps
    seen = {}
    sampler = plan.sampler(7)
    for t, idx in enumerate(sampler.next() for _ in range(plan.steps)):
        for i in idx.tolist():
            assert t - seen.get(i, -10) >= 4
            seen[i] = t


def test_fixed_order_sensitivity_and_gaussian_closed_form():
    plan = PrivatePlan(80, 10, epochs=3, scheme="fixed_order", strategy="bisr:4")
    assert plan.steps == 24 and plan.participation.label.startswith("fixed_epochs")
    C = plan.strategy.C.dense()
    X = C.T @ C  # CᵀC ≥ 0 here, so sens² = max over classes of Σ (CᵀC)_ij
    s2 = max(X[np.ix_(range(c, 24, 8), range(c, 24, 8))].sum() for c in range(8))
    assert plan.sensitivity == pytest.approx(math.sqrt(s2), rel=1e-12)
    assert account(plan, 2.0, delta=1e-5).epsilon == pytest.approx(gaussian_epsilon(0.5, 1e-5), rel=1e-9)


def test_balls_in_bins_has_no_dp_accounting_event():
    plan = PrivatePlan(400, 100, steps=8, scheme="balls_in_bins", strategy="bsr:2")
    with pytest.raises(ValueError, match="balls_in_bins.*monte_carlo"):
        plan.to_dp_event(1.0)


def test_calibrate_returns_a_plan_with_its_noise_and_epsilon_after():
    plan = PrivatePlan(10_000, 100, steps=200).calibrate(2.0, 1e-5)
    assert plan.privacy.epsilon <= 2.0 and plan.privacy.epsilon > 1.99
    assert plan.noise_multiplier == plan.privacy.noise_multiplier
    assert plan.noise_std(0.5) == pytest.approx(0.5 * plan.noise_multiplier)
    assert plan.epsilon_after(200) is plan.privacy
    early = plan.epsilon_after(50)
    ref = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), 50
    )
    assert early.epsilon == pytest.approx(_pld_epsilon(ref, 1e-5), rel=1e-6)
    assert calibrate(plan, epsilon=2.0, delta=1e-5).noise_multiplier == plan.noise_multiplier


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(steps=11, epochs=1), "steps/epochs"),
        (dict(), "steps/epochs"),
        (dict(steps=10, batch_size=2000), "batch_size"),
        (dict(steps=10, scheme="shuffle"), "scheme"),
        (dict(steps=10, min_sep=4), "min_sep"),
        (dict(steps=10, strategy="bsr"), "bands"),
        (dict(steps=10, strategy="bsr:4"), "DP-SGD"),
        (dict(steps=10, scheme="single_release", epochs=None), "single_release"),
        (dict(steps=40, scheme="cyclic_poisson", strategy="bisr:4"), "C is not banded"),
        (dict(steps=10, strategy=factorize(prefix_sum(11), "identity")), "steps=10"),
        (dict(steps=10, noise_multiplier=0.0), "noise_multiplier"),
    ],
)
def test_plan_validation(kwargs, match):
    base = dict(dataset_size=1000, batch_size=100)
    if kwargs.get("scheme") == "single_release":
        kwargs = dict(kwargs, steps=11)
    with pytest.raises((ValueError, TypeError), match=match):
        PrivatePlan(**{**base, **kwargs})


def test_plan_needs_a_noise_multiplier_for_its_noise_std():
    with pytest.raises(ValueError, match="calibrate"):
        PrivatePlan(100, 10, steps=5).noise_std(1.0)


@register_scheme
@dataclass(frozen=True)
class _FullBatch(Scheme):
    """Every step uses all N examples (q = 1): n Gaussian releases, μ = √n/σ."""

    name: ClassVar[str] = "test_full_batch"
    matrix_mechanism: ClassVar[bool] = False

    def event(self, run, sigma):
        return GaussianEvent(sigma, run.steps), EventInfo(1.0, 1.0, {})

    def sampler(self, run, seed):
        from dpmf.plan.samplers import BatchSampler

        class All(BatchSampler):
            def _draw(self, t):
                return np.arange(self.dataset_size)

        return All(run.dataset_size, run.batch_size, run.steps, seed=seed)

    def expected_batch_size(self, run):
        return float(run.dataset_size)


def test_a_scheme_registered_by_the_test_is_accounted_sampled_and_calibrated():
    assert SCHEMES["test_full_batch"] is _FullBatch
    plan = PrivatePlan(50, 50, steps=9, scheme="test_full_batch")
    assert account(plan, 3.0, delta=1e-5).epsilon == pytest.approx(gaussian_epsilon(1.0, 1e-5), rel=1e-9)
    cal = plan.calibrate(1.0, 1e-5)
    assert cal.privacy.epsilon <= 1.0 + 1e-12
    assert gaussian_epsilon(3.0 / cal.noise_multiplier, 1e-5) == pytest.approx(1.0, rel=1e-6)
    sampler = plan.sampler(0)
    assert [len(sampler.next()) for _ in range(9)] == [50] * 9
    assert plan.expected_batch_size == 50.0
    with pytest.raises(ValueError, match="DP-SGD"):
        PrivatePlan(50, 50, steps=9, scheme="test_full_batch", strategy="bsr:2")


def _doubled(workload, p, participation, options):
    e = np.zeros(workload.n)
    e[0] = 2.0
    return Factorization("test_doubled", None, workload, ScaledToeplitz(e))


def test_a_strategy_registered_by_the_test_is_built_evaluated_and_planned():
    if "test_doubled" not in STRATEGIES:
        register_strategy(Strategy("test_doubled", _doubled, banded=True, summary="C = 2·I"))
    f = factorize(prefix_sum(16), "test_doubled")
    e, ref = evaluate(f), evaluate(factorize(prefix_sum(16), "identity"))
    # C = 2I: sensitivity 2, B = A/2, so the errors equal the identity's
    assert e.sensitivity == pytest.approx(2.0) and e.mean_se == pytest.approx(ref.mean_se)
    plan = PrivatePlan(160, 10, steps=16, scheme="cyclic_poisson", strategy="test_doubled")
    assert plan.sensitivity == pytest.approx(2.0) and plan.bands == 1
    with pytest.raises(ValueError, match="registered"):
        register_strategy(Strategy("test_doubled", _doubled))


def test_plan_schedule_builds_the_strategy_on_the_learning_rate_workload():
    s = Schedule("exponential", 0.1)
    plan = PrivatePlan(640, 10, steps=64, scheme="fixed_order", strategy="lr_aware", schedule=s)
    assert plan.workload.name != "prefix_sum"
    ev = evaluate(plan.strategy)
    assert (ev.sensitivity, ev.max_se, ev.mean_se) == pytest.approx((1.3214, 1.5630, 1.4146), abs=1e-4)
