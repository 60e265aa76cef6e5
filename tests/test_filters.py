"""Temporal filters against independent truths: DOPPLER against scipy.signal (lfilter for the
recursion, dimpulse for the impulse response and the white-noise variance Σh²); DiSK on a
quadratic loss against the error recursion e_t = (1−κ)e_{t−1} + κw_t derived in closed form
(noise-free: the exact gradient; noisy: the predicted MSE factor); compositions against the
optimizers fed with pre-filtered gradients; the fresh-noise gain seen by DP-MuonBC."""

import math

import numpy as np
import pytest
import scipy.signal as ss
import torch

import dpmf.optim.transforms as transforms_module
from dpmf.optim import (
    DPSGD,
    Disk,
    DiskLookahead,
    Doppler,
    DPMuon,
    DPMuonBC,
    EvaluationPoint,
    StepContext,
    make_filter,
    single_pass_gamma,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


BUTTER2 = tuple(map(tuple, ss.butter(2, 0.1)))  # (b, a), second-order low-pass
FILTER_CASES = {
    "default": ((1.0, -0.9), (0.1,)),
    "butter2": (BUTTER2[1], BUTTER2[0]),
    "fir": ((1.0,), (0.5, 0.3, 0.2)),
    "double_pole": ((1.0, -1.6, 0.64), (0.02, 0.02)),
}


def run_stage(stage, inputs, param=None):
    """Feed the tensors ``inputs`` through ``stage``; return the outputs and fresh gains."""
    param = inputs[0] if param is None else param
    state = stage.init(param)
    outs, gains = [], []
    for g in inputs:
        out, state = stage.update(g, state, param, StepContext())
        outs.append(out.clone())
        gains.append(stage.fresh_gain(state))
    return outs, gains


def impulse_response(a, b, n):
    """h_0..h_{n−1} of b(z⁻¹)/a(z⁻¹) with scipy's state-space dimpulse (polynomials in z of
    equal degree, so no delay is introduced)."""
    L = max(len(a), len(b))
    num = np.concatenate([b, np.zeros(L - len(b))])
    den = np.concatenate([a, np.zeros(L - len(a))])
    _, (h,) = ss.dimpulse((num, den, 1), n=n)
    return h[:, 0]


# --- DOPPLER -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", FILTER_CASES)
def test_doppler_dc_gain_is_one_at_every_step(case):
    a, b = FILTER_CASES[case]
    const = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outs, _ = run_stage(Doppler(a, b), [const] * 40)
    for t, out in enumerate(outs, start=1):
        torch.testing.assert_close(out, const, rtol=1e-12, atol=0, msg=f"step {t}")


@pytest.mark.parametrize("case", FILTER_CASES)
def test_doppler_equals_scipy_lfilter_normalized_by_step_response(case):
    a, b = FILTER_CASES[case]
    rng = np.random.default_rng(1)
    G = rng.standard_normal((25, 4, 5))
    outs, gains = run_stage(Doppler(a, b), [torch.from_numpy(g) for g in G])
    ref = ss.lfilter(b, a, G, axis=0) / ss.lfilter(b, a, np.ones(25))[:, None, None]
    np.testing.assert_allclose(np.stack([o.numpy() for o in outs]), ref, rtol=1e-10, atol=1e-12)
    # the fresh gain is the coefficient of g_t in the output: b₀/c_t
    c = ss.lfilter(b, a, np.ones(25))
    np.testing.assert_allclose(gains, b[0] / a[0] / c, rtol=1e-12)
    assert gains[0] == pytest.approx(1.0)


@pytest.mark.parametrize("case", ["default", "butter2", "double_pole"])
def test_doppler_white_noise_variance_is_sum_of_squared_impulse_response(case):
    a, b = FILTER_CASES[case]
    T, N = 200, 100_000
    h = impulse_response(a, b, T)
    c = np.cumsum(h)  # response to a unit step = normalizer
    gen = torch.Generator().manual_seed(2)
    stage = Doppler(a, b)
    state = stage.init(torch.zeros(N))
    var = []
    for _ in range(T):
        out, state = stage.update(
            torch.randn(N, generator=gen, dtype=torch.float64), state, None, StepContext()
        )
        var.append(float(out.var()))
    predicted = np.cumsum(h**2) / c**2  # Var m̂_t = Σ_{k<t} h_k² / c_t²
    tol = 5 * math.sqrt(2 / N)  # relative std of a variance estimate from N Gaussian samples
    np.testing.assert_allclose(var, predicted, rtol=tol)
    # the steady state is the analytic Σ h_k² of the normalized filter h/Σh (whole response)
    h_all = impulse_response(a, b, 5000)
    steady = np.sum(h_all**2) / np.sum(h_all) ** 2
    assert np.sum(h_all) == pytest.approx(np.sum(b) / np.sum(a), rel=1e-12)  # DC gain
    assert var[-1] == pytest.approx(steady, rel=tol)
    assert steady < 0.2  # the filter does reduce white noise (first order: 0.1/1.9)


def test_doppler_state_on_parameter_device_and_dtype_and_memory():
    p = torch.zeros(3, 4, dtype=torch.float32)
    b, a = BUTTER2
    stage = Doppler(a, b)
    state = stage.init(p)
    for _ in range(4):
        out, state = stage.update(torch.ones(3, 4), state, p, StepContext())
    assert out.dtype == torch.float32
    assert len(state["outputs"]) == 2 and len(state["inputs"]) == 2  # na = nb = 2
    assert all(x.dtype == torch.float32 and x.shape == p.shape for x in state["outputs"] + state["inputs"])
    default = Doppler()
    s = default.init(p)
    for _ in range(3):
        _, s = default.update(torch.ones(3, 4), s, p, StepContext())
    assert len(s["outputs"]) == 1 and s["inputs"] == []  # one buffer, as momentum
    assert s["normalizer"] == pytest.approx(1 - 0.9**3)


def test_doppler_does_not_modify_its_input():
    g = torch.randn(5, dtype=torch.float64)
    keep = g.clone()
    run_stage(Doppler(*FILTER_CASES["butter2"]), [g, g, g])
    assert torch.equal(g, keep)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(a=(1.0, -1.1)), "stable"),
        (dict(a=(1.0, 1.0)), "stable"),
        (dict(a=(0.0, 1.0)), r"a\[0\]"),
        (dict(b=(0.0, 0.1)), r"b\[0\]"),
        (dict(b=(1.0, -1.0)), "DC gain"),
        (dict(b=(0.3, -0.1, -0.2)), "normalizer"),
        (dict(b=(float("nan"),)), "NaN"),
        (dict(a=()), "length"),
    ],
)
def test_doppler_bad_coefficients_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Doppler(**kwargs)


