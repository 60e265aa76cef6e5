"""DP-MuonBC: the heat-extrapolation estimator on maps with known Gaussian means, on the
Newton–Schulz map, and inside the optimizer.

Closed form used (Z with iid N(0, 1) entries, M of shape m×n): for the cubic map
f(X) = X·Xᵀ·X, the terms of f(M + sZ) odd in Z have mean zero and
E[Z·Zᵀ] = n·I_m, E[Zᵀ·Z] = m·I_n, E[Z·Mᵀ·Z] = M (entry (i, j): Σ_{k,l} E[Z_ik Z_lj] M_lk
= M_ij), so E f(M + sZ) = f(M) + s²·(m + n + 1)·M exactly.
"""

import math

import numpy as np
import pytest
import torch

from dpmf.optim import (
    DPMuon,
    DPMuonBC,
    EmaMomentum,
    StepContext,
    aspect_factor,
    bias_corrected,
    newton_schulz,
    newton_schulz_bc,
    richardson_weights,
)


def cubic(X):
    return X @ X.mT @ X


def quintic(X):
    return X @ X.mT @ X @ X.mT @ X


def _draws(M, s, N, seed):
    """N antithetic pairs of Y = M ± s·Z, float64: shape (2N, m, n)."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(N, *M.shape, generator=g, dtype=torch.float64)
    return torch.cat([M + s * Z, M - s * Z]), g


def _pair_mean(E, N):
    """Average each antithetic pair: N iid samples."""
    return (E[:N] + E[N:]) / 2


def _entry_z(samples, center):
    """Per-entry z-scores of the mean of iid samples against ``center``."""
    n = samples.shape[0]
    se = samples.std(dim=0) / math.sqrt(n)
    return (samples.mean(dim=0) - center) / se, se


def test_richardson_weights_solve_the_extrapolation_conditions():
    for K in range(0, 6):
        w = np.array(richardson_weights(K))
        x = np.arange(1, K + 2, dtype=np.float64)  # nodes h_k/s² = k + 1
        vander = np.vander(x, K + 1, increasing=True).T  # row j: x_k^j
        rhs = np.zeros(K + 1)
        rhs[0] = 1.0
        np.testing.assert_allclose(w, np.linalg.solve(vander, rhs), rtol=1e-12, atol=1e-9)
    assert richardson_weights(1) == (2.0, -1.0)
    assert richardson_weights(2) == (3.0, -3.0, 1.0)
    with pytest.raises(ValueError, match="order"):
        richardson_weights(-1)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4)])
def test_cubic_map_plain_bias_is_s2_T_and_first_order_is_unbiased(shape):
    m, n = shape
    M = torch.randn(m, n, generator=torch.Generator().manual_seed(10 + m), dtype=torch.float64)
    s, N = 0.3, 20000
    Y, g = _draws(M, s, N, seed=20 + m)
    exact_bias = s**2 * (m + n + 1) * M
    plain = _pair_mean(cubic(Y), N)
    z_plain, se_plain = _entry_z(plain, cubic(M) + exact_bias)
    assert z_plain.abs().max() < 5.0
    # The bias is large against the Monte Carlo error, so a wrong T(M) would be caught.
    assert exact_bias.norm() > 50 * se_plain.norm()
    bc = _pair_mean(bias_corrected(cubic, Y, s, order=1, probes=1, generator=g), N)
    z_bc, se_bc = _entry_z(bc, cubic(M))
    assert z_bc.abs().max() < 5.0
    assert exact_bias.norm() > 20 * se_bc.norm()


def test_cubic_map_without_antithetic_probes_is_unbiased_too():
    M = torch.randn(3, 4, generator=torch.Generator().manual_seed(30), dtype=torch.float64)
    s, N = 0.3, 20000
    Y, g = _draws(M, s, N, seed=31)
    bc = _pair_mean(bias_corrected(cubic, Y, s, order=1, probes=2, antithetic=False, generator=g), N)
    z, se = _entry_z(bc, cubic(M))
    assert z.abs().max() < 5.0 and (s**2 * 8 * M).norm() > 20 * se.norm()


def test_quintic_map_needs_second_order():
    # φ(h) = E f(M + √h ξ) is quadratic in h for a quintic f: order 2 is exactly unbiased,
    # order 1 keeps a bias −2·c₂·s⁴.
    M = torch.randn(3, 4, generator=torch.Generator().manual_seed(40), dtype=torch.float64)
    s, N = 0.35, 40000
    Y, g = _draws(M, s, N, seed=41)
    target = quintic(M)
    bc2 = _pair_mean(bias_corrected(quintic, Y, s, order=2, probes=1, generator=g), N)
    z2, _ = _entry_z(bc2, target)
    assert z2.abs().max() < 5.0
    bc1 = _pair_mean(bias_corrected(quintic, Y, s, order=1, probes=1, generator=g), N)
    z1, _ = _entry_z(bc1, target)
    assert z1.abs().max() > 8.0
    plain = _pair_mean(quintic(Y), N)
    assert (plain.mean(0) - target).norm() > 3 * (bc1.mean(0) - target).norm()


def _ns64(X):
    return newton_schulz(X, batched=True)


def _ns_bias_figures(s, N, order, seed=50):
    """Plain vs corrected bias of Newton–Schulz at fresh-noise std s (float64)."""
    m, n = 8, 16
    rng = np.random.default_rng(0)
    U, _ = np.linalg.qr(rng.standard_normal((m, m)))
    V, _ = np.linalg.qr(rng.standard_normal((n, m)))
    M = torch.tensor(U @ np.diag(np.linspace(1.0, 0.2, m)) @ V.T)  # ‖M‖_F ≈ 1.85
    target = _ns64(M[None])[0]
    # Pilot sample fixes the direction u of the plain bias; the main sample tests along it.
    Yp, gp = _draws(M, s, 500, seed=seed)
    u = _pair_mean(_ns64(Yp) - target, 500).mean(0)
    u = u / u.norm()
    Y, g = _draws(M, s, N, seed=seed + 1)
    plain = _pair_mean(_ns64(Y) - target, N)
    corr = _pair_mean(bias_corrected(_ns64, Y, s, order=order, probes=1, generator=g) - target, N)
    a = (plain * u).sum((1, 2))
    c = (corr * u).sum((1, 2))
    d = a - torch.sign(c.mean()) * c  # paired (same Y): plain minus |corrected| along u
    return {
        "plain_bias": plain.mean(0).norm().item(),
        "plain_floor": (plain.var(0).sum() / N).sqrt().item(),
        "corrected_bias": corr.mean(0).norm().item(),
        "corrected_floor": (corr.var(0).sum() / N).sqrt().item(),
        "z_plain": (a.mean() / a.std() * math.sqrt(N)).item(),
        "z_difference": (d.mean() / d.std() * math.sqrt(N)).item(),
    }


@pytest.mark.parametrize("order", [1, 2])
def test_newton_schulz_bias_is_reduced(order):
    # Stated noise scale: s = 0.01 per entry on an 8×16 matrix with singular values 1 … 0.2
    # (noise Frobenius norm 0.11 against ‖M‖_F = 1.85).
    fig = _ns_bias_figures(0.01, 2000, order)
    print(order, fig)
    assert fig["z_plain"] > 10  # the plain bias is measurable
    assert fig["corrected_bias"] < fig["plain_bias"] / 3
    assert fig["z_difference"] > 4


def test_newton_schulz_bc_scale_invariant_zero_safe_and_reduces_to_plain():
    Y = torch.randn(6, 10, generator=torch.Generator().manual_seed(60))
    ref = newton_schulz_bc(Y, 0.05, generator=torch.Generator().manual_seed(1))
    for c in [1e-10, 1e10]:  # float32 probes; same generator state, scaled (Y, s)
        out = newton_schulz_bc(Y * c, 0.05 * c, generator=torch.Generator().manual_seed(1))
        assert (out - ref).norm() / ref.norm() < 1e-5
    zero = newton_schulz_bc(torch.zeros(6, 10), 0.3, generator=torch.Generator().manual_seed(2))
    assert not zero.any()  # antithetic probes cancel exactly for the odd map
    torch.testing.assert_close(newton_schulz_bc(Y, 0.0), newton_schulz(Y))
    with pytest.raises(ValueError, match="noise_std"):
        newton_schulz_bc(Y, -0.1)
    with pytest.raises(ValueError, match="shape"):
        newton_schulz_bc(torch.ones(2, 3, 4, 5), 0.1)
    with pytest.raises(ValueError, match="probes"):
        newton_schulz_bc(Y, 0.1, probes=0)


def test_ema_fresh_gain_matches_finite_difference():
    # The coefficient of the current gradient in M̂_t, measured by perturbing it.
    for beta in [0.0, 0.5, 0.9, 0.95]:
        for look in [True, False]:
            stage = EmaMomentum(beta, look)
            p = torch.zeros(3, 4, dtype=torch.float64)
            state = stage.init(p)
            g0 = torch.randn(3, 4, dtype=torch.float64)
            stage.update(g0, state, p, StepContext())
            saved = state["momentum"].clone()
            g1 = torch.randn(3, 4, dtype=torch.float64)
            out_a, _ = stage.update(g1, {"momentum": saved.clone()}, p, StepContext())
            out_b, _ = stage.update(g1 + 1.0, {"momentum": saved.clone()}, p, StepContext())
            measured = (out_b - out_a).mean().item()
            assert measured == pytest.approx(stage.fresh_gain(state), abs=1e-12)
            assert stage.fresh_gain(state) == pytest.approx((1 - beta) * (1 + beta) if look else 1 - beta)


def _tiny_weight(seed=70, shape=(6, 10)):
    w = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))
    return w


def test_optimizer_update_equals_manual_composition():
    beta, lr, std, seed = 0.9, 0.1, 0.2, 5
    w = _tiny_weight()
    w0 = w.detach().clone()
    opt = DPMuonBC([w], lr=lr, beta=beta, probe_seed=seed, noise_std=std, allow_unprivatized=True)
    g = torch.Generator().manual_seed(seed)
    M = torch.zeros_like(w0)
    grads = [torch.randn(6, 10, generator=torch.Generator().manual_seed(80 + t)) for t in range(3)]
    expected = w0.clone()
    for G in grads:
        w.grad = G.clone()
        opt.step()
        M = beta * M + (1 - beta) * G
        Mhat = (1 - beta) * G + beta * M
        s = (1 - beta) * (1 + beta) * std  # fresh-noise std in M̂_t
        X = newton_schulz_bc(Mhat, s, generator=g)
        expected = expected - lr * aspect_factor(6, 10) * X
        torch.testing.assert_close(w.detach(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(opt.state[w]["transform"]["0"]["momentum"], M)


def test_optimizer_zero_gradient_zero_update_and_zero_noise_equals_dp_muon():
    w = _tiny_weight()
    before = w.detach().clone()
    opt = DPMuonBC([w], lr=0.1, noise_std=0.5, allow_unprivatized=True)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(w.detach(), before)
    a, b = _tiny_weight(71), _tiny_weight(71)
    oa, ob = (
        DPMuonBC([a], lr=0.1, noise_std=0.0, allow_unprivatized=True),
        DPMuon([b], lr=0.1, allow_unprivatized=True),
    )
    for t in range(3):
        G = torch.randn(6, 10, generator=torch.Generator().manual_seed(90 + t))
        a.grad, b.grad = G.clone(), G.clone()
        oa.step()
        ob.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=0)


def test_optimizer_scale_invariance_with_scaled_noise_std():
    base = _tiny_weight(72).detach()
    G = torch.randn(6, 10, generator=torch.Generator().manual_seed(73))
    steps = {}
    for c in [1e-10, 1.0, 1e10]:
        w = torch.nn.Parameter(base.clone())
        opt = DPMuonBC([w], lr=1.0, probe_seed=3, noise_std=0.3 * c, allow_unprivatized=True)
        w.grad = G * c
        opt.step()
        steps[c] = base - w.detach()
    for c in [1e-10, 1e10]:
        assert (steps[c] - steps[1.0]).norm() / steps[1.0].norm() < 1e-5


def test_optimizer_refuses_missing_noise_std_before_touching_weights():
    w = _tiny_weight()
    before = w.detach().clone()
    opt = DPMuonBC([w], lr=0.1, allow_unprivatized=True)
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match="noise_std"):
        opt.step()
    assert torch.equal(w.detach(), before)
    with pytest.raises(ValueError, match="std"):
        DPMuonBC([w], lr=0.1, noise_std=-1.0, allow_unprivatized=True)
    with pytest.raises(ValueError, match="std"):
        DPMuonBC([w], lr=0.1, noise_std=float("nan"), allow_unprivatized=True)


def test_optimizer_resume_from_state_dict_reproduces_probes():
    grads = [torch.randn(6, 10, generator=torch.Generator().manual_seed(100 + t)) for t in range(4)]

    def run(split):
        w = _tiny_weight()
        opt = DPMuonBC([w], lr=0.1, probe_seed=9, noise_std=0.3, allow_unprivatized=True)
        for t, G in enumerate(grads):
            if t == split:
                saved = {"w": w.detach().clone(), "opt": opt.state_dict()}
                w = torch.nn.Parameter(saved["w"])
                opt = DPMuonBC(
                    [w], lr=0.1, probe_seed=0, noise_std=0.3, allow_unprivatized=True
                )  # seed: state dict
                opt.load_state_dict(saved["opt"])
            w.grad = G.clone()
            opt.step()
        return w.detach()

    uninterrupted = run(split=None)
    assert torch.equal(run(split=2), uninterrupted)
    other = _tiny_weight()
    o = DPMuonBC([other], lr=0.1, probe_seed=10, noise_std=0.3, allow_unprivatized=True)
    for G in grads:
        other.grad = G.clone()
        o.step()
    assert not torch.equal(other.detach(), uninterrupted)  # the probes matter
