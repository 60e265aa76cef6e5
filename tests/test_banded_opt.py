"""Banded-optimized strategies (bisr_opt, bsr_opt), their objective and the L-BFGS helper."""

import numpy as np
import pytest
from scipy.linalg import toeplitz

from dpmf.mechanisms import (
    Participation,
    evaluate,
    factorize,
    inverse_coefficients,
    optimize_banded,
    sensitivity,
)
from dpmf.mechanisms._lbfgs import minimize_lbfgs
from dpmf.mechanisms.toeplitz import is_nonincreasing_nonnegative
from dpmf.mechanisms.toeplitz_objective import (
    frobenius_sq,
    last_row_sq,
    reciprocal_gradient,
    sensitivity_sq,
)
from dpmf.workloads import lr_scheduled, momentum, prefix_sum, schedule


def _exp(n, beta=0.1):
    return lr_scheduled(schedule("exponential", n, beta))


def _toep(c):
    return toeplitz(c, np.zeros(len(c)))


CASES = [
    (prefix_sum(64), Participation.separated(16, 4)),
    (_exp(64), Participation.separated(16, 4)),
    (prefix_sum(64), Participation.single()),
    (_exp(48), Participation.fixed_epochs(12, 4)),
    (momentum(60, momentum=0.9), Participation.separated(15, 4)),
]


@pytest.mark.parametrize("workload, participation", CASES)
@pytest.mark.parametrize("name, start", [("bisr_opt", "bisr"), ("bsr_opt", "bsr")])
@pytest.mark.parametrize("p", [1, 2, 4, 16])
def test_never_worse_than_start(workload, participation, name, start, p):
    res = optimize_banded(workload, name, p, participation)
    # the start value, recomputed independently from the closed-form strategy
    start_eval = evaluate(factorize(workload, f"{start}:{p}"), participation)
    assert res.start_value == pytest.approx(start_eval.mean_se, rel=1e-12)
    assert res.value <= start_eval.mean_se * (1 + 1e-12)
    ev = evaluate(res.factorization, participation)
    assert ev.mean_se == pytest.approx(res.value, rel=1e-12)
    assert res.factorization.label == f"{name}:{p}" and res.factorization.bands == p
    # banded where it should be, and an exact sensitivity
    if name == "bisr_opt":
        assert res.factorization.noise_bands <= p
    else:
        assert res.factorization.C.bandwidth <= p
    assert ev.sensitivity_exact


def test_improves_substantially_at_few_bands():
    w, part = prefix_sum(64), Participation.separated(16, 4)
    for name in ("bisr_opt", "bsr_opt"):
        res = optimize_banded(w, name, 4, part)
        assert res.improved and res.value < 0.97 * res.start_value
    # more coefficients never hurt (the p-coefficient problem contains the p/2 one)
    vals = [optimize_banded(w, "bisr_opt", p, part).value for p in (1, 2, 4, 8, 16)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(vals, vals[1:], strict=False))


def test_min_sep_sensitivity_is_exact_by_brute_force():
    w, part = prefix_sum(24), Participation.separated(6, 4)
    for name in ("bisr_opt", "bsr_opt"):
        res = optimize_banded(w, name, 4, part)
        c = res.factorization.C.toeplitz_coeffs
        assert is_nonincreasing_nonnegative(c)
        ev = evaluate(res.factorization, part)
        assert ev.sensitivity_method == "toeplitz_closed_form"
        # the same matrix as a dense array: sensitivity() enumerates every set and sign
        brute = sensitivity(res.factorization.C_dense(), part)
        assert brute.method == "exhaustive" and brute.exact
        assert ev.sensitivity == pytest.approx(brute.value, rel=1e-12)


def test_max_se_objective():
    w, part = prefix_sum(128), Participation.separated(32, 4)
    res = optimize_banded(w, "bisr_opt", 8, part, objective="max_se")
    start = evaluate(factorize(w, "bisr:8"), part)
    assert res.value <= start.max_se and res.value == pytest.approx(evaluate(res.factorization, part).max_se)
    with pytest.raises(ValueError, match="Toeplitz"):
        optimize_banded(_exp(32), "bisr_opt", 4, objective="max_se")