def test_doppler_coefficients_normalized_by_a0():
    assert Doppler((2.0, -1.8), (0.2,)) == Doppler()


# --- DiSK on a quadratic -------------------------------------------------------------------------


def quadratic(d, seed):
    """f(x) = ½ Σ h_i x_i² − Σ r_i x_i: known diagonal Hessian, gradient H x − r."""
    rng = np.random.default_rng(seed)
    h = torch.from_numpy(rng.uniform(0.2, 1.0, d))
    r = torch.from_numpy(rng.standard_normal(d))
    x0 = torch.from_numpy(rng.standard_normal(d))
    return h, r, x0


def plan_gradient(plan, x, h, r):
    """Σ_j w_j ∇f(x + shift_j) for the quadratic (the loop's side of DiSK)."""
    total = torch.zeros_like(x)
    for point in plan:
        at = x if point.shift is None else x + point.shift["x"]
        total += point.weight * (h * at - r)
    return total


def run_disk(kappa, gamma, steps, noise_std, d=6, seed=3, lr=0.5, lookahead=True):
    """DiSK-SGD (DPSGD with the Disk filter, momentum 0) on the quadratic; returns per step the
    filtered gradient m_t, the true gradient ∇f(x_t) and the noisy observation."""
    h, r, x0 = quadratic(d, seed)
    x = torch.nn.Parameter(x0.clone())
    opt = DPSGD([("x", x)], lr=lr, filter=Disk(kappa, gamma), allow_unprivatized=True)
    look = DiskLookahead(kappa, gamma)
    gen = torch.Generator().manual_seed(seed + 100)
    filtered, true, observed = [], [], []
    for _ in range(steps):
        plan = look.points([("x", x)]) if lookahead else (EvaluationPoint(1.0),)
        noise = noise_std * torch.randn(d, generator=gen, dtype=torch.float64)
        x.grad = plan_gradient(plan, x.detach(), h, r) + noise
        true.append(h * x.detach() - r)
        observed.append(true[-1] + noise)
        before = x.detach().clone()
        opt.step()
        filtered.append((before - x.detach()) / lr)  # momentum 0: the step is lr·m_t
    return filtered, true, observed


