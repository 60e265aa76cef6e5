"""What cannot make a plan silently weaker than it reports: a privacy result of another run or of
another schedule, an accountant or scheme reporting under a built-in name, batches of another
plan's sampler, and a factorization whose name, noise or noise layout does not match its C."""

import dataclasses

import dp_accounting
import pytest

from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream

DELTA = 1e-5


def _rdp_epsilon(sigma, q, steps):
    """ε of DP-SGD by dp-accounting's RDP accountant (independent of dpmf)."""
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(DELTA)


@pytest.fixture(scope="module")
def measured():
    """A DP-SGD plan with σ = 1.2 and its RDP privacy result."""
    plan = PrivatePlan(1000, 50, steps=20, clip_norm=1.0, accountant="rdp")
    res = plan.account(1.2, delta=DELTA)
    return plan.with_noise(1.2, privacy=res)


def test_a_plan_keeps_the_privacy_result_of_its_own_sigma(measured):
    # the correct path is unchanged: ε is dp-accounting's RDP ε at σ = 1.2, q = 0.05, n = 20
    want = _rdp_epsilon(1.2, 0.05, 20)
    assert measured.privacy.epsilon == pytest.approx(want, rel=1e-9)
    assert measured.epsilon_after(20) is measured.privacy


@pytest.mark.parametrize(
    "make",
    [
        lambda p: dataclasses.replace(p, noise_multiplier=0.3),  # the old ε for a quarter of the noise
        lambda p: p.with_noise(0.3, privacy=p.privacy),
        lambda p: dataclasses.replace(p, dataset_size=100),  # q = 0.5 instead of 0.05
        lambda p: dataclasses.replace(p, steps=40, epochs=None, strategy="identity"),
        lambda p: dataclasses.replace(p, scheme="fixed_order"),
    ],
    ids=["replace-sigma", "with_noise-old-result", "replace-N", "replace-steps", "replace-scheme"],
)
def test_a_privacy_result_of_another_run_is_refused(measured, make):
    # before: the plan reported ε ≈ 1.4 (σ = 1.2) while its noise was σ = 0.3 (ε in the tens)
    with pytest.raises(ValueError, match=r"^privacy is invalid: it was measured with \w+="):
        make(measured)


def test_an_unregistered_accountant_cannot_report_under_a_built_in_name():
    from dpmf.accountants.registry import PLD
    from dpmf.accountants.result import Measurement

    class Liar:
        def supports(self, event):
            return True

        def epsilon(self, event, delta):
            return Measurement(0.01, delta, "pld", "upper_bound", "dp-accounting PLD")

    @dataclasses.dataclass(frozen=True)
    class Impostor(PLD):  # inherits name = "pld"
        def build(self):
            return Liar()

    plan = PrivatePlan(1000, 50, steps=20, clip_norm=1.0, accountant="rdp")
    # before: account(0.5) reported ε = 0.01 "pld upper_bound" (RDP's ε is about 9)
    assert plan.account(0.5, delta=DELTA).epsilon == pytest.approx(_rdp_epsilon(0.5, 0.05, 20), rel=1e-9)
    for make in (
        lambda: plan.with_accountant(Impostor()),
        lambda: PrivatePlan(1000, 50, steps=20, accountant=Impostor()),
    ):
        with pytest.raises(
            TypeError, match=r"^accountant=Impostor\(...\) is invalid: the name 'pld' is registered to PLD"
        ):
            make()


@pytest.mark.parametrize(
    "other, what",
    [
        (dict(dataset_size=100), "dataset_size is 100 and the plan's 1000"),  # rate 0.5, not 0.05
        (dict(batch_size=500), "batch_size is 500 and the plan's 50"),
        (dict(scheme="fixed_order"), "scheme is 'fixed_order' and the plan's 'poisson'"),
    ],
    ids=["N", "B", "scheme"],
)
def test_a_privatizer_refuses_batches_of_another_plans_sampler(other, what):
    import torch
    from torch import nn

    from dpmf.optim.privatize import Privatizer

    plan = PrivatePlan(1000, 50, steps=20, clip_norm=1.0).with_noise(1.0)
    model = nn.Linear(3, 2)
    priv = Privatizer(model, nn.functional.cross_entropy, plan=plan, noise=noise_stream(plan, 8, 1))
    priv.draw_from(plan.sampler(1))  # its own: accepted
    wrong = dataclasses.replace(plan, **other).sampler(1)
    assert wrong.steps == plan.steps  # the only thing compared before
    priv = Privatizer(model, nn.functional.cross_entropy, plan=plan, noise=noise_stream(plan, 8, 1))
    with pytest.raises(ValueError, match=rf"^sampler is invalid: its {what} "):
        priv.draw_from(wrong)
    del torch


