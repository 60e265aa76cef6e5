"""The private gradient of one step: clip → sum → add correlated noise → divide by the expected batch.

g̃_t = ( Σ_{i∈batch_t} clip_ζ(∇ℓ(θ_t; x_i)) + σ·ζ·sens·(C⁻¹Z)_t ) / B̄

with ζ the clip norm, σ the noise multiplier, sens = sens(C) the sensitivity of the strategy
for the run's participation pattern, (C⁻¹Z)_t the step's correlated noise of unit scale
(``dpmf.optim.noise``) and B̄ the **expected** batch size, a public number (dividing by the
realised size would leak it). This is the release of the matrix mechanism B(CG + Z) in the
form that streams over steps (Denisov et al., "Improved Differential
Privacy for SGD via Optimal Private Linear Operators on Adaptive Streams", NeurIPS 2022);
everything an optimizer does with g̃_t afterwards is post-processing.

A logical batch may be processed in physical micro-batches (gradient accumulation): the clipped
sums are added and the noise is added once, so each logical batch is one step of the
mechanism and of the accountant.

Before any work, each step checks that the model is the one the step
was built for (``dpmf.optim.model_guard.ModelStructure``) and, once the step draws its batches
from the plan's sampler (``draw_from``: ``make_private`` and ``dpmf train`` do), that the batch is
the one the sampler drew for this step, not yet privatized (``dpmf.optim.batches``); after the
forward and backward, that no parameter or buffer was written (``check_state_unchanged``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dpmf._validation import check_choice, check_int, check_real
from dpmf.optim.batch_probe import BatchCouplingError, batch_size_of, probe_batch_independence
from dpmf.optim.batches import BatchCheckError, DrawnBatches
from dpmf.optim.clipping import (
    NonFiniteGradientError,
    check_per_example_safe,
    clipped_sum,
    trainable_parameters,
)
from dpmf.optim.fsdp import local_part
from dpmf.optim.ghost import CLIPPING_MODES
from dpmf.optim.model_guard import (
    ModelChangedError,
    ModelStateChangedError,
    ModelStructure,
    ModelWalk,
    check_state_unchanged,
    state_versions,
)
from dpmf.optim.noise import CorrelatedNoise, noise_for_factorization
from dpmf.seeds import KeyHolder

__all__ = ["AUTO_MICRO_BATCH_ENTRIES", "STEP_CHECK_ERRORS", "PrivateStep", "Privatizer", "StepStage"]

AUTO_MICRO_BATCH_ENTRIES = 1 << 24

#: what the private step's checks of an honest user's mistakes raise before anything is
#: released (a distributed step makes every rank raise the one a rank raised)
STEP_CHECK_ERRORS = (
    ModelChangedError,
    BatchCheckError,
    ModelStateChangedError,
    BatchCouplingError,
    NonFiniteGradientError,
)


@dataclass(frozen=True)
class PrivateStep:
    """What one private step did (all public except through the noise).

    Attributes:
        step: the 0-based step index t of the mechanism.
        batch_size: the realised number of examples (0 for an empty Poisson batch). Not
            released by the mechanism; for logging only.
        expected_batch_size: B̄, the divisor.
        noise_std: σ·ζ·sens, the standard deviation of the unit-scale noise stream on the sum.
        fresh_noise_std: σ·ζ·sens·|(C⁻¹)_tt|/B̄, the per-entry std of the part of this step's
            noise in ``p.grad`` that is independent of earlier steps (what a bias correction
            of a non-linear map of the gradient needs).
        figures: (examples clipped, Σ_i ‖g_i‖₂) of the batch, float64 values (a (2,) tensor on
            the model's device, or numbers), read only when ``clipped_fraction`` or
            ``mean_norm`` is: the step itself never waits for them (logging only).
        loss_sum: Σ_i ℓ_i(θ_t) over the batch from the private forward, a detached 0-dim float64
            tensor on the model's device (logging only: a non-private statistic of the batch);
            None with an evaluation plan of other points.

    Properties ``clipped_fraction`` (share of the examples with ‖g_i‖ > ζ) and ``mean_norm``
    (mean unclipped per-example norm) are 0 for an empty batch.
    """

    step: int
    batch_size: int
    expected_batch_size: float
    noise_std: float
    fresh_noise_std: float
    figures: object = (0.0, 0.0)
    loss_sum: torch.Tensor | None = None

    @property
    def clipped_fraction(self) -> float:
        """Share of the batch's examples whose gradient norm exceeded ζ (logging only)."""
        return float(self.figures[0]) / self.batch_size if self.batch_size else 0.0

    @property
    def mean_norm(self) -> float:
        """Mean unclipped per-example gradient norm of the batch (logging only)."""
        return float(self.figures[1]) / self.batch_size if self.batch_size else 0.0


class StepStage:
    """A stage a white-box audit inserts into the private step (``Privatizer.set_stage``); every
    method's default leaves the step as it is.

    Called in this order within ``privatize`` at step t, after the batch check and before the
    noise: ``select`` (the examples the step clips, e.g. canary slots removed), the clipped sum,
    ``before_release`` (add to the clipped sums in place: the canaries), the noise and the
    division by B̄ (``_release``), ``after_release`` (read the private gradients just written).
    A stage can only add to what the step releases, never remove noise: the noise, its scale and
    the accounting are the plan's whatever a stage does.
    """

    def select(self, step: int, inputs, targets, example_ids):
        """(inputs, targets, example_ids) the step clips; default: as given."""
        return inputs, targets, example_ids

    def before_release(self, step: int, params: list, sums: list) -> None:
        """Change the clipped sums (one tensor per parameter of ``params``) in place."""

    def after_release(self, step: int, params: list, written: list) -> None:
        """Read ``p.grad`` of the parameters ``written`` (this process's, in a sharded run)."""


def _clip_norm_of(plan, clip_norm) -> float:
    """ζ: the plan's ``clip_norm``; a given one must agree with it (a plan without one takes it)."""
    own = getattr(plan, "clip_norm", None)
    if clip_norm is None:
        return plan.require_clip_norm()
    clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_inclusive=False)
    if own is not None and own != clip_norm:
        raise ValueError(
            f"clip_norm={clip_norm!r} is invalid: the plan's clip_norm is {own!r}; the clip norm is part "
            "of the guarantee, so give it to the plan only"
        )
    return clip_norm


