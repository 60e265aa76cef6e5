"""DP optimizers against references: DP-Muon re-derived inline from the DP-Muon paper's formulas,
DP-SGD/DP-Adam against torch.optim.SGD/Adam/AdamW, DP-Muon-S against numpy's SVD; and the
invariants (zero gradient, scale invariance, conv reshaping, finiteness, checkpoints)."""

import numpy as np
import pytest
import torch

import dpmf.optim.bias_correction as bc_module
import dpmf.optim.transforms as transforms_module
from dpmf.optim import (
    DPSGD,
    Chain,
    DPAdam,
    DPMuon,
    DPMuonBC,
    DPMuonS,
    EmaMomentum,
    Scale,
    Transform,
)

A, B, C = 3.4445, -4.7750, 2.0315


def ns_reference(G):
    """The DP-Muon paper (Sec. Method), written out: X₀ = G/‖G‖_F, X ← aX + b(XXᵀ)X + c(XXᵀ)²X five times."""
    X = G / np.linalg.norm(G)
    for _ in range(5):
        XXt = X @ X.T
        X = A * X + B * XXt @ X + C * XXt @ XXt @ X
    return X


def grads_for(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) * scale for p in params]


def make_params(shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


# --- DP-Muon as the paper ----------------------------------------------------------------------


def test_dp_muon_matches_design_formulas_step_by_step():
    beta, lr, mu, vlr = 0.9, 0.05, 0.8, 0.3
    # wide linear, tall linear, very tall (aspect capped), conv kernel, bias
    shapes = [(3, 5), (7, 3), (20, 2), (4, 2, 2, 2), (6,)]
    params = make_params(shapes, seed=1)
    opt = DPMuon(params, lr=lr, beta=beta, vector_momentum=mu, vector_lr=vlr, allow_unprivatized=True)
    theta = [p.detach().numpy().copy() for p in params]
    M = [np.zeros(s) for s in shapes]
    buf = np.zeros(6)
    for t in range(4):
        grads = grads_for(params, seed=10 + t)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (shape, g) in enumerate(zip(shapes, grads, strict=True)):
            G = g.numpy()
            if len(shape) == 1:  # DP-SGD heavy-ball momentum
                buf = mu * buf + G
                theta[i] = theta[i] - vlr * buf
                continue
            M[i] = beta * M[i] + (1 - beta) * G
            Mhat = (1 - beta) * G + beta * M[i]
            m, n = shape[0], int(np.prod(shape[1:]))
            X5 = ns_reference(Mhat.reshape(m, n))
            update = np.sqrt(min(4.0, max(1.0, m / n))) * X5
            theta[i] = theta[i] - lr * update.reshape(shape)
            state = opt.state[params[i]]["transform"]["0"]["momentum"]
            np.testing.assert_allclose(state.numpy(), M[i], rtol=1e-12, atol=1e-14)
        for p, ref in zip(params, theta, strict=True):
            np.testing.assert_allclose(p.detach().numpy(), ref, rtol=1e-9, atol=1e-11)


def test_dp_muon_float32_close_to_float64_reference():
    p = make_params([(16, 24)], seed=2, dtype=torch.float32)[0]
    opt = DPMuon([p], lr=1.0, beta=0.0, allow_unprivatized=True)  # one step: update = NS(G)
    theta0 = p.detach().double().numpy().copy()
    G = grads_for([p], seed=3)[0]
    p.grad = G
    opt.step()
    ref = theta0 - ns_reference(G.double().numpy())
    np.testing.assert_allclose(p.detach().double().numpy(), ref, atol=2e-5)


def test_conv_kernel_reshaped_out_by_in_kh_kw():
    for shape, factor in [((4, 3, 3, 3), 1.0), ((64, 1, 2, 2), 2.0)]:
        p = make_params([shape], seed=4)[0]
        theta0 = p.detach().numpy().copy()
        opt = DPMuon([p], lr=1.0, beta=0.0, allow_unprivatized=True)
        G = grads_for([p], seed=5)[0]
        p.grad = G
        opt.step()
        rows = shape[0]
        ref = factor * ns_reference(G.numpy().reshape(rows, -1)).reshape(shape)
        np.testing.assert_allclose(theta0 - p.detach().numpy(), ref, rtol=1e-9, atol=1e-11)
        # Not the polar factor of a batch of kh×kw (or of (out·in) × (kh·kw)) matrices.
        wrong = ns_reference(G.numpy().reshape(-1, shape[-1] * shape[-2])).reshape(shape)
        assert np.abs(ref - wrong).max() > 1e-2


# --- DP-SGD and DP-Adam against torch ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(momentum=0.0),
        dict(momentum=0.9, weight_decay=1e-2),
        dict(momentum=0.9, nesterov=True, weight_decay=5e-3),
    ],
)
def test_dp_sgd_matches_torch_sgd(kwargs):
    shapes = [(5, 4), (4,), (2, 3, 2, 2)]
    ours, ref = make_params(shapes, seed=6), make_params(shapes, seed=6)
    o1, o2 = DPSGD(ours, lr=0.1, **kwargs, allow_unprivatized=True), torch.optim.SGD(ref, lr=0.1, **kwargs)
    for t in range(6):
        for a, b, g in zip(ours, ref, grads_for(ours, seed=20 + t), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs, torch_cls",
    [
        (dict(), torch.optim.Adam),
        (dict(weight_decay=1e-2), torch.optim.Adam),
        (dict(betas=(0.8, 0.99), eps=1e-6), torch.optim.Adam),
        (dict(weight_decay=1e-2, decoupled_weight_decay=True), torch.optim.AdamW),
    ],
)
def test_dp_adam_matches_torch_adam(kwargs, torch_cls):
    shapes = [(5, 4), (4,)]
    ours, ref = make_params(shapes, seed=7), make_params(shapes, seed=7)
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "decoupled_weight_decay"}
    o1, o2 = DPAdam(ours, lr=0.01, **kwargs, allow_unprivatized=True), torch_cls(ref, lr=0.01, **torch_kwargs)
    for t in range(6):
        for a, b, g in zip(ours, ref, grads_for(ours, seed=30 + t), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


# --- DP-Muon-S --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 10), (12, 2)])
def test_dp_muon_s_matches_sigma1_times_uncapped_aspect(shape):
    beta, lr = 0.8, 0.1
    p = make_params([shape], seed=8)[0]
    opt = DPMuonS([p], lr=lr, beta=beta, power_iterations=60, allow_unprivatized=True)
    theta = p.detach().numpy().copy()
    M = np.zeros(shape)
    m, n = shape
    for t in range(3):
        G = grads_for([p], seed=40 + t)[0]
        p.grad = G.clone()
        opt.step()
        G = G.numpy()
        M = beta * M + (1 - beta) * G
        Mhat = (1 - beta) * G + beta * M
        sigma1 = np.linalg.svd(M, compute_uv=False)[0]  # of the heavy-ball momentum M_t
        theta = theta - lr * sigma1 * np.sqrt(max(1.0, m / n)) * ns_reference(Mhat)
        np.testing.assert_allclose(p.detach().numpy(), theta, rtol=1e-8, atol=1e-10)


def test_dp_muon_s_is_homogeneous_of_degree_one():
    base = make_params([(10, 6)], seed=9, dtype=torch.float32)[0].detach()
    G = grads_for([base], seed=10)[0]
    steps = {}
    for c in [1e-10, 1.0, 1e10]:
        w = torch.nn.Parameter(base.clone())
        opt = DPMuonS([w], lr=1.0 / c, allow_unprivatized=True)  # moves of order 1 whatever c
        for _ in range(3):
            w.grad = G * c
            opt.step()
        steps[c] = base.double() - w.detach().double()
    for c in [1e-10, 1e10]:
        assert (steps[c] - steps[1.0]).norm() / steps[1.0].norm() < 1e-4


# --- invariants -------------------------------------------------------------------------------


def _all_optimizers(params):
    bc = DPMuonBC(params, lr=0.1, noise_std=0.7, allow_unprivatized=True)
    return [
        DPSGD(params, lr=0.1, momentum=0.9, allow_unprivatized=True),
        DPAdam(params, lr=0.1, allow_unprivatized=True),
        DPMuon(params, lr=0.1, allow_unprivatized=True),
        DPMuonS(params, lr=0.1, allow_unprivatized=True),
        bc,
    ]


def test_zero_gradient_gives_zero_update_for_every_optimizer():
    params = make_params([(5, 7), (3, 2, 2, 2), (5,)], seed=11, dtype=torch.float32)
    before = [p.detach().clone() for p in params]
    for opt in _all_optimizers(params):
        for _ in range(2):
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
        for p, b in zip(params, before, strict=True):
            assert torch.equal(p.detach(), b), type(opt).__name__


@pytest.mark.parametrize("base", [1e-12, 1.0, 1e12])
def test_matrix_update_invariant_to_gradient_scale(base):
    w0 = make_params([(12, 20), (6, 3, 2, 2)], seed=12, dtype=torch.float32)
    grads = [grads_for(w0, seed=50 + t, scale=base) for t in range(3)]
    moves = {}
    for c in [1e-10, 1e-5, 1.0, 1e5, 1e10]:
        params = [torch.nn.Parameter(p.detach().clone()) for p in w0]
        opt = DPMuon(params, lr=1.0, allow_unprivatized=True)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g * c  # float32 entries from 1e-22 to 1e22
            opt.step()
        moves[c] = [(a.detach() - b.detach()).double() for a, b in zip(w0, params, strict=True)]
    for c, move in moves.items():
        for m_c, m_1 in zip(move, moves[1.0], strict=True):
            assert torch.isfinite(m_c).all()
            assert (m_c - m_1).norm() / m_1.norm() < 1e-5, c


def test_non_finite_gradient_refused_before_any_update():
    params = make_params([(4, 5), (4,)], seed=13, dtype=torch.float32)
    named = [("layer.weight", params[0]), ("layer.bias", params[1])]
    before = [p.detach().clone() for p in params]
    for bad in [float("nan"), float("inf")]:
        opt = DPMuon(named, lr=0.1, allow_unprivatized=True)
        params[0].grad = torch.ones(4, 5)
        params[1].grad = torch.ones(4)
        params[1].grad[2] = bad
        with pytest.raises(ValueError, match="'layer.bias'.*NaN or infinite"):
            opt.step()
        for p, b in zip(params, before, strict=True):
            assert torch.equal(p.detach(), b)
        assert not opt.state  # no state was created either


def test_non_matrices_never_reach_newton_schulz(monkeypatch):
    seen = []

    def spy(fn):
        def wrapped(G, *args, **kwargs):
            seen.append((tuple(G.shape), kwargs.get("batched", False)))
            return fn(G, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(transforms_module, "newton_schulz", spy(transforms_module.newton_schulz))
    monkeypatch.setattr(bc_module, "newton_schulz", spy(bc_module.newton_schulz))
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3),
        torch.nn.GroupNorm(2, 4),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 5),
    )
    x = torch.randn(3, 2, 6, 6)
    for cls in [DPMuon, DPMuonS, DPMuonBC]:
        seen.clear()
        opt = cls(model.parameters(), lr=0.01, noise_std=0.1, allow_unprivatized=True)
        model.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        mats = sorted(shape[-2:] for shape, _ in seen)
        assert mats == [(4, 18), (5, 64)], cls.__name__
        for shape, batched in seen:
            assert len(shape) == (3 if batched else 2)


