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
update it with the 1-D rule, never Newton–Schulz (``dpmf.train.build.build_optimizer`` routes
it there; ``route_parameters`` refuses it for a matrix rule).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import grad, grad_and_value, vmap

from dpmf._validation import check_choice, check_int, check_real
from dpmf.optim.clipping_layers import row_norms
from dpmf.optim.fsdp import is_sharded, sharded_names, zeros_of
from dpmf.optim.func_call import functional_call
from dpmf.optim.ghost import CLIPPING_MODES, ghost_clipped_sum
from dpmf.optim.model_guard import ModelWalk
from dpmf.optim.trees import map_tensors

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
    """A per-example gradient holds NaN or ±inf; raised before any parameter is changed.

    The message names the step and the parameters, never the examples: batch membership is
    secret under sampling amplification, and messages end up in logs. The examples are kept as
    attributes for the user who debugs on their own machine.

    Attributes:
        step: the training step, or None.
        positions: positions in the logical batch of the failing examples (list of int).
        example_ids: their dataset indices (list of int), or None when they were not given.
        parameters: names of the parameters with non-finite entries.
    """

    def __init__(self, message: str, *, step=None, positions=(), example_ids=None, parameters=()):
        super().__init__(message)
        self.step = step
        self.positions = list(positions)
        self.example_ids = None if example_ids is None else list(example_ids)
        self.parameters = list(parameters)


@dataclass(frozen=True, eq=False)
class ClippedSum:
    """The clipped and summed per-example gradients of one logical batch.

    Attributes:
        grads: one tensor per trainable parameter (the order of ``trainable_parameters``),
            each Σ_i clip_ζ(g_i) restricted to that parameter; zeros for an empty batch.
        norms: the unclipped global ℓ2 norms ‖g_i‖₂, shape (B,), float64.
        batch_size: B, the realised number of examples.
        clip_norm: ζ.
        method: the clipping method that computed it (``"vmap"``, ``"ghost"`` or ``"bk"``).
        loss_sum: Σ_i ℓ_i(θ) of the batch's per-example losses from the same forward, a
            detached 0-dim float64 tensor (a non-private statistic of the batch); None with an
            evaluation plan (``points``).
    """

    grads: list[torch.Tensor]
    norms: torch.Tensor
    batch_size: int
    clip_norm: float
    method: str = "vmap"
    loss_sum: torch.Tensor | None = None

    @property
    def clipped_fraction(self) -> float:
        """Fraction of the examples whose gradient norm exceeded ζ (0 for an empty batch)."""
        if self.batch_size == 0:
            return 0.0
        return float((self.norms > self.clip_norm).double().mean())


# Layers whose output for one example depends on the other examples of the batch.
_BATCH_COUPLED = (nn.modules.batchnorm._BatchNorm,)

# torch's fused recurrent kernels, whose per-example gradients torch.func cannot take (its vmap of
# rnn_tanh, gru, the cells and float64 LSTMs writes a batched hidden state into an unbatched one;
# float32 LSTMs batch on CPU only), and which have no clipping handler.
_NO_PER_EXAMPLE_KERNEL = (nn.RNNBase, nn.RNNCellBase)


