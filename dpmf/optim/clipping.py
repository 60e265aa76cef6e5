"""Per-example gradients, global ℓ2 clipping and their sum — the sensitivity-bounding stage.

For a batch of examples x_1..x_B the private step needs Σ_i clip_ζ(∇ℓ(θ; x_i)) where
clip_ζ(g) = g·min(1, ζ/‖g‖₂) and the norm is taken jointly over **all** trainable parameters
(global clipping). Changing one example then changes the sum by at most ζ in ℓ2, which is the
sensitivity that the Gaussian noise is calibrated to (Abadi et al., "Deep Learning with
Differential Privacy", CCS 2016, Algorithm 1).

Per-example gradients are computed with ``torch.func``: ``vmap(grad(loss_of_one_example))``
over the batch, with the model evaluated by ``functional_call``. A logical batch is processed
in physical micro-batches of at most ``micro_batch_size`` examples, so memory is
O(micro_batch_size · d) whatever the logical batch size; the clipped sums of the micro-batches
are added, so the result is the same as for one pass.

Models whose layers couple the examples of a batch (BatchNorm in training mode) have no
per-example gradient; they are refused up front (``check_per_example_safe``), with GroupNorm
as the fix.

Every trainable tensor counts in the global norm whatever its shape: a per-channel scale of
shape (C, 1, 1) is clipped and noised like any other entry. Its shape matters only to the
optimizer afterwards: it is a vector (its matrix view C × 1 is degenerate), so DP-Muon must
update it with the 1-D rule, never Newton–Schulz (``dpmf.train.run.build_optimizer`` routes
it there; ``route_parameters`` refuses it for a matrix rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpmf._validation import check_int, check_real

__all__ = [
    "NonFiniteGradientError",
    "ClippedSum",
    "check_per_example_safe",
    "trainable_parameters",
    "per_example_gradients",
    "clip_factors",
    "clipped_sum",
]


class NonFiniteGradientError(FloatingPointError):
    """A per-example gradient holds NaN or ±inf; raised before any parameter is changed."""


@dataclass(frozen=True, eq=False)
class ClippedSum:
    """The clipped and summed per-example gradients of one logical batch.

    Attributes:
        grads: one tensor per trainable parameter (the order of ``trainable_parameters``),
            each Σ_i clip_ζ(g_i) restricted to that parameter; zeros for an empty batch.
        norms: the unclipped global ℓ2 norms ‖g_i‖₂, shape (B,), float64.
        batch_size: B, the realised number of examples.
        clip_norm: ζ.
    """

    grads: list[torch.Tensor]
    norms: torch.Tensor
    batch_size: int
    clip_norm: float

    @property
    def clipped_fraction(self) -> float:
        """Fraction of the examples whose gradient norm exceeded ζ (0 for an empty batch)."""
        if self.batch_size == 0:
            return 0.0
        return float((self.norms > self.clip_norm).double().mean())


# Layers whose output for one example depends on the other examples of the batch.
_BATCH_COUPLED = (nn.modules.batchnorm._BatchNorm,)


def check_per_example_safe(model: nn.Module) -> None:
    """Refuse a model whose layers couple the examples of a batch.

    BatchNorm (any ``_BatchNorm`` subclass, including SyncBatchNorm and the lazy variants)
    normalises with batch statistics, so one example's output — and gradient — depends on the
    others: there is no per-example gradient to clip and the sensitivity bound fails. Instance
    norms that track running statistics update those statistics from the whole batch as well.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: naming every offending module and the fix (GroupNorm, or LayerNorm).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__} is invalid: must be a torch.nn.Module")
    bad = []
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_COUPLED):
            bad.append(f"{name or '<model>'} ({type(module).__name__})")
        elif isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            bad.append(f"{name or '<model>'} ({type(module).__name__} with track_running_stats=True)")
    if bad:
        raise ValueError(
            "model is invalid for per-example clipping: these modules couple the examples of a "
            f"batch: {', '.join(bad)}. Replace BatchNorm with GroupNorm (e.g. "
            "nn.GroupNorm(num_groups, num_channels)) or LayerNorm, and use "
            "track_running_stats=False for instance norms."
        )


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs with ``requires_grad`` — the ones clipped and noised.

    Frozen parameters (``requires_grad=False``) are skipped: they get no gradient, no noise and
    do not count towards the clipping norm.

    Raises:
        ValueError: the model has no trainable parameter.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model is invalid: it has no trainable parameter (requires_grad=True)")
    return named


