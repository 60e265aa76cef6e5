"""Newton–Schulz orthogonalization, power iteration and the matrix view.

Truths used: matrices built from a known SVD (numpy QR), the scalar quintic iterated in
float64, scipy's subspace angles, numpy's SVD.
"""

import numpy as np
import pytest
import scipy.linalg as sl
import torch

from dpmf.optim import (
    QUINTIC_COEFFICIENTS,
    aspect_factor,
    check_matrix_parameter,
    matrix_view,
    newton_schulz,
    top_singular_value,
)
from dpmf.optim.power_iteration import initial_vector

SHAPES = [(8, 8), (16, 64), (64, 16), (32, 48), (100, 30), (5, 200)]


def _known_svd(m, n, sv, seed):
    rng = np.random.default_rng(seed)
    k = min(m, n)
    U, _ = np.linalg.qr(rng.standard_normal((m, k)))
    V, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return U, V, U @ np.diag(sv) @ V.T


def _quintic_iterated(x, steps=5):
    a, b, c = QUINTIC_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize("shape", SHAPES)
def test_known_svd_singular_vectors_kept_and_values_mapped(shape):
    m, n = shape
    k = min(m, n)
    sv = np.geomspace(1.0, 1e-3, k)  # well separated; the smallest are below 0.01·‖G‖_F
    U, V, G = _known_svd(m, n, sv, seed=m * 1000 + n)
    X = newton_schulz(torch.tensor(G, dtype=torch.float32)).double().numpy()
    ratio = sv / np.linalg.norm(G)
    for i in range(k):
        # X maps the right singular vector v_i onto the left one u_i (and back).
        assert sl.subspace_angles((X @ V[:, i])[:, None], U[:, [i]])[0] < 1e-3
        assert sl.subspace_angles((X.T @ U[:, i])[:, None], V[:, [i]])[0] < 1e-3
    d = np.einsum("mi,mn,ni->i", U, X, V)
    big = ratio >= 0.01
    assert big.sum() >= 2 and (~big).any()
    assert np.all((d[big] >= 0.5) & (d[big] <= 1.5))
    # Each singular value follows the scalar quintic p⁵(σ_i/‖G‖_F) (float64 reference).
    np.testing.assert_allclose(d, _quintic_iterated(ratio), atol=1e-4)
    # No direction is inflated beyond what p⁵ allows on [0, 1].
    assert np.linalg.svd(X, compute_uv=False).max() < 1.21