def test_disk_without_noise_returns_the_true_gradient():
    for kappa, gamma in [(0.7, 0.5), (0.3, 2.0), (0.7, single_pass_gamma(0.7)), (1.0, 0.5)]:
        filtered, true, _ = run_disk(kappa, gamma, steps=12, noise_std=0.0)
        for t, (m, g) in enumerate(zip(filtered, true, strict=True), start=1):
            torch.testing.assert_close(
                m, g, rtol=1e-10, atol=1e-12, msg=f"kappa={kappa} gamma={gamma} step {t}"
            )
    # the prediction matters: the same filter fed the gradient at x_t only lags behind
    filtered, true, _ = run_disk(0.7, 0.5, steps=5, noise_std=0.0, lookahead=False)
    assert float((filtered[-1] - true[-1]).abs().max()) > 1e-3


def disk_mse_factor(kappa, t):
    """E‖m_t − ∇f(x_t)‖² / E‖w_t‖² for DiSK on a quadratic with i.i.d. noise w_t.

    Derivation: ∇f is affine, so the finite difference is exact and the observation is
    ∇f(x_t) + ((1−κ)/κ)·H d_t + w_t; with ∇f(x_t) = ∇f(x_{t−1}) + H d_t the error
    e_t = m_t − ∇f(x_t) obeys e_t = (1−κ)·e_{t−1} + κ·w_t, e_1 = w_1, whatever the trajectory.
    Hence Var e_t/s² = (1−κ)^{2(t−1)} + κ²·Σ_{j<t−1}(1−κ)^{2j} → κ/(2−κ).
    """
    q = (1 - kappa) ** 2
    return q ** (t - 1) + kappa**2 * (1 - q ** (t - 1)) / (1 - q)


@pytest.mark.parametrize("kappa, gamma", [(0.7, 0.5), (0.4, 1.0)])
def test_disk_mse_reduced_by_the_predicted_factor(kappa, gamma):
    d, steps, s = 40_000, 10, 0.3
    filtered, true, observed = run_disk(kappa, gamma, steps, noise_std=s, d=d, lr=0.3)
    tol = 5 * math.sqrt(2 / d)  # relative std of a mean of d squared Gaussians
    for t in range(1, steps + 1):
        mse_filtered = float(((filtered[t - 1] - true[t - 1]) ** 2).mean())
        mse_plain = float(((observed[t - 1] - true[t - 1]) ** 2).mean())
        assert mse_plain == pytest.approx(s**2, rel=tol)
        factor = disk_mse_factor(kappa, t)
        assert mse_filtered / mse_plain == pytest.approx(factor, rel=2 * tol), f"step {t}"
    assert disk_mse_factor(kappa, steps) == pytest.approx(kappa / (2 - kappa), rel=1e-3)


def test_disk_fresh_gain_and_first_step():
    g1, g2 = torch.ones(3), 3 * torch.ones(3)
    outs, gains = run_stage(Disk(0.7, 0.5), [g1, g2])
    torch.testing.assert_close(outs[0], g1)
    torch.testing.assert_close(outs[1], 0.3 * g1 + 0.7 * g2)
    assert gains == [1.0, 0.7]


# --- DiSK's evaluation plan ----------------------------------------------------------------------


