"""Composable update stages for the DP optimizers, in the spirit of optax's transformations.

A stage maps the current update of one parameter to a new one, with its state explicit:

    state = stage.init(param)                              # dict of tensors / numbers
    update, state = stage.update(update, state, param, ctx)

Stages are frozen dataclasses (hyperparameters only, picklable, comparable). They may update
their state tensors in place and return the same dict (the torch idiom: no second copy of a
momentum buffer); they never modify their input ``update`` in place, so a stage may return one
of its state tensors and the next stage may read it. A named optimizer is a short ``Chain``:

    DP-SGD     Chain(AddDecayedWeights(λ), HeavyBall(μ, nesterov))
    DP-Adam    Chain(AddDecayedWeights(λ), ScaleByAdam(β₁, β₂, ε))
    DP-Muon    Chain(EmaMomentum(β, nesterov=True), Orthogonalize(), ScaleByShape(cap=4))
    DP-Muon-S  Chain(EmaMomentum(β), Orthogonalize(), ScaleBySpectralNorm(), ScaleByShape(None))
    DP-MuonBC  Chain(EmaMomentum(β), OrthogonalizeBiasCorrected(order), ScaleByShape(cap=4))

(the muon chains end with AddDecayedWeights(λ): decoupled weight decay).

A temporal filter (a low-pass IIR, a Kalman filter) is one more stage, placed first, between
the privatized gradient and the momentum (the ``filter`` hook of ``dpmf.optim.optimizers``).

Fresh-noise bookkeeping. ``StepContext.noise_std`` carries the std of the fresh Gaussian noise
(the part of this step's noise independent of all earlier steps) in each entry of the current
update. After each stage the chain multiplies it by the stage's ``fresh_gain(state)`` — the
coefficient with which the stage's current input enters its output when the output is affine
in that input — or sets it to None when the stage is nonlinear or does not say. The bias
correction of DP-MuonBC reads it. A new stage that is affine in its input must override
``fresh_gain``; the default None is always safe (the bias correction then refuses to run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dpmf._validation import check_int, check_real
from dpmf.optim.bias_correction import newton_schulz_bc
from dpmf.optim.fsdp import gathered, scattered
from dpmf.optim.matrix import aspect_factor, check_matrix_parameter, matrix_view
from dpmf.optim.orthogonalization import QUINTIC_COEFFICIENTS, check_coefficients, newton_schulz
from dpmf.optim.power_iteration import initial_vector, top_singular_value

__all__ = [
    "StepContext",
    "Transform",
    "Chain",
    "Identity",
    "Scale",
    "AddDecayedWeights",
    "HeavyBall",
    "EmaMomentum",
    "ScaleByAdam",
    "Orthogonalize",
    "OrthogonalizeBiasCorrected",
    "ScaleBySpectralNorm",
    "ScaleByShape",
    "bias_correction",
    "chain",
]


@dataclass
class StepContext:
    """What one optimizer step tells the stages about the parameter being updated.

    Attributes:
        name: the parameter's name, for error messages.
        noise_std: std of the fresh Gaussian noise per entry of the current update (None:
            unknown). Set by the optimizer (``DPOptimizer.noise_std``) and propagated by ``Chain``.
        generator: torch.Generator on the parameter's device for stages that draw random
            probes (post-processing randomness), or None.
        aux: intermediate tensors a stage publishes for later stages of the same step (e.g.
            ``EmaMomentum`` publishes ``"momentum"``, read by ``ScaleBySpectralNorm``).
    """

    name: str = "parameter"
    noise_std: float | None = None
    generator: torch.Generator | None = None
    aux: dict = field(default_factory=dict)


class Transform:
    """Base class of an update stage: ``init(param) -> state`` and
    ``update(update, state, param, ctx) -> (update, state)``.

    Subclasses are frozen dataclasses. ``fresh_gain(state)`` returns c when the output equals
    c·(current input) + (terms fixed by the history), and None otherwise (the default).
    """

    def init(self, param: torch.Tensor) -> dict:
        """Return the initial state for ``param`` (a dict; empty for stateless stages)."""
        return {}

    def update(self, update: torch.Tensor, state: dict, param: torch.Tensor, ctx: StepContext):
        """Return (new update, new state). Must not modify ``update`` in place."""
        raise NotImplementedError

    def fresh_gain(self, state: dict) -> float | None:
        """Coefficient of the current input in the output (None: nonlinear or unknown)."""
        return None


@dataclass(frozen=True)
class Chain(Transform):
    """Apply ``stages`` in order; the state is ``{"0": state₀, "1": state₁, …}``.

    Propagates ``ctx.noise_std`` through each stage's ``fresh_gain`` (module docstring).

    Raises:
        TypeError: a stage is not a ``Transform``.
    """

    stages: tuple = ()

    def __post_init__(self):
        stages = tuple(self.stages)
        for i, s in enumerate(stages):
            if not isinstance(s, Transform):
                raise TypeError(f"stages[{i}]={s!r} is invalid: must be a Transform")
        object.__setattr__(self, "stages", stages)

    def init(self, param):
        return {str(i): s.init(param) for i, s in enumerate(self.stages)}

    def update(self, update, state, param, ctx):
        new_state = {}
        update = self.update_stages(update, state, param, ctx, new_state, 0, len(self.stages))
        return update, new_state

    def update_stages(self, update, state, param, ctx, new_state: dict, start: int, stop: int):
        """Stages ``start`` … ``stop − 1`` of ``update`` on ``update`` (the output of the stages
        before), their states written into ``new_state``; returns that stage's output. A step
        that runs one stage itself for many parameters at once (``DPOptimizer``: owner-based
        orthogonalisation of fully_shard matrices) runs the stages around it with this."""
        for i in range(start, stop):
            update, new_state[str(i)] = self.stages[i].update(update, state[str(i)], param, ctx)
            self.note_stage(i, new_state[str(i)], ctx)
        return update

    def note_stage(self, i: int, stage_state, ctx) -> None:
        """Carry ``ctx.noise_std`` through stage ``i`` (its ``fresh_gain``)."""
        gain = self.stages[i].fresh_gain(stage_state)
        unknown = gain is None or ctx.noise_std is None
        ctx.noise_std = None if unknown else ctx.noise_std * gain

    def fresh_gain(self, state):
        total = 1.0
        for i, s in enumerate(self.stages):
            g = s.fresh_gain(state[str(i)])
            if g is None:
                return None
            total *= g
        return total


def chain(*stages: Transform) -> Chain:
    """``Chain(stages)``, skipping ``None`` entries (convenient for optional stages)."""
    return Chain(tuple(s for s in stages if s is not None))


@dataclass(frozen=True)
class Identity(Transform):
    """Return the update unchanged."""

    def update(self, update, state, param, ctx):
        return update, state

    def fresh_gain(self, state):
        return 1.0


@dataclass(frozen=True)
class Scale(Transform):
    """Multiply the update by a constant ``factor`` (finite)."""

    factor: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "factor", check_real("factor", self.factor))

    def update(self, update, state, param, ctx):
        return update * self.factor, state

    def fresh_gain(self, state):
        return self.factor


@dataclass(frozen=True)
class AddDecayedWeights(Transform):
    """update + λ·param. First in a chain it is L2 regularization (torch's ``weight_decay``);
    last (before the learning rate) it is decoupled weight decay (AdamW): the step becomes
    param ← param − lr·(update + λ·param).

    Raises:
        ValueError: weight_decay < 0 or not finite.
    """

    weight_decay: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "weight_decay", check_real("weight_decay", self.weight_decay, low=0.0))

    def update(self, update, state, param, ctx):
        if self.weight_decay == 0.0:
            return update, state
        return update + self.weight_decay * param.detach().to(update.dtype), state

    def fresh_gain(self, state):
        return 1.0


@dataclass(frozen=True)
class HeavyBall(Transform):
    """Heavy-ball momentum as torch.optim.SGD (dampening 0): b_t = μ·b_{t−1} + g_t, b_0 = 0;
    returns b_t, or g_t + μ·b_t with ``nesterov``.

    Fresh gain: 1 (1 + μ with Nesterov). μ = 0 keeps no state and returns g_t.

    Raises:
        ValueError: momentum outside [0, 1), Nesterov with momentum 0.
    """

    momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        mu = check_real("momentum", self.momentum, low=0.0, high=1.0, high_inclusive=False)
        object.__setattr__(self, "momentum", mu)
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"nesterov={self.nesterov!r} is invalid: must be a bool")
        if self.nesterov and mu == 0.0:
            raise ValueError("nesterov=True is invalid with momentum=0: needs momentum in (0, 1)")

    def init(self, param):
        if self.momentum == 0.0:
            return {}
        return {"buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}

    def update(self, update, state, param, ctx):
        if self.momentum == 0.0:
            return update, state
        buf = state["buffer"]
        buf.mul_(self.momentum).add_(update)
        out = update + self.momentum * buf if self.nesterov else buf
        return out, state

    def fresh_gain(self, state):
        return 1.0 + self.momentum if self.nesterov else 1.0


@dataclass(frozen=True)
class EmaMomentum(Transform):
    """EMA momentum M_t = β·M_{t−1} + (1−β)·G_t (M_0 = 0); returns the Nesterov look-ahead
    M̂_t = (1−β)·G_t + β·M_t, or M_t without ``nesterov``. Publishes M_t as
    ``ctx.aux["momentum"]``.

    Source: DP-Muon (the DP-Muon paper, Sec. Method, item 1).

    Fresh gain: M̂_t = (1−β)·G_t + β·(β·M_{t−1} + (1−β)·G_t) = (1−β)(1+β)·G_t + β²·M_{t−1},
    so (1−β)(1+β) = 1 − β² with Nesterov, and 1 − β without.

    Raises:
        ValueError: beta outside [0, 1).
    """

    beta: float = 0.95
    nesterov: bool = True

    def __post_init__(self):
        object.__setattr__(
            self, "beta", check_real("beta", self.beta, low=0.0, high=1.0, high_inclusive=False)
        )
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"nesterov={self.nesterov!r} is invalid: must be a bool")

    def init(self, param):
        return {"momentum": torch.zeros_like(param, memory_format=torch.preserve_format)}

    def update(self, update, state, param, ctx):
        m = state["momentum"]
        m.mul_(self.beta).add_(update, alpha=1.0 - self.beta)
        ctx.aux["momentum"] = m
        if self.nesterov:
            return (1.0 - self.beta) * update + self.beta * m, state
        return m, state

    def fresh_gain(self, state):
        b = self.beta
        return (1.0 - b) * (1.0 + b) if self.nesterov else 1.0 - b


def bias_correction(decay: float, count: int) -> float:
    """1 − decay^count: divide an EMA with zero start by it to remove its bias (Adam, Alg. 1).

    Raises:
        ValueError: decay outside [0, 1) or count < 1.
    """
    decay = check_real("decay", decay, low=0.0, high=1.0, high_inclusive=False)
    count = check_int("count", count, minimum=1)
    return 1.0 - decay**count


@dataclass(frozen=True)
class ScaleByAdam(Transform):
    """Adam's direction m̂_t/(√v̂_t + ε) with bias-corrected moments (Kingma & Ba, Alg. 1):
    m_t = β₁m + (1−β₁)g, v_t = β₂v + (1−β₂)g², m̂ = m/(1−β₁ᵗ), v̂ = v/(1−β₂ᵗ).

    Written as torch.optim.Adam computes it: m/(1−β₁ᵗ) / (√v/√(1−β₂ᵗ) + ε).

    Raises:
        ValueError: betas outside [0, 1), eps <= 0.
    """

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        for name in ("b1", "b2"):
            v = check_real(name, getattr(self, name), low=0.0, high=1.0, high_inclusive=False)
            object.__setattr__(self, name, v)
        object.__setattr__(self, "eps", check_real("eps", self.eps, low=0.0, low_inclusive=False))

    def init(self, param):
        z = torch.zeros_like(param, memory_format=torch.preserve_format)
        return {"mu": z, "nu": z.clone(), "count": 0}

    def update(self, update, state, param, ctx):
        count = state["count"] + 1
        mu, nu = state["mu"], state["nu"]
        mu.lerp_(update, 1.0 - self.b1)
        nu.mul_(self.b2).addcmul_(update, update, value=1.0 - self.b2)
        bc1 = bias_correction(self.b1, count)
        bc2 = bias_correction(self.b2, count)
        denom = nu.sqrt() / math.sqrt(bc2) + self.eps
        state["count"] = count
        return mu / bc1 / denom, state


def _matrix_dims(param: torch.Tensor, ctx: StepContext) -> tuple[int, int]:
    return check_matrix_parameter(ctx.name, param.shape)


@dataclass(frozen=True)
class Orthogonalize(Transform):
    """Replace the update by the Newton–Schulz orthogonalization of its matrix view
    (out × in·kh·kw for conv kernels), reshaped back. ``newton_schulz`` documents the map.

    Raises:
        ValueError: steps < 0, bad coefficients; at update time a parameter without a proper
            matrix view (fewer than 2 dimensions, or a single row/column).
    """

    steps: int = 5
    coefficients: tuple = QUINTIC_COEFFICIENTS
    eps: float = 1e-7

    def __post_init__(self):
        object.__setattr__(self, "steps", check_int("steps", self.steps, minimum=0))
        object.__setattr__(self, "coefficients", check_coefficients(self.coefficients))
        object.__setattr__(self, "eps", check_real("eps", self.eps, low=0.0, high=1.0, low_inclusive=False))

    def update(self, update, state, param, ctx):
        _matrix_dims(param, ctx)
        # a fully_shard parameter's update alone: the whole matrix gathered (one all-gather),
        # each rank keeping its rows of the result (a DP optimizer's step orthogonalises a
        # group's fully_shard matrices by owners instead: ``orthogonalized_by_owners``)
        return scattered(self.whole(gathered(update)), update), state

    def whole(self, update: torch.Tensor) -> torch.Tensor:
        """The orthogonalised update of one whole (unsharded) tensor, of its shape."""
        X = newton_schulz(matrix_view(update), self.steps, self.coefficients, self.eps)
        return X.reshape(update.shape)


@dataclass(frozen=True)
class OrthogonalizeBiasCorrected(Transform):
    """Bias-corrected Newton–Schulz (DP-MuonBC): ``newton_schulz_bc`` of the matrix view with
    s = ``ctx.noise_std`` (the fresh-noise std of the stage's input, e.g. (1−β²)× the
    privatized gradient's after Nesterov EMA momentum) and probes from ``ctx.generator``.

    Raises:
        ValueError: bad order/probes/steps; at update time a parameter without a proper matrix
            view, or an unknown fresh-noise std (no privatizer bound and no ``noise_std`` given, or a stage
            before this one that does not declare its ``fresh_gain``).
    """

    order: int = 1
    probes: int = 1
    antithetic: bool = True
    steps: int = 5
    coefficients: tuple = QUINTIC_COEFFICIENTS
    eps: float = 1e-7

    def __post_init__(self):
        object.__setattr__(self, "order", check_int("order", self.order, minimum=1))
        object.__setattr__(self, "probes", check_int("probes", self.probes, minimum=1))
        if not isinstance(self.antithetic, bool):
            raise TypeError(f"antithetic={self.antithetic!r} is invalid: must be a bool")
        object.__setattr__(self, "steps", check_int("steps", self.steps, minimum=0))
        object.__setattr__(self, "coefficients", check_coefficients(self.coefficients))
        object.__setattr__(self, "eps", check_real("eps", self.eps, low=0.0, high=1.0, low_inclusive=False))

    def update(self, update, state, param, ctx):
        _matrix_dims(param, ctx)
        if ctx.noise_std is None:
            raise ValueError(
                f"parameter {ctx.name!r}: the fresh-noise std of the input to the bias-corrected "
                "orthogonalization is unknown: bind the optimizer to its privatizer "
                "(privatizer.bind(optimizer)) or give noise_std= (the std of the fresh Gaussian "
                "noise per entry of the privatized gradient), and make every stage before it "
                "declare its fresh_gain"
            )
        X = newton_schulz_bc(
            matrix_view(update),
            ctx.noise_std,
            order=self.order,
            probes=self.probes,
            antithetic=self.antithetic,
            generator=ctx.generator,
            steps=self.steps,
            coefficients=self.coefficients,
            eps=self.eps,
        )
        return X.to(update.dtype).reshape(update.shape), state


@dataclass(frozen=True)
class ScaleBySpectralNorm(Transform):
    """Multiply the update by σ₁ of a published matrix (default ``ctx.aux["momentum"]``, the
    heavy-ball momentum M_t of DP-Muon-S), estimated by warm-started power iteration on its
    matrix view; the right singular vector is kept in the state (``"vector"``).

    Source: DP-Muon-S, σ₁(M_t)·√max(1, m/n)·X₅ (the DP-Muon paper, Sec. Method, item 4).

    Raises:
        ValueError: power_iterations < 1; at update time a missing source tensor or a
            parameter without a proper matrix view.
    """

    power_iterations: int = 2
    source: str = "momentum"

    def __post_init__(self):
        object.__setattr__(
            self,
            "power_iterations",
            check_int("power_iterations", self.power_iterations, minimum=1),
        )
        if not isinstance(self.source, str):
            raise TypeError(f"source={self.source!r} is invalid: must be a str")

    def update(self, update, state, param, ctx):
        rows, cols = _matrix_dims(param, ctx)
        if "vector" not in state:  # created at the first update, where the name is known
            state["vector"] = initial_vector(cols, dtype=param.dtype, device=param.device)
        if self.source not in ctx.aux:
            raise ValueError(
                f"parameter {ctx.name!r}: ScaleBySpectralNorm needs ctx.aux[{self.source!r}], "
                "published by an earlier stage (EmaMomentum publishes 'momentum')"
            )
        M = matrix_view(ctx.aux[self.source])
        sigma, v = top_singular_value(M, state["vector"], self.power_iterations)
        state["vector"] = v
        return update * sigma.to(update.dtype), state


@dataclass(frozen=True)
class ScaleByShape(Transform):
    """Multiply by the aspect factor √min(cap, max(1, m/n)) of the parameter's matrix view
    (m = out, n = in·kh·kw); ``cap=None`` gives √max(1, m/n). ``aspect_factor`` documents it.

    Raises:
        ValueError: cap < 1; at update time a parameter without a proper matrix view.
    """

    cap: float | None = 4.0

    def __post_init__(self):
        if self.cap is not None:
            object.__setattr__(self, "cap", check_real("cap", self.cap, low=1.0))

    def update(self, update, state, param, ctx):
        rows, cols = _matrix_dims(param, ctx)
        factor = aspect_factor(rows, cols, self.cap)
        state["factor"] = factor
        return update * factor, state

    def fresh_gain(self, state):
        return state.get("factor")
