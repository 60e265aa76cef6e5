"""Canaries in training (torch): white-box gradient canaries and black-box input canaries.

White-box gradient canaries (Steinke, Nasr & Jagielski 2023, §6; Nasr et al. 2023). Canary j is
a direction u_j in parameter space (a random unit vector scaled to the clip norm ζ, so that it
is a gradient the clipping would let through). It is a pseudo-example of the data set
(index N + j), sampled at each step by the plan's scheme like every example, and, if it is
"in" (probability ½, independently of everything else), u_j is added to the CLIPPED SUM at the
steps it is sampled. Nothing else changes: the noise, its scale and the divisor are the plan's.
The injection is a stage of the private step (``dpmf.audit.private_audit.CanaryStage``, a
``dpmf.optim.privatize.StepStage``) that only the audits set; training has no canary option.

Score: the released noisy gradient of step t (B̄·p.grad) is projected on each unit direction
u_j/ζ; the projections y_j ∈ ℝⁿ are combined over the canary's possible steps π_j with the
mechanism-aware weighting of ``dpmf.audit.mechanism``: score_j = ⟨P1_π, y_j⟩/√(1_πᵀP1_π) with
P = CᵀC/(σζs)² (``white_box_scores``; for DP-SGD, the sum of the projections over π, divided by
σζs·√|π|) when the batches are public, and the scheme's likelihood ratio built on the same
whitened statistics under amplified sampling (``dpmf.audit.mechanism.likelihood_scores``; the
runner uses it, which is the linear score when the batches are public).

Black-box input canaries: m training examples copied with a wrong label (uniform among the
other classes); each copy is a pseudo-example sampled like the others and "in" with probability
½. Score: minus the final model's loss on the mislabeled copy (lower loss ⇒ "in").
"""

from __future__ import annotations

import numpy as np
import torch

from dpmf.optim.clipping import trainable_parameters

__all__ = ["gradient_canaries", "input_canaries", "white_box_scores"]


def gradient_canaries(dim: int, count: int, clip_norm: float, *, seed: int, device=None, dtype=torch.float32):
    """``count`` random directions in ℝ^dim of norm ``clip_norm``: shape (count, dim).

    Raises:
        ValueError: dim or count < 1, clip_norm ≤ 0.
    """
    if dim < 1 or count < 1:
        raise ValueError(f"dim={dim}, count={count} are invalid: both must be >= 1")
    if not clip_norm > 0:
        raise ValueError(f"clip_norm={clip_norm!r} is invalid: must be > 0")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    u = torch.randn(count, dim, generator=gen, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True) * float(clip_norm)
    return u.to(device=device or "cpu", dtype=dtype)


def white_box_scores(projections: np.ndarray, possible: np.ndarray, plan, clip_norm: float) -> np.ndarray:
    """score_j = ⟨P1_π, y_j⟩/√(1_πᵀP1_π), P = CᵀC/(σζs)² (``dpmf.audit.mechanism``).

    Args:
        projections: shape (n, m), y_j in column j.
        possible: shape (n, m) boolean, the steps each canary may be scored at.
        plan: the run's plan (C, σ, s).
        clip_norm: ζ.

    Returns:
        shape (m,): in units of the noise (N(0, 1) for an "out" canary when the other gradients
        project to 0); canaries with no possible step get 0.
    """
    from dpmf.audit.mechanism import precision_matrix

    P = precision_matrix(plan, plan.noise_std(clip_norm))
    w = possible.astype(np.float64)
    Pw = P @ w
    q = np.einsum("tk,tk->k", w, Pw)
    s = np.einsum("tk,tk->k", Pw, projections)
    return np.where(q > 0, s / np.sqrt(np.where(q > 0, q, 1.0)), 0.0)


def input_canaries(train_x: torch.Tensor, train_y: torch.Tensor, count: int, num_classes: int, *, seed: int):
    """``count`` training examples copied with a wrong label.

    Returns:
        (x, y): shapes (count, …) and (count,), y ≠ the original label (uniform among the others).

    Raises:
        ValueError: count < 1, fewer than 2 classes.
    """
    if count < 1 or num_classes < 2:
        raise ValueError(f"count={count} is invalid: must be >= 1 (and the data must have >= 2 classes)")
    rng = np.random.default_rng(int(seed))
    idx = rng.choice(train_x.shape[0], size=count, replace=count > train_x.shape[0])
    shift = rng.integers(1, num_classes, size=count)
    y = (train_y[torch.from_numpy(idx)].numpy() + shift) % num_classes
    return train_x[torch.from_numpy(idx)].clone(), torch.from_numpy(y).to(train_y.dtype)


def canary_losses(model, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    """Per-example cross-entropy of ``model`` on (x, y), shape (m,), float64."""
    model.eval()
    out = []
    with torch.no_grad():
        dev = next(model.parameters()).device
        for i in range(0, x.shape[0], batch_size):
            logits = model(x[i : i + batch_size].to(dev))
            out.append(
                torch.nn.functional.cross_entropy(logits, y[i : i + batch_size].to(dev), reduction="none")
            )
    model.train()
    return torch.cat(out).double().cpu().numpy()


def param_dim(model) -> int:
    """The number of trainable entries (the canaries' dimension)."""
    return sum(p.numel() for _, p in trainable_parameters(model))