@pytest.mark.parametrize("shape", [(30, 70), (70, 30), (1, 9)])
def test_transpose_equivariance_exact_for_rectangular(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(newton_schulz(G.T), newton_schulz(G).T)


def test_transpose_equivariance_square():
    G = torch.randn(30, 30, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(newton_schulz(G.T), newton_schulz(G).T, atol=5e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", [1e4, 1e-8, 1e-3])
def test_low_precision_inputs(dtype, norm):
    G = torch.randn(64, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    G = G / G.norm() * norm
    low = G.to(dtype)
    out = newton_schulz(low)
    assert out.dtype == dtype and torch.isfinite(out).all()
    if dtype == torch.float16 and norm == 1e-8:
        # Every entry (~1e-10) is below half of float16's smallest subnormal 2⁻²⁴ ≈ 6e-8: the
        # float16 input is exactly zero, and the output is the zero matrix.
        assert not low.any() and not out.any()
        return
    ref = newton_schulz(G.float())
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 5e-2


def test_float16_smallest_representable_scale():
    # Entries ~1e-6 are float16 subnormals (4–5 significant bits) and still within 5e-2.
    G = torch.randn(64, 128, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    G = G / G.norm() * 1e-4
    ref = newton_schulz(G.float())
    rel = (newton_schulz(G.half()).float() - ref).norm() / ref.norm()
    assert rel < 5e-2


@pytest.mark.parametrize("base", [1e-12, 1.0, 1e12])
def test_scale_invariance_float32_without_under_or_overflow(base):
    G = torch.randn(40, 24, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = newton_schulz(G)  # float64
    for c in [1e-10, 1e-5, 1.0, 1e5, 1e10]:
        # Entries from 1e-22 to 1e22: their squares under/overflow float32.
        out = newton_schulz((G * (base * c)).float())
        assert torch.isfinite(out).all()
        assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_zero_input_gives_zero_and_batch_matches_loop():
    assert not newton_schulz(torch.zeros(4, 6)).any()
    g = torch.Generator().manual_seed(6)
    batch = torch.randn(3, 5, 9, generator=g)
    batch[1] = 0.0
    out = newton_schulz(batch, batched=True)
    assert not out[1].any() and torch.isfinite(out).all()
    for i in (0, 2):
        torch.testing.assert_close(out[i], newton_schulz(batch[i]), atol=2e-6, rtol=0)
    tall = torch.randn(2, 9, 4, generator=g)
    torch.testing.assert_close(newton_schulz(tall, batched=True)[1], newton_schulz(tall[1]))


def test_output_dtype_float64_stays_float64():
    G = torch.randn(6, 10, dtype=torch.float64)
    assert newton_schulz(G).dtype == torch.float64


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), (4, 3, 2, 2), ()])
def test_refuses_non_matrices(shape):
    with pytest.raises(ValueError, match="G of shape"):
        newton_schulz(torch.ones(shape))


def test_refuses_bad_arguments():
    G = torch.ones(3, 4)
    with pytest.raises(ValueError, match="batch"):
        newton_schulz(G, batched=True)
    with pytest.raises(TypeError, match="floating"):
        newton_schulz(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        newton_schulz(np.ones((3, 4)))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(G, steps=-1)
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(G, coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(G, coefficients=(1.0, float("nan"), 2.0))
    with pytest.raises(ValueError, match="eps"):
        newton_schulz(G, eps=-1e-3)


def test_matrix_view_of_conv_kernel_and_degenerate_parameters():
    w = torch.arange(4 * 3 * 2 * 2, dtype=torch.float32).reshape(4, 3, 2, 2)
    v = matrix_view(w)
    assert v.shape == (4, 12) and torch.equal(v[1], w[1].flatten())
    assert v.data_ptr() == w.data_ptr()  # a view, no copy
    assert check_matrix_parameter("conv", w.shape) == (4, 12)
    with pytest.raises(ValueError, match=r"'scale'.*\(8, 1, 1\).*8×1.*sgd"):
        check_matrix_parameter("scale", (8, 1, 1))
    with pytest.raises(ValueError, match=r"'bias'.*\(8,\)"):
        check_matrix_parameter("bias", (8,))
    with pytest.raises(ValueError, match="at least 2"):
        matrix_view(torch.ones(5))


def test_aspect_factor_values():
    assert aspect_factor(10, 40) == 1.0
    assert aspect_factor(40, 10) == 2.0  # √min(4, 4)
    assert aspect_factor(90, 10) == 2.0  # capped at √4
    assert aspect_factor(90, 10, cap=None) == 3.0
    assert aspect_factor(20, 10) == pytest.approx(np.sqrt(2.0))


def test_power_iteration_converges_warm_started_and_is_homogeneous():
    sv = np.concatenate([[2.0, 1.5], np.linspace(1.0, 0.1, 28)])  # gap σ₂/σ₁ = 0.75
    U, V, M = _known_svd(30, 50, sv, seed=7)
    M_t = torch.tensor(M, dtype=torch.float32)
    v = initial_vector(50)
    estimates = []
    for _ in range(8):  # warm start: the vector carries over between calls
        sigma, v = top_singular_value(M_t, v, iterations=2)
        estimates.append(float(sigma))
    top = np.linalg.svd(M, compute_uv=False)[0]
    assert abs(estimates[-1] - top) / top < 1e-4
    assert all(e <= top * (1 + 1e-6) for e in estimates)  # Rayleigh lower bounds
    # Two iterations from a random start are not enough; the warm start gets there.
    assert abs(estimates[0] - top) / top > 1e-3
    for c in [1e-30, 1e30]:  # squares of the entries under/overflow float32
        s_c, _ = top_singular_value(M_t * c, v, iterations=2)
        assert float(s_c) / c == pytest.approx(estimates[-1], rel=1e-5)
    zero, v0 = top_singular_value(torch.zeros(30, 50), v, iterations=3)
    assert float(zero) == 0.0
    torch.testing.assert_close(v0, v)
