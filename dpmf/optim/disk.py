"""DiSK: the Kalman-filter correction ``Disk`` (an update stage) and its evaluation plan
``DiskLookahead`` (the training loop's side), in one module.

DiSK (Zhang, Bu, Balle, Hong, Razaviyayn, Mirrokni, "DiSK: Differentially Private Optimizer
with Simplified Kalman Filter for Noise Reduction", arXiv:2410.03883): a Kalman filter whose
state is the gradient, simplified to a scalar gain κ. Prediction: the gradient moves with
the parameters, ∇f(x_t) ≈ ∇f(x_{t−1}) + H_t d_t with d_t = x_t − x_{t−1}, and the
Hessian-vector product is the finite difference H_t d_t ≈ (∇f(x_t + γd_t) − ∇f(x_t))/γ.
Correction: m_t = (1−κ)·(m_{t−1} + H_t d_t) + κ·(observed gradient at x_t). Collecting the
terms that need data,

    m_t = (1−κ)·m_{t−1} + κ·g̃_{t+½},
    g̃_{t+½} = privatize( per example: (1−c)·∇ℓ(x_t; ξ) + c·∇ℓ(x_t + γd_t; ξ) ),
    c = (1−κ)/(κγ).

Privacy of the extra pass (the choice made here). The two gradients of an example are
combined **before** clipping, and the combination is clipped to ζ and noised once: each step
is still one Gaussian release of a sum of per-example vectors of norm ≤ ζ, at the same noise
multiplier and sampling as DP-SGD (or as the matrix mechanism's step). The evaluation points
x_t and x_t + γd_t are functions of earlier releases, which adaptive composition allows.
Hence the accountant sees exactly the steps of the unfiltered run and ε does not change;
the extra forward/backward pass costs compute, not privacy. (Clipping the two gradients
separately and adding them would give sensitivity (|1−c| + |c|)·ζ, and releasing them as two
noisy gradients would be two Gaussian releases per step for the accountant.) With
γ = (1−κ)/κ the weight of x_t vanishes
(c = 1) and one pass at the extrapolated point suffices. The loop's side — the evaluation
points and weights — is ``DiskLookahead``; ``Disk`` below is the
optimizer's side (the correction), which sees only g̃_{t+½} in ``p.grad``. Without the
loop's cooperation (gradient at x_t only) the stage is an EMA with gain κ, i.e. DiSK with
the prediction's Hessian term dropped.

On the first step there is no prediction: m_1 = g̃_{1+½} (which is the gradient at x_1, as
d_1 = 0), so the first output is unbiased and its fresh gain is 1.

``DiskLookahead`` gives DiSK's plan (Zhang et al., "DiSK: Differentially Private Optimizer
with Simplified Kalman Filter for Noise Reduction", arXiv:2410.03883):

    step 1:  {(1, θ_1)}
    step t:  {(1 − c, θ_t), (c, θ_t + γ·(θ_t − θ_{t−1}))},   c = (1−κ)/(κγ),

dropping a point of weight 0 (c = 1 for γ = (1−κ)/κ: one pass; c = 0 for κ = 1).
It keeps θ_{t−1} (one copy of the trainable parameters), which it takes at each call, so the
loop calls ``points`` exactly once per step, before computing the gradients, and saves
``state_dict()`` in its checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpmf._validation import check_real
from dpmf.optim.lookahead import EvaluationPoint, named_tensors
from dpmf.optim.transforms import Transform

__all__ = ["Disk", "DiskLookahead", "disk_extrapolation_weight", "single_pass_gamma"]


def single_pass_gamma(kappa: float) -> float:
    """γ = (1−κ)/κ: DiSK's extrapolation length for which the gradient at x_t drops out and
    one forward/backward pass per step suffices (module docstring).

    Raises:
        ValueError: kappa outside (0, 1).
    """
    kappa = check_real("kappa", kappa, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    return (1.0 - kappa) / kappa


def disk_extrapolation_weight(kappa: float, gamma: float) -> float:
    """c = (1−κ)/(κγ), the weight of the gradient at the extrapolated point x_t + γd_t
    (1 − c is that of the gradient at x_t). Values within 1e-12 of 1 are returned as 1.

    Source: DiSK (module docstring), the combination of prediction and correction.

    Raises:
        ValueError: kappa outside (0, 1], gamma <= 0.
    """
    kappa = check_real("kappa", kappa, low=0.0, high=1.0, low_inclusive=False)
    gamma = check_real("gamma", gamma, low=0.0, low_inclusive=False)
    c = (1.0 - kappa) / (kappa * gamma)
    return 1.0 if abs(c - 1.0) <= 1e-12 else c


@dataclass(frozen=True)
class Disk(Transform):
    """DiSK's correction m_t = (1−κ)·m_{t−1} + κ·g̃_{t+½}, m_1 = g̃_{1+½} (module docstring).

    ``p.grad`` must hold g̃_{t+½}, the privatized combination of the gradients at x_t and
    x_t + γ(x_t − x_{t−1}) that ``DiskLookahead(kappa, gamma)`` asks the
    training loop for; ``lookahead()`` builds it with this stage's κ and γ.

    Args:
        kappa: Kalman gain κ in (0, 1] (1: no filtering).
        gamma: extrapolation length γ > 0 of the finite-difference Hessian-vector product.

    State (per parameter): ``estimate`` m_t (a tensor of the update's device and dtype,
    returned as the output: later stages must not modify it in place, as for every stage),
    ``step``. Fresh gain: 1 at the first step, κ afterwards.

    Raises:
        ValueError: kappa outside (0, 1], gamma <= 0.
    """

    kappa: float = 0.7
    gamma: float = 0.5

    def __post_init__(self):
        object.__setattr__(
            self, "kappa", check_real("kappa", self.kappa, low=0.0, high=1.0, low_inclusive=False)
        )
        object.__setattr__(self, "gamma", check_real("gamma", self.gamma, low=0.0, low_inclusive=False))

    @property
    def extrapolation_weight(self) -> float:
        """c = (1−κ)/(κγ) (``disk_extrapolation_weight``)."""
        return disk_extrapolation_weight(self.kappa, self.gamma)

    def lookahead(self):
        """The training loop's side of this filter: ``DiskLookahead(kappa, gamma)``."""
        return DiskLookahead(self.kappa, self.gamma)

    def init(self, param):
        return {"estimate": None, "step": 0}

    def update(self, update, state, param, ctx):
        m = state["estimate"]
        if m is None or state["step"] == 0:
            m = update.detach().clone()
        else:
            m.mul_(1.0 - self.kappa).add_(update, alpha=self.kappa)
        state["estimate"] = m
        state["step"] += 1
        return m, state

    def fresh_gain(self, state):
        step = state.get("step", 0)
        if step == 0:
            return None
        return 1.0 if step == 1 else self.kappa