def _stamp(g: torch.Tensor) -> tuple[int, int]:
    """(version, address) of a gradient's storage (a DTensor's local part): what a later
    in-place write or replacement changes."""
    t = local_part(g)
    return t._version, t.data_ptr()


class Privatizer(KeyHolder):
    """Writes the private gradient g̃_t into ``p.grad`` of every trainable parameter.

    Args:
        model: the network; refused if a layer couples examples (BatchNorm). Frozen parameters
            (``requires_grad=False``) get no gradient and no noise.
        loss_fn: ``loss_fn(output, target)`` → scalar on a batch of one example.
        plan: the run's ``dpmf.PrivatePlan`` with its noise multiplier (required): σ, the
            sensitivity s and the expected batch size B̄ are taken from it, and the noise stream
            must be the plan's (same strategy, same number of steps). Build the whole step with
            ``dpmf.step.build(plan, model, loss_fn)``, which also binds the plan's sampler.
        clip_norm: ζ > 0; default the plan's ``clip_norm`` (a given one must equal it; a plan
            without one takes it).
        noise: the unit-scale correlated noise stream; its ``dim`` must equal the number of
            trainable entries and its device/dtype the model's.
        micro_batch_size: the most per-example gradients held at once; None: as many as fit
            in ``AUTO_MICRO_BATCH_ENTRIES`` entries (2²⁴, 64 MiB at float32), at least 8:
            max(8, ⌊2²⁴/d⌋) examples on the vmap path, the whole batch under ghost and
            book-keeping clipping (whose memory is that of the activations). Besides bounding
            memory, moderate micro-batches keep the per-example work in cache (on CPU,
            3-block CNN, 256 examples: 1.08 s in one pass, 0.63 s in micro-batches of 64).
        clipping: ``"auto"`` (default), ``"vmap"``, ``"ghost"`` or ``"bk"``: how the per-example
            norms and the clipped sum are computed (``dpmf.optim.clipping.clipped_sum``; the
            same sum up to rounding, the same sensitivity ζ). Under ``torch.autocast`` (bf16)
            the norms and sums are taken in float32 and the noise is added in the parameters'
            dtype.

    What every step checks, before any work: the model's parameters (which, their shapes,
    trainable or frozen) and submodules are those of construction (``ModelChangedError`` names
    the change); with ``draw_from(sampler)``, the batch is the one the sampler drew for this
    step, handed out by the door and not yet privatized (``dpmf.optim.batches.BatchCheckError``).
    After the forward and backward: no parameter or buffer was written
    (``ModelStateChangedError``). Without ``draw_from`` the caller is responsible for giving
    each step its sampled batch (the low-level API).

    Raises:
        ValueError: any argument outside its range, a batch-coupled model, a noise stream
            whose dimension does not match the model, a plan without σ, or a noise stream that
            is not the plan's.
        TypeError: no plan, or a noise stream of another device or dtype than the parameters.
    """

    #: whether the model's parameters are shards (DTensors) whose noise this step adds shard by
    #: shard (the sharded distributed step); a one-process step refuses them
    shards_parameters = False

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        noise: CorrelatedNoise,
        plan,
        clip_norm: float | None = None,
        micro_batch_size: int | None = None,
        clipping: str = "auto",
    ):
        check_per_example_safe(model, sharded=self.shards_parameters)
        self.clipping = check_choice("clipping", clipping, CLIPPING_MODES)
        if not hasattr(plan, "require_noise_multiplier"):
            raise TypeError(
                f"plan={plan!r} is invalid: a Privatizer requires the run's dpmf.PrivatePlan with its "
                "noise multiplier (plan.calibrate(…) or plan.with_noise(σ)); "
                "or use dpmf.step.build(plan, model, loss_fn)"
            )
        noise_multiplier = plan.noise_multiplier_at(0)  # σ (of the first segment)
        sensitivity = plan.sensitivity
        expected_batch_size = plan.expected_batch_size
        _check_noise_matches_plan(noise, plan)
        self.plan = plan
        self.last_step: PrivateStep | None = None
        self._written: list | None = None  # (param, grad tensor, its version and address) of the last step
        self.model = model
        self.loss_fn = loss_fn
        self.clip_norm = _clip_norm_of(plan, clip_norm)
        self.noise_multiplier = check_real("noise_multiplier", noise_multiplier, low=0.0)
        self.sensitivity = check_real("sensitivity", sensitivity, low=0.0, low_inclusive=False)
        self.expected_batch_size = check_real(
            "expected_batch_size", expected_batch_size, low=0.0, low_inclusive=False
        )
        if micro_batch_size is not None:
            micro_batch_size = check_int("micro_batch_size", micro_batch_size, minimum=1)
        if not isinstance(noise, CorrelatedNoise):
            raise TypeError(f"noise={noise!r} is invalid: must be a dpmf.optim.noise.CorrelatedNoise")
        named = trainable_parameters(model)
        dim = self._noised_entries([p for _, p in named])
        if noise.dim != dim:
            raise ValueError(
                f"noise.dim={noise.dim} is invalid: the model has {dim} trainable entries to noise here"
            )
        p0 = named[0][1]
        if noise.device.type != p0.device.type or noise.dtype != p0.dtype:
            raise TypeError(
                f"noise is on {noise.device}/{noise.dtype} but the parameters are on "
                f"{p0.device}/{p0.dtype}: create the stream with the model's device and dtype"
            )
        self.noise = noise
        self.structure = ModelStructure(model)
        self.drawn: DrawnBatches | None = None
        self._probed = False  # batch independence (dpmf.optim.batch_probe), on the first batch
        self.stage: StepStage | None = None  # an audit's stage (set_stage)
        self._micro_batch_given = micro_batch_size is not None
        entries = sum(p.numel() for _, p in named)  # one per-example gradient
        self.micro_batch_size = micro_batch_size or max(8, AUTO_MICRO_BATCH_ENTRIES // entries)

    @property
    def noise_std(self) -> float:
        """σ_t·ζ·sens: the noise standard deviation on the summed clipped gradients of the
        current step t (σ_t = the plan's σ, or its segment's with ``noise_segments``)."""
        return self.noise_multiplier * self.clip_norm * self.sensitivity

    @property
    def fresh_noise_std(self) -> float | None:
        """The fresh-noise std of the last privatized step (``PrivateStep.fresh_noise_std``), or
        None before the first step."""
        return None if self.last_step is None else self.last_step.fresh_noise_std

    def check_gradients(self, params=()) -> None:
        """Raise unless every trainable parameter's ``p.grad`` is the private gradient this
        privatizer wrote for the current step, unchanged and not yet used by a step, and no
        tensor of ``params`` (what the optimizer about to step holds) has a gradient it did not
        write.

        Args:
            params: the optimizer's parameters (``OptimizerGroups.params``); () checks only the
                gradients written.

        Raises:
            ModelChangedError: the model changed since the step was built.
            RuntimeError: no private step yet, its gradients already consumed by a step, a
                ``p.grad`` replaced or modified (e.g. by a plain ``loss.backward()``), or a
                parameter of ``params`` with a gradient the step did not write.
        """
        fix = (
            "call the private backward (PrivateTraining.backward or Privatizer.privatize) once "
            "before each optimizer.step(), and do not call loss.backward() yourself"
        )
        if self._written is None:
            raise RuntimeError(f"optimizer.step() refused: no private gradient for this step; {fix}")
        for p, g, version in self._written:
            # a plain loss.backward() accumulates into p.grad in place (its version moves)
            if p.grad is not g or _stamp(g) != version:
                raise RuntimeError(
                    "optimizer.step() refused: p.grad was replaced or modified after the private "
                    f"step wrote it (a parameter of shape {tuple(p.shape)}); {fix}"
                )
        if params:
            written = {id(p) for p, _, _ in self._written}
            for p in params:
                if p.grad is not None and id(p) not in written:
                    raise RuntimeError(
                        f"optimizer.step() refused: a parameter of shape {tuple(p.shape)} has a "
                        f"gradient the private step did not write (unfrozen after make_private?); {fix}"
                    )
        else:  # no optimizer's parameters to check: the model is the step's
            self.structure.check("optimizer.step()")

    def post_process(self, fn) -> None:
        """Run ``fn()``, which changes this step's private gradients in place (post-processing,
        e.g. FedProx's proximal term), and vouch for the result: the next ``step()`` accepts it.

        Raises:
            RuntimeError: no unconsumed private gradient (as ``check_gradients``).
        """
        self.check_gradients()
        fn()
        self._written = [(p, p.grad, _stamp(p.grad)) for p, _, _ in self._written]

    def consume(self) -> None:
        """Mark this step's private gradients as used (the next ``step()`` needs a new one)."""
        self._written = None

    def set_stage(self, stage: StepStage) -> None:
        """Insert ``stage`` (a white-box audit's canaries) into every later step.

        Raises:
            TypeError: ``stage`` is not a ``StepStage``.
            ValueError: a stage is already set, or a step was already taken.
        """
        if not isinstance(stage, StepStage):
            raise TypeError(f"stage={stage!r} is invalid: must be a dpmf.optim.privatize.StepStage")
        if self.stage is not None or self.noise.step != 0:
            raise ValueError(
                "stage is invalid here: set it once, before the first private step (build the run again)"
            )
        self.stage = stage

    def draw_from(self, sampler) -> DrawnBatches:
        """Take every step's batch from ``sampler`` (the plan's, at this privatizer's step):
        from now on ``privatize`` accepts at step t only the batch drawn for step t
        (``DrawnBatches.draw``) and handed out (``DrawnBatches.record``), once. Returns the
        ``DrawnBatches`` to draw from.

        Raises:
            ValueError: the sampler is at another step than the noise stream, or its number of
                steps is not the plan's.
        """
        if self.plan is not None and int(sampler.steps) != int(self.plan.steps):
            raise ValueError(
                f"sampler is invalid: it covers {sampler.steps} steps and the plan {self.plan.steps}; use "
                "plan.sampler(seed)"
            )
        if self.plan is not None:
            _check_sampler_matches_plan(sampler, self.plan)
        self.drawn = DrawnBatches(sampler, self.noise.step)
        return self.drawn

    @property
    def step(self) -> int:
        """The next step index of the mechanism (= steps taken so far)."""
        return self.noise.step

    def privatize(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        example_ids: torch.Tensor | None = None,
        points=None,
        handed_out=None,
    ) -> PrivateStep:
        """Compute g̃_t for this logical batch and store it in ``p.grad``; advance to t + 1.

        Args:
            inputs: shape (B, …), B ≥ 0 (an empty batch gives a noise-only gradient, and the
                step still counts).
            targets: shape (B, …).
            example_ids: shape (B,), dataset indices (only to name examples in an error).
            points: an evaluation plan (``dpmf.optim.lookahead``, e.g. DiSK's two points);
                each example's combined vector is clipped to ζ and the noise added once, so
                the step is one release at the same sensitivity. None: the gradient at θ.
            handed_out: the batch exactly as the data loader yielded it, when the door derived
                ``inputs`` and ``targets`` from it (a Hugging Face dict split into model inputs
                and labels); the batch check is made on it. None: on (inputs, targets).

        Returns:
            ``PrivateStep`` with the step's public numbers and logging figures.

        Raises:
            ModelChangedError: the model changed since construction.
            BatchCheckError: (with ``draw_from``) not the batch drawn for this step, or one
                already privatized.
            ModelStateChangedError: the forward/backward wrote a parameter or buffer (nothing
                is released, the step does not advance; the model state is tainted).
            NonFiniteGradientError: a per-example gradient is NaN/inf; no ``p.grad`` is touched
                and the step does not advance.
        """
        t = self.noise.step
        walk = ModelWalk(self.model)  # one walk for the checks before the forward (read only)
        if self.plan.noise_segments is not None and t < self.plan.steps:  # σ of t's segment
            self.noise_multiplier = self.plan.noise_multiplier_at(t)
        self._before_forward(t, walk, inputs, targets, example_ids, handed_out)
        if self.stage is not None:
            inputs, targets, example_ids = self.stage.select(t, inputs, targets, example_ids)
        named = trainable_parameters(self.model, walk)
        summed = self._clipped_sum(inputs, targets, t, walk, example_ids, points)
        batch_size, figures = self._batch_figures(summed)  # a distributed step agrees here
        # the parameters of the sums: those of the walk (the check above saw every parameter
        # still in place; a requires_grad changed meanwhile is refused by the optimizer's step)
        params = [p for _, p in named]
        sums = list(summed.grads)
        if self.stage is not None:
            self.stage.before_release(t, params, sums)
        written = self._release(params, sums)
        if self.stage is not None:
            self.stage.after_release(t, params, written)
        scale = self.noise_std
        fresh = scale * abs(self.noise.innovation(t)) / self.expected_batch_size
        self._written = [(p, p.grad, _stamp(p.grad)) for p in written]
        if self.drawn is not None:
            self.drawn.consume(t)
        self.last_step = PrivateStep(
            t,
            batch_size,
            self.expected_batch_size,
            scale,
            fresh,
            figures,
            summed.loss_sum,
        )
        return self.last_step

    def _before_forward(self, t: int, walk, inputs, targets, example_ids, handed_out) -> None:
        """The checks before the forward: the model is the one the step was built for and
        (``draw_from``) the batch is the one drawn for step ``t`` (``handed_out``: as the loader
        yielded it). Raises what they raise (``STEP_CHECK_ERRORS``)."""
        self.structure.check("private step", walk)
        if self.drawn is not None:
            if handed_out is None:
                self.drawn.check(t, inputs, targets, example_ids)
            else:
                self.drawn.check(t, handed_out, None, example_ids)

    #: whether every rank must issue the same collectives in the forward and backward (a
    #: fully_shard model's are collectives): the probe then runs whole and on an agreed step,
    #: and the micro-batches are as many on every rank
    _lockstep = False

    def _probe_now(self, inputs) -> bool:
        """Whether the batch-independence probe runs on this batch: the first of ≥ 2 examples."""
        return not self._probed and batch_size_of(inputs) >= 2

    def _sum_sink(self):
        """Where the clipped sums go as they are computed (``clipped_sum(sink=)``), or None:
        returned whole."""
        return None

    def _micro_batches(self) -> int | None:
        """The number of micro-batches every rank runs (lock-step), or None: as many as the
        batch needs."""
        return None

    def _clipped_sum(self, inputs, targets, t: int, walk, example_ids, points):
        """``clipped_sum`` of the batch under this step's settings (the batch-independence probe
        first, on the first batch of ≥ 2 examples), with the model's parameters and buffers
        unchanged around it (``ModelStateChangedError`` otherwise). In lock-step what the probe
        raises is raised after the clipped sum (every rank's passes are the same)."""
        before = state_versions(self.model, walk)
        coupled = None
        try:
            if self._probe_now(inputs):
                try:
                    self._probe(inputs, targets, t, walk)
                except STEP_CHECK_ERRORS as err:  # a coupling, or a NaN gradient of the probe's
                    if not self._lockstep:
                        raise
                    coupled = err
            summed = clipped_sum(
                self.model,
                self.loss_fn,
                inputs,
                targets,
                clip_norm=self.clip_norm,
                micro_batch_size=self.micro_batch_size if self._micro_batch_given else None,
                micro_batch_entries=AUTO_MICRO_BATCH_ENTRIES,
                step=t,
                example_ids=example_ids,
                points=points,
                clipping=self.clipping,
                walk=walk,
                micro_batches=self._micro_batches(),
                sink=self._sum_sink(),
            )
        except BatchCouplingError:  # a forward that writes the model also changes its outputs
            check_state_unchanged(self.model, before, "the private forward/backward", t)
            raise
        except RuntimeError as err:  # torch.func refuses some in-place writes itself
            check_state_unchanged(self.model, before, "the private forward/backward", t)
            text = str(err)
            if "in-place" in text or "inplace" in text or "mutate" in text:
                raise ModelStateChangedError(
                    f"private step refused at step {t}: the model's forward writes a tensor in place "
                    f"(torch.func: {text.splitlines()[0][:160]}); a parameter or buffer written by the "
                    "forward releases the batch without noise: remove the write from the forward"
                ) from err
            raise
        check_state_unchanged(self.model, before, "the private forward/backward", t)
        if coupled is not None:
            raise coupled
        return summed

    def _probe(self, inputs, targets, t: int, walk) -> None:
        """``probe_batch_independence`` under this step's clipping method (once per privatizer)."""

        def norms_of(x, y):
            return clipped_sum(
                self.model,
                self.loss_fn,
                x,
                y,
                clip_norm=self.clip_norm,
                micro_batch_entries=AUTO_MICRO_BATCH_ENTRIES,
                step=t,
                clipping=self.clipping,
                walk=walk,
            ).norms

        probe_batch_independence(self.model, inputs, targets, norms_of, whole=self._lockstep)
        self._probed = True

    # -- the parts a distributed step replaces ------------------------------------------------
    def _noised_entries(self, params: list) -> int:
        """How many coordinates this privatizer's noise stream covers (all trainable entries)."""
        return sum(p.numel() for p in params)

    def _release(self, params: list, sums: list) -> list:
        """Add σζs·(C⁻¹Z)_t to the clipped sums, divide by B̄, and set ``p.grad``; returns the
        parameters whose gradient was written (all of them here)."""
        z = self.noise.next()
        if len(params) != len(sums):
            raise ValueError(f"sums are invalid: {len(sums)} tensors for {len(params)} parameters")
        sizes = [p.numel() for p in params]
        if sum(sizes) != z.numel():
            raise ValueError(f"noise is invalid: {z.numel()} entries for {sum(sizes)} parameter entries")
        parts = [part.view(p.shape) for part, p in zip(torch.split(z, sizes), params, strict=True)]
        if z.device.type == "cpu":  # one call each (per tensor the same add_ and div_ kernels)
            torch._foreach_add_(sums, parts, alpha=self.noise_std)
            # B̄ as a 0-d tensor: a Python number is copied into a tensor once per parameter
            # (the same division: the scalar is cast to the sums' dtype either way)
            torch._foreach_div_(sums, torch.tensor(self.expected_batch_size, dtype=sums[0].dtype))
        else:
            for s, part in zip(sums, parts, strict=True):
                s.add_(part, alpha=self.noise_std).div_(self.expected_batch_size)
        for p, s in zip(params, sums, strict=True):
            p.grad = s
        return params

    def _batch_figures(self, summed) -> tuple[int, object]:
        """(examples, (clipped examples, sum of norms)) of the step's batch, for logging: the
        figures as one float64 tensor, not read here (no host synchronisation)."""
        n = int(summed.batch_size)
        if not n:
            return 0, (0.0, 0.0)
        norms = summed.norms
        return n, torch.stack([(norms > self.clip_norm).sum().to(norms.dtype), norms.sum()])

    def after_step(self) -> None:
        """Called after each optimizer step (a distributed step returns the parameters to
        every process here); nothing in one process."""

    def use_key(self, key: int) -> None:
        """Adopt the run's ``key`` for the noise stream (a checkpoint's, on resume)."""
        self.noise.use_key(key)


def _check_sampler_matches_plan(sampler, plan) -> None:
    """Refuse a sampler of another scheme, data size, batch size or group count than the plan's:
    σ, B̄ and ε are the plan's, so batches drawn at another rate would be accounted wrongly."""
    scheme = plan.scheme
    own = {"scheme": scheme.name, "dataset_size": plan.dataset_size, "batch_size": plan.batch_size}
    if hasattr(scheme, "groups"):
        own["groups"] = scheme.groups(plan)
    for name, value in own.items():
        theirs = getattr(sampler, name, None)
        if theirs != value:
            raise ValueError(
                f"sampler is invalid: its {name} is {theirs!r} and the plan's {value!r} (the plan's σ "
                "and ε hold only for its own batches); use plan.sampler(seed)"
            )


def _check_noise_matches_plan(noise: CorrelatedNoise, plan) -> None:
    """Refuse a noise stream that is not the plan's strategy's (another generator, other
    coefficients, or another number of steps)."""
    # d = 1: no large buffers
    expected = noise_for_factorization(plan.strategy, 1, seed=0, device=noise.device, dtype=noise.dtype)
    theirs, ours = noise.fingerprint(), expected.fingerprint()
    for key in ("dim", "mode", "keys", "chunk", "sizes", "owned", "ranges"):
        theirs.pop(key, None)
        ours.pop(key, None)
    if theirs != ours:
        raise ValueError(
            f"noise is invalid for this plan: it streams {theirs}, the plan's strategy "
            f"{plan.label!r} needs {ours}; build the step with dpmf.step.build(plan, model, loss_fn)"
        )
