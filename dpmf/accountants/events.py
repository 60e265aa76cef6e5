"""Privacy events: small immutable records of *what happened* in a training run.

An event says which randomized mechanism touched one example's data, in units of the
mechanism's sensitivity; an accountant (``dpmf.accountants.library``, ``.montecarlo``) says
*how private* that was. Every noise multiplier here is the ratio of the Gaussian noise
standard deviation to the ℓ2 sensitivity of what it protects.

=========================  ==================================================================
event                      mechanism
=========================  ==================================================================
``GaussianEvent``          ``count`` Gaussian releases, each sensitivity 1 and noise std σ
                           (the same as one release with μ = √count/σ)
``PoissonGaussianEvent``   ``steps`` Poisson-subsampled Gaussian releases at rate q (DP-SGD)
``MixtureGaussianEvent``   the balls-in-bins dominating pair: the uniform mixture over bins j of
                           N(v_j, σ²I) against N(0, σ²I), given by the Gram matrix
                           G_ij = ⟨v_i, v_j⟩; ``repetitions`` independent copies
``ComposedEvent``          the adaptive composition of the events it lists
=========================  ==================================================================

The record/measurement split follows dp-accounting's ``dp_event`` module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_int, check_real

__all__ = [
    "GaussianEvent",
    "PoissonGaussianEvent",
    "MixtureGaussianEvent",
    "ComposedEvent",
    "Event",
    "flatten",
]


@dataclass(frozen=True)
class GaussianEvent:
    """``count`` Gaussian releases with sensitivity 1 and noise std ``noise_multiplier``.

    Composing k Gaussian mechanisms of sensitivity 1 and std σ is exactly one Gaussian
    mechanism with μ = √k/σ (Dong, Roth & Su, "Gaussian Differential Privacy", 2022, Cor. 3.3).

    Raises:
        ValueError: σ ≤ 0 or not finite, count < 1.
    """

    noise_multiplier: float
    count: int = 1

    def __post_init__(self):
        s = check_real("noise_multiplier", self.noise_multiplier, low=0.0, low_inclusive=False)
        object.__setattr__(self, "noise_multiplier", s)
        object.__setattr__(self, "count", check_int("count", self.count, minimum=1))

    @property
    def mu(self) -> float:
        """The Gaussian-DP parameter μ = √count/σ of the whole event."""
        return float(np.sqrt(self.count) / self.noise_multiplier)


@dataclass(frozen=True)
class PoissonGaussianEvent:
    """``steps`` Poisson-subsampled Gaussian releases: DP-SGD at sampling rate q.

    Each step includes every example independently with probability ``sampling_rate`` and
    adds N(0, σ²) noise to the sum of (clipped, norm ≤ 1) contributions.

    Raises:
        ValueError: σ ≤ 0, q outside (0, 1], steps < 1.
    """

    noise_multiplier: float
    sampling_rate: float
    steps: int

    def __post_init__(self):
        s = check_real("noise_multiplier", self.noise_multiplier, low=0.0, low_inclusive=False)
        q = check_real("sampling_rate", self.sampling_rate, low=0.0, high=1.0, low_inclusive=False)
        object.__setattr__(self, "noise_multiplier", s)
        object.__setattr__(self, "sampling_rate", q)
        object.__setattr__(self, "steps", check_int("steps", self.steps, minimum=1))


@dataclass(frozen=True, eq=False)
class MixtureGaussianEvent:
    """The dominating pair of balls-in-bins sampling for a linear Gaussian mechanism.

    P = (1/b) Σ_j N(v_j, σ²I) against Q = N(0, σ²I), both directions (add and remove), where
    v_j ∈ ℝⁿ is the (normalized) contribution of an example that sits in bin j. The privacy loss
    depends on the v_j only through their Gram matrix ``gram`` (b×b, G_ij = ⟨v_i, v_j⟩), so that
    is what the event stores. ``repetitions`` independent copies are composed (one per epoch
    when the bins are redrawn every epoch).

    Source: Chua et al., "Balls-and-Bins Sampling for DP-SGD" (AISTATS 2025), the dominating pair
    (P_B, Q_B) for one epoch; Choquette-Choo et al. (2025) for its matrix-mechanism form with
    fixed bins, valid when CᵀC ≥ 0 entry-wise.

    Attributes:
        noise_multiplier: σ > 0.
        gram: the b×b positive semi-definite matrix G, b ≥ 1.
        repetitions: number of independent copies composed, ≥ 1.

    Raises:
        ValueError: σ ≤ 0, a non-square, non-symmetric or non-finite G, a negative diagonal,
            repetitions < 1.
    """

    noise_multiplier: float
    gram: np.ndarray
    repetitions: int = 1

    def __post_init__(self):
        s = check_real("noise_multiplier", self.noise_multiplier, low=0.0, low_inclusive=False)
        object.__setattr__(self, "noise_multiplier", s)
        G = np.array(self.gram, dtype=np.float64)
        if G.ndim != 2 or G.shape[0] != G.shape[1] or G.shape[0] < 1:
            raise ValueError(f"gram is invalid: must be a square b×b array, got shape {G.shape}")
        if not np.all(np.isfinite(G)):
            raise ValueError("gram is invalid: contains NaN or infinite entries")
        scale = max(float(np.max(np.abs(G))), 1e-300)
        if np.max(np.abs(G - G.T)) > 1e-10 * scale:
            raise ValueError("gram is invalid: must be symmetric")
        if np.any(np.diag(G) < 0):
            raise ValueError("gram is invalid: the diagonal (squared norms) must be >= 0")
        G = (G + G.T) / 2.0
        G.setflags(write=False)
        object.__setattr__(self, "gram", G)
        object.__setattr__(self, "repetitions", check_int("repetitions", self.repetitions, minimum=1))

    @property
    def bins(self) -> int:
        """The number b of mixture components (bins)."""
        return int(self.gram.shape[0])

    @property
    def max_norm(self) -> float:
        """max_j ‖v_j‖: the sensitivity of a single component (no amplification)."""
        return float(np.sqrt(np.max(np.diag(self.gram))))


@dataclass(frozen=True)
class ComposedEvent:
    """The adaptive composition of ``events`` (a non-empty tuple of events)."""

    events: tuple

    def __post_init__(self):
        events = tuple(self.events)
        if not events:
            raise ValueError("events is invalid: must contain at least one event")
        for e in events:
            if not isinstance(e, Event):
                raise TypeError(f"events is invalid: {e!r} is not a dpmf.accountants event")
        object.__setattr__(self, "events", events)


Event = GaussianEvent | PoissonGaussianEvent | MixtureGaussianEvent | ComposedEvent


def flatten(event) -> list:
    """The non-composed events of ``event``, in order (nested compositions unrolled)."""
    if isinstance(event, ComposedEvent):
        out = []
        for e in event.events:
            out.extend(flatten(e))
        return out
    if not isinstance(event, Event):
        raise TypeError(f"event={event!r} is invalid: must be a dpmf.accountants event")
    return [event]