def test_degenerate_and_vector_parameters_refused_by_matrix_rules():
    scale = torch.nn.Parameter(torch.ones(8, 1, 1))
    with pytest.raises(ValueError, match=r"'scale'.*\(8, 1, 1\).*rules=\{'scale': 'sgd'\}"):
        DPMuon([("scale", scale)], lr=0.1, allow_unprivatized=True)
    with pytest.raises(ValueError, match=r"params\[0\].*\(8, 1, 1\)"):
        DPMuonBC([scale], lr=0.1, allow_unprivatized=True)
    bias = torch.nn.Parameter(torch.ones(8))
    with pytest.raises(ValueError, match=r"'bias'.*\(8,\)"):
        DPMuon([{"params": [("bias", bias)], "rule": "muon"}], lr=0.1, allow_unprivatized=True)
    # Routed explicitly to a vector rule, both are fine.
    DPMuon([{"params": [("scale", scale), ("bias", bias)], "rule": "sgd"}], lr=0.1, allow_unprivatized=True)


def test_bad_hyperparameters_named():
    p = [torch.nn.Parameter(torch.ones(3, 4))]
    cases = [
        (lambda: DPSGD(p, allow_unprivatized=True), "lr is required"),
        (lambda: DPSGD(p, lr=-1.0, allow_unprivatized=True), "lr=-1.0"),
        (lambda: DPSGD(p, lr=0.1, momentum=1.0, allow_unprivatized=True), "momentum=1.0"),
        (lambda: DPSGD(p, lr=0.1, nesterov=True, allow_unprivatized=True), "nesterov"),
        (lambda: DPSGD(p, lr=0.1, weight_decay=-1e-3, allow_unprivatized=True), "weight_decay"),
        (lambda: DPAdam(p, betas=(1.0, 0.9), allow_unprivatized=True), "b1=1.0"),
        (lambda: DPAdam(p, eps=0.0, allow_unprivatized=True), "eps=0.0"),
        (lambda: DPMuon(p, beta=1.0, allow_unprivatized=True), "beta=1.0"),
        (lambda: DPMuon(p, ns_steps=-1, allow_unprivatized=True), "steps=-1"),
        (lambda: DPMuon(p, ns_coefficients=(1.0, 2.0), allow_unprivatized=True), "coefficients"),
        (lambda: DPMuonS(p, power_iterations=0, allow_unprivatized=True), "power_iterations=0"),
        (lambda: DPMuonBC(p, order=0, allow_unprivatized=True), "order=0"),
        (lambda: DPMuonBC(p, probes=0, allow_unprivatized=True), "probes=0"),
        (lambda: DPMuon([{"params": p, "rule": "lion"}], allow_unprivatized=True), "rule='lion'"),
        (lambda: DPMuon(p, vector_lr=-0.1, allow_unprivatized=True), "vector_lr"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match="unexpected keyword"):
        DPMuon(p, momentun=0.9, allow_unprivatized=True)
    with pytest.raises(TypeError, match="vector_momentum"):
        DPMuon(p, momentum=0.9, allow_unprivatized=True)
    with pytest.raises(TypeError, match="filter"):
        DPSGD(p, lr=0.1, filter="lowpass", allow_unprivatized=True)


# --- extension points -------------------------------------------------------------------------


def test_filter_stage_runs_first_and_enters_the_noise_std(monkeypatch):
    params = make_params([(4, 6)], seed=14, dtype=torch.float32)
    plain = make_params([(4, 6)], seed=14, dtype=torch.float32)
    o1 = DPSGD(params, lr=0.1, momentum=0.9, filter=Scale(0.5), allow_unprivatized=True)
    o2 = DPSGD(plain, lr=0.05, momentum=0.9, allow_unprivatized=True)
    for t in range(3):
        for a, b, g in zip(params, plain, grads_for(params, seed=60 + t), strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(params[0], plain[0], rtol=1e-6, atol=1e-7)

    seen = []
    original = transforms_module.newton_schulz_bc

    def spy(Y, noise_std, **kwargs):
        seen.append(float(noise_std))
        return original(Y, noise_std, **kwargs)

    monkeypatch.setattr(transforms_module, "newton_schulz_bc", spy)
    beta, std = 0.9, 0.4
    opt = DPMuonBC(params, lr=0.1, beta=beta, filter=Scale(0.5), noise_std=std, allow_unprivatized=True)
    params[0].grad = torch.ones(4, 6)
    opt.step()
    assert seen == [pytest.approx(0.5 * (1 - beta) * (1 + beta) * std)]

    class Opaque(Transform):  # declares no fresh_gain
        def update(self, update, state, param, ctx):
            return update.tanh(), state

    opt = DPMuonBC(params, lr=0.1, filter=Opaque(), noise_std=std, allow_unprivatized=True)
    with pytest.raises(ValueError, match="fresh_gain"):
        opt.step()


def test_custom_transform_group():
    p = make_params([(3, 4)], seed=15)[0]
    theta0 = p.detach().clone()
    opt = DPSGD(
        [{"params": [p], "transform": Chain((EmaMomentum(0.5, False), Scale(2.0)))}],
        lr=0.1,
        allow_unprivatized=True,
    )
    G = grads_for([p], seed=16)[0]
    p.grad = G
    opt.step()
    torch.testing.assert_close(p.detach(), theta0 - 0.1 * 2.0 * 0.5 * G)


@pytest.mark.parametrize("cls", [DPMuonS, DPAdam, DPMuon, DPMuonBC])
def test_resume_from_state_dict_is_exact(cls, tmp_path):
    shapes = [(6, 4), (4,)]
    grads = [grads_for(make_params(shapes), seed=70 + t) for t in range(5)]

    def run(split):
        params = make_params(shapes, seed=17, dtype=torch.float32)
        opt = cls(params, lr=0.05, noise_std=0.2, allow_unprivatized=True)
        for t, gs in enumerate(grads):
            if t == split:
                path = tmp_path / f"{cls.__name__}.pt"
                torch.save({"p": [p.detach() for p in params], "opt": opt.state_dict()}, path)
                saved = torch.load(path, weights_only=True)  # plain data and tensors only
                params = [torch.nn.Parameter(x.clone()) for x in saved["p"]]
                opt = cls(params, lr=0.05, noise_std=0.2, allow_unprivatized=True)
                opt.load_state_dict(saved["opt"])  # restores the probe generator
            for p, g in zip(params, gs, strict=True):
                p.grad = g.float()
            opt.step()
        return [p.detach() for p in params]

    for a, b in zip(run(None), run(3), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    shapes = [(16, 24), (8, 3, 3, 3), (8,)]
    for cls in [DPSGD, DPAdam, DPMuon, DPMuonS, DPMuonBC]:
        cpu = make_params(shapes, seed=18, dtype=torch.float32)
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        outs = []
        for params in (cpu, gpu):
            opt = cls(params, lr=0.05, noise_std=0.0, allow_unprivatized=True)
            for t in range(3):
                for p, g in zip(params, grads_for(cpu, seed=80 + t), strict=True):
                    p.grad = g.to(p.device)
                opt.step()
            outs.append([p.detach().cpu() for p in params])
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