class DiskLookahead:
    """DiSK's evaluation plan (module docstring), with θ_{t−1} as its state.

    Args:
        kappa: Kalman gain κ in (0, 1], as the ``Disk`` filter stage.
        gamma: extrapolation length γ > 0, as the ``Disk`` filter stage.

    Raises:
        ValueError: kappa outside (0, 1], gamma <= 0.
    """

    def __init__(self, kappa: float = 0.7, gamma: float = 0.5):
        self.kappa = check_real("kappa", kappa, low=0.0, high=1.0, low_inclusive=False)
        self.gamma = check_real("gamma", gamma, low=0.0, low_inclusive=False)
        self.weight = disk_extrapolation_weight(self.kappa, self.gamma)
        self._previous: dict[str, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"DiskLookahead(kappa={self.kappa!r}, gamma={self.gamma!r})"

    @property
    def passes(self) -> int:
        """Forward/backward passes per step from the second step on (1 or 2)."""
        return sum(1 for w in (1.0 - self.weight, self.weight) if w != 0.0)

    @torch.no_grad()
    def points(self, params) -> tuple[EvaluationPoint, ...]:
        """The plan of the current step at the parameters θ_t = ``params``; records θ_t as
        the previous point of the next call.

        Args:
            params: the model (its trainable parameters) or (name, tensor) pairs.

        Returns:
            one or two ``EvaluationPoint``s (module docstring); shifts γ·(θ_t − θ_{t−1}) are
            new tensors of each parameter's device and dtype.

        Raises:
            ValueError: the parameters' names or shapes differ from those of the last call.
        """
        named = named_tensors(params)
        previous = self._previous
        if previous is None:
            plan = (EvaluationPoint(1.0, None),)
        else:
            self._check_same(named, previous)
            shift = {
                n: (p.detach() - previous[n].to(device=p.device, dtype=p.dtype)).mul_(self.gamma)
                for n, p in named
            }
            terms = ((1.0 - self.weight, None), (self.weight, shift))
            plan = tuple(EvaluationPoint(w, s) for w, s in terms if w != 0.0)
        self._previous = {n: p.detach().clone() for n, p in named}
        return plan

    @staticmethod
    def _check_same(named, previous) -> None:
        names = [n for n, _ in named]
        if names != list(previous):
            raise ValueError(
                f"params is invalid: names {names} differ from those of the previous step {list(previous)}"
            )
        for n, p in named:
            if p.shape != previous[n].shape:
                raise ValueError(
                    f"params is invalid: {n!r} has shape {tuple(p.shape)}, "
                    f"previously {tuple(previous[n].shape)}"
                )

    def state_dict(self) -> dict:
        """κ, γ and θ_{t−1} (tensors on their devices), for checkpoints."""
        prev = None if self._previous is None else {n: v.clone() for n, v in self._previous.items()}
        return {"kappa": self.kappa, "gamma": self.gamma, "previous": prev}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``.

        Raises:
            ValueError: κ or γ differ from this object's.
        """
        for key in ("kappa", "gamma"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state is invalid: {key}={state.get(key)!r} differs from {getattr(self, key)!r}"
                )
        prev = state.get("previous")
        self._previous = None if prev is None else {n: v.clone() for n, v in prev.items()}