def per_example_gradients(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    points=None,
) -> list[torch.Tensor]:
    """∇_θ ℓ(θ; x_i, y_i) for every example, by ``vmap(grad(·))`` over the batch.

    Args:
        model: the network; evaluated with its current parameters and buffers. Its mode
            (train/eval) is respected; dropout draws independent masks per example.
        loss_fn: ``loss_fn(output, target)`` → scalar, called on a batch of ONE example
            (output of shape (1, …), target of shape (1, …)), e.g. ``F.cross_entropy``.
        inputs: shape (B, …).
        targets: shape (B, …).
        points: an evaluation plan (``dpmf.optim.lookahead``): a sequence of
            ``EvaluationPoint(weight, shift)``; the per-example vector is then
            Σ_j weight_j·∇ℓ(θ + shift_j; x_i, y_i), one vector per example (DiSK's prediction
            needs two points). None: the plain gradient at θ.

    Returns:
        one tensor per trainable parameter (order of ``trainable_parameters``), shape
        (B, *parameter.shape).

    Raises:
        ValueError: the model couples examples (see ``check_per_example_safe``), inputs and
            targets differ in batch size, or a plan whose weights are not finite or whose
            shifts do not match the trainable parameters.
    """
    check_per_example_safe(model)
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"inputs and targets are invalid: batch sizes differ ({inputs.shape[0]} vs {targets.shape[0]})"
        )
    named = trainable_parameters(model)
    names = [n for n, _ in named]
    params = {n: p.detach() for n, p in named}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {n: b for n, b in model.named_buffers()}

    plan = _check_points(points, named)

    def loss_at(p, x, y):
        out = functional_call(model, (p, frozen, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    def loss_of_one(p, x, y):
        if plan is None:
            return loss_at(p, x, y)
        # Σ_j w_j ℓ(θ + s_j): its gradient in θ is the plan's per-example vector.
        total = 0.0
        for weight, shift in plan:
            at = p if shift is None else {n: p[n] + shift[n] for n in p}
            total = total + weight * loss_at(at, x, y)
        return total

    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0), randomness="different")(params, inputs, targets)
    return [grads[n] for n in names]


def _check_points(points, named) -> list[tuple[float, dict | None]] | None:
    """The plan as (weight, shift) pairs, validated against the trainable parameters."""
    if points is None:
        return None
    plan = []
    shapes = {n: p.shape for n, p in named}
    for j, point in enumerate(points):
        weight, shift = getattr(point, "weight", None), getattr(point, "shift", None)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"points[{j}].weight={weight!r} is invalid: must be a finite real")
        if shift is not None:
            if not isinstance(shift, dict) or set(shift) != set(shapes):
                raise ValueError(
                    f"points[{j}].shift is invalid: must map every trainable parameter name "
                    f"({', '.join(shapes)}) to a tensor"
                )
            for n, v in shift.items():
                if not isinstance(v, torch.Tensor) or v.shape != shapes[n]:
                    raise ValueError(
                        f"points[{j}].shift[{n!r}] is invalid: must be a tensor of shape {tuple(shapes[n])}"
                    )
        plan.append((float(weight), shift))
    if not plan:
        raise ValueError("points is invalid: an evaluation plan needs at least one point")
    return plan


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """min(1, ζ/‖g_i‖): the factor that brings each gradient inside the ℓ2 ball of radius ζ.

    Computed as ζ / max(‖g_i‖, ζ), exact (no ε in the denominator); a zero gradient gets 1.

    Args:
        norms: shape (B,), finite and ≥ 0.
        clip_norm: ζ > 0.

    Returns:
        shape (B,), dtype of ``norms``.
    """
    return clip_norm / torch.clamp(norms, min=clip_norm)


