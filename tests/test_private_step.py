"""``PrivatePlan.private_step``: the one constructor of sampler, noise stream and privatizer."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf import seeds
from dpmf.distributed import ExecutionFlags, simulate
from dpmf.optim.batches import BatchCheckError
from dpmf.optim.noise import ChunkedKeys
from dpmf.plan import PrivatePlan

X = torch.randn(40, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))


def _model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _plan():
    return PrivatePlan(40, 8, steps=6, scheme="cyclic_poisson", strategy="bsr:3", noise_multiplier=1.1)


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
    noise = plan.noise(sum(sizes), key, dtype=torch.float64, keys=ChunkedKeys(sizes) if chunked else None)
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=0.7, noise=noise)
    sampler = plan.sampler(key)
    out = []
    for _ in range(4):
        idx = torch.from_numpy(sampler.next())
        priv.privatize(X[idx], Y[idx])
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(out)


def test_the_bound_step_is_the_plans_sampler_noise_and_privatizer():
    plan = _plan()
    step = plan.private_step(_model(), F.cross_entropy, clip_norm=0.7, seed=13)
    assert step.privatizer.plan is plan and step.privatizer.drawn is step.batches
    assert step.noise.keys is not None  # chunked keys by default
    first = _run(step)
    torch.testing.assert_close(first, _by_hand(plan, 13), rtol=0, atol=0)  # bit-identical
    stream = plan.private_step(
        _model(), F.cross_entropy, clip_norm=0.7, seed=13, flags=ExecutionFlags(noise_keys="stream")
    )
    torch.testing.assert_close(_run(stream), _by_hand(plan, 13, chunked=False), rtol=0, atol=0)
    other = plan.private_step(_model(), F.cross_entropy, clip_norm=0.7, seed=14)
    assert not torch.equal(_run(other), first)


def test_the_bound_step_accepts_only_the_drawn_batch():
    step = _plan().private_step(_model(), F.cross_entropy, clip_norm=0.7, seed=2)
    with pytest.raises(BatchCheckError):
        step.privatizer.privatize(X[:8], Y[:8])


def test_a_secret_key_is_drawn_and_never_shown():
    step = _plan().private_step(_model(), F.cross_entropy, clip_norm=0.7)
    assert step.policy.is_secret and step.key.bit_length() > 64
    assert str(step.key) not in repr(step) and str(step.key) not in repr(step.policy)
    policy = seeds.SeedPolicy.of(9)
    assert _plan().private_step(_model(), F.cross_entropy, clip_norm=0.7, seed=policy).key == 9


def test_two_simulated_processes_take_the_one_process_step():
    plan = _plan()
    one = _run(plan.private_step(_model(), F.cross_entropy, clip_norm=0.7, seed=5))

    models = [_model(), _model()]  # built here: torch's global generator is not for threads

    def rank(comm):
        model = models[comm.rank]
        step = plan.private_step(model, F.cross_entropy, clip_norm=0.7, seed=5, process_group=comm)
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
    plan = PrivatePlan(40, 8, steps=6)
    with pytest.raises(ValueError, match="noise_multiplier is unknown"):
        plan.private_step(_model(), F.cross_entropy, clip_norm=1.0, seed=1)
    with pytest.raises(TypeError, match="flags="):
        _plan().private_step(_model(), F.cross_entropy, clip_norm=1.0, seed=1, flags={"clipping": "vmap"})


def test_noise_segments_account_as_the_composition_and_set_each_steps_sigma():
    import dp_accounting as dpa

    plan = PrivatePlan(1000, 10, steps=30, noise_segments=((10, 1.0), (20, 2.0)))
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0)), 10)
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(2.0)), 20)
    assert plan.account(delta=1e-5).epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-2)
    assert [plan.noise_multiplier_at(t) for t in (0, 9, 10, 29)] == [1.0, 1.0, 2.0, 2.0]
    # the privatizer adds σ_t·ζ·(C⁻¹Z)_t at each step: σ of the step's segment
    step = plan.private_step(_model(), F.cross_entropy, clip_norm=0.5, seed=3)
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
