"""Streaming correlated noise: exact agreement with C⁻¹Z, covariance over seeds, state size."""

import numpy as np
import pytest
import torch
from scipy.linalg import toeplitz

from dpmf.mechanisms import ScaledToeplitz, factorize
from dpmf.optim.noise import (
    BandedSqrtNoise,
    BLTNoise,
    DenseInverseNoise,
    ToeplitzInverseNoise,
    identity_noise,
    noise_for_factorization,
)
from dpmf.workloads import Schedule, from_schedule, prefix_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


N = 8  # steps of the small strategies


def _exp_workload(n=N):
    return from_schedule(Schedule("exponential", 0.2), n)


def _blt_coeffs(omega, theta, n):
    # independent construction of Toep(g): g_0 = 1, g_j = Σ_i ω_i θ_i^{j−1}
    g = np.zeros(n)
    g[0] = 1.0
    for j in range(1, n):
        g[j] = sum(w * th ** (j - 1) for w, th in zip(omega, theta, strict=True))
    return g


OMEGA, THETA = [0.35, 0.2], [0.9, 0.5]
rng = np.random.default_rng(7)
ROWS, COLS = rng.uniform(0.5, 1.5, N), rng.uniform(0.5, 1.5, N)
BSR_C = np.array([1.0, 0.5, 0.375, 0.0, 0.0, 0.0, 0.0, 0.0])


def _cases():
    """(label, make(dim, seed, dtype) -> generator, dense C⁻¹ from an independent route)."""
    fz = {
        spec: factorize(w, spec)
        for spec, w in [
            ("identity", prefix_sum(N)),
            ("bisr:3", prefix_sum(N)),
            ("bsr:3", prefix_sum(N)),
            ("sqrt_prefix", prefix_sum(N)),
            ("sqrt_prefix_scaled", _exp_workload()),
            ("output", _exp_workload()),
            ("sqrt", _exp_workload()),
            ("blt:2", prefix_sum(N)),
        ]
    }

    def from_fz(spec, mode=None):
        return lambda dim, seed, dtype: noise_for_factorization(
            fz[spec], dim, seed=seed, dtype=dtype, mode=mode
        )

    def inv(spec):
        # C⁻¹ as the inverse of the dense C (numpy), not the power series of the mechanism
        return np.linalg.inv(fz[spec].C.dense())

    g_blt = _blt_coeffs(OMEGA, THETA, N)
    return [
        ("identity", from_fz("identity"), np.eye(N)),
        ("bisr:3 buffer", from_fz("bisr:3", "buffer"), inv("bisr:3")),
        ("bisr:3 regenerate", from_fz("bisr:3", "regenerate"), inv("bisr:3")),
        ("bsr:3 recursion", from_fz("bsr:3"), inv("bsr:3")),
        ("sqrt_prefix full toeplitz", from_fz("sqrt_prefix"), inv("sqrt_prefix")),
        ("sqrt_prefix_scaled row scale", from_fz("sqrt_prefix_scaled"), inv("sqrt_prefix_scaled")),
        ("output of A_chi banded+scale", from_fz("output"), inv("output")),
        ("sqrt of A_chi dense", from_fz("sqrt"), inv("sqrt")),
        ("optimized blt:2 buffers", from_fz("blt:2"), inv("blt:2")),
        (
            "blt",
            lambda dim, seed, dtype: BLTNoise(OMEGA, THETA, dim, seed=seed, steps=N, dtype=dtype),
            toeplitz(g_blt, np.zeros(N)),
        ),
        (
            "blt scaled",
            lambda dim, seed, dtype: BLTNoise(
                OMEGA, THETA, dim, seed=seed, steps=N, row_scale=ROWS, col_scale=COLS, dtype=dtype
            ),
            ROWS[:, None] * toeplitz(g_blt, np.zeros(N)) * COLS[None, :],
        ),
        (
            "banded sqrt scaled",
            lambda dim, seed, dtype: BandedSqrtNoise(
                BSR_C, dim, seed=seed, steps=N, row_scale=ROWS, col_scale=COLS, dtype=dtype
            ),
            np.linalg.inv(ROWS[:, None] * toeplitz(BSR_C, np.zeros(N)) * COLS[None, :]),
        ),
        (
            "toeplitz inverse scaled buffer",
            lambda dim, seed, dtype: ToeplitzInverseNoise(
                [1.0, -0.6, 0.2], dim, seed=seed, steps=N, row_scale=ROWS, col_scale=COLS, dtype=dtype
            ),
            ROWS[:, None] * toeplitz([1.0, -0.6, 0.2] + [0.0] * (N - 3), np.zeros(N)) * COLS[None, :],
        ),
    ]