def check_per_example_safe(model: nn.Module, walk: ModelWalk | None = None, *, sharded: bool = False) -> None:
    """Refuse a model whose layers couple the examples of a batch.

    BatchNorm (any ``_BatchNorm`` subclass, including SyncBatchNorm and the lazy variants)
    normalises with batch statistics, so one example's output — and gradient — depends on the
    others: there is no per-example gradient to clip and the sensitivity bound fails. Instance
    norms that track running statistics update those statistics from the whole batch as well.
    ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm`` renormalize, in place and without
    noise, exactly the rows of the batch's tokens. (Any other write to a parameter or buffer
    during the private forward is caught at the step by ``dpmf.optim.model_guard``.) torch's
    recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and their cells) have no per-example
    gradient path (torch.func cannot batch their fused kernels reliably): refused while
    trainable, with a recurrence written with ``nn.Linear`` layers (book-keeping) as the way out.
    A module compiled by ``torch.compile`` is refused: its graph hides the layers the clipping
    reads. Parameters sharded as DTensors (``fully_shard``, FSDP2) are refused unless
    ``sharded``: only the sharded step (``make_private(process_group=…)``,
    ``dpmf.distributed.step``) adds their noise shard by shard.

    Args:
        walk: a ``dpmf.optim.model_guard.ModelWalk`` of ``model`` taken now (None: a new one).
        sharded: accept DTensor parameters (the sharded step checks them itself).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: naming every offending module and the fix (GroupNorm, or LayerNorm;
            ``max_norm=None``; nn.Linear gates for recurrent layers).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__} is invalid: must be a torch.nn.Module")
    walk = ModelWalk(model) if walk is None else walk
    compiled = [name or "<model>" for name, m in walk.unique_modules if _is_compiled(m)]
    if compiled:
        raise ValueError(
            f"model is invalid for per-example clipping: {', '.join(compiled)} is a torch.compile'd "
            "module (OptimizedModule), whose compiled graph hides the layers the clipping reads; "
            "give make_private the module before compiling (model._orig_mod)"
        )
    found = [] if sharded else sharded_names(model)
    if found:
        raise ValueError(
            f"model is invalid for a one-process private step: its parameters {', '.join(found[:3])} are "
            "sharded DTensors (torch.distributed fully_shard / FSDP2); give make_private "
            "process_group=… (the process group they are sharded over) for the sharded step"
        )
    recurrent = [
        f"{name or '<model>'} ({type(m).__name__})"
        for name, m in walk.unique_modules
        if isinstance(m, _NO_PER_EXAMPLE_KERNEL) and any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    if recurrent:
        raise ValueError(
            f"model is invalid for per-example clipping: {', '.join(recurrent)} has no per-example "
            "gradient path (torch.func cannot batch torch's fused recurrent kernels); write the "
            "cell with nn.Linear layers and elementwise gates, unrolled over time (clipped exactly "
            "by book-keeping), or freeze the layer"
        )
    bad = []
    for name, module in walk.unique_modules:
        if isinstance(module, _BATCH_COUPLED):
            bad.append(f"{name or '<model>'} ({type(module).__name__})")
        elif isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            bad.append(f"{name or '<model>'} ({type(module).__name__} with track_running_stats=True)")
        elif isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.max_norm is not None:
            bad.append(f"{name or '<model>'} ({type(module).__name__} with max_norm={module.max_norm!r})")
    if bad:
        raise ValueError(
            "model is invalid for per-example clipping: these modules couple the examples of a "
            f"batch or write the batch into the model: {', '.join(bad)}. Replace BatchNorm with "
            "GroupNorm (e.g. nn.GroupNorm(num_groups, num_channels)) or LayerNorm, use "
            "track_running_stats=False for instance norms, and max_norm=None for embeddings (their "
            "in-place renormalization writes the batch's rows into the weights without noise)."
        )


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile`` returns (``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, "_orig_mod", None), nn.Module
    )


def trainable_parameters(model: nn.Module, walk: ModelWalk | None = None) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs with ``requires_grad`` — the ones clipped and noised — in
    the order of ``named_parameters()``.

    Frozen parameters (``requires_grad=False``) are skipped: they get no gradient, no noise and
    do not count towards the clipping norm.

    Args:
        walk: a ``dpmf.optim.model_guard.ModelWalk`` of ``model`` taken now (None: a new one).

    Raises:
        ValueError: the model has no trainable parameter.
    """
    named = (ModelWalk(model) if walk is None else walk).trainable()
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
    plan = _check_points(points, named)
    grads = _vmap_gradients(model, loss_fn, inputs, targets, plan, [n for n, _ in named])
    return [grads[n] for n, _ in named]


