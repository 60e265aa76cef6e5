"""Top singular value σ₁ of a matrix by warm-started power iteration.

DP-Muon-S scales its orthogonalized update by σ₁(M_t) of the heavy-ball momentum M_t
("Spectral Gradient Orthogonalization Improves Differentially Private Training at Scale",
Sec. Method, item 4). The momentum changes slowly between steps, so the right singular vector
of the previous step is an excellent start and one or two iterations per step suffice.
"""

from __future__ import annotations

import torch

from dpmf._validation import check_int

__all__ = ["top_singular_value", "initial_vector"]


def initial_vector(cols: int, *, dtype=torch.float32, device=None, seed: int = 0) -> torch.Tensor:
    """A deterministic random unit vector of shape (cols,) to start the power iteration.

    Drawn from N(0, I) with a private CPU generator seeded by ``seed`` (the global RNG is not
    touched), then normalized and moved to ``device``/``dtype``. A random start is almost
    surely not orthogonal to the top singular vector.
    """
    cols = check_int("cols", cols, minimum=1)
    gen = torch.Generator(device="cpu").manual_seed(check_int("seed", seed, minimum=0))
    v = torch.randn(cols, generator=gen, dtype=torch.float64)
    v = v / torch.linalg.vector_norm(v)
    return v.to(dtype=dtype, device=device)


def top_singular_value(
    M: torch.Tensor, v: torch.Tensor, iterations: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimate σ₁(M) by ``iterations`` steps of power iteration on MᵀM from the vector ``v``.

    Each step is v ← MᵀM·v/‖MᵀM·v‖; the estimate is ‖M·v‖ for the final unit v, a lower bound
    of σ₁ that converges at the rate (σ₂/σ₁)^(2k). M is divided by its largest absolute entry
    first (computed in float32, float64 for float64 input), so the estimate is exactly
    homogeneous, σ₁(c·M) = c·σ₁(M), even where squares of M's entries under- or overflow.

    Args:
        M: matrix of shape (m, n), finite.
        v: start vector of shape (n,) (the previous step's result), any non-zero vector.
        iterations: number of MᵀM products, >= 0.

    Returns:
        (sigma, v): the estimate as a 0-d tensor in the working dtype, and the updated unit
        vector of shape (n,) in ``v``'s dtype. For M = 0: sigma = 0 and v unchanged.

    Raises:
        ValueError: M not 2-D, v of the wrong shape, iterations < 0.
    """
    if not isinstance(M, torch.Tensor) or M.ndim != 2:
        raise ValueError(f"M is invalid: must be a 2-D tensor, got {getattr(M, 'shape', M)!r}")
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != (M.shape[1],):
        raise ValueError(
            f"v is invalid: must be a tensor of shape ({M.shape[1]},), got {tuple(getattr(v, 'shape', ()))}"
        )
    iterations = check_int("iterations", iterations, minimum=0)
    work = torch.promote_types(M.dtype, torch.float32)
    A = M.to(work)
    peak = A.abs().amax()
    # No branch on the value (no device synchronization): a zero M stays zero, every
    # product below is zero, x is kept and sigma = 0.
    A = A / torch.where(peak > 0, peak, torch.ones_like(peak))
    x = v.to(work)
    x = x / torch.linalg.vector_norm(x).clamp_min(torch.finfo(work).tiny)
    for _ in range(iterations):
        y = A.mT @ (A @ x)
        norm = torch.linalg.vector_norm(y)
        # y = 0 only if x is in the null space of A; then keep x (sigma below is then 0).
        x = torch.where(norm > 0, y / norm.clamp_min(torch.finfo(work).tiny), x)
    sigma = torch.linalg.vector_norm(A @ x) * peak
    return sigma, x.to(v.dtype)