def test_disk_lookahead_points():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    look = DiskLookahead(0.7, 0.5)
    (p1,) = look.points([("x", x)])
    assert p1.weight == 1.0 and p1.shift is None
    x2 = torch.tensor([0.5, 3.0], dtype=torch.float64)
    p_now, p_ahead = look.points([("x", x2)])
    c = 0.3 / (0.7 * 0.5)
    assert p_now.weight == pytest.approx(1 - c) and p_now.shift is None
    assert p_ahead.weight == pytest.approx(c)
    torch.testing.assert_close(p_ahead.shift["x"], 0.5 * (x2 - x))
    # γ = (1−κ)/κ: the gradient at x_t drops out, one pass at the extrapolated point
    single = DiskLookahead(0.7, single_pass_gamma(0.7))
    single.points([("x", x)])
    (only,) = single.points([("x", x2)])
    assert only.weight == 1.0 and single.passes == 1
    torch.testing.assert_close(only.shift["x"], (0.3 / 0.7) * (x2 - x))
    assert DiskLookahead(0.7, 0.5).passes == 2
    assert DiskLookahead(1.0, 0.5).passes == 1  # no filtering, no extrapolation
    with pytest.raises(ValueError, match="names"):
        look.points([("y", x)])


def test_disk_lookahead_state_dict_round_trip():
    a, b = DiskLookahead(0.6, 0.8), DiskLookahead(0.6, 0.8)
    x0, x1 = torch.zeros(3), torch.arange(3.0)
    a.points([("w", x0)])
    b.load_state_dict(a.state_dict())
    (_, pa), (_, pb) = a.points([("w", x1)]), b.points([("w", x1)])
    assert torch.equal(pa.shift["w"], pb.shift["w"])
    with pytest.raises(ValueError, match="kappa"):
        DiskLookahead(0.5, 0.8).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kappa=0.0), "kappa"),
        (dict(kappa=1.5), "kappa"),
        (dict(gamma=0.0), "gamma"),
        (dict(gamma=float("inf")), "gamma"),
    ],
)
def test_disk_bad_hyperparameters_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Disk(**kwargs)
    with pytest.raises(ValueError, match=match):
        DiskLookahead(**kwargs)


# --- composition with the optimizers -----------------------------------------------------------


def test_doppler_muon_equals_muon_on_prefiltered_gradients():
    a, b = FILTER_CASES["butter2"]
    rng = np.random.default_rng(4)
    G = rng.standard_normal((6, 5, 3))
    pre = ss.lfilter(b, a, G, axis=0) / ss.lfilter(b, a, np.ones(6))[:, None, None]
    x0 = torch.from_numpy(rng.standard_normal((5, 3)))
    p1, p2 = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    o1 = DPMuon([p1], lr=0.1, beta=0.9, filter=Doppler(a, b), allow_unprivatized=True)
    o2 = DPMuon([p2], lr=0.1, beta=0.9, allow_unprivatized=True)
    for t in range(6):
        p1.grad, p2.grad = torch.from_numpy(G[t]), torch.from_numpy(pre[t])
        o1.step()
        o2.step()
        torch.testing.assert_close(p1.detach(), p2.detach(), rtol=1e-9, atol=1e-11)


def test_disk_sgd_with_momentum_equals_sgd_on_prefiltered_gradients():
    rng = np.random.default_rng(5)
    G = rng.standard_normal((5, 4))
    pre, m = [], None
    for g in G:
        m = g.copy() if m is None else 0.3 * m + 0.7 * g
        pre.append(m)
    p1, p2 = (
        torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)),
        torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)),
    )
    o1 = DPSGD([p1], lr=0.1, momentum=0.9, filter=Disk(0.7, 0.5), allow_unprivatized=True)
    o2 = DPSGD([p2], lr=0.1, momentum=0.9, allow_unprivatized=True)
    for t in range(5):
        p1.grad, p2.grad = torch.from_numpy(G[t]), torch.from_numpy(pre[t])
        o1.step()
        o2.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["doppler", "disk"])