def _vmap_gradients(model, loss_fn, inputs, targets, plan, wanted, *, with_losses: bool = False):
    """Per-example gradients of the trainable parameters named in ``wanted`` (the others are
    held fixed), by ``vmap(grad(·))`` of the whole model; ``plan`` already validated. With
    ``with_losses`` (and no plan): (the gradients, the (b,) per-example losses), by
    ``vmap(grad_and_value(·))``."""
    named = trainable_parameters(model)
    wanted_set = set(wanted)
    params = {n: p.detach() for n, p in named if n in wanted_set}
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in wanted_set}
    buffers = {n: b for n, b in model.named_buffers()}

    def loss_at(p, x, y, shift):
        at = p if shift is None else {n: p[n] + shift[n] for n in p}
        rest = fixed if shift is None else {n: v + shift[n] if n in shift else v for n, v in fixed.items()}
        out = _call(model, (at, rest, buffers), x)
        return loss_fn(out, map_tensors(lambda t: t.unsqueeze(0), y))

    def loss_of_one(p, x, y):
        if plan is None:
            return loss_at(p, x, y, None)
        # Σ_j w_j ℓ(θ + s_j): its gradient in θ is the plan's per-example vector.
        total = 0.0
        for weight, shift in plan:
            total = total + weight * loss_at(p, x, y, shift)
        return total

    if with_losses and plan is None:
        grads, losses = vmap(grad_and_value(loss_of_one), in_dims=(None, 0, 0), randomness="different")(
            params, inputs, targets
        )
        return grads, losses.detach().reshape(-1)
    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0), randomness="different")(params, inputs, targets)
    return (grads, None) if with_losses else grads


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
    clipping: str = "auto",
    micro_batch_entries: int | None = None,
    walk: ModelWalk | None = None,
    micro_batches: int | None = None,
    sink=None,
) -> ClippedSum:
    """Σ_i clip_ζ(∇ℓ(θ; x_i)) over a logical batch, in micro-batches.

    The norm of each per-example gradient is global over all trainable parameters (float64
    sums of per-parameter squared norms; a per-parameter norm that overflows its dtype is
    recomputed in float64, so a finite gradient never has an infinite norm).

    Clipping methods (``clipping``), all giving the same sum up to rounding:

    - ``"vmap"``: per-example gradients of every parameter by ``vmap(grad(·))``
      (``per_example_gradients``); memory O(micro_batch_size·d).
    - ``"ghost"``: per-example norms by ghost norms (``dpmf.optim.ghost``) from one forward and
      one backward that computes no weight gradient, then a second backward of Σ_i c_i·ℓ_i.
    - ``"bk"``: the same norms, then the sum Σ_i c_i·g_i by book-keeping from the recorded
      activations and output gradients, without a second backward.
    - ``"auto"``: ``"bk"`` when every trainable parameter has a ghost norm or a per-module
      ``torch.func`` gradient, else ``"vmap"`` (decided on the first micro-batch of a model and
      input shape, then remembered).

    Under ``"ghost"``/``"bk"`` the parameters of modules without a closed form take the
    ``torch.func`` path (per module, or for the whole model; ``dpmf.optim.ghost``), so every
    model works, more slowly when much of it falls back.

    Mixed precision (``torch.autocast``: bf16, or fp16 on GPU): forward and backward run in
    the low precision; activations and output gradients are cast to float32 before any norm or
    sum, norms are combined in float64, sums are in the parameters' dtype. The bound is exact
    for the vectors whose norms are taken, so the sensitivity is ζ at any precision; fp16 has
    no loss scaling (output gradients below 6·10⁻⁸ flush to zero): prefer bf16.

    Args:
        model, loss_fn: as in ``per_example_gradients``.
        inputs: shape (B, …); B may be 0 (an empty Poisson batch) — the sum is then zero.
        targets: shape (B, …).
        clip_norm: ζ > 0.
        micro_batch_size: the most examples processed at once, by every method; None: see
            ``micro_batch_entries``.
        step: the training step, only to name it in an error.
        example_ids: shape (B,), dataset indices of the examples; kept in an error's
            ``example_ids`` attribute, never in its message.
        points: an evaluation plan (``per_example_gradients``): each example's combined vector
            Σ_j w_j·∇ℓ(θ + s_j; x_i) is what is clipped to ζ, so the sensitivity stays ζ.
            Every method supports plans (ghost norms treat the points as further calls of
            each layer, so the cross terms between points are included).
        clipping: ``"auto"``, ``"vmap"``, ``"ghost"`` or ``"bk"``.
        micro_batch_entries: with ``micro_batch_size=None``, the most per-example gradient
            entries the vmap path holds at once: max(8, ⌊entries/d⌋) examples per micro-batch
            (d trainable entries); ghost and book-keeping, whose memory is that of the
            activations (plus b·p·d for the layers whose per-example gradient is
            instantiated), take the whole batch. None: the whole batch for every method.
        walk: a ``dpmf.optim.model_guard.ModelWalk`` of ``model`` taken now, by a caller that
            walked the model for its own checks (``Privatizer``); None: a new one.
        micro_batches, sink: a fully_shard step in lock-step (``dpmf.distributed.step``): run
            exactly ``micro_batches`` book-keeping passes (those past the batch on its first
            example, counting nothing), and send each layer's sums to ``sink(dict)`` as they are
            computed (``sink.end_pass()`` after each pass; ``sink.counting`` False on padding;
            ``ClippedSum.grads`` is then ``sink.shards()``). None: neither.

    Returns:
        ``ClippedSum`` with one summed tensor per trainable parameter.

    Raises:
        ValueError: ζ ≤ 0, micro_batch_size < 1, an unknown clipping method, a batch-coupled model.
        NonFiniteGradientError: a per-example gradient has NaN/inf entries (naming the step
            and the parameters; the examples only as attributes); nothing is returned.
    """
    clip_norm, clipping, batch, device, walk, named, plan = _checked_call(
        model, inputs, targets, clip_norm, clipping, walk, points
    )
    micro_batch_size, vmap_micro = _micro_batch_sizes(named, batch, micro_batch_size, micro_batch_entries)
    if sink is not None and clipping != "bk":
        raise ValueError(f"sink is invalid with clipping={clipping!r}: it takes book-keeping sums ('bk')")
    sums, all_norms, used, all_losses = _sum_micro_batches(
        model, loss_fn, inputs, targets, clip_norm, named, plan, clipping, (micro_batch_size, vmap_micro),
        step, example_ids, walk, batch, device, sink,
    )  # fmt: skip
    if micro_batches is not None:
        _pad_micro_batches(model, loss_fn, inputs, targets, clip_norm, named, plan, used, walk, batch,
                           micro_batches - -(-batch // micro_batch_size), sink)  # fmt: skip
    norms = torch.cat(all_norms) if all_norms else torch.zeros(0, dtype=torch.float64)
    whole = [zeros_of(p) if t is None else t for t, (_, p) in zip(sums, named, strict=True)]
    grads = sink.shards() if sink is not None else whole
    return ClippedSum(grads, norms, batch, clip_norm, used, _loss_sum(all_losses, batch, device))


def _checked_call(model, inputs, targets, clip_norm, clipping, walk, points) -> tuple:
    """``clipped_sum``'s arguments checked: (ζ, the method, B, the device, the walk, the
    trainable (name, parameter) pairs, the evaluation plan).

    Raises:
        ValueError: ζ ≤ 0, an unknown method (or one a fully_shard model cannot take), inputs
            and targets of different batch sizes, a bad plan; what ``check_per_example_safe``
            raises.
    """
    clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_inclusive=False)
    clipping = check_choice("clipping", clipping, CLIPPING_MODES)
    batch, device, clipping = _batch_of(inputs, clipping)
    target_batch = int(_leaves(targets)[0].shape[0])
    walk = ModelWalk(model) if walk is None else walk
    check_per_example_safe(model, walk, sharded=True)
    if batch != target_batch:
        raise ValueError(f"inputs and targets are invalid: batch sizes differ ({batch} vs {target_batch})")
    named = trainable_parameters(model, walk)
    clipping = _sharded_clipping(named, clipping)
    return clip_norm, clipping, batch, device, walk, named, _check_points(points, named)


def _sharded_clipping(named: list, clipping: str) -> str:
    """The clipping method: ``"bk"`` for a fully_shard model (book-keeping, the one path that
    works at the shards), ``clipping`` otherwise.

    Raises:
        ValueError: ``"vmap"`` or ``"ghost"`` for a fully_shard model.
    """
    if not (named and is_sharded(named[0][1])):
        return clipping
    if clipping not in ("auto", "bk"):
        raise ValueError(
            f"clipping={clipping!r} is invalid for a fully_shard model: use 'bk' or 'auto' (book-keeping "
            "from each layer's activations; per-example gradients of whole parameters need them whole)"
        )
    return "bk"


def _loss_sum(all_losses: list, batch: int, device) -> torch.Tensor | None:
    """Σ_i ℓ_i(θ) over the batch from the micro-batches' per-example losses, a detached 0-dim
    float64 tensor on the batch's device (0 for an empty batch); None when a micro-batch gave
    no losses (an evaluation plan). No host synchronisation."""
    if batch == 0:
        return torch.zeros((), dtype=torch.float64, device=device)
    if any(ell is None for ell in all_losses):
        return None
    return sum(ell.detach().to(torch.float64).sum() for ell in all_losses)


def _sum_micro_batches(model, loss_fn, inputs, targets, clip_norm, named, plan, clipping, sizes, step,
                       example_ids, walk, batch, device, sink=None):  # fmt: skip
    """``clipped_sum``'s micro-batches: (the summed tensors, None for parameters no micro-batch
    summed, the per-example norms of each micro-batch, the method used, the per-example losses
    of each micro-batch — None entries where a method gave none)."""
    micro_batch_size, vmap_micro = sizes
    names = [n for n, _ in named]
    sums: list[torch.Tensor | None] = [None] * len(named)  # None until the first micro-batch
    all_norms, all_losses = [], []
    used = "vmap" if clipping in ("vmap", "auto") else clipping
    if clipping == "auto":
        used = "vmap" if _AUTO_VMAP.get(model, {}).get(_signature(inputs, names, model)) else "bk"
    start = 0
    while start < batch:
        stop = min(start + (vmap_micro if used == "vmap" else micro_batch_size), batch)
        x, y = _slice(inputs, start, stop), _slice(targets, start, stop)
        if used != "vmap":
            got = _ghost_micro_batch(
                model, loss_fn, x, y, clip_norm, names, plan, used, clipping == "auto", walk, sink
            )
            if sink is not None:
                sink.end_pass()
            if got is None:  # auto: a parameter needs the whole-model path; use it for all
                _AUTO_VMAP.setdefault(model, {})[_signature(inputs, names, model)] = True
                used = "vmap"
                continue  # this micro-batch again, at the vmap path's size
            _add_ghost_sums(sums, named, got, start, step, example_ids, all_norms)
            all_losses.append(got[2])
        else:
            grads, losses = _vmap_micro_batch(model, loss_fn, x, y, plan, names, clipping)
            with torch.autocast(device.type, enabled=False):  # norms and sums not in bf16
                _vmap_clip_into(sums, names, grads, clip_norm, start, step, example_ids, all_norms)
            all_losses.append(losses)
        start = stop
    return sums, all_norms, used, all_losses


def _pad_micro_batches(model, loss_fn, inputs, targets, clip_norm, named, plan, used, walk, batch, count,
                       sink=None):  # fmt: skip
    """``count`` book-keeping passes on the batch's first example whose results count nothing
    (``clipped_sum(micro_batches=)``: the collectives of a fully_shard model's passes).

    Raises:
        ValueError: ``count`` < 0 (fewer passes agreed than the batch needs), or passes to pad
            with no example or under another method than book-keeping.
    """
    if count == 0:
        return
    if count < 0 or used == "vmap" or batch == 0:
        raise ValueError(
            f"micro_batches is invalid: {count} passes to pad past the batch's own under clipping "
            f"{used!r} with {batch} examples (lock-step passes pad a non-empty batch "
            "with its own book-keeping passes)"
        )
    x, y = _slice(inputs, 0, 1), _slice(targets, 0, 1)
    names = [n for n, _ in named]
    counting = None if sink is None else sink.counting
    if sink is not None:
        sink.counting = False
    try:
        for _ in range(count):
            _ghost_micro_batch(model, loss_fn, x, y, clip_norm, names, plan, used, False, walk, sink)
            if sink is not None:
                sink.end_pass()
    finally:
        if sink is not None:
            sink.counting = counting


def _micro_batch_sizes(named: list, batch: int, micro_batch_size, micro_batch_entries) -> tuple[int, int]:
    """(ghost/bk micro-batch size, vmap micro-batch size) of ``clipped_sum``.

    Raises:
        ValueError: a size or entry count below 1.
    """
    if micro_batch_size is not None:
        micro_batch_size = check_int("micro_batch_size", micro_batch_size, minimum=1)
        return micro_batch_size, micro_batch_size
    if micro_batch_entries is not None:
        micro_batch_entries = check_int("micro_batch_entries", micro_batch_entries, minimum=1)
    dim = sum(p.numel() for _, p in named)
    whole = max(batch, 1)
    return whole, (whole if micro_batch_entries is None else max(8, micro_batch_entries // dim))


def _batch_of(inputs, clipping: str) -> tuple[int, torch.device, str]:
    """(B, the device, the clipping method) of a batch of inputs: one tensor, or a tuple
    (``model(*x)``: vmap only) or dict (``model(**x)``) of tensors of one dimension 0.

    Raises:
        ValueError: tuple inputs under ghost/bk, or tensors of different dimension 0.
    """
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]), inputs.device, clipping
    leaves = _leaves(inputs)
    if not isinstance(inputs, dict):
        if clipping in ("ghost", "bk"):
            raise ValueError(
                f"clipping={clipping!r} is invalid with tuple inputs: ghost norms need one input "
                "tensor or a dict (model(**batch)); use clipping='auto' or 'vmap'"
            )
        clipping = "vmap"
    first = leaves[0]
    if any(t.shape[0] != first.shape[0] for t in leaves):
        raise ValueError("inputs are invalid: the tensors of a tuple/dict batch differ in dimension 0")
    return int(first.shape[0]), first.device, clipping


def _add_ghost_sums(sums: list, named: list, got, start: int, step, example_ids, all_norms: list) -> None:
    """Add a ghost/bk micro-batch's clipped sums (``got`` = (norms, grads)) into ``sums``
    (None entries: the first micro-batch), in the parameters' dtype and shape.

    Raises:
        NonFiniteGradientError: the micro-batch summed nothing because a norm is not finite.
    """
    norms, grads = got[0], got[1]
    names = [n for n, _ in named]
    # ghost_clipped_sum sums nothing (no grads) exactly when a norm is not finite: its own check
    # on the norms is not repeated here
    if not grads:
        bad = [n for n in names if not bool(torch.isfinite(norms[1][n]).all())]
        _raise_non_finite(bad, norms[0], start, step, example_ids)
    for k, n in enumerate(names):
        p, g = named[k][1], grads[n]
        if g is None:  # sent to a sink
            continue
        if g.dtype != p.dtype or g.shape != p.shape:
            g = g.to(p.dtype).reshape(p.shape)
        if sums[k] is None:
            sums[k] = g if g.is_contiguous() else g.contiguous()
        else:
            sums[k].add_(g)
    all_norms.append(norms[0])


def _vmap_micro_batch(
    model, loss_fn, x, y, plan, names: list, clipping: str
) -> tuple[list, torch.Tensor | None]:
    """Per-example gradients of one micro-batch by ``vmap(grad_and_value(·))``, one per name of
    ``names``, and the (b,) per-example losses (None with an evaluation plan).

    Raises:
        RuntimeError: torch.func cannot run the model (with what to use instead).
    """
    try:
        grads, losses = _vmap_gradients(model, loss_fn, x, y, plan, names, with_losses=True)
    except RuntimeError as exc:
        if "vmap" not in str(exc):
            raise
        raise RuntimeError(
            f"clipping={clipping!r}: torch.func per-example gradients (vmap) cannot run this model: "
            f"{str(exc).splitlines()[0]} Use clipping='auto' with layers that have clipping handlers "
            "(dpmf.register_clipping_layer; Hugging Face models: a dpmf.train.hf loss), or make the "
            "model's forward free of data-dependent branches (transformers: attn_implementation='eager')"
        ) from exc
    return [grads[n] for n in names], losses


def _leaves(tree) -> list[torch.Tensor]:
    """The tensors of a tensor, or a (nested) tuple/list/dict of tensors, in order.

    Raises:
        TypeError: anything else, or no tensor at all.
    """
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        out = [t for v in tree.values() for t in _leaves(v)]
    elif isinstance(tree, list | tuple):
        out = [t for v in tree for t in _leaves(v)]
    else:
        raise TypeError(
            f"inputs are invalid: expected tensors, tuples or dicts of tensors, got {type(tree).__name__}"
        )
    if not out:
        raise TypeError("inputs are invalid: the tuple/dict holds no tensor")
    return out


def _slice(tree, start: int, stop: int):
    """``tree`` with every tensor sliced to examples [start, stop) along dimension 0 (``tree``
    itself when that is all of it)."""
    if start == 0 and stop == int(_leaves(tree)[0].shape[0]):
        return tree
    if isinstance(tree, torch.Tensor):
        return tree[start:stop]
    if isinstance(tree, dict):
        return {k: _slice(v, start, stop) for k, v in tree.items()}
    return type(tree)(_slice(v, start, stop) for v in tree)


def _call(model, params, x):
    """``model`` at ``params`` on one example's input ``x`` (tensor: model(x); tuple: model(*x);
    dict: model(**x)), each tensor given a batch dimension of 1."""
    one = map_tensors(lambda t: t.unsqueeze(0), x)
    if isinstance(one, dict):
        return functional_call(model, params, (), one)
    if isinstance(one, tuple | list):
        return functional_call(model, params, tuple(one))
    return functional_call(model, params, (one,))


def _vmap_clip_into(sums, names, grads, clip_norm, start, step, example_ids, all_norms) -> None:
    """Norms of explicit per-example gradients, clip factors, and their weighted sums added to
    ``sums`` (in place; None entries are set)."""
    sq = torch.zeros(grads[0].shape[0], dtype=torch.float64, device=grads[0].device)
    bad = []
    for n, g in zip(names, grads, strict=True):
        part = row_norms(g)  # float64, from runs of float32 norms (one long float32 norm drifts)
        if not bool(torch.isfinite(part).all()):  # overflow of a finite gradient, or NaN
            part = torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1, dtype=torch.float64)
            if not bool(torch.isfinite(part).all()):
                bad.append(n)
        sq += part.double() ** 2
    norms = torch.sqrt(sq)
    if not bool(torch.isfinite(norms).all()):
        _raise_non_finite(bad, norms, start, step, example_ids)
    factors = clip_factors(norms, clip_norm)
    for k, g in enumerate(grads):
        t = torch.tensordot(factors.to(g.dtype), g, dims=1)
        sums[k] = t if sums[k] is None else sums[k].add_(t)
    all_norms.append(norms)


