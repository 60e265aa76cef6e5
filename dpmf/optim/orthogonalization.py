"""Newton–Schulz orthogonalization: an approximation of the polar factor U·Vᵀ of a matrix.

For G = U·diag(σ)·Vᵀ the iteration acts on the singular values alone:

    X₀ = G / ‖G‖_F,    X ← a·X + b·(X·Xᵀ)·X + c·(X·Xᵀ)²·X,

so Xₖ = U·diag(pᵏ(σ/‖G‖_F))·Vᵀ with the odd quintic p(x) = a·x + b·x³ + c·x⁵. With the
coefficients (a, b, c) = (3.4445, −4.7750, 2.0315) and five steps, every x = σᵢ/‖G‖_F in
[0.0011, 1] is mapped into [0.5, 1.21] (into [0.68, 1.14] for x ≥ 0.01): the singular vectors
are kept and the singular values pushed towards 1.

Source: DP-Muon ("Spectral Gradient Orthogonalization Improves Differentially Private Training
at Scale", Sec. Method, item 2), which fixes the normalization, the coefficients and the five
steps.
"""

from __future__ import annotations

import numbers

import torch

from dpmf._validation import check_int, check_real

__all__ = ["QUINTIC_COEFFICIENTS", "newton_schulz", "check_coefficients"]

#: (a, b, c) of the quintic Newton–Schulz step of DP-Muon (the DP-Muon paper, Sec. Method, item 2).
QUINTIC_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


def check_coefficients(coefficients) -> tuple[float, float, float]:
    """Return ``coefficients`` as a tuple of three finite floats (a, b, c).

    Raises:
        TypeError / ValueError: not a sequence of three finite real numbers.
    """
    try:
        items = tuple(coefficients)
    except TypeError:
        raise TypeError(
            f"coefficients={coefficients!r} is invalid: must be a sequence (a, b, c) of 3 reals"
        ) from None
    if len(items) != 3 or not all(isinstance(v, numbers.Real) for v in items):
        raise ValueError(f"coefficients={coefficients!r} is invalid: must be a sequence (a, b, c) of 3 reals")
    return tuple(check_real(f"coefficients[{i}]", v) for i, v in enumerate(items))


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients=QUINTIC_COEFFICIENTS,
    eps: float = 1e-7,
    *,
    batched: bool = False,
) -> torch.Tensor:
    """Orthogonalize a matrix (or a batch of matrices) by the quintic Newton–Schulz iteration.

    The input is first divided by its largest absolute entry and then by its Frobenius norm,
    so no square of an entry of the input is ever formed: the result is the same for G and
    c·G for every c > 0 (up to rounding), also where G's squares would under- or overflow.
    The iteration runs on the wide orientation (a tall G is transposed, iterated and
    transposed back), so f(Gᵀ) = f(G)ᵀ and the Gram matrices are min(m, n)².

    Args:
        G: a matrix of shape (m, n), or with ``batched=True`` a batch of shape (b, m, n).
            Floating point, any dtype and device; it must be finite (a NaN or inf entry gives a
            non-finite result: the optimizers check gradients before calling this).
        steps: number of Newton–Schulz steps, >= 0 (DP-Muon uses 5).
        coefficients: (a, b, c) of the step X ← aX + b(XXᵀ)X + c(XXᵀ)²X.
        eps: floor of the Frobenius norm of the max-normalized input, in (0, 1]. That norm is
            >= 1 unless the input is zero, so the floor only guards the zero matrix and
            never perturbs the normalization X₀ = G/‖G‖_F.
        batched: accept a 3-D batch of matrices. Without it only 2-D input is accepted, so a
            conv kernel is never mistaken for a batch: reshape it to out × (in·kh·kw) first
            (``dpmf.optim.matrix_view``).

    Returns:
        A tensor of G's shape, dtype and device. The normalization and the iteration are
        computed in float32 for float16/bfloat16/float32 inputs and in float64 for float64
        inputs; the result is cast back. A zero matrix gives a zero matrix.

    Raises:
        TypeError: G is not a floating-point tensor.
        ValueError: G is not 2-D (3-D with ``batched=True``); bad steps, coefficients or eps.
    """
    if not isinstance(G, torch.Tensor):
        raise TypeError(f"G={type(G).__name__} is invalid: must be a torch.Tensor")
    expected = 3 if batched else 2
    if G.ndim != expected:
        what = "a 3-D batch (b, m, n)" if batched else "a 2-D matrix (m, n)"
        raise ValueError(
            f"G of shape {tuple(G.shape)} is invalid: newton_schulz takes {what}"
            + ("" if batched else " (pass batched=True for a 3-D batch of matrices)")
            + "; reshape a conv kernel (out, in, kh, kw) to out × in·kh·kw with matrix_view, "
            "and never pass 1-D parameters"
        )
    if not G.is_floating_point():
        raise TypeError(f"G of dtype {G.dtype} is invalid: must be a floating-point tensor")
    steps = check_int("steps", steps, minimum=0)
    a, b, c = check_coefficients(coefficients)
    eps = check_real("eps", eps, low=0.0, high=1.0, low_inclusive=False)
    if G.numel() == 0:
        return G.clone()

    work = torch.promote_types(G.dtype, torch.float32)
    X = G.to(work)
    transpose = X.shape[-2] > X.shape[-1]
    if transpose:
        X = X.mT
    # Two-stage normalization: by the largest entry (exact scale removal, no squares), then by
    # the Frobenius norm of a matrix whose largest entry is 1.
    peak = X.abs().amax(dim=(-2, -1), keepdim=True)
    X = X / torch.where(peak > 0, peak, torch.ones_like(peak))
    X = X / torch.linalg.matrix_norm(X, ord="fro", keepdim=True).clamp_min(eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transpose:
        X = X.mT
    return X.to(G.dtype)
