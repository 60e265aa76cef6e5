"""Factorizations: the reference table, B·C = A, closed forms, structured vs dense evaluation."""

import numpy as np
import pytest
from scipy.linalg import solve_triangular, sqrtm
from scipy.special import gammaln

from dpmf.mechanisms import (
    BANDED,
    FACTORIZATIONS,
    OPTIMIZED,
    Participation,
    b_row_norms,
    evaluate,
    factorize,
    parse_factorization,
)
from dpmf.mechanisms.registry import STRATEGIES
from dpmf.workloads import SCHEDULES, Schedule, from_schedule, momentum, prefix_sum, toeplitz_surrogate


def all_specs(n):
    """Every closed-form factorization (the optimized ones: test_bc_equals_a_optimized)."""
    out = []
    for name in FACTORIZATIONS:
        if name in OPTIMIZED:
            continue
        if name in BANDED:
            out += [f"{name}:{p}" for p in sorted({1, 2, 4, 16, n, n + 5})]
        elif STRATEGIES[name].parameter is not None:  # λ of lcgd
            out += [f"{name}:{lam}" for lam in (0.0, 0.5, 0.95)]
        else:
            out.append(name)
    return out


# Reference table of the conventions: exponential decay, n = 64, β = 0.1, single participation.
REFERENCE = {
    "identity": (1.0000, 3.7489, 3.3602),
    "sqrt_prefix": (1.5456, 1.7689, 1.3888),
    "lr_aware": (1.3214, 1.5630, 1.4146),
}


@pytest.mark.parametrize("name", REFERENCE)
def test_reference_table(name):
    w = from_schedule(Schedule("exponential", 0.1), 64)
    e = evaluate(factorize(w, name))
    sens, mx, mean = REFERENCE[name]
    assert round(e.sensitivity, 4) == sens
    assert round(e.max_se, 4) == mx
    assert round(e.mean_se, 4) == mean
    assert round(e.lower_bound, 4) == 0.9282
    assert e.sensitivity_exact


@pytest.mark.parametrize("n", [2, 3, 64, 257])
@pytest.mark.parametrize("sched", SCHEDULES)
def test_bc_equals_a(n, sched):
    w = from_schedule(Schedule(sched, 0.1), n)
    for spec in all_specs(n):
        f = factorize(w, spec)
        assert f.residual() < 1e-10, spec


@pytest.mark.parametrize("spec", ["dense", "bisr_opt:2", "bsr_opt:4", "blt:2"])
def test_bc_equals_a_optimized(spec):
    for w in [from_schedule(Schedule("cosine", 0.1), 24), prefix_sum(3), momentum(20, 0.9, 0.99)]:
        assert factorize(w, spec).residual() < 1e-10, (w.name, spec)


def test_bc_equals_a_other_workloads():
    for w in [prefix_sum(40), toeplitz_surrogate(np.linspace(1, 0.2, 40)), momentum(40, 0.9, 0.99)]:
        for spec in all_specs(40):
            assert factorize(w, spec).residual() < 1e-10, (w.name, spec)


def test_prefix_sum_square_root_maxse_closed_form():
    for n in [1, 2, 64, 1000]:
        j = np.arange(n, dtype=float)
        r = np.exp(gammaln(2 * j + 1) - 2 * gammaln(j + 1) - j * np.log(4.0))  # binom(2j, j)/4^j
        e = evaluate(factorize(prefix_sum(n), "sqrt_prefix"))
        assert e.max_se == pytest.approx(np.sum(r**2), rel=1e-12)
    assert evaluate(factorize(prefix_sum(64), "sqrt_prefix")).max_se == pytest.approx(2.3888, abs=5e-5)


def test_structures_as_documented():
    w = from_schedule(Schedule("exponential", 0.1), 50)
    chi = w.column_scale
    ones = np.tril(np.ones((50, 50)))
    A1_half = np.real(sqrtm(ones))
    np.testing.assert_allclose(factorize(w, "sqrt_prefix").C_dense(), A1_half, atol=1e-10)
    np.testing.assert_allclose(
        factorize(w, "sqrt_prefix_scaled").C_dense(), A1_half @ np.diag(chi), atol=1e-10
    )
    np.testing.assert_allclose(factorize(w, "sqrt_prefix_scaled").B_dense(), A1_half, atol=1e-10)
    np.testing.assert_allclose(factorize(w, "output").C_dense(), w.dense())
    np.testing.assert_allclose(factorize(w, "output").B_dense(), np.eye(50), atol=1e-12)
    X = factorize(w, "sqrt").C_dense()
    np.testing.assert_allclose(X, np.real(sqrtm(w.dense())), atol=1e-9)
    T = np.array([[chi[i - j] if i >= j else 0 for j in range(50)] for i in range(50)])
    np.testing.assert_allclose(factorize(w, "lr_aware").C_dense(), np.real(sqrtm(T)), atol=1e-9)
    # banded: bisr C⁻¹ is the 3-banded truncation of A₁^{−1/2}
    inv_half = solve_triangular(A1_half, np.eye(50), lower=True)
    banded = np.tril(np.triu(inv_half, -2))
    f = factorize(w, "bisr:3")
    np.testing.assert_allclose(f.C_inverse.dense(), banded, atol=1e-12)
    assert f.noise_bands == 3
    np.testing.assert_allclose(factorize(w, "bsr:3").C_dense(), np.tril(np.triu(A1_half, -2)), atol=1e-12)
    lr_half = np.real(sqrtm(T))
    np.testing.assert_allclose(factorize(w, "lr_bsr:3").C_dense(), np.tril(np.triu(lr_half, -2)), atol=1e-9)


