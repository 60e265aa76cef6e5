"""Where the training loop evaluates the per-example gradients of a step: the hook through
which DiSK's prediction gets its extra forward/backward pass.

A plan is a tuple of ``EvaluationPoint(weight, shift)``: the per-example vector of example ξ
at parameters θ is Σ_j weight_j · ∇ℓ(θ + shift_j; ξ) (shift None: θ itself). The loop
clips **that vector** to ζ, sums over the batch and adds the step's noise once, so a plan
changes what is released but not its sensitivity or the number of releases: the privacy
accounting of the run is unchanged (``dpmf.optim.disk`` for the argument). The
plain plan is one point of weight 1 at θ.

DiSK's plan is ``dpmf.optim.disk.DiskLookahead``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["EvaluationPoint", "named_tensors"]


@dataclass(frozen=True, eq=False)
class EvaluationPoint:
    """One term of a step's per-example vector: ``weight`` · ∇ℓ(θ + ``shift``; ξ).

    Attributes:
        weight: a finite real (may be negative).
        shift: parameter name → tensor of that parameter's shape, device and dtype, added to
            it; None for θ itself. Names are those of the trainable parameters.
    """

    weight: float
    shift: dict | None = None


def named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of ``params``: an nn.Module (its trainable parameters) or an
    iterable of (name, tensor) pairs.

    Raises:
        TypeError: anything else.
    """
    if isinstance(params, nn.Module):
        return [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    if isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        named = list(params)
        for i, item in enumerate(named):
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    f"params is invalid: item {i} is {type(item).__name__}; expected an "
                    "nn.Module or (name, tensor) pairs such as model.named_parameters()"
                )
        return named
    raise TypeError(
        f"params={type(params).__name__} is invalid: expected an nn.Module or (name, tensor) pairs"
    )
