"""``dpmf.step.build``: the one constructor of sampler, noise stream and privatizer (a ``DPStep``)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf import seeds
from dpmf.distributed import simulate
from dpmf.optim.batches import BatchCheckError
from dpmf.optim.noise import ChunkedKeys
from dpmf.plan import PrivatePlan
from dpmf.step import ExecutionFlags, noise_stream
from dpmf.step import build as build_step

X = torch.randn(40, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))


def _model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _plan(**kw):
    kw = {"noise_multiplier": 1.1, "clip_norm": 0.7, **kw}
    return PrivatePlan(40, 8, steps=6, scheme="cyclic_poisson", strategy="bsr:3", **kw)


def _run(step, k=4):
    out = []
    for _ in range(k):
        drawn_at, idx = step.batches.draw()
        step.batches.record(drawn_at, ids=idx, n=len(idx))
        ids = torch.from_numpy(idx)
        step.privatizer.privatize(X[ids], Y[ids], example_ids=ids)
        out.append(torch.cat([p.grad.flatten() for p in step.privatizer.model.parameters()]))
    return torch.stack(out)


def _by_hand(plan, key, chunked=True):
    """The private step as the doors assembled it before: sampler, keys, noise, privatizer."""
    from dpmf.optim.privatize import Privatizer

    model = _model()
    sizes = tuple(p.numel() for p in model.parameters())
    noise = noise_stream(
        plan, sum(sizes), key, dtype=torch.float64, keys=ChunkedKeys(sizes) if chunked else None
    )
    priv = Privatizer(model, F.cross_entropy, plan=plan, noise=noise)
    sampler = plan.sampler(key)
    out = []
    for _ in range(4):
        idx = torch.from_numpy(sampler.next())
        priv.privatize(X[idx], Y[idx])
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(out)


def test_the_bound_step_is_the_plans_sampler_noise_and_privatizer():
    plan = _plan(seed=13)
    step = build_step(plan, _model(), F.cross_entropy)
    assert step.privatizer.plan is plan and step.privatizer.drawn is step.batches
    assert step.noise.keys is not None  # chunked keys by default
    first = _run(step)
    torch.testing.assert_close(first, _by_hand(plan, 13), rtol=0, atol=0)  # bit-identical
    stream = build_step(plan, _model(), F.cross_entropy, flags=ExecutionFlags(noise_keys="stream"))
    torch.testing.assert_close(_run(stream), _by_hand(plan, 13, chunked=False), rtol=0, atol=0)
    other = build_step(plan.with_settings(seed=14), _model(), F.cross_entropy)
    assert not torch.equal(_run(other), first)


def test_the_bound_step_accepts_only_the_drawn_batch():
    step = build_step(_plan(seed=2), _model(), F.cross_entropy)
    with pytest.raises(BatchCheckError):
        step.privatizer.privatize(X[:8], Y[:8])


def test_a_secret_key_is_drawn_and_never_shown():
    step = build_step(_plan(), _model(), F.cross_entropy)
    assert step.policy.is_secret and step.key.bit_length() > 64
    assert str(step.key) not in repr(step) and str(step.key) not in repr(step.policy)
    policy = seeds.SeedPolicy.of(9)
    assert build_step(_plan(), _model(), F.cross_entropy, seed=policy).key == 9
    given = build_step(_plan(seed=9), _model(), F.cross_entropy)
    assert given.key == 9 and not given.policy.is_secret and given.policy.notice
    assert "seed=" not in repr(_plan(seed=9)) and "seed" not in _plan(seed=9).to_dict()
    with pytest.raises(TypeError, match="give an integer seed to the plan"):
        build_step(_plan(), _model(), F.cross_entropy, seed=9)


def test_two_simulated_processes_take_the_one_process_step():
    plan = _plan(seed=5)
    one = _run(build_step(plan, _model(), F.cross_entropy))

    models = [_model(), _model()]  # built here: torch's global generator is not for threads

    def rank(comm):
        model = models[comm.rank]
        step = build_step(plan, model, F.cross_entropy, comm=comm)
        assert step.collectives is comm
        out = []
        for _ in range(4):
            drawn_at, idx = step.batches.draw()  # this rank's slice of the global batch
            step.batches.record(drawn_at, ids=idx, n=len(idx))
            ids = torch.from_numpy(idx)
            step.privatizer.privatize(X[ids], Y[ids], example_ids=ids)
            out.append(
                [p.grad.clone() if p.grad is not None else None for p in step.privatizer.model.parameters()]
            )
        return step.privatizer.owners, out

    results = simulate(2, rank)
    owners = results[0][0]
    for t in range(4):
        got = torch.cat([results[owners[j]][1][t][j].flatten() for j in range(len(owners))])
        torch.testing.assert_close(got, one[t], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(clipping="fast"), "clipping='fast' is invalid"),
        (dict(noise_keys="per-rank"), "noise_keys='per-rank' is invalid"),
        (dict(distributed_mode="ring"), "distributed_mode='ring' is invalid"),
        (dict(micro_batch_size=0), "micro_batch_size"),
    ],
)
def test_bad_flags_are_refused_in_one_line(flags, match):
    with pytest.raises(ValueError, match=match):
        ExecutionFlags(**flags)


def test_a_plan_without_noise_or_bad_flags_is_refused_before_any_work():
    plan = PrivatePlan(40, 8, steps=6, clip_norm=1.0)
    with pytest.raises(ValueError, match="noise_multiplier is unknown"):
        build_step(plan, _model(), F.cross_entropy)
    with pytest.raises(ValueError, match="clip_norm is unknown"):
        build_step(_plan(clip_norm=None), _model(), F.cross_entropy)
    with pytest.raises(TypeError, match="flags="):
        build_step(_plan(), _model(), F.cross_entropy, flags={"clipping": "vmap"})


def test_noise_segments_account_as_the_composition_and_set_each_steps_sigma():
    import dp_accounting as dpa

    plan = PrivatePlan(1000, 10, steps=30, noise_segments=((10, 1.0), (20, 2.0)), clip_norm=0.5, seed=3)
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0)), 10)
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(2.0)), 20)
    assert plan.account(delta=1e-5).epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-2)
    assert [plan.noise_multiplier_at(t) for t in (0, 9, 10, 29)] == [1.0, 1.0, 2.0, 2.0]
    # the privatizer adds σ_t·ζ·(C⁻¹Z)_t at each step: σ of the step's segment
    step = build_step(plan, _model(), F.cross_entropy)
    for t in range(12):
        drawn_at, _ = step.batches.draw()
        step.batches.record(drawn_at, ids=np.zeros(0, dtype=np.int64), n=0)
        step.privatizer.privatize(X[:0], Y[:0], example_ids=torch.zeros(0, dtype=torch.long))
        got = torch.cat([p.grad.flatten() for p in step.privatizer.model.parameters()]) * 10.0
        sigma = 1.0 if t < 10 else 2.0
        torch.testing.assert_close(got, sigma * 0.5 * step.noise.raw_noise(t), rtol=1e-12, atol=1e-12)
        step.privatizer.consume()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_segments=((10, 1.0),)), "its steps sum to 10, the plan has 30"),
        (dict(noise_segments=((30, -1.0),)), r"noise_segments\[0\]"),
        (dict(noise_segments=((30, 1.0),), noise_multiplier=1.0), "together with noise_multiplier"),
        (dict(noise_segments=((30, 1.0),), scheme="fixed_order"), "DP-SGD under Poisson sampling"),
    ],
)
def test_bad_noise_segments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivatePlan(1000, 10, steps=30, **kwargs)


def test_a_segment_without_noise_has_no_finite_epsilon():
    with pytest.raises(ValueError, match="σ = 0"):
        PrivatePlan(1000, 10, steps=30, noise_segments=((30, 0.0),)).account(delta=1e-5)


def test_the_plan_holds_clip_norm_accountant_and_seed_policy():
    import dp_accounting as dpa
    from dp_accounting import pld, rdp

    from dpmf.accountants.registry import RDP, MonteCarlo

    plan = PrivatePlan(1000, 10, steps=50, clip_norm=0.5, accountant="rdp").calibrate(2.0, 1e-5)
    assert isinstance(plan.accountant, RDP) and plan.privacy.accountant == "rdp"
    acc = rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(plan.noise_multiplier)), 50)
    assert plan.privacy.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    # ε after 20 steps is measured by the plan's accountant (RDP), not the scheme's default (PLD)
    acc20 = rdp.RdpAccountant()
    acc20.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(plan.noise_multiplier)), 20)
    assert plan.epsilon_after(20).epsilon == pytest.approx(acc20.get_epsilon(1e-5), rel=1e-6)
    assert plan.noise_std() == pytest.approx(plan.noise_multiplier * 0.5)
    assert plan.to_dict()["clip_norm"] == 0.5 and plan.to_dict()["accountant"] == "rdp"
    # the settings survive derived plans; σ and ε are kept by with_settings
    kept = plan.with_settings(clip_norm=2.0)
    assert kept.clip_norm == 2.0 and kept.noise_multiplier == plan.noise_multiplier
    assert kept.privacy is plan.privacy and plan.truncated(10).accountant == plan.accountant
    # a Monte Carlo specification carries its own settings (fixed order, DP-SGD: Gaussian)
    spec = MonteCarlo(samples=20_000, seed=3, confidence=None)
    mc = PrivatePlan(1000, 10, steps=5, scheme="fixed_order", accountant=spec)
    res = mc.account(1.0, delta=1e-3)
    assert res.accountant == "monte_carlo" and res.samples == 20_000 and res.guarantee == "estimate"
    assert (
        res.epsilon
        == mc.account(
            1.0, delta=1e-3, accountant="monte_carlo", samples=20_000, seed=3, confidence=None
        ).epsilon
    )
    ref = pld.PLDAccountant()
    ref.compose(dpa.GaussianDpEvent(1.0), 1)  # each example in one step of the epoch
    assert res.epsilon == pytest.approx(ref.get_epsilon(1e-3), rel=0.1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(clip_norm=0.0), ValueError, "clip_norm=0.0 is invalid"),
        (dict(clip_norm=float("nan")), ValueError, "clip_norm=nan is invalid"),
        (dict(accountant="monte_carlo"), ValueError, "accountant='monte_carlo' is invalid for scheme='poiss"),
        (dict(accountant="magic"), ValueError, "accountant='magic' is invalid"),
        (dict(accountant=3), TypeError, "accountant=3 is invalid"),
        (dict(seed=-1), ValueError, r"seed \(value not shown: it is secret\) is invalid: got a negative"),
    ],
)
def test_bad_plan_settings_are_refused_in_one_line(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        PrivatePlan(100, 10, steps=5, **kwargs)
    assert "\n" not in str(info.value)


def test_a_privatizer_refuses_a_clip_norm_other_than_the_plans():
    from dpmf.optim.privatize import Privatizer

    plan = _plan()
    noise = noise_stream(plan, sum(p.numel() for p in _model().parameters()), 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="the plan's clip_norm is 0.7"):
        Privatizer(_model(), F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise)


def test_a_step_stage_adds_to_the_clipped_sum_before_the_noise_and_is_set_once():
    # Two runs with one seed: the staged run's p.grad is the plain run's + v/B̄ (v added to the
    # clipped sums before the noise), and select's removed examples are not clipped into it.
    import dpmf
    from dpmf.optim.privatize import StepStage

    class AddV(StepStage):
        def __init__(self, v):
            self.v, self.seen = v, []

        def before_release(self, step, params, sums):
            for s, v in zip(sums, self.v, strict=True):
                s.add_(v)

        def after_release(self, step, params, written):
            self.seen.append([p.grad.clone() for p in written])

    def run(stage):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3).double()
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(
            torch.randn(40, 5, generator=g).double(), torch.randint(0, 3, (40,), generator=g)
        )
        private = dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
            batch_size=8, steps=3, noise_multiplier=1.0, factorization="identity", scheme="poisson", seed=7,
        )  # fmt: skip
        if stage is not None:
            with pytest.raises(TypeError, match="StepStage"):
                private.privatizer.set_stage(object())
            private.privatizer.set_stage(stage)
            with pytest.raises(ValueError, match="set it once"):
                private.privatizer.set_stage(StepStage())
        x, y = next(iter(private.data_loader))
        private.backward(x, target=y, return_loss=False)
        grads = [p.grad.clone() for p in model.parameters()]
        private.optimizer.step()
        with pytest.raises(ValueError, match="before the first private step"):
            private.privatizer.set_stage(StepStage())
        return grads, private.plan.expected_batch_size

    v = [torch.full((3, 5), 0.25, dtype=torch.float64), torch.arange(3.0, dtype=torch.float64)]
    stage = AddV(v)
    plain, b = run(None)
    staged, _ = run(stage)
    for a, s, vi, seen in zip(plain, staged, v, stage.seen[0], strict=True):
        torch.testing.assert_close(s, a + vi / b, rtol=0, atol=1e-12)
        assert torch.equal(seen, s)


def test_the_step_is_frozen_and_carries_the_plans_event():
    import dataclasses

    plan = _plan(seed=3)
    step = build_step(plan, _model(), F.cross_entropy)
    assert step.event == plan.event() and step.event.noise_multiplier == pytest.approx(1.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.sampler = None


def test_the_plan_builds_no_torch_part_and_says_where_they_are_built():
    plan = _plan()
    with pytest.raises(
        AttributeError, match=r"PrivatePlan.private_step .* dpmf.step.build\(plan, model, loss_fn\)"
    ):
        plan.private_step(_model(), F.cross_entropy)
    with pytest.raises(AttributeError, match=r"dpmf.step.noise_stream\(plan, dim, key\)"):
        plan.noise(3, 0)
    with pytest.raises(AttributeError, match="has no attribute 'nosie'"):
        plan.nosie  # noqa: B018 — a misspelling stays a plain AttributeError
    # the noise stream of the step is the plan's stream: the identity's raw noise itself
    z = noise_stream(PrivatePlan(40, 8, steps=6, strategy="identity"), 5, 11, dtype=torch.float64)
    torch.testing.assert_close(z.next(), z.raw_noise(0), rtol=0, atol=0)


@pytest.mark.parametrize(
    "clients, per_round, rounds, scheme, identity_sensitivity",
    [
        (6, 6, 9, "fixed_order", 3.0),  # every client in every round: √R
        (12, 4, 7, "fixed_order", 3**0.5),  # ⌈12/4⌉ = 3 groups: rounds 1, 4, 7 for the first (√3)
        (12, 4, 7, "poisson", 1.0),  # Poisson: one step's sensitivity
    ],
)
def test_client_level_sigma_keeps_flowers_meaning_with_the_plans_sensitivity(
    clients, per_round, rounds, scheme, identity_sensitivity
):
    # σ_c is the noise multiplier on one round's sum under identity noise: the plan's σ is
    # σ_c / s_I and the noise on the sum σ_c·ζ, whatever strategy correlates it across rounds
    from dpmf.federated.local import client_level_plan

    plan = client_level_plan(clients, per_round, rounds, scheme, "identity", 2.0, 0.5)
    assert plan.sensitivity == pytest.approx(identity_sensitivity, rel=1e-12)
    assert plan.noise_multiplier == pytest.approx(2.0 / identity_sensitivity, rel=1e-12)
    assert plan.noise_std() == pytest.approx(2.0 * 0.5, rel=1e-12)
    if scheme == "fixed_order":
        banded = client_level_plan(clients, per_round, rounds, scheme, "bisr:2", 2.0, 0.5)
        assert banded.noise_multiplier == plan.noise_multiplier  # the identity's privacy
