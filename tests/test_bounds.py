"""Lower bounds: nuclear norms against SVD and closed forms; validity against factorizations."""

import math

import numpy as np
import pytest
from scipy.linalg import svdvals

from dpmf.mechanisms import Participation, evaluate, factorize, lower_bound, nuclear_norm
from dpmf.mechanisms.bounds import bound_classes
from dpmf.workloads import SCHEDULES, Schedule, from_schedule, momentum, prefix_sum


def test_prefix_sum_singular_values_closed_form():
    """σ_k(A₁) = 1 / (2 sin((2k−1)π / (2(2n+1)))), k = 1..n."""
    for n in (1, 5, 64, 777):
        k = np.arange(1, n + 1)
        ref = np.sum(1.0 / (2.0 * np.sin((2 * k - 1) * np.pi / (2 * (2 * n + 1)))))
        assert nuclear_norm(prefix_sum(n)) == pytest.approx(ref, rel=1e-11)
    assert nuclear_norm(prefix_sum(64)) / 64 == pytest.approx(2.0401, abs=5e-5)


@pytest.mark.parametrize("sched", SCHEDULES)
def test_bidiagonal_path_matches_svd(sched):
    for n in (2, 50, 400):
        w = from_schedule(Schedule(sched, 1e-3), n)
        assert nuclear_norm(w) == pytest.approx(svdvals(w.dense()).sum(), rel=1e-10)
    w = momentum(80, 0.9, 0.95)
    assert nuclear_norm(w) == pytest.approx(svdvals(w.dense()).sum(), rel=1e-12)


def test_bound_classes():
    assert bound_classes(64, Participation.single()) == 64
    assert bound_classes(64, Participation.separated(16, 4)) == 16
    assert bound_classes(64, Participation.separated(4, 2)) == 32  # ⌈64/2⌉ > b
    assert bound_classes(10, Participation.separated(50, 3)) == 10
    assert bound_classes(64, Participation.fixed_epochs(16, 4)) == 16


def test_min_sep_bound_is_sqrt_k_times_single_when_n_is_kb():
    w = from_schedule(Schedule("exponential", 0.1), 64)
    single = lower_bound(w)
    assert lower_bound(w, Participation.separated(16, 4)) == pytest.approx(2 * single, rel=1e-14)
    assert lower_bound(w, Participation.fixed_epochs(16, 4)) == pytest.approx(2 * single, rel=1e-14)


@pytest.mark.parametrize(
    "part",
    [
        Participation.single(),
        Participation.separated(8, 4),
        Participation.separated(5, 3),
        Participation.fixed_epochs(8, 4),
    ],
)
def test_bound_below_every_factorization(part):
    for sched in ("constant", "exponential", "cosine"):
        w = from_schedule(Schedule(sched, 0.05), 32)
        lb = lower_bound(w, part)
        for spec in [
            "identity",
            "sqrt_prefix",
            "lr_aware",
            "sqrt",
            "bisr:4",
            "bsr:2",
            "output",
            "sqrt_prefix_scaled",
        ]:
            e = evaluate(factorize(w, spec), part, with_lower_bound=False)
            assert lb <= e.mean_se * (1 + 1e-12) <= e.max_se * (1 + 1e-12)


def test_random_factorizations_respect_bound():
    """The bound holds for arbitrary (not only named) factorizations: random lower-triangular C."""
    rng = np.random.default_rng(0)
    n = 12
    w = from_schedule(Schedule("linear", 0.2), n)
    A = w.dense()
    part = Participation.separated(4, 3)
    lb = lower_bound(w, part)
    from dpmf.mechanisms import sensitivity

    for _ in range(20):
        C = np.tril(rng.normal(size=(n, n)))
        C[np.diag_indices(n)] = np.abs(C[np.diag_indices(n)]) + 0.5
        B = A @ np.linalg.inv(C)
        s = sensitivity(C, part)
        assert s.value * np.linalg.norm(B) / math.sqrt(n) >= lb


def _golub_kahan_nuclear_norm(w):
    """The former method, re-derived: ‖A‖_* = Σ 1/σ_i(A⁻¹), σ_i(A⁻¹) the positive eigenvalues
    of the 2n×2n Golub–Kahan matrix of the bidiagonal A⁻¹ (LAPACK MRRR)."""
    from scipy.linalg import eigh_tridiagonal

    n = w.n
    inv_diag = 1.0 / (w.coeffs[0] * w.scale)
    off = np.empty(2 * n - 1)
    off[0::2] = inv_diag
    off[1::2] = -inv_diag[1:]
    ev = eigh_tridiagonal(np.zeros(2 * n), off, eigvals_only=True)
    return float(np.sum(1.0 / np.abs(ev[n:])))


@pytest.mark.parametrize("sched", SCHEDULES)
def test_quadrature_matches_golub_kahan_eigenvalues_to_1e_10(sched):
    for n, beta in ((2, 0.5), (3, 1e-3), (257, 0.1), (4096, 0.1), (4096, 1e-4)):
        w = from_schedule(Schedule(sched, beta), n)
        assert nuclear_norm(w) == pytest.approx(_golub_kahan_nuclear_norm(w), rel=1e-10)


def test_quadrature_matches_the_prefix_sum_closed_form_and_scales():
    """A constant column scale d goes through the quadrature when the coefficients are not 1."""
    from dpmf.mechanisms.bounds import _bidiagonal_inverse_nuclear_norm

    for n in (1, 2, 10, 3000):
        k = np.arange(1, n + 1)
        ref = np.sum(1.0 / (2.0 * np.sin((2 * k - 1) * np.pi / (2 * (2 * n + 1)))))
        assert _bidiagonal_inverse_nuclear_norm(np.full(n, 2.5)) == pytest.approx(2.5 * ref, rel=1e-12)
    rng = np.random.default_rng(3)
    d = np.exp(rng.normal(size=300) * 3.0)  # condition number ~1e8
    A = np.tril(np.ones((300, 300))) * d[None, :]
    assert _bidiagonal_inverse_nuclear_norm(d) == pytest.approx(svdvals(A).sum(), rel=1e-11)
