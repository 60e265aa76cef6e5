"""Correcting the mean distortion of fresh Gaussian noise in a nonlinear matrix map (DP-MuonBC).

Setting. At step t the optimizer applies a nonlinear map f (Newton–Schulz) to a matrix
Y = M̂_t built from the privatized gradient. Conditioned on the whole history F before this
step's fresh noise, Y = μ + s·Z with μ fixed by F, Z ~ N(0, I) entry-wise and s the known std
of the fresh noise in Y. The plain update f(Y) is biased: E[f(Y) | F] ≠ f(μ).

Gaussian heat identity. Let φ(h) = E[f(μ + √h·ξ)], ξ ~ N(0, I). Then ∂φ/∂h = ½·Δφ, so for a
smooth f, φ(h) = Σ_j (h/2)^j·Δʲf(μ)/j! (a finite sum for a polynomial f). A fresh probe ξ
added with weight a·s gives an unbiased sample of φ at a larger variance:

    E[f(Y + a·s·ξ) | F] = φ((1 + a²)·s²).

Richardson extrapolation. Sampling φ at the nodes h_k = (k+1)·s², k = 0..K (probe weight
a_k = √k; k = 0 is the plain f(Y)) and combining them with the Lagrange weights of
extrapolation to h = 0,

    w_k = Π_{j≠k} (0 − x_j)/(x_k − x_j) with x_j = j + 1,   i.e.   w_k = (−1)^k·C(K+1, k+1),

gives the order-K estimator Σ_k w_k·f(Y + √k·s·ξ) whose conditional bias is the interpolation
error of a degree-K polynomial in h: O(s^(2K+2)) instead of O(s²). Order 1 is
2·f(Y) − f(Y + s·ξ) (weights 2, −1); order 2 has weights 3, −3, 1; Σ_k w_k = 1 and
Σ_k w_k·x_k^j = 0 for j = 1..K. The price is variance: Σ_k |w_k| = 2^(K+1) − 1.

Each f(Y + √k·s·ξ) is averaged over ``probes`` fresh probes, each used antithetically
(±ξ: same mean, smaller variance; for an odd f such as Newton–Schulz the average over ±ξ of
f(0 ± s·ξ) is exactly 0, so a zero input still gives a zero output); the same probes serve
every level k (common random numbers: the alternating sum of strongly correlated terms has a
much smaller variance). The probes are drawn after the privatized release and are pure
post-processing: they cost no privacy.

Source: "DP-MuonBC" (the abstract in ``papers/dp-sgd-compliance-fl-and-dp-muon-bc.txt``:
conditioning on the adaptive history gives an exact Gaussian heat identity; first order reduces
the bias from second to fourth order in the fresh noise scale; order K has bias of order 2K+2).
The weights above are derived here from that identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dpmf._validation import check_int, check_real
from dpmf.optim.orthogonalization import QUINTIC_COEFFICIENTS, newton_schulz

__all__ = ["richardson_weights", "bias_corrected", "newton_schulz_bc"]


def richardson_weights(order: int) -> tuple[float, ...]:
    """Weights w_k = (−1)^k·C(K+1, k+1), k = 0..K, of the order-K heat extrapolation.

    w_k multiplies E f(Y + √k·s·ξ); they extrapolate φ(h) from the nodes h = s², 2s², …,
    (K+1)s² to h = 0 (module docstring).

    Raises:
        ValueError: order < 0. Order 0 gives (1.0,): the plain map.
    """
    order = check_int("order", order, minimum=0)
    return tuple(float((-1) ** k * math.comb(order + 1, k + 1)) for k in range(order + 1))


def _check_noise_std(noise_std):
    if isinstance(noise_std, torch.Tensor):
        if noise_std.ndim != 0:
            raise ValueError(
                f"noise_std is invalid: must be a number or a 0-d tensor, got shape {tuple(noise_std.shape)}"
            )
        return noise_std
    return check_real("noise_std", noise_std, low=0.0)


def bias_corrected(
    f: Callable[[torch.Tensor], torch.Tensor],
    Y: torch.Tensor,
    noise_std,
    *,
    order: int = 1,
    probes: int = 1,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Order-K heat-extrapolation estimate of f(μ) from one noisy Y = μ + s·Z (any matrix map f).

    Computes Σ_k w_k·mean_j f(Y ± √k·s·ξ_j) with w = ``richardson_weights(order)``, the k = 0
    term being f(Y) itself. All evaluations go to ``f`` in one batch.

    Args:
        f: batched matrix map: takes (N, m, n) and returns (N, ...) (e.g.
            ``lambda X: newton_schulz(X, batched=True)``).
        Y: the noisy matrix, shape (m, n), or a batch (B, m, n) of independent ones (each gets
            its own probes).
        noise_std: s >= 0, the std of the fresh Gaussian noise in each entry of Y (a number or
            a 0-d tensor). s = 0 returns f(Y).
        order: K >= 0; the conditional bias is O(s^(2K+2)).
        probes: number of probes ξ_j per evaluation level, >= 1.
        antithetic: use each probe as ±ξ_j (2·probes evaluations per level) instead of once.
        generator: torch.Generator on Y's device for the probes (None: the global RNG).

    Returns:
        Tensor of the shape of f's output for Y (f(Y)'s shape), in f's output dtype.
        Probes are drawn in float32 (float64 for float64 Y).

    Raises:
        TypeError: f not callable, Y not a floating tensor.
        ValueError: Y not 2-D or 3-D, noise_std < 0 or not finite, order < 0, probes < 1.
    """
    if not callable(f):
        raise TypeError(f"f={f!r} is invalid: must be a callable matrix map")
    if not isinstance(Y, torch.Tensor) or not Y.is_floating_point():
        raise TypeError("Y is invalid: must be a floating-point torch.Tensor")
    if Y.ndim not in (2, 3):
        raise ValueError(f"Y of shape {tuple(Y.shape)} is invalid: must be (m, n) or a batch (B, m, n)")
    noise_std = _check_noise_std(noise_std)
    weights = richardson_weights(order)
    probes = check_int("probes", probes, minimum=1)
    single = Y.ndim == 2
    Yb = Y.unsqueeze(0) if single else Y
    batch = Yb.shape[0]
    if order == 0 or (not isinstance(noise_std, torch.Tensor) and noise_std == 0.0):
        out = f(Yb)
        return out[0] if single else out

    work = torch.promote_types(Y.dtype, torch.float32)
    Yw = Yb.to(work)
    xi = torch.randn((probes, *Yw.shape), generator=generator, dtype=work, device=Y.device)
    signs = (1.0, -1.0) if antithetic else (1.0,)
    inputs = [Yw]
    for k in range(1, order + 1):
        step = math.sqrt(k) * noise_std
        for sign in signs:
            inputs.append((Yw.unsqueeze(0) + (sign * step) * xi).reshape(-1, *Yw.shape[1:]))
    F = f(torch.cat(inputs, dim=0))
    out_shape = F.shape[1:]
    plain, rest = F[:batch], F[batch:]
    rest = rest.reshape(order, len(signs), probes, batch, *out_shape)
    # Pair +ξ and −ξ before averaging (exact cancellation for odd maps at Y = 0).
    level_means = rest.sum(dim=1).mean(dim=1) / len(signs)
    est = weights[0] * plain
    for k in range(1, order + 1):
        est = est + weights[k] * level_means[k - 1]
    return est[0] if single else est