def test_banded_edge_bands():
    w = from_schedule(Schedule("linear", 0.2), 30)
    np.testing.assert_allclose(factorize(w, "bisr:1").C_dense(), np.eye(30))
    np.testing.assert_allclose(factorize(w, "bsr:30").C_dense(), factorize(w, "sqrt_prefix").C_dense())
    np.testing.assert_allclose(
        factorize(w, "lr_bisr:99").C_dense(), factorize(w, "lr_aware").C_dense(), atol=1e-12
    )


@pytest.mark.parametrize("sched", ["constant", "exponential", "cosine", "inverse_power"])
def test_structured_row_norms_equal_dense(sched):
    n = 120
    w = from_schedule(Schedule(sched, 0.05), n)
    for spec in all_specs(n):
        f = factorize(w, spec)
        dense = np.linalg.norm(f.workload.dense() @ np.linalg.inv(f.C_dense()), axis=1)
        np.testing.assert_allclose(b_row_norms(f), dense, rtol=1e-9, atol=1e-12, err_msg=spec)


def test_row_norms_momentum_with_schedule():
    chi = np.linspace(1, 0.1, 60)
    w = momentum(60, 0.9, 1.0, chi=chi)
    for spec in ["sqrt_prefix", "bisr:4", "lr_aware", "sqrt"]:
        f = factorize(w, spec)
        dense = np.linalg.norm(w.dense() @ np.linalg.inv(f.C_dense()), axis=1)
        np.testing.assert_allclose(b_row_norms(f), dense, rtol=1e-9)


def test_figure1_shape():
    """Paper's Figure 1: lr_aware below sqrt_prefix in MaxSE and above it in MeanSE, the lower
    bound below every factorization (exponential decay, β ∈ {0.1, 0.01})."""
    for beta in (0.1, 0.01):
        for n in (32, 64, 256, 1024, 4096):
            w = from_schedule(Schedule("exponential", beta), n)
            lr = evaluate(factorize(w, "lr_aware"))
            sp = evaluate(factorize(w, "sqrt_prefix"), with_lower_bound=False)
            assert lr.max_se < sp.max_se
            assert lr.mean_se > sp.mean_se
            assert lr.lower_bound < min(lr.mean_se, sp.mean_se)


def test_noise_coefficients():
    w = prefix_sum(10)
    f = factorize(w, "sqrt_prefix")
    np.testing.assert_allclose(
        f.noise_coefficients,
        [1, -1 / 2, -1 / 8, -1 / 16, -5 / 128, -7 / 256, -21 / 1024, -33 / 2048, -429 / 32768, -715 / 65536],
    )
    assert (
        factorize(from_schedule(Schedule("linear", 0.5), 10), "sqrt_prefix_scaled").noise_coefficients is None
    )
    assert factorize(from_schedule(Schedule("linear", 0.5), 10), "sqrt").noise_coefficients is None


def test_n1_and_n2():
    for n in (1, 2):
        for sched in SCHEDULES:
            w = from_schedule(Schedule(sched, 0.5), n)
            for spec in all_specs(n):
                e = evaluate(factorize(w, spec), Participation.separated(1, 3))
                assert np.isfinite([e.sensitivity, e.max_se, e.mean_se, e.lower_bound]).all()
                assert e.lower_bound <= e.mean_se * (1 + 1e-12) <= e.max_se * (1 + 1e-12)


def test_tiny_beta_is_finite():
    w = from_schedule(Schedule("exponential", 1e-6), 300)
    for spec in all_specs(300):
        e = evaluate(factorize(w, spec))
        assert np.isfinite([e.sensitivity, e.max_se, e.mean_se]).all()
        assert factorize(w, spec).residual() < 1e-10


@pytest.mark.parametrize(
    "spec, match",
    [
        ("bogus", "factorization"),
        ("bisr", "bands"),
        ("bisr:0", "bands"),
        ("bsr:-2", "bands"),
        ("bsr:x", "bands"),
        ("identity:4", "no bands"),
        ("lr_aware:2", "no bands"),
    ],
)
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_factorization(spec)


def test_parse():
    assert parse_factorization("bisr:16") == ("bisr", 16)
    assert parse_factorization("lr_bsr", bands=4) == ("lr_bsr", 4)
    assert parse_factorization("sqrt") == ("sqrt", None)
    with pytest.raises(TypeError):
        factorize(np.eye(3), "sqrt")


@pytest.mark.parametrize("sched", ["exponential", "cosine", "polynomial"])
@pytest.mark.parametrize(
    "spec", ["sqrt_prefix", "lr_aware", "bisr:3", "bsr:5", "lr_bisr:7", "sqrt_prefix_scaled"]
)
def test_structured_row_norms_equal_dense_rows(sched, spec):
    """The banded running-row recursion and the geometric-schedule Toeplitz path against B = A·C⁻¹."""
    from dpmf.mechanisms import b_row_norms

    for n in (1, 2, 9, 200):
        w = from_schedule(Schedule(sched, 0.05), n)
        f = factorize(w, spec)
        dense = np.linalg.norm(w.dense() @ np.linalg.inv(f.C.dense()), axis=1)
        np.testing.assert_allclose(b_row_norms(f), dense, rtol=1e-11)