def test_lr_aware_start():
    w, part = _exp(64), Participation.separated(16, 4)
    res = optimize_banded(w, "bisr_opt", 4, part, start="lr_bisr")
    assert res.start.label == "lr_bisr:4"
    assert res.value <= evaluate(factorize(w, "lr_bisr:4"), part).mean_se


def test_factorize_names():
    w, part = prefix_sum(32), Participation.separated(8, 4)
    f = factorize(w, "bisr_opt:4", participation=part)
    assert f.label == "bisr_opt:4"
    assert evaluate(f, part).mean_se == pytest.approx(optimize_banded(w, "bisr_opt", 4, part).value)
    with pytest.raises(ValueError, match="needs bands"):
        factorize(w, "bsr_opt")


def test_invalid_input():
    w = prefix_sum(16)
    with pytest.raises(ValueError, match="bands"):
        optimize_banded(w, "bisr_opt", 0)
    with pytest.raises(ValueError, match="name"):
        optimize_banded(w, "bisr", 4)
    with pytest.raises(ValueError, match="start"):
        optimize_banded(w, "bisr_opt", 4, start="bsr")
    with pytest.raises(ValueError, match="objective"):
        optimize_banded(w, "bsr_opt", 4, objective="rmse")
    with pytest.raises(TypeError, match="participation"):
        optimize_banded(w, "bsr_opt", 4, participation="single")


# --- the differentiable objective pieces --------------------------------------------------------


@pytest.mark.parametrize("workload", [prefix_sum(40), _exp(40), momentum(40, momentum=0.8)])
def test_frobenius_sq_and_gradient(workload):
    rng = np.random.default_rng(1)
    n = workload.n
    y = rng.standard_normal(n) * 0.3
    y[0] = 1.0
    A = workload.dense()
    value, grad = frobenius_sq(workload, y)
    assert value == pytest.approx(np.sum((A @ _toep(y)) ** 2), rel=1e-12)
    eps = 1e-6
    for j in (0, 3, 17, 39):
        e = np.zeros(n)
        e[j] = eps
        fd = (frobenius_sq(workload, y + e)[0] - frobenius_sq(workload, y - e)[0]) / (2 * eps)
        assert grad[j] == pytest.approx(fd, rel=1e-6, abs=1e-6)
    # banded: the same value for a banded y, the gradient on its band
    yb = y.copy()
    yb[5:] = 0.0
    vb, gb = frobenius_sq(workload, yb, bandwidth=5)
    assert vb == pytest.approx(frobenius_sq(workload, yb)[0], rel=1e-12)
    assert np.allclose(gb[:5], frobenius_sq(workload, yb)[1][:5], rtol=1e-10)


def test_last_row_sq_is_max_row():
    w = momentum(50, momentum=0.7)
    y = inverse_coefficients(np.linspace(1.0, 0.2, 50))
    B = w.dense() @ _toep(y)
    value, _ = last_row_sq(w, y)
    assert value == pytest.approx(np.max(np.sum(B**2, axis=1)), rel=1e-12)


@pytest.mark.parametrize(
    "participation",
    [Participation.single(), Participation.separated(5, 3), Participation.fixed_epochs(5, 4)],
)
def test_sensitivity_sq_and_reciprocal_gradient(participation):
    n = 20
    g = np.zeros(n)
    g[:3] = [1.0, -0.5, -0.1]
    c = inverse_coefficients(g)
    assert is_nonincreasing_nonnegative(c)
    s2, gs = sensitivity_sq(c, participation)
    assert s2 == pytest.approx(sensitivity(_toep(c), participation).value ** 2, rel=1e-12)

    def f(gg):
        return sensitivity_sq(inverse_coefficients(gg), participation)[0]

    analytic = reciprocal_gradient(gs, c, 3)
    eps = 1e-7
    for j in range(1, 3):
        e = np.zeros(n)
        e[j] = eps
        assert analytic[j] == pytest.approx((f(g + e) - f(g - e)) / (2 * eps), rel=1e-6)


