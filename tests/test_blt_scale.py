"""BLT closed forms at any n (dpmf.mechanisms.blt_closed) and the optimizer built on them."""

import mpmath
import numpy as np
import pytest

from dpmf.mechanisms import Participation, evaluate, optimize_blt, sensitivity
from dpmf.mechanisms.blt import (
    blt_coefficients,
    blt_factorization,
    blt_inverse_parameters,
    blt_prefix_error,
    blt_sensitivity,
)
from dpmf.mechanisms.blt_closed import (
    blt_closed_form,
    objective_terms,
    pair_objective_terms,
    pair_output_scales,
)
from dpmf.workloads import prefix_sum

# jax-privacy 2.0.0, buffered_toeplitz.optimize(n=n, error="max", min_buffers=d, max_buffers=d):
# its loss (sens²·MaxSE², its own closed form) and the strategy C = BLT(θ, ω) it returned
# (benchmarks/bench_blt_scale.py records them again)
JAX = {
    (10_000, 3): (
        16.267118526720033,
        [0.9998486824974182, 0.9947171537109649, 0.8643041650370922],
        [0.018054464156841102, 0.07554026778753839, 0.3321564317896366],
    ),
    (100_000, 4): (
        22.63555292001016,
        [0.999986724374142, 0.9996127803694448, 0.9915768375096191, 0.8318680385525875],
        [0.005233692496572336, 0.01923494372489983, 0.08860470027572555, 0.3321481124429376],
    ),
}


def _random_blt(rng, d):
    """Noise parameters whose inverse (the strategy) is a non-negative decreasing BLT."""
    while True:
        th_c = np.sort(rng.uniform(0.05, 0.9995, d))
        om_c = rng.dirichlet(np.ones(d)) * rng.uniform(0.2, 0.9) * (1.0 - th_c) ** 0.3
        try:
            return blt_inverse_parameters(th_c, om_c)
        except ValueError:
            continue


