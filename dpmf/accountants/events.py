"""Privacy events: small immutable records of *what happened* in a training run.

An event says which randomized mechanism touched one example's data, in units of the
mechanism's sensitivity; an accountant (``dpmf.accountants.library``, ``.montecarlo``) says
*how private* that was. Every noise multiplier here is the ratio of the Gaussian noise
standard deviation to the ℓ2 sensitivity of what it protects.

dpmf's events **are** ``dp_accounting.DpEvent`` objects, the currency of dp-accounting: the three
that dp-accounting knows are its own classes with dpmf's names and checks, so any
dp-accounting accountant composes them as they are and ``PrivatePlan.to_dp_event`` returns the
plan's event itself; the one it does not know (balls-in-bins) subclasses ``DpEvent``. Each
accountant of ``dpmf.accountants`` says which events it measures (``supports``).

=========================  ==================================================================
event                      mechanism (dp-accounting class)
=========================  ==================================================================
``GaussianEvent``          ``count`` Gaussian releases, each sensitivity 1 and noise std σ
                           (the same as one release with μ = √count/σ)
                           — ``SelfComposedDpEvent(GaussianDpEvent(σ), count)``
``PoissonGaussianEvent``   ``steps`` Poisson-subsampled Gaussian releases at rate q (DP-SGD)
                           — ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
                           GaussianDpEvent(σ)), steps)``
``MixtureGaussianEvent``   the balls-in-bins dominating pair: the uniform mixture over bins j of
                           N(v_j, σ²I) against N(0, σ²I), given by the Gram matrix
                           G_ij = ⟨v_i, v_j⟩; ``repetitions`` independent copies — a new
                           ``DpEvent``
``ComposedEvent``          the adaptive composition of the events it lists — ``ComposedDpEvent``
=========================  ==================================================================

``flatten`` also reads those dp-accounting events when they are built with dp-accounting's own
classes (``SelfComposedDpEvent(GaussianDpEvent(σ), k)`` and the like), so a dpmf accountant
measures them too.
"""

from __future__ import annotations

import numpy as np
from dp_accounting import dp_event as _dpe

from dpmf._validation import check_int, check_real

__all__ = [
    "GaussianEvent",
    "PoissonGaussianEvent",
    "MixtureGaussianEvent",
    "ComposedEvent",
    "Event",
    "flatten",
]


def _sigma(value) -> float:
    return check_real("noise_multiplier", value, low=0.0, low_inclusive=False)


class _AsDpAccounting:
    """Equality and hashing as the dp-accounting event of dp-accounting's own classes
    (``_plain``): a dpmf event equals the event a user builds by hand in dp-accounting."""

    __slots__ = ()

    def _plain(self):
        raise NotImplementedError

    def __eq__(self, other):
        if isinstance(other, _AsDpAccounting):
            other = other._plain()
        elif not isinstance(other, _dpe.DpEvent):
            return NotImplemented
        return self._plain() == other

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash(self._plain())


class GaussianEvent(_AsDpAccounting, _dpe.SelfComposedDpEvent):
    """``count`` Gaussian releases with sensitivity 1 and noise std ``noise_multiplier``:
    dp-accounting's ``SelfComposedDpEvent(GaussianDpEvent(σ), count)``.

    Composing k Gaussian mechanisms of sensitivity 1 and std σ is exactly one Gaussian
    mechanism with μ = √k/σ (Dong, Roth & Su, "Gaussian Differential Privacy", 2022, Cor. 3.3).

    Raises:
        ValueError: σ ≤ 0 or not finite, count < 1.
    """

    __slots__ = ()

    def __init__(self, noise_multiplier: float, count: int = 1):
        s = _sigma(noise_multiplier)
        super().__init__(_dpe.GaussianDpEvent(s), check_int("count", count, minimum=1))

    @property
    def noise_multiplier(self) -> float:
        """σ of each release."""
        return self.event.noise_multiplier

    @property
    def mu(self) -> float:
        """The Gaussian-DP parameter μ = √count/σ of the whole event."""
        return float(np.sqrt(self.count) / self.noise_multiplier)

    def _plain(self):
        return _dpe.SelfComposedDpEvent(self.event, self.count)

    def with_noise(self, noise_multiplier: float) -> GaussianEvent:
        """The same releases at another σ."""
        return GaussianEvent(noise_multiplier, self.count)

    def __repr__(self) -> str:
        return f"GaussianEvent(noise_multiplier={self.noise_multiplier!r}, count={self.count!r})"


class PoissonGaussianEvent(_AsDpAccounting, _dpe.SelfComposedDpEvent):
    """``steps`` Poisson-subsampled Gaussian releases: DP-SGD at sampling rate q;
    dp-accounting's ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps)``.

    Each step includes every example independently with probability ``sampling_rate`` and
    adds N(0, σ²) noise to the sum of (clipped, norm ≤ 1) contributions.

    Raises:
        ValueError: σ ≤ 0, q outside (0, 1], steps < 1.
    """

    __slots__ = ()

    def __init__(self, noise_multiplier: float, sampling_rate: float, steps: int):
        s = _sigma(noise_multiplier)
        q = check_real("sampling_rate", sampling_rate, low=0.0, high=1.0, low_inclusive=False)
        inner = _dpe.PoissonSampledDpEvent(q, _dpe.GaussianDpEvent(s))
        super().__init__(inner, check_int("steps", steps, minimum=1))

    @property
    def noise_multiplier(self) -> float:
        """σ of each step."""
        return self.event.event.noise_multiplier

    @property
    def sampling_rate(self) -> float:
        """q, the probability that a step includes an example."""
        return self.event.sampling_probability

    @property
    def steps(self) -> int:
        """The number of steps (the self-composition's count)."""
        return self.count

    def _plain(self):
        return _dpe.SelfComposedDpEvent(self.event, self.count)

    def with_noise(self, noise_multiplier: float) -> PoissonGaussianEvent:
        """The same steps at another σ."""
        return PoissonGaussianEvent(noise_multiplier, self.sampling_rate, self.steps)

    def __repr__(self) -> str:
        return (
            f"PoissonGaussianEvent(noise_multiplier={self.noise_multiplier!r}, "
            f"sampling_rate={self.sampling_rate!r}, steps={self.steps!r})"
        )