CASES = _cases()
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("label,make,M", CASES, ids=IDS)
def test_stream_equals_dense_inverse_times_raw_noise(label, make, M):
    """y_t = (M Z)_t exactly, with Z the regenerated raw noises of the same stream."""
    gen = make(5, 123, torch.float64)
    ys = torch.stack([gen.next() for _ in range(N)]).numpy()
    Z = torch.stack([gen.raw_noise(t) for t in range(N)]).numpy()
    np.testing.assert_allclose(ys, M @ Z, rtol=1e-10, atol=1e-12)
    # the coefficient of the fresh noise z_t is the diagonal of C⁻¹
    np.testing.assert_allclose([gen.innovation(t) for t in range(N)], np.diag(M), rtol=1e-12)


def _cov_stat(samples, M):
    """max over entries of |empirical − analytic| / standard error, zero-mean Gaussian."""
    S = M @ M.T
    n_seeds = samples.shape[0]
    emp = samples.T @ samples / n_seeds
    se = np.sqrt((np.outer(np.diag(S), np.diag(S)) + S**2) / n_seeds)
    return float(np.max(np.abs(emp - S) / se))


@pytest.mark.parametrize("label,make,M", CASES, ids=IDS)
def test_covariance_over_2000_seeds_matches_C_inverse_C_inverse_T(label, make, M):
    """One scalar parameter (d = 1), 2000 seeds: Cov over steps ≈ C⁻¹C⁻ᵀ within 5 standard errors."""
    seeds = 2000
    samples = np.empty((seeds, N))
    for k in range(seeds):
        gen = make(1, 10_000 + k, torch.float32)
        samples[k] = [float(gen.next()) for _ in range(N)]
    assert _cov_stat(samples, M) < 5.0
    # the test has power: transposed correlation (the classic documentation slip) is rejected
    # whenever it is a different covariance
    if not np.allclose(M.T @ M, M @ M.T, atol=0.1):
        assert _cov_stat(samples, M.T) > 5.0


@pytest.mark.parametrize("label,make,M", CASES, ids=IDS)
def test_state_between_steps_is_at_most_documented(label, make, M):
    dim = 7
    gen = make(dim, 1, torch.float32)
    for _ in range(N - 1):
        gen.next()
        assert gen.state_numel() <= gen.documented_state_numel
    assert gen.state_bytes() == gen.state_numel() * 4


def test_documented_state_sizes():
    d = 11
    assert identity_noise(d, seed=0, steps=5).documented_state_numel == 0
    assert ToeplitzInverseNoise([1, 0.5, 0.2, 0.1], d, seed=0, steps=9).state_numel() == 3 * d
    assert ToeplitzInverseNoise([1, 0.5, 0.2], d, seed=0, steps=9, mode="regenerate").state_numel() == 0
    assert BandedSqrtNoise([1, 0.5, 0.2, 0.1, 0.0], d, seed=0, steps=9).state_numel() == 3 * d
    assert BLTNoise([0.1, 0.2, 0.3], [0.9, 0.8, 0.7], d, seed=0, steps=9).state_numel() == 3 * d
    dense = DenseInverseNoise(np.tril(np.ones((6, 6))), d, seed=0)
    assert dense.state_numel() == dense.documented_state_numel == 0


