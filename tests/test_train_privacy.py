"""Privacy invariants of the private step: noise scale, divisor, step counting, accumulation."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim.clipping import clipped_sum
from dpmf.optim.privatize import Privatizer
from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def wide_model(d_in=50, d_out=400):
    torch.manual_seed(0)
    return nn.Linear(d_in, d_out)  # 20 400 noised coordinates


def batch(b, d_in=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d_in, generator=g), torch.randint(0, 400, (b,), generator=g)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_noise_std_on_the_summed_gradient_is_sigma_zeta_sens():
    model = wide_model()
    d = sum(p.numel() for p in model.parameters())
    sigma, zeta = 1.7, 0.3
    # fixed order, one batch of 64 per epoch, 4 epochs: DP-SGD with k = 4 participations
    plan = PrivatePlan(64, 64, steps=4, scheme="fixed_order", noise_multiplier=sigma)
    sens, b_bar = plan.sensitivity, plan.expected_batch_size
    assert sens == pytest.approx(2.0) and b_bar == 64.0  # √k, and B
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=zeta, noise=noise_stream(plan, d, 1))
    x, y = batch(20)
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=zeta)
    info = priv.privatize(x, y)
    noise_on_sum = grads(model) * b_bar - torch.cat([g.flatten() for g in ref.grads])
    target = sigma * zeta * sens
    assert info.noise_std == pytest.approx(target)
    # d = 20 400 coordinates: the std estimate has relative standard error 1/√(2d) ≈ 0.5 %
    assert float(noise_on_sum.std()) == pytest.approx(target, rel=0.025)
    assert abs(float(noise_on_sum.mean())) < 5 * target / np.sqrt(d)
    # an empty batch: the gradient is the noise alone, same scale
    priv.privatize(torch.zeros(0, 50), torch.zeros(0, dtype=torch.long))
    assert float(grads(model).std() * b_bar) == pytest.approx(target, rel=0.025)


def test_correlated_noise_on_the_sum_is_sigma_zeta_sens_times_C_inverse_Z():
    model = wide_model(5, 4)
    d = sum(p.numel() for p in model.parameters())
    n = 6
    sigma, zeta = 0.9, 2.0
    plan = PrivatePlan(8, 8, steps=n, scheme="fixed_order", strategy="bsr:3", noise_multiplier=sigma)
    fz, sens = plan.strategy, plan.sensitivity
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=zeta, noise=noise_stream(plan, d, 3))
    got = []
    for _ in range(n):
        priv.privatize(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
        got.append(grads(model) * 8.0)
    Z = torch.stack([priv.noise.raw_noise(t) for t in range(n)]).double().numpy()
    expected = sigma * zeta * sens * np.linalg.inv(fz.C.dense()) @ Z
    np.testing.assert_allclose(torch.stack(got).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_mean_divides_by_the_expected_batch_size_not_the_realised_one():
    model = wide_model(6, 3)
    d = sum(p.numel() for p in model.parameters())
    plan = PrivatePlan(100, 10, steps=2, noise_segments=((2, 0.0),))  # Poisson, B̄ = 10, no noise
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(plan, d, 0))
    x, y = batch(3, d_in=6)
    y = y % 3
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=1.0)
    info = priv.privatize(x, y)
    torch.testing.assert_close(grads(model), torch.cat([g.flatten() for g in ref.grads]) / 10.0)
    assert info.batch_size == 3 and info.expected_batch_size == 10.0


def test_every_step_counts_including_empty_batches():
    model = wide_model(6, 3)
    d = sum(p.numel() for p in model.parameters())
    plan = PrivatePlan(6, 2, steps=3, scheme="fixed_order", noise_multiplier=1.0)
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(plan, d, 0))
    x, y = batch(2, d_in=6)
    y = y % 3
    steps = [priv.privatize(x[:k], y[:k]).step for k in (2, 0, 1)]
    assert steps == [0, 1, 2] and priv.step == 3
    with pytest.raises(RuntimeError, match="3 steps"):  # the strategy's n steps are a hard limit
        priv.privatize(x, y)


def test_gradient_accumulation_is_one_step_at_the_logical_batch():
    x, y = batch(13, d_in=6)
    y = y % 3
    out = []
    for micro in (None, 4, 1):
        model = wide_model(6, 3)
        d = sum(p.numel() for p in model.parameters())
        plan = PrivatePlan(65, 13, steps=5, scheme="fixed_order", noise_multiplier=1.3)
        priv = Privatizer(
            model,
            F.cross_entropy,
            plan=plan,
            clip_norm=0.5,
            noise=noise_stream(plan, d, 2),
            micro_batch_size=micro,
        )
        info = priv.privatize(x, y)
        assert info.step == 0 and priv.step == 1 and info.batch_size == 13  # one step, one noise draw
        out.append(grads(model))
    torch.testing.assert_close(out[1], out[0])
    torch.testing.assert_close(out[2], out[0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"plan": PrivatePlan(12, 4, steps=3)}, "noise_multiplier is unknown"),
    ],
)
def test_bad_privatizer_arguments_are_refused(kwargs, match):
    model = wide_model(6, 3)
    d = sum(p.numel() for p in model.parameters())
    plan = _plan()
    args = {"plan": plan, "clip_norm": 1.0, "noise": noise_stream(plan, d, 0)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Privatizer(model, F.cross_entropy, **args)


def test_a_privatizer_requires_a_plan():
    model = wide_model(6, 3)
    noise = noise_stream(_plan(), 21, 0)
    with pytest.raises(TypeError, match="plan=None is invalid: a Privatizer requires the run's"):
        Privatizer(model, F.cross_entropy, plan=None, clip_norm=1.0, noise=noise)
    with pytest.raises(TypeError, match="noise_multiplier"):  # the plan-less form is gone
        Privatizer(
            model,
            F.cross_entropy,
            clip_norm=1.0,
            noise=noise,
            noise_multiplier=1.0,
            sensitivity=1.0,
            expected_batch_size=4.0,
        )


def _plan():
    return PrivatePlan(12, 4, steps=3, scheme="fixed_order", noise_multiplier=1.0)


def test_noise_stream_must_match_the_model():
    model = wide_model(6, 3)
    with pytest.raises(ValueError, match="noise.dim=5"):
        Privatizer(
            model,
            F.cross_entropy,
            clip_norm=1.0,
            plan=_plan(),
            noise=noise_stream(_plan(), 5, 0),
        )
    with pytest.raises(TypeError, match="dtype"):
        Privatizer(
            model,
            F.cross_entropy,
            clip_norm=1.0,
            plan=_plan(),
            noise=noise_stream(_plan(), 21, 0, dtype=torch.float64),
        )


def test_default_micro_batch_bounds_the_per_example_gradient_memory():
    model = wide_model(6, 3)
    d = sum(p.numel() for p in model.parameters())
    priv = Privatizer(
        model,
        F.cross_entropy,
        clip_norm=1.0,
        plan=_plan(),
        noise=noise_stream(_plan(), d, 0),
    )
    assert priv.micro_batch_size == (1 << 24) // 21
    big = nn.Linear(2100, 1000)  # d = 2 101 000 > 2²⁴/8: at least 8 examples per micro-batch
    priv = Privatizer(
        big,
        F.cross_entropy,
        clip_norm=1.0,
        plan=_plan(),
        noise=noise_stream(_plan(), 2_101_000, 0),
    )
    assert priv.micro_batch_size == 8