def newton_schulz_bc(
    Y: torch.Tensor,
    noise_std,
    *,
    order: int = 1,
    probes: int = 1,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
    steps: int = 5,
    coefficients=QUINTIC_COEFFICIENTS,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Bias-corrected Newton–Schulz orthogonalization of a noisy matrix Y (DP-MuonBC).

    ``bias_corrected`` applied to f = ``newton_schulz``. Because f(c·X) = f(X) for c > 0, Y and
    s are first divided together by max(max|Yᵢⱼ|, s), which changes nothing mathematically and
    keeps every sum Y ± √k·s·ξ representable: the result is invariant to scaling (Y, s) by any
    c > 0.

    Args:
        Y: matrix (m, n) — conv kernels reshaped to out × in·kh·kw first — or a batch (B, m, n).
        noise_std: s >= 0, std of the fresh Gaussian noise per entry of Y (number or 0-d tensor).
        order, probes, antithetic, generator: as in ``bias_corrected``.
        steps, coefficients, eps: as in ``newton_schulz``.

    Returns:
        Tensor of Y's shape, in float32 (float64 for float64 Y).

    Raises:
        As ``bias_corrected`` and ``newton_schulz``.
    """
    if not isinstance(Y, torch.Tensor) or not Y.is_floating_point():
        raise TypeError("Y is invalid: must be a floating-point torch.Tensor")
    if Y.ndim not in (2, 3):
        raise ValueError(
            f"Y of shape {tuple(Y.shape)} is invalid: newton_schulz_bc takes a matrix (m, n) or a "
            "batch (B, m, n); reshape conv kernels to out × in·kh·kw first"
        )
    noise_std = _check_noise_std(noise_std)
    work = torch.promote_types(Y.dtype, torch.float32)
    Yw = Y.to(work)
    s = torch.as_tensor(noise_std, dtype=work, device=Y.device)
    scale = torch.maximum(Yw.abs().amax(dim=(-2, -1), keepdim=True), s)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    Yn = Yw / scale
    sn = s / scale  # (1, 1) or (B, 1, 1): broadcasts over each matrix's probes

    def f(X):
        return newton_schulz(X, steps, coefficients, eps, batched=True)

    if Y.ndim == 2:
        return bias_corrected(
            f,
            Yn,
            sn.reshape(()),
            order=order,
            probes=probes,
            antithetic=antithetic,
            generator=generator,
        )
    # A batch with per-matrix scales: correct each matrix with its own normalized s.
    return torch.stack(
        [
            bias_corrected(
                f,
                Yn[i],
                sn[i].reshape(()),
                order=order,
                probes=probes,
                antithetic=antithetic,
                generator=generator,
            )
            for i in range(Y.shape[0])
        ]
    )