def test_factory_picks_the_streaming_form():
    w = prefix_sum(64)
    g = noise_for_factorization(factorize(w, "identity"), 3, seed=0)
    assert isinstance(g, ToeplitzInverseNoise) and g.bands == 1
    g = noise_for_factorization(factorize(w, "bisr:4"), 3, seed=0)
    assert isinstance(g, ToeplitzInverseNoise) and g.bands == 4 and g.mode == "buffer"
    g = noise_for_factorization(factorize(w, "bsr:4"), 3, seed=0)
    assert isinstance(g, BandedSqrtNoise) and g.bands == 4
    g = noise_for_factorization(factorize(w, "sqrt_prefix"), 3, seed=0)
    assert isinstance(g, ToeplitzInverseNoise) and g.bands == 64 and g.mode == "regenerate"
    g = noise_for_factorization(factorize(w, "output"), 3, seed=0)  # A₁⁻¹ = Toep(1, −1)
    assert isinstance(g, ToeplitzInverseNoise) and g.bands == 2
    g = noise_for_factorization(factorize(_exp_workload(64), "sqrt"), 3, seed=0)
    assert isinstance(g, DenseInverseNoise)
    g = noise_for_factorization(factorize(w, "blt:3"), 3, seed=0)
    assert isinstance(g, BLTNoise) and g.buffers == 3 and g.state_numel() == 3 * 3


def test_checkpoint_resumes_the_same_stream_and_refuses_another():
    fz = factorize(prefix_sum(12), "bsr:4")
    full = noise_for_factorization(fz, 6, seed=5)
    ref = torch.stack([full.next() for _ in range(12)])
    first = noise_for_factorization(fz, 6, seed=5)
    for _ in range(5):
        first.next()
    state = first.state_dict()
    second = noise_for_factorization(fz, 6, seed=5)
    second.load_state_dict(state)
    rest = torch.stack([second.next() for _ in range(7)])
    assert torch.equal(rest, ref[5:])
    with pytest.raises(ValueError, match="seed"):
        noise_for_factorization(fz, 6, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="coeffs"):
        noise_for_factorization(factorize(prefix_sum(12), "bsr:3"), 6, seed=5).load_state_dict(state)


def test_stream_refuses_steps_beyond_the_strategy():
    gen = identity_noise(2, seed=0, steps=2)
    gen.next()
    gen.next()
    with pytest.raises(RuntimeError, match="2 steps"):
        gen.next()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="coeffs"):
        ToeplitzInverseNoise([0.0, 1.0], 3, seed=0, steps=4)
    with pytest.raises(ValueError, match="mode"):
        ToeplitzInverseNoise([1.0], 3, seed=0, steps=4, mode="cache")
    with pytest.raises(ValueError, match="dim"):
        identity_noise(0, seed=0, steps=4)
    with pytest.raises(ValueError, match="theta"):
        BLTNoise([0.1, 0.2], [0.5], 3, seed=0, steps=4)
    with pytest.raises(ValueError, match="row_scale"):
        BandedSqrtNoise([1.0, 0.5], 3, seed=0, steps=4, row_scale=[1.0, 0.0, 1.0, 1.0])
    with pytest.raises(TypeError, match="factorization"):
        noise_for_factorization(ScaledToeplitz(np.ones(3)), 3, seed=0)


def test_noise_lives_on_the_requested_dtype():
    g = noise_for_factorization(factorize(prefix_sum(4), "bisr:2"), 3, seed=0, dtype=torch.float64)
    assert g.next().dtype == torch.float64
    # half precision: computed in float32 (the recursion does not accumulate bf16 round-off)
    fz = factorize(prefix_sum(40), "bsr:4")
    g16 = noise_for_factorization(fz, 3, seed=0, dtype=torch.bfloat16)
    g32 = noise_for_factorization(fz, 3, seed=0, dtype=torch.float32)
    for _ in range(40):
        a, b = g16.next(), g32.next()
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))
    assert g16.state_bytes() == 3 * 3 * 4