def test_a_cyclic_poisson_privatizer_refuses_another_group_count():
    from torch import nn

    from dpmf.optim.privatize import Privatizer

    plan = PrivatePlan(1000, 50, steps=20, scheme="cyclic_poisson", min_sep=2, clip_norm=1.0).with_noise(1.0)
    wrong = PrivatePlan(1000, 50, steps=20, scheme="cyclic_poisson", min_sep=4).sampler(
        1
    )  # rate 0.2, not 0.1
    priv = Privatizer(nn.Linear(3, 2), nn.functional.cross_entropy, plan=plan, noise=noise_stream(plan, 8, 1))
    with pytest.raises(ValueError, match=r"^sampler is invalid: its groups is 4 and the plan's 2 "):
        priv.draw_from(wrong)


def test_a_cyclic_poisson_plan_with_min_sep_can_be_given_its_noise():
    # before: with_noise/calibrate (dataclasses.replace) refused the plan's own min_sep
    plan = PrivatePlan(1000, 50, steps=20, scheme="cyclic_poisson", min_sep=2).with_noise(1.0)
    assert plan.min_sep == 2 and plan.sampling_rate == pytest.approx(0.1, rel=0, abs=1e-15)  # B·b'/N
    with pytest.raises(ValueError, match=r"options \['min_sep'\] are invalid with a Scheme object"):
        dataclasses.replace(plan, min_sep=4)  # another b' must go through plan.replace(min_sep=4)
    assert plan.replace(min_sep=4).sampling_rate == pytest.approx(0.2, rel=0, abs=1e-15)


def test_a_factorization_named_identity_must_be_the_identity():
    import numpy as np

    from dpmf.mechanisms.factorizations import Factorization
    from dpmf.mechanisms.structured import DenseLowerTriangular, ScaledToeplitz
    from dpmf.workloads import prefix_sum

    e = np.zeros(20)
    e[0] = 10.0  # C = 10·I: the noise C⁻¹Z is a tenth of DP-SGD's, ε was reported as DP-SGD's at σ
    for C in (
        ScaledToeplitz(e),
        DenseLowerTriangular(10.0 * np.eye(20)),
        ScaledToeplitz(np.eye(20)[0], np.full(20, 0.1)),
    ):
        fake = Factorization("identity", None, prefix_sum(20), C)
        with pytest.raises(
            ValueError, match=r"^strategy is invalid: a Factorization named 'identity' .* not the identity"
        ):
            PrivatePlan(1000, 50, steps=20, strategy=fake)
    real = Factorization("identity", None, prefix_sum(20), ScaledToeplitz(np.eye(20)[0]))
    assert PrivatePlan(1000, 50, steps=20, strategy=real).sensitivity == 1.0


def test_an_unregistered_scheme_cannot_report_under_a_built_in_name():
    from dpmf.plan.schemes import Poisson

    @dataclasses.dataclass(frozen=True)
    class Quieter(Poisson):  # inherits name = "poisson"; accounts 100× the noise it adds
        def event(self, run, sigma):
            return super().event(run, 100 * sigma)

    with pytest.raises(
        TypeError, match=r"^scheme=Quieter\(...\) is invalid: the name 'poisson' is registered to Poisson"
    ):
        PrivatePlan(1000, 50, steps=20, scheme=Quieter())


def test_a_privacy_result_of_the_same_label_on_another_schedule_is_refused():
    from dpmf.workloads import Schedule

    def plan(gamma):
        return PrivatePlan(
            64,
            16,
            epochs=2,
            scheme="fixed_order",
            strategy="sqrt_prefix_scaled",
            schedule=Schedule("polynomial", 0.5, gamma),
        )

    a, b = plan(2.0), plan(5.0)
    assert a.label == b.label and a.sensitivity != b.sensitivity  # another C under the same label
    res = a.account(1.0, delta=DELTA)
    assert b.with_noise(1.0, privacy=b.account(1.0, delta=DELTA)).privacy.sensitivity == b.sensitivity
    with pytest.raises(ValueError, match=r"^privacy is invalid: it was measured with sensitivity="):
        b.with_noise(1.0, privacy=res)