# auto mode: (model → input signatures) for which a parameter needed the whole-model path
_AUTO_VMAP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# explicit ghost/bk: (model → module names) already warned about
_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(inputs, names, model):
    if isinstance(inputs, dict):
        shapes = tuple(
            (k, tuple(v.shape[1:]), v.dtype) for k, v in inputs.items() if isinstance(v, torch.Tensor)
        )
        return (shapes, tuple(names), model.training)
    if not isinstance(inputs, torch.Tensor):
        return (len(inputs), tuple(names), model.training)
    return (tuple(inputs.shape[1:]), inputs.dtype, tuple(names), model.training)


def _ghost_micro_batch(model, loss_fn, x, y, clip_norm, names, plan, method, auto, walk=None, sink=None):
    """((norms, parameter name → per-example squared norms), grads, the (b,) per-example losses
    or None) by ghost norms, or None (auto fallback)."""

    def subset(wanted):
        return _vmap_gradients(model, loss_fn, x, y, plan, wanted)

    res = ghost_clipped_sum(
        model,
        loss_fn,
        x,
        y,
        clip_norm=clip_norm,
        names=names,
        plan=plan,
        method=method,
        subset_gradients=subset,
        allow_fallback=not auto,
        walk=walk,
        sink=sink,
    )
    if res is None:
        return None
    if res.fallback:
        warned = _WARNED.setdefault(model, set())
        news = {k: v for k, v in res.fallback.items() if k not in warned}
        if news:
            warned.update(news)
            detail = "; ".join(f"{k}: {v}" for k, v in news.items())
            warnings.warn(
                f"clipping={method!r}: the parameters of these modules take the slower whole-model "
                f"torch.func path ({detail}); clipping='auto' would use it for the whole model",
                stacklevel=4,
            )
    return (res.norms, res.sq_by_param), res.grads, res.losses


def _raise_non_finite(bad_params, norms, offset, step, example_ids):
    bad_rows = torch.nonzero(~torch.isfinite(norms)).flatten().cpu()
    positions = (bad_rows + offset).tolist()
    ids = None if example_ids is None else example_ids[bad_rows + offset].tolist()
    where = "" if step is None else f" at step {step}"
    raise NonFiniteGradientError(
        f"non-finite per-example gradient{where}: examples of the batch have NaN or inf entries "
        f"in parameters {_short(bad_params)} (or a norm overflow). The parameters were not "
        "updated. Check the inputs for NaN/inf, lower the learning rate, or use a numerically "
        "stable loss. The examples are not named here (batch membership is secret); they are "
        "in this error's example_ids and positions attributes.",
        step=step,
        positions=positions,
        example_ids=ids,
        parameters=bad_params,
    )


def _short(items, limit: int = 8) -> str:
    items = list(items)
    text = ", ".join(str(i) for i in items[:limit])
    return f"[{text}{', …' if len(items) > limit else ''}]"