def test_muon_bc_after_a_filter_gets_the_filtered_fresh_noise_std(name, monkeypatch):
    seen = []
    original = transforms_module.newton_schulz_bc

    def spy(Y, noise_std, **kwargs):
        seen.append(float(noise_std))
        return original(Y, noise_std, **kwargs)

    monkeypatch.setattr(transforms_module, "newton_schulz_bc", spy)
    beta, std = 0.9, 0.4
    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = DPMuonBC([p], lr=0.01, beta=beta, filter=make_filter(name), noise_std=std, allow_unprivatized=True)
    for _ in range(3):
        p.grad = torch.randn(4, 6)
        opt.step()
    if name == "doppler":  # b₀/c_t with c_t = 1 − 0.9ᵗ
        gains = [0.1 / (1 - 0.9**t) for t in (1, 2, 3)]
    else:
        gains = [1.0, 0.7, 0.7]
    assert seen == pytest.approx([g * (1 - beta) * (1 + beta) * std for g in gains])


@pytest.mark.parametrize("stage", [Doppler(*FILTER_CASES["butter2"]), Disk(0.7, 0.5)])
def test_filtered_optimizer_resumes_exactly(stage, tmp_path):
    grads = [torch.randn(6, 4, generator=torch.Generator().manual_seed(t)) for t in range(6)]

    def run(split):
        p = torch.nn.Parameter(torch.ones(6, 4))
        opt = DPMuon([p], lr=0.05, filter=stage, allow_unprivatized=True)
        for t, g in enumerate(grads):
            if t == split:
                path = tmp_path / "ckpt.pt"
                torch.save({"p": p.detach(), "opt": opt.state_dict()}, path)
                saved = torch.load(path, weights_only=True)
                p = torch.nn.Parameter(saved["p"].clone())
                opt = DPMuon([p], lr=0.05, filter=stage, allow_unprivatized=True)
                opt.load_state_dict(saved["opt"])
            p.grad = g.clone()
            opt.step()
        return p.detach()

    assert torch.equal(run(None), run(3))


def test_make_filter():
    assert make_filter("none") is None
    assert make_filter("doppler", a=(1, -0.5), b=(0.5,)) == Doppler((1.0, -0.5), (0.5,))
    assert make_filter("disk", kappa=0.5, gamma=1.0) == Disk(0.5, 1.0)
    with pytest.raises(ValueError, match="filter"):
        make_filter("kalman")


def test_state_dict_is_plain_data_and_refuses_another_filter():
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = DPSGD([p], lr=0.1, filter=Doppler(), allow_unprivatized=True)
    p.grad = torch.ones(3, 2)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["filter"] == {"dpmf_stage": repr(Doppler())}
    other = DPSGD([p], lr=0.1, filter=Doppler((1.0, -0.5), (0.5,)), allow_unprivatized=True)
    with pytest.raises(ValueError, match="filter"):
        other.load_state_dict(sd)
    same = DPSGD([p], lr=0.1, filter=Doppler(), allow_unprivatized=True)
    same.load_state_dict(sd)
    assert same.param_groups[0]["filter"] == Doppler()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_filters_on_cuda_match_cpu():
    for stage in (Doppler(*FILTER_CASES["butter2"]), Disk(0.7, 0.5)):
        outs = []
        for device in ("cpu", "cuda"):
            p = torch.nn.Parameter(torch.ones(8, 6, device=device))
            opt = DPMuon([p], lr=0.05, filter=stage, allow_unprivatized=True)
            for t in range(4):
                g = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
                p.grad = g.to(device)
                opt.step()
            state = opt.state[p]["transform"]["0"]
            tensors = state.get("outputs", []) + [state.get("estimate")]
            assert all(x.device.type == device for x in tensors if x is not None)
            outs.append(p.detach().cpu())
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


def test_state_dict_without_filter_refused_by_a_filtered_optimizer():
    p = torch.nn.Parameter(torch.ones(3, 2))
    plain = DPSGD([p], lr=0.1, allow_unprivatized=True)
    with pytest.raises(ValueError, match="filter=None"):
        DPSGD([p], lr=0.1, filter=Disk(), allow_unprivatized=True).load_state_dict(plain.state_dict())