def test_lbfgs_minimizes_and_respects_the_feasible_region():
    def rosen(x):
        f = 100 * (x[1] - x[0] ** 2) ** 2 + (1 - x[0]) ** 2
        g = np.array([-400 * x[0] * (x[1] - x[0] ** 2) - 2 * (1 - x[0]), 200 * (x[1] - x[0] ** 2)])
        return f, g

    res = minimize_lbfgs(rosen, np.array([-1.2, 1.0]), max_iterations=500)
    assert res.converged and np.allclose(res.x, [1.0, 1.0], atol=1e-5)

    # minimum at x = 2 outside the feasible region x ≤ 1: the answer is the boundary
    def bounded(x):
        return None if x[0] > 1.0 else (float((x[0] - 2.0) ** 2), np.array([2 * (x[0] - 2.0)]))

    res = minimize_lbfgs(bounded, np.array([0.0]), max_iterations=200)
    assert res.x[0] <= 1.0 and res.x[0] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="x0"):
        minimize_lbfgs(bounded, np.array([3.0]))


# --- optima on the edge of the closed-form region ---------------------------------------------

# MeanSE² that L-BFGS alone stopped at (on the region's edge, gradient 1.9 and 2.9), recorded
EDGE_CASES = [
    (128, 64, 2, 64, 12.230690291766553),
    (256, 64, 4, 64, 33.210825936019205),
]


@pytest.mark.parametrize("n, b, k, p, stalled", EDGE_CASES)
def test_bisr_opt_converges_on_the_region_edge(n, b, k, p, stalled):
    """min_sep with k ≥ 2: the optimum sits where C stops being non-increasing; the result is
    a KKT point (projected gradient below tolerance), lower than where L-BFGS stalled, and its
    sensitivity exact."""
    part = Participation.separated(b, k)
    res = optimize_banded(prefix_sum(n), "bisr_opt", p, part)
    assert res.converged and res.gradient_norm <= 1e-5 * max(1.0, np.log(res.value**2))
    assert res.value**2 <= stalled * (1 - 3e-3)
    ev = evaluate(res.factorization, part, with_lower_bound=False)
    assert ev.sensitivity_exact and ev.mean_se == pytest.approx(res.value, rel=1e-12)
    assert is_nonincreasing_nonnegative(res.factorization.C.toeplitz_coeffs)


def test_bisr_opt_reports_no_convergence_on_the_edge_without_the_constrained_solve(monkeypatch):
    """Beyond the constrained solve's size limit, an L-BFGS run stalled on the edge (n = 1024,
    b = 64, k = 2: gradient 0.79) is reported as not converged, with its projected gradient."""
    from dpmf.mechanisms import banded_opt

    monkeypatch.setattr(banded_opt, "_POLISH_MAX_STEPS", 0)
    res = optimize_banded(prefix_sum(1024), "bisr_opt", 64, Participation.separated(64, 2))
    assert not res.converged
    assert res.gradient_norm > 1e-3


# jax-privacy 2.0.0 ``toeplitz.optimize_banded_toeplitz(n, b, reduction_fn=jnp.mean)`` (banded C,
# b bands), sens²·MeanSE² under min-sep(b, k) evaluated by dpmf (benchmarks/bench_banded_jax.py)
JAX_BANDED = [
    (128, 64, 2, 11.79577384583751),
    (256, 64, 4, 30.981842870174315),
    (1024, 64, 2, 33.063304195722715),
]


@pytest.mark.parametrize("n, b, k, jax_loss", JAX_BANDED)
def test_bsr_opt_reaches_jax_privacy_banded_optimum(n, b, k, jax_loss):
    """Same class (banded C): dpmf's optimum is jax-privacy's to 1e-6 relative or lower."""
    part = Participation.separated(b, k)
    res = optimize_banded(prefix_sum(n), "bsr_opt", b, part)
    assert res.value**2 <= jax_loss * (1 + 1e-6)
    assert res.value**2 == pytest.approx(jax_loss, rel=1e-8)  # the same optimum, not a looser one


def test_bisr_opt_below_jax_privacy_banded_optimum_at_many_steps():
    """n = 1024, b = 64, k = 2: the banded-noise class (C⁻¹ banded) beats the best banded C."""
    res = optimize_banded(prefix_sum(1024), "bisr_opt", 64, Participation.separated(64, 2))
    assert res.converged
    assert res.value**2 < 0.85 * JAX_BANDED[2][3]
