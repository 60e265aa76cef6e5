"""A careless or hostile user of the plan API: nothing may make dpmf silently weaker than it
reports (a stale ε, a secret in a message, a built-in silently replaced)."""

import dataclasses

import dp_accounting
import pytest

from dpmf.plan import PrivatePlan

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


SECRET = 98765432


@pytest.mark.parametrize(
    "bad, kind",
    [(-SECRET, ValueError), (SECRET + 0.5, ValueError), (str(SECRET), TypeError), (float("nan"), ValueError)],
    ids=["negative", "non-integral", "string", "nan"],
)
@pytest.mark.parametrize(
    "use",
    [
        lambda s: PrivatePlan(1000, 50, steps=20, seed=s),
        lambda s: PrivatePlan(1000, 50, steps=20).with_settings(seed=s),
        lambda s: PrivatePlan(1000, 50, steps=20).sampler(s),
        lambda s: __import__("dpmf.seeds").seeds.SeedPolicy.of(s),
    ],
    ids=["plan", "with_settings", "sampler", "SeedPolicy"],
)
def test_an_invalid_seed_is_refused_without_showing_it(bad, kind, use):
    # a seed meant as secret (a typo, a string from the environment) must not reach the logs
    with pytest.raises(kind, match=r"^seed \(value not shown: it is secret\) is invalid: got ") as info:
        use(bad)
    assert str(SECRET) not in str(info.value)


def test_the_built_in_linear_handler_is_not_silently_replaced():
    import torch

    from dpmf.optim import clipped_sum, register_clipping_layer
    from dpmf.optim.ghost_layers import _REGISTRY, LinearHandler

    class Unclipped(LinearHandler):
        """Reports every example's norm as 0: nothing would ever be clipped."""

        name = "unclipped"

        def sq_norms(self, module, calls, attrs, dtype):
            norms, state = super().sq_norms(module, calls, attrs, dtype)
            return {a: torch.zeros_like(v) for a, v in norms.items()}, state

    key = "torch.nn.modules.linear.Linear"
    own = _REGISTRY[key]
    try:
        _refuse_and_replace(key, own, Unclipped, register_clipping_layer, clipped_sum)
    finally:
        _REGISTRY[key] = own  # whatever happened, the next tests clip with the built-in handler


def _refuse_and_replace(key, own, Unclipped, register_clipping_layer, clipped_sum):
    import torch
    from torch import nn

    from dpmf.optim.ghost_layers import _REGISTRY

    with pytest.raises(ValueError, match=rf"^module_type='{key}' is invalid: dpmf's own 'linear' handler"):
        register_clipping_layer(nn.Linear, Unclipped())
    with pytest.raises(ValueError, match="pass replace=True"):
        register_clipping_layer(key, Unclipped())
    assert _REGISTRY[key] is own
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = (
        torch.randn(6, 4, generator=g, dtype=torch.float64),
        torch.randn(6, 3, generator=g, dtype=torch.float64),
    )
    loss = lambda out, t: ((out - t) ** 2).sum()  # noqa: E731
    ref = clipped_sum(model, loss, x, y, clip_norm=0.1, clipping="vmap")  # torch.func, no handler
    out = clipped_sum(model, loss, x, y, clip_norm=0.1, clipping="ghost")
    assert float(ref.norms.min()) > 0.1  # every example is clipped
    torch.testing.assert_close(out.norms, ref.norms, rtol=1e-9, atol=0)
    # an explicit replacement is still possible (and undone here)
    register_clipping_layer(nn.Linear, Unclipped(), replace=True)
    try:
        assert float(clipped_sum(model, loss, x, y, clip_norm=0.1, clipping="ghost").norms.max()) == 0.0
    finally:
        register_clipping_layer(nn.Linear, own, replace=True)


def test_the_shared_privacy_ledger_never_names_a_given_noise_seed():
    import json

    from dpmf.train.ledger import privacy_ledger

    # make_private/dpmf train sample the Monte Carlo accountant with the given seed (reproducible)
    plan = PrivatePlan(64, 16, steps=4, scheme="balls_in_bins", clip_norm=1.0, seed=SECRET).with_noise(3.0)
    res = plan.account(delta=1e-3, seed=SECRET)
    assert res.seed == SECRET and str(SECRET) in res.method  # the run's own result keeps it
    ledger = privacy_ledger(plan, res, steps_taken=4, clip_norm=1.0, seed_given=True)
    text = json.dumps(ledger)
    assert str(SECRET) not in text  # before: "…samples/direction, seed 98765432)" in privacy.json
    assert ledger["epsilon"] == res.epsilon and "seed withheld" in ledger["method"]


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
    priv = Privatizer(model, nn.functional.cross_entropy, plan=plan, noise=plan.noise(8, 1))
    priv.draw_from(plan.sampler(1))  # its own: accepted
    wrong = dataclasses.replace(plan, **other).sampler(1)
    assert wrong.steps == plan.steps  # the only thing compared before
    priv = Privatizer(model, nn.functional.cross_entropy, plan=plan, noise=plan.noise(8, 1))
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
    priv = Privatizer(nn.Linear(3, 2), nn.functional.cross_entropy, plan=plan, noise=plan.noise(8, 1))
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


def test_a_misspelled_accountant_setting_is_refused_without_its_value():
    from dpmf.accountants.registry import MonteCarlo

    plan = PrivatePlan(64, 16, steps=4, scheme="balls_in_bins", clip_norm=1.0)
    for call in (
        lambda: plan.with_accountant(MonteCarlo(), confidnce=None),  # before: silently kept 0.99
        lambda: plan.calibrate(1.0, 1e-3, sead=SECRET),  # before: silently seed 0
    ):
        with pytest.raises(
            TypeError, match=r"^setting '(confidnce|sead)' is invalid: the accountant settings are "
        ) as info:
            call()
        assert str(SECRET) not in str(info.value)
    assert plan.with_accountant(confidence=0.95).accountant == MonteCarlo(confidence=0.95)


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


def test_objects_holding_the_key_refuse_pickling_so_it_never_reaches_a_world_readable_file():
    import copy
    import pickle

    import torch
    import torch.nn.functional as F

    from dpmf import seeds

    plan = PrivatePlan(100, 10, steps=20, strategy="bsr:4", scheme="fixed_order", noise_multiplier=1.0,
                       clip_norm=1.0)  # fmt: skip
    step = plan.private_step(torch.nn.Linear(3, 2), F.cross_entropy)
    holders = [step, step.policy, step.noise, step.sampler, step.privatizer, seeds.SeedPolicy.of(None)]
    for obj in holders:
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied: it holds the run's secret"):
            pickle.dumps(obj)
        with pytest.raises(TypeError, match="secret noise key"):
            copy.deepcopy(obj)
    # the plan itself holds no key and still pickles
    assert pickle.loads(pickle.dumps(plan)).to_dict() == plan.to_dict()