def clipped_sum(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    clip_norm: float,
    micro_batch_size: int | None = None,
    step: int | None = None,
    example_ids: torch.Tensor | None = None,
    points=None,
) -> ClippedSum:
    """Σ_i clip_ζ(∇ℓ(θ; x_i)) over a logical batch, in micro-batches.

    The norm of each per-example gradient is global over all trainable parameters: per-tensor
    norms in the gradient's dtype, recomputed in float64 when they overflow (so a finite
    gradient never has an infinite norm), combined in float64.

    Args:
        model, loss_fn: as in ``per_example_gradients``.
        inputs: shape (B, …); B may be 0 (an empty Poisson batch) — the sum is then zero.
        targets: shape (B, …).
        clip_norm: ζ > 0.
        micro_batch_size: the most examples whose gradients are held at once (memory
            O(micro_batch_size·d)); None processes the whole batch at once.
        step: the training step, only to name it in an error.
        example_ids: shape (B,), dataset indices of the examples, only to name them in an error.
        points: an evaluation plan (``per_example_gradients``): each example's combined vector
            Σ_j w_j·∇ℓ(θ + s_j; x_i) is what is clipped to ζ, so the sensitivity stays ζ.

    Returns:
        ``ClippedSum`` with one summed tensor per trainable parameter.

    Raises:
        ValueError: ζ ≤ 0, micro_batch_size < 1, a batch-coupled model.
        NonFiniteGradientError: a per-example gradient has NaN/inf entries (naming the step,
            the examples and the parameters); nothing is summed or returned.
    """
    clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_inclusive=False)
    batch = int(inputs.shape[0])
    if micro_batch_size is None:
        micro_batch_size = max(batch, 1)
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, minimum=1)
    check_per_example_safe(model)
    named = trainable_parameters(model)
    sums = [torch.zeros_like(p, memory_format=torch.contiguous_format) for _, p in named]
    all_norms = []
    for start in range(0, batch, micro_batch_size):
        stop = min(start + micro_batch_size, batch)
        grads = per_example_gradients(model, loss_fn, inputs[start:stop], targets[start:stop], points=points)
        sq = torch.zeros(stop - start, dtype=torch.float64, device=inputs.device)
        for g in grads:
            flat = g.reshape(g.shape[0], -1)
            part = torch.linalg.vector_norm(flat, dim=1)
            if not bool(torch.isfinite(part).all()):  # overflow of a finite gradient, or NaN
                part = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64)
            sq += part.double() ** 2
        norms = torch.sqrt(sq)
        if not bool(torch.isfinite(norms).all()):
            _raise_non_finite(named, grads, norms, start, step, example_ids)
        factors = clip_factors(norms, clip_norm)
        for s, g in zip(sums, grads, strict=True):
            s += torch.tensordot(factors.to(g.dtype), g, dims=1)
        all_norms.append(norms)
    norms = torch.cat(all_norms) if all_norms else torch.zeros(0, dtype=torch.float64)
    return ClippedSum(sums, norms, batch, clip_norm)


def _raise_non_finite(named, grads, norms, offset, step, example_ids):
    bad_rows = torch.nonzero(~torch.isfinite(norms)).flatten()
    positions = (bad_rows + offset).tolist()
    ids = positions if example_ids is None else example_ids[bad_rows + offset].tolist()
    bad_params = [
        n for (n, _), g in zip(named, grads, strict=True) if not bool(torch.isfinite(g[bad_rows]).all())
    ]
    where = "" if step is None else f" at step {step}"
    label = "batch positions" if example_ids is None else "examples"
    raise NonFiniteGradientError(
        f"non-finite per-example gradient{where}: {label} {_short(ids)} have NaN or inf entries "
        f"in parameters {_short(bad_params)} (or a norm overflow). The parameters were not "
        "updated. Check the inputs for NaN/inf, lower the learning rate, or use a numerically "
        "stable loss."
    )


def _short(items, limit: int = 8) -> str:
    items = list(items)
    text = ", ".join(str(i) for i in items[:limit])
    return f"[{text}{', …' if len(items) > limit else ''}]"