@pytest.mark.parametrize("seed", range(4))
def test_closed_forms_equal_the_exact_evaluation(seed):
    """Sensitivity, MaxSE and MeanSE of random BLT noise (and, through the inverse, strategy)
    parametrizations against the O(n) evaluation, 1e-9 relative."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 10_001))
    theta, omega = _random_blt(rng, int(rng.integers(1, 5)))
    ev = evaluate(blt_factorization(prefix_sum(n), theta, omega), with_lower_bound=False)
    cf = blt_closed_form(theta, omega, n)
    assert cf.sensitivity == pytest.approx(ev.sensitivity, rel=1e-9)
    assert cf.max_se == pytest.approx(ev.max_se, rel=1e-9)
    assert cf.mean_se == pytest.approx(ev.mean_se, rel=1e-9)
    assert cf.max_se_sq == pytest.approx(ev.max_se**2, rel=1e-9)
    try:
        th_c, om_c = blt_inverse_parameters(theta, omega)
    except ValueError:
        return
    cs = blt_closed_form(th_c, om_c, n, matrix="strategy")
    assert cs.max_se == pytest.approx(ev.max_se, rel=1e-9)
    assert cs.mean_se == pytest.approx(ev.mean_se, rel=1e-9)


@pytest.mark.parametrize(
    "participation", [Participation.separated(97, 5), Participation.fixed_epochs(400, 5)]
)
def test_closed_form_multi_participation_sensitivity(participation):
    n = 2000
    th_c, om_c = np.array([0.5, 0.95, 0.999]), np.array([0.2, 0.04, 0.001])  # C ≥ 0, decreasing
    C = blt_factorization(prefix_sum(n), *blt_inverse_parameters(th_c, om_c)).C
    s = sensitivity(C, participation)
    assert s.exact
    assert blt_sensitivity(th_c, om_c, n, participation) == pytest.approx(s.value, rel=1e-9)
    th, om = blt_inverse_parameters(th_c, om_c)  # the noise parametrization: checked on the coefficients
    assert blt_closed_form(th, om, n, participation).sensitivity == pytest.approx(s.value, rel=1e-9)
    bad = ([0.4, 0.85], [0.8, 0.5]) if participation.kind == "min_sep" else ([0.4, 0.85], [-0.8, 0.5])
    with pytest.raises(ValueError, match="non-negative"):
        blt_closed_form(*bad, n, participation, matrix="strategy")


def _mp_closed(theta, omega, n):
    """sens² of C = BLT(θ, ω) and (Σ_t h_t², Σ_t (n−t)h_t²) of C⁻¹ = BLT(θ, ω) from the
    textbook geometric sums at 80 digits (cancellation harmless there); decays < 1."""
    mpmath.mp.dps = 80
    th = [mpmath.mpf(float(t)) for t in theta]
    om = [mpmath.mpf(float(w)) for w in omega]
    N = mpmath.mpf(n)

    def geo(q, m):
        return (1 - q**m) / (1 - q)

    def wgeo(q):  # Σ_{t<n} (n − t) q^t
        return (N - q * geo(q, n)) / (1 - q)

    d = len(th)
    sens2 = 1 + sum(om[i] * om[j] * geo(th[i] * th[j], n - 1) for i in range(d) for j in range(d))
    gam = [om[i] / (1 - th[i]) for i in range(d)]
    beta = 1 + sum(gam)
    last = N * beta**2 - 2 * beta * sum(gam[i] * geo(th[i], n) for i in range(d))
    last += sum(gam[i] * gam[j] * geo(th[i] * th[j], n) for i in range(d) for j in range(d))
    frob = beta**2 * N * (N + 1) / 2 - 2 * beta * sum(gam[i] * wgeo(th[i]) for i in range(d))
    frob += sum(gam[i] * gam[j] * wgeo(th[i] * th[j]) for i in range(d) for j in range(d))
    return float(sens2), float(last), float(frob)


@pytest.mark.parametrize("gap", [1e-6, 1e-8, 1e-10, 1e-12])
def test_decays_near_one_against_mpmath(gap):
    """The doubling forms stay accurate as a decay approaches 1 (the geometric-sum forms in
    float64 lose everything at 1 − 1e-10), n = 10⁶."""
    n = 1_000_000
    theta = np.array([0.3, 0.97, 1.0 - gap])
    omega = np.array([-0.35, -0.05, -1e-3])
    sens2, last, frob = _mp_closed(theta, omega, n)
    strat = blt_closed_form(theta, omega, n, matrix="strategy")
    noise = blt_closed_form(theta, omega, n)
    assert strat.sensitivity_sq == pytest.approx(sens2, rel=1e-6)
    assert noise.max_row_sq == pytest.approx(last, rel=1e-6)
    assert noise.mean_row_sq * n == pytest.approx(frob, rel=1e-6)
    assert blt_prefix_error(theta, omega, n, "max_se") ** 2 == pytest.approx(last, rel=1e-6)


def test_decay_exactly_one_against_exact_sums():
    """A buffer that never decays (θ = 1): sums of the exact coefficients at 60 digits."""
    n = 3000
    theta, omega = np.array([0.6, 1.0]), np.array([-0.3, -0.01])
    mpmath.mp.dps = 60
    g = [mpmath.mpf(1)] + [
        sum(mpmath.mpf(float(w)) * mpmath.mpf(float(t)) ** (k - 1) for t, w in zip(theta, omega, strict=True))
        for k in range(1, n)
    ]
    h, acc = [], mpmath.mpf(0)
    for gk in g:
        acc += gk
        h.append(acc)
    last = sum(x * x for x in h)
    frob = sum((n - t) * h[t] ** 2 for t in range(n))
    sens2 = sum(x * x for x in g)
    noise = blt_closed_form(theta, omega, n)
    assert noise.max_row_sq == pytest.approx(float(last), rel=1e-9)
    assert noise.mean_row_sq * n == pytest.approx(float(frob), rel=1e-9)
    strat = blt_closed_form(theta, omega, n, matrix="strategy")
    assert strat.sensitivity_sq == pytest.approx(float(sens2), rel=1e-9)
    assert np.allclose(blt_coefficients(theta, omega, 5), [1.0, -0.31, -0.19, -0.118, -0.0748])


def test_decay_above_one_refused():
    with pytest.raises(ValueError, match=r"theta is invalid.*\(-1, 1\]"):
        blt_closed_form([1.0 + 1e-9], [0.1], 10)
    with pytest.raises(ValueError, match="matrix"):
        blt_closed_form([0.5], [0.1], 10, matrix="both")


@pytest.mark.parametrize("param", ["noise", "strategy"])
@pytest.mark.parametrize("objective", ["max_se", "mean_se"])
def test_complex_step_gradients(param, objective):
    theta, omega = blt_inverse_parameters([0.4, 0.9, 0.995], [0.3, 0.05, 0.01])
    if param == "strategy":
        theta, omega = blt_inverse_parameters(theta, omega)
    n = 5000
    s2, e2, gs, ge = objective_terms(theta, omega, n, objective, param)
    x = np.concatenate([theta, omega])
    for j in range(6):
        e = np.zeros(6)
        e[j] = 1e-7
        hi = objective_terms((x + e)[:3], (x + e)[3:], n, objective, param)
        lo = objective_terms((x - e)[:3], (x - e)[3:], n, objective, param)
        assert gs[j] == pytest.approx((hi[0] - lo[0]) / 2e-7, rel=1e-5, abs=1e-6 * abs(s2))
        assert ge[j] == pytest.approx((hi[1] - lo[1]) / 2e-7, rel=1e-5, abs=1e-6 * abs(e2))
    # the decay-pair parametrization: same values, output scales by partial fractions
    th_hat, om_hat = blt_inverse_parameters(theta, omega)
    om_pair, om_hat_pair = pair_output_scales(theta, th_hat)
    assert np.allclose(om_pair, omega, rtol=1e-9) and np.allclose(om_hat_pair, om_hat, rtol=1e-9)
    if param == "strategy":
        p2 = pair_objective_terms(theta, th_hat, n, objective)
        assert p2[0] == pytest.approx(s2, rel=1e-10) and p2[1] == pytest.approx(e2, rel=1e-10)


def _jax_value(n, d):
    loss, th_c, om_c = JAX[(n, d)]
    th, om = blt_inverse_parameters(th_c, om_c)
    ev = evaluate(blt_factorization(prefix_sum(n), th, om), with_lower_bound=False)
    assert ev.max_se**2 == pytest.approx(loss, rel=1e-7)  # jax's own closed form agrees
    return ev.max_se**2


def test_default_starts_reach_jax_privacy_optimum_three_buffers():
    """n = 10⁴, 3 buffers, MaxSE: the default multi-start reaches jax-privacy's optimum (both
    evaluated by dpmf's O(n) code)."""
    n = 10_000
    res = optimize_blt(prefix_sum(n), 3, objective="max_se")
    assert res.value**2 <= _jax_value(n, 3) * (1 + 1e-6)
    assert res.converged
    assert res.error_closed_form == pytest.approx(res.value, rel=1e-9)


def test_four_buffers_n100000_matches_jax_privacy():
    n = 100_000
    res = optimize_blt(prefix_sum(n), 4, objective="max_se")
    assert res.value**2 <= _jax_value(n, 4) * (1 + 1e-6)
    assert res.converged and res.sensitivity_exact


def test_inverse_coefficients_at_large_n_from_the_inverse_parameters():
    """Beyond n = 131072 the inverse's coefficients come from its own BLT parameters (O(n·d)):
    the power-series reciprocal's values."""
    from dpmf.mechanisms.blt import BufferedToeplitz
    from dpmf.mechanisms.toeplitz import inverse_coefficients

    n = 200_000
    theta, omega = blt_inverse_parameters([0.5, 0.99, 0.99995], [0.3, 0.05, 0.004])
    M = BufferedToeplitz.from_buffers(theta, omega, n)
    inv = M.inverse()
    ref = inverse_coefficients(M.coeffs)
    assert np.allclose(inv.coeffs, ref, rtol=0, atol=1e-11 * np.max(np.abs(ref)))
    assert np.allclose(inv.theta, [0.5, 0.99, 0.99995]) and np.allclose(inv.omega, [0.3, 0.05, 0.004])