class MixtureGaussianEvent(_dpe.DpEvent):
    """The dominating pair of balls-in-bins sampling for a linear Gaussian mechanism (a
    ``dp_accounting.DpEvent`` that dp-accounting's accountants do not measure; dpmf's Monte
    Carlo accountant does).

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
        gram: the b×b positive semi-definite matrix G (read-only), b ≥ 1.
        repetitions: number of independent copies composed, ≥ 1.

    Equality is identity (the Gram matrix is an array).

    Raises:
        ValueError: σ ≤ 0, a non-square, non-symmetric or non-finite G, a negative diagonal,
            repetitions < 1.
    """

    def __init__(self, noise_multiplier: float, gram, repetitions: int = 1):
        s = _sigma(noise_multiplier)
        G = np.array(gram, dtype=np.float64)
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
        r = check_int("repetitions", repetitions, minimum=1)
        for name, value in (("noise_multiplier", s), ("gram", G), ("repetitions", r)):
            object.__setattr__(self, name, value)  # frozen, as every DpEvent

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def bins(self) -> int:
        """The number b of mixture components (bins)."""
        return int(self.gram.shape[0])

    @property
    def max_norm(self) -> float:
        """max_j ‖v_j‖: the sensitivity of a single component (no amplification)."""
        return float(np.sqrt(np.max(np.diag(self.gram))))

    def with_noise(self, noise_multiplier: float) -> MixtureGaussianEvent:
        """The same mixture at another σ."""
        return MixtureGaussianEvent(noise_multiplier, self.gram, self.repetitions)

    def __repr__(self) -> str:
        return (
            f"MixtureGaussianEvent(noise_multiplier={self.noise_multiplier!r}, bins={self.bins}, "
            f"repetitions={self.repetitions!r})"
        )


class ComposedEvent(_AsDpAccounting, _dpe.ComposedDpEvent):
    """The adaptive composition of ``events`` (a non-empty sequence of events, kept as a tuple):
    dp-accounting's ``ComposedDpEvent``."""

    __slots__ = ()

    def __init__(self, events):
        events = tuple(events)
        if not events:
            raise ValueError("events is invalid: must contain at least one event")
        events = tuple(_as_event(e) for e in events)
        super().__init__(events)

    def _plain(self):
        plain = [e._plain() if isinstance(e, _AsDpAccounting) else e for e in self.events]
        return _dpe.ComposedDpEvent(plain)

    def __hash__(self):  # dp-accounting's holds a list (unhashable): hash the tuple of events
        return hash((ComposedEvent, self.events))

    def __repr__(self) -> str:
        return f"ComposedEvent(events={self.events!r})"


Event = GaussianEvent | PoissonGaussianEvent | MixtureGaussianEvent | ComposedEvent


def _as_event(e):
    """``e`` as one of dpmf's events: itself, or the dpmf event of a dp-accounting event built
    from dp-accounting's own classes (a Gaussian, self-composed or not, a self-composed
    Poisson-sampled Gaussian, a composition of those).

    Raises:
        TypeError: any other event (dpmf's accountants do not measure it).
    """
    if isinstance(e, Event):
        return e
    if isinstance(e, _dpe.GaussianDpEvent):
        return GaussianEvent(e.noise_multiplier)
    if isinstance(e, _dpe.SelfComposedDpEvent):
        inner = e.event
        if isinstance(inner, _dpe.GaussianDpEvent):
            return GaussianEvent(inner.noise_multiplier, e.count)
        if isinstance(inner, _dpe.PoissonSampledDpEvent) and isinstance(inner.event, _dpe.GaussianDpEvent):
            return PoissonGaussianEvent(inner.event.noise_multiplier, inner.sampling_probability, e.count)
    if isinstance(e, _dpe.PoissonSampledDpEvent) and isinstance(e.event, _dpe.GaussianDpEvent):
        return PoissonGaussianEvent(e.event.noise_multiplier, e.sampling_probability, 1)
    if isinstance(e, _dpe.ComposedDpEvent):
        return ComposedEvent(e.events)
    raise TypeError(
        f"events is invalid: {e!r} is not an event dpmf's accountants measure (a Gaussian, a "
        "Poisson-subsampled Gaussian, a balls-in-bins mixture, or a composition of those)"
    )


def flatten(event) -> list:
    """The non-composed events of ``event``, in order (nested compositions unrolled), as dpmf
    events (a dp-accounting event of the kinds ``ComposedEvent`` reads is converted).

    Raises:
        TypeError: not an event dpmf's accountants measure.
    """
    try:
        event = _as_event(event)
    except TypeError:
        raise TypeError(f"event={event!r} is invalid: must be a dpmf.accountants event") from None
    if isinstance(event, ComposedEvent):
        out = []
        for e in event.events:
            out.extend(flatten(e))
        return out
    return [event]