def test_a_factorization_whose_noise_is_not_C_inverse_is_refused():
    import numpy as np

    from dpmf.mechanisms import factorize
    from dpmf.mechanisms.factorizations import Factorization
    from dpmf.mechanisms.structured import ScaledToeplitz
    from dpmf.workloads import prefix_sum

    real = factorize(prefix_sum(20), "bisr:4")  # carries its banded C⁻¹
    assert real.noise is not None
    plan = PrivatePlan(1000, 50, steps=20, scheme="fixed_order", strategy=real)
    # a tenth of the noise under the same C (the same sensitivity and ε): before, accepted
    quiet = Factorization(
        real.name, real.bands, real.workload, real.C, ScaledToeplitz(0.1 * real.noise.coeffs)
    )
    with pytest.raises(ValueError, match=r"^strategy='bisr:4' is invalid: its noise correlation is not C⁻¹"):
        PrivatePlan(1000, 50, steps=20, scheme="fixed_order", strategy=quiet)
    e = np.zeros(20)
    e[0] = 1.0
    fake = Factorization("identity", None, prefix_sum(20), ScaledToeplitz(e), ScaledToeplitz(0.1 * e))
    with pytest.raises(ValueError, match="its noise correlation is not C⁻¹"):
        PrivatePlan(1000, 50, steps=20, strategy=fake)
    assert (
        plan.sensitivity
        == PrivatePlan(1000, 50, steps=20, scheme="fixed_order", strategy="bisr:4").sensitivity
    )


def test_a_given_factorization_is_checked_once_not_on_every_derived_plan(monkeypatch):
    from dpmf.mechanisms import factorize
    from dpmf.plan import plan as plan_mod
    from dpmf.workloads import prefix_sum

    calls = {"n": 0}
    real = plan_mod._inverts

    def counting(noise, C):
        calls["n"] += 1
        return real(noise, C)

    monkeypatch.setattr(plan_mod, "_inverts", counting)
    f = factorize(prefix_sum(40), "bisr:4")
    assert f.noise is not None
    plan = PrivatePlan(400, 40, steps=40, scheme="fixed_order", strategy=f, clip_norm=1.0)
    plan.with_noise(1.0).with_settings(clip_norm=2.0).calibrate(4.0, 1e-5)
    assert calls["n"] == 1
    # a strategy built from its spec is never checked (consistent by construction)
    PrivatePlan(400, 40, steps=40, scheme="fixed_order", strategy="bisr:4").with_noise(1.0)
    assert calls["n"] == 1


# -- mechanisms: a Factorization subclass whose noise layout is not C⁻¹ --------------------------------
# PrivatePlan checks the noise stream of a given Factorization against C⁻¹, not only its ``noise``
# field: the stream comes from ``noise_layout()``, which a subclass may override (BLT does). A
# subclass whose layout streams 0.1·C⁻¹Z is refused (or streams C⁻¹Z): accepted, the plan would report
# the sensitivity and ε of C⁻¹Z while the run adds a tenth of that noise.
@pytest.mark.torch
def test_a_factorization_whose_noise_layout_is_not_c_inverse_is_refused():
    from dpmf.mechanisms.factorizations import Factorization
    from dpmf.mechanisms.registry import factorize
    from dpmf.mechanisms.streaming import ToeplitzInverseLayout
    from dpmf.plan.plan import PrivatePlan
    from dpmf.workloads.workload import prefix_sum

    n = 16
    base = factorize(prefix_sum(n), "sqrt_prefix")

    class Quiet(Factorization):
        def noise_layout(self, mode=None):
            lay = super().noise_layout(mode)
            return ToeplitzInverseLayout(lay.steps, lay.coeffs * 0.1, lay.row_scale, lay.col_scale, lay.mode)

    quiet = Quiet(base.name, base.bands, base.workload, base.C)
    kw = dict(dataset_size=160, batch_size=10, steps=n, scheme="fixed_order", noise_multiplier=1.0)
    honest = noise_stream(PrivatePlan(strategy=base, **kw), 4000, 7).next()
    try:
        plan = PrivatePlan(strategy=quiet, **kw)
    except ValueError:
        return
    got = noise_stream(plan, 4000, 7).next()
    # the first step's noise is Z_0·(C⁻¹)_00 for both: the accounting's noise would be equal
    assert float(got.std()) == pytest.approx(float(honest.std()), rel=1e-6)


def test_cyclic_poisson_whose_bands_oversample_names_the_strategy_and_the_way_out():
    # min_sep comes from the strategy's bands when not given: the refusal says so, and how far
    # it can go (N/B = 2048/256 = 8 bands at most)
    with pytest.raises(
        ValueError, match=r"min_sep=16 \(the 16 bands of factorization 'bsr:16'\).*at most 8 bands"
    ):
        PrivatePlan(2048, 256, steps=40, scheme="cyclic_poisson", strategy="bsr:16")
    assert PrivatePlan(2048, 256, steps=40, scheme="cyclic_poisson", strategy="bsr:8").scheme.groups
