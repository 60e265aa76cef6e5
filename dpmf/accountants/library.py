"""Accountants backed by well-kept libraries: PLD and RDP (dp-accounting), PRV (prv-accountant).

They measure ``GaussianEvent``, ``PoissonGaussianEvent`` and compositions of them, under the
add-or-remove-one adjacency. Pure Gaussian compositions are measured exactly in closed form
(the privacy loss of a μ-GDP mechanism is N(μ²/2, μ²), so its PLD is known analytically); every
other case is delegated to the library. A Gaussian composition with almost no noise
(μ > ``EXACT_MAX_MU``, up to μ = ∞) is measured by the closed-form tail bound of
``dpmf.accountants.gaussian`` by every accountant.

===========  ==============================================================  ===============
accountant   library call                                                    guarantee
===========  ==============================================================  ===============
``pld``      ``dp_accounting.pld.PLDAccountant`` (pessimistic discretization)  upper_bound
``rdp``      ``dp_accounting.rdp.RdpAccountant`` (Mironov 2017; conversion     upper_bound
             of Canonne, Kamath & Steinke 2020)
``prv``      ``prv_accountant.PRVAccountant`` (Gopi, Lee & Wutschitz 2021);   upper_bound
             its upper end (estimate + ε error); where its discretization
             fails, PLD instead (with a logged warning)
===========  ==============================================================  ===============

Limits, refused by name rather than answered wrongly: a Poisson-subsampled noise multiplier
below ``MIN_SUBSAMPLED_NOISE_MULTIPLIER`` for PLD/PRV, or below ``MIN_NOISE_MULTIPLIER`` for
any of them (``NoiseTooSmallError``); a δ below the mass that
PLD's pessimistic discretization leaves at ε = ∞ (about 10⁻¹⁵ per composition; every ε would be
``inf``), ``DeltaTooSmallError``, which names RDP as the accountant that resolves such δ.
"""

from __future__ import annotations

import logging
import math
import warnings

from dpmf._lazy import lazy_module
from dpmf._validation import check_real
from dpmf.accountants.events import ComposedEvent, GaussianEvent, PoissonGaussianEvent, flatten
from dpmf.accountants.gaussian import EXACT_MAX_MU, gaussian_delta, gaussian_epsilon
from dpmf.accountants.memory import check_pld_memory
from dpmf.accountants.result import Measurement

# imported at their first use (dp-accounting takes about a second to import)
_pld = lazy_module("dp_accounting.pld")
_rdp = lazy_module("dp_accounting.rdp")

__all__ = [
    "PLDAccountant",
    "RDPAccountant",
    "PRVAccountant",
    "NoiseTooSmallError",
    "DeltaTooSmallError",
    "MIN_SUBSAMPLED_NOISE_MULTIPLIER",
    "MIN_NOISE_MULTIPLIER",
]

logger = logging.getLogger(__name__)


def _check_delta(delta) -> float:
    return check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)


def _check_epsilon(epsilon) -> float:
    return check_real("epsilon", epsilon, low=0.0)


def _library_events(event) -> list:
    """The flat list of events, each Gaussian or Poisson-Gaussian; q = 1 is a Gaussian."""
    out = []
    for e in flatten(event):
        if isinstance(e, PoissonGaussianEvent) and e.sampling_rate == 1.0:
            e = GaussianEvent(e.noise_multiplier, e.steps)
        if not isinstance(e, GaussianEvent | PoissonGaussianEvent):
            raise ValueError(
                f"event {type(e).__name__} is not supported by this accountant: "
                "it measures Gaussian and Poisson-subsampled Gaussian events"
            )
        out.append(e)
    return out


# Below this per-step noise multiplier a Poisson-subsampled Gaussian's privacy loss is too wide
# for the PLD/PRV grids (gigabytes of memory or hours): those accountants refuse it.
MIN_SUBSAMPLED_NOISE_MULTIPLIER = 0.1


# Below this noise multiplier σ² underflows in the libraries' arithmetic (dp-accounting's RDP
# returns ε = 0 at σ = 1e-160, and divides by zero at 1e-200): every library accountant refuses a
# library call below it. A composition of Gaussian events alone is measured in closed form at
# any σ (``_LibraryAccountant._analytic``) and never reaches the libraries.
MIN_NOISE_MULTIPLIER = 1e-50


class NoiseTooSmallError(ValueError):
    """A noise multiplier below what the accountant measures: ``MIN_SUBSAMPLED_NOISE_MULTIPLIER``
    for PLD/PRV under Poisson subsampling, ``MIN_NOISE_MULTIPLIER`` for every library accountant
    (a Gaussian composition alone is measured in closed form at any σ)."""


class DeltaTooSmallError(ValueError):
    """δ below what the PLD accountant resolves: its discretization leaves more than δ at ε = ∞,
    so no finite ε would be reported. RDP resolves every δ > 0 (an upper bound)."""


def _check_representable(events, name: str) -> None:
    for e in events:
        if e.noise_multiplier < MIN_NOISE_MULTIPLIER:
            raise NoiseTooSmallError(
                f"noise_multiplier={e.noise_multiplier:g} (per step, after normalization) is invalid "
                f"for the {name} accountant: must be >= {MIN_NOISE_MULTIPLIER:g} (below it the "
                "arithmetic of the privacy loss overflows; such a run has no meaningful privacy)"
            )


def _check_discretizable(events, name: str) -> None:
    for e in events:
        if isinstance(e, PoissonGaussianEvent) and e.noise_multiplier < MIN_SUBSAMPLED_NOISE_MULTIPLIER:
            raise NoiseTooSmallError(
                f"noise_multiplier={e.noise_multiplier:g} (per step, after normalization) is invalid "
                f"for the {name} accountant with Poisson subsampling: must be >= "
                f"{MIN_SUBSAMPLED_NOISE_MULTIPLIER:g} (the privacy loss is too wide to discretize); "
                "accountant='rdp' gives an upper bound"
            )


def _gaussian_mu(events) -> float | None:
    """μ of the composition when every event is Gaussian: μ² = Σ count/σ²; else None.

    Computed as (1/σ_min)·√(Σ count·(σ_min/σ)²), so that a tiny σ gives a large (or infinite)
    μ instead of a division by zero."""
    if not all(isinstance(e, GaussianEvent) for e in events):
        return None
    s_min = min(e.noise_multiplier for e in events)
    root = math.sqrt(sum(e.count * (s_min / e.noise_multiplier) ** 2 for e in events))
    return (1.0 / s_min) * root  # float division and product overflow to inf, not an error


def _composed(events):
    """The composition of ``events`` (dpmf events, hence dp-accounting ``DpEvent`` objects that
    dp-accounting's accountants compose as they are)."""
    return events[0] if len(events) == 1 else ComposedEvent(tuple(events))


class _LibraryAccountant:
    name = ""

    def supports(self, event) -> bool:
        """Whether this accountant can measure ``event``."""
        try:
            _library_events(event)
        except (ValueError, TypeError):
            return False
        return True

    def _analytic(self, mu: float, delta=None, epsilon=None) -> Measurement:
        value = gaussian_epsilon(mu, delta) if delta is not None else gaussian_delta(mu, epsilon)
        if math.isinf(mu) or (delta is not None and math.isinf(value)):
            method = (
                f"analytic Gaussian: the noise multiplier is so small (mu={mu:.3g}) that ε ≈ μ²/2 "
                "exceeds the largest float (reported as inf): the noise is negligible"
            )
            logger.warning("privacy: %s", method)
        elif mu > EXACT_MAX_MU:
            method = (
                f"Gaussian tail bound (mu={mu:.6g} > {EXACT_MAX_MU:g}: almost no noise; "
                "ε ≤ μ²/2 + μ·Φ⁻¹(1−δ), Dong, Roth & Su 2022)"
            )
        else:
            method = f"analytic Gaussian (mu={mu:.6g}; Balle & Wang 2018)"
        if delta is not None:
            return Measurement(value, delta, self.name, "upper_bound", method)
        return Measurement(epsilon, value, self.name, "upper_bound", method)


class PLDAccountant(_LibraryAccountant):
    """Privacy-loss-distribution accountant (dp-accounting), the default and tightest.

    Args:
        value_discretization_interval: the PLD grid step of dp-accounting (default 1e-4);
            coarser is faster and more pessimistic (ε can only grow).
    """

    name = "pld"

    @property
    def _vdi(self) -> float:
        return self.value_discretization_interval

    def __init__(self, value_discretization_interval: float = 1e-4):
        self.value_discretization_interval = check_real(
            "value_discretization_interval",
            value_discretization_interval,
            low=0.0,
            low_inclusive=False,
        )

    def _accountant(self, events):
        _check_representable(events, self.name)
        _check_discretizable(events, self.name)
        check_pld_memory(events, self.value_discretization_interval)
        acc = _pld.PLDAccountant(value_discretization_interval=self.value_discretization_interval)
        acc.compose(_composed(events))
        return acc

    def epsilon(self, event, delta: float) -> Measurement:
        """ε at ``delta`` (an upper bound: dp-accounting's pessimistic PLD)."""
        delta = _check_delta(delta)
        events = _library_events(event)
        mu = _gaussian_mu(events)
        if mu is not None:
            return self._analytic(mu, delta=delta)
        acc = self._accountant(events)
        with warnings.catch_warnings():  # an overflow inside dp-accounting means ε = inf: handled below
            warnings.simplefilter("ignore", RuntimeWarning)
            eps = float(acc.get_epsilon(delta))
        if math.isinf(eps):
            # a subsampled Gaussian's ε is finite at every δ > 0: inf is the discretization's
            # mass at infinity, not the privacy of the run
            floor = float(acc.get_delta(1e6))
            if not floor > delta:
                # δ is resolved; ε itself is beyond the grid (its privacy loss overflows)
                sigmas = ", ".join(f"{e.noise_multiplier:g}" for e in events)
                raise NoiseTooSmallError(
                    f"noise_multiplier={sigmas} (per step, after normalization) is too small for "
                    f"the pld accountant at delta={delta:g}: the run's epsilon is beyond what its "
                    "grid resolves (the privacy loss overflows), i.e. there is essentially no "
                    "privacy; use a larger noise multiplier (a smaller epsilon target), or "
                    "accountant='rdp'"
                )
            raise DeltaTooSmallError(
                f"delta={delta:g} is invalid for the pld accountant: it cannot resolve a delta "
                f"below about {floor:.2g} (its pessimistic discretization leaves that much "
                "at epsilon = inf); accountant='rdp' gives an upper bound at any delta"
            )
        method = f"dp-accounting PLD (value_discretization_interval={self._vdi:g})"
        return Measurement(max(eps, 0.0), delta, self.name, "upper_bound", method)

    def delta(self, event, epsilon: float) -> Measurement:
        """δ at ``epsilon`` (an upper bound)."""
        epsilon = _check_epsilon(epsilon)
        events = _library_events(event)
        mu = _gaussian_mu(events)
        if mu is not None:
            return self._analytic(mu, epsilon=epsilon)
        d = float(self._accountant(events).get_delta(epsilon))
        method = f"dp-accounting PLD (value_discretization_interval={self._vdi:g})"
        return Measurement(epsilon, min(max(d, 0.0), 1.0), self.name, "upper_bound", method)


class RDPAccountant(_LibraryAccountant):
    """Rényi-DP accountant (dp-accounting): a fast upper bound, looser than PLD."""

    name = "rdp"

    def _accountant(self, events):
        _check_representable(events, self.name)
        acc = _rdp.RdpAccountant()
        acc.compose(_composed(events))
        return acc

    def epsilon(self, event, delta: float) -> Measurement:
        """ε at ``delta`` from the RDP curve (an upper bound); a Gaussian composition with
        μ > ``EXACT_MAX_MU`` (almost no noise) in closed form."""
        delta = _check_delta(delta)
        events = _library_events(event)
        mu = _gaussian_mu(events)
        if mu is not None and mu > EXACT_MAX_MU:
            return self._analytic(mu, delta=delta)
        eps = float(self._accountant(events).get_epsilon(delta))
        return Measurement(max(eps, 0.0), delta, self.name, "upper_bound", "dp-accounting RDP")

    def delta(self, event, epsilon: float) -> Measurement:
        """δ at ``epsilon`` from the RDP curve (an upper bound)."""
        epsilon = _check_epsilon(epsilon)
        events = _library_events(event)
        mu = _gaussian_mu(events)
        if mu is not None and mu > EXACT_MAX_MU:
            return self._analytic(mu, epsilon=epsilon)
        d = float(self._accountant(events).get_delta(epsilon))
        return Measurement(epsilon, min(max(d, 0.0), 1.0), self.name, "upper_bound", "dp-accounting RDP")


class PRVAccountant(_LibraryAccountant):
    """Privacy-random-variable accountant (prv-accountant); reports its upper bound.

    Args:
        eps_error: the accountant's ε error (its upper bound adds it), default 0.01.
        delta_error_ratio: its δ error as a fraction of δ, default 1e-3.
    """

    name = "prv"

    def __init__(self, eps_error: float = 0.01, delta_error_ratio: float = 1e-3):
        self.eps_error = check_real("eps_error", eps_error, low=0.0, low_inclusive=False)
        self.delta_error_ratio = check_real(
            "delta_error_ratio",
            delta_error_ratio,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            high_inclusive=False,
        )

    def _prvs(self, events):
        from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism

        prvs, counts = [], []
        for e in events:
            if isinstance(e, GaussianEvent):
                prvs.append(GaussianMechanism(e.noise_multiplier))
                counts.append(e.count)
            else:
                prvs.append(PoissonSubsampledGaussianMechanism(e.sampling_rate, e.noise_multiplier))
                counts.append(e.steps)
        return prvs, counts

    def _accountant(self, events, delta_error: float):
        from prv_accountant import PRVAccountant as _PRV

        _check_representable(events, self.name)
        _check_discretizable(events, self.name)
        prvs, counts = self._prvs(events)
        acc = _PRV(prvs, eps_error=self.eps_error, delta_error=delta_error, max_self_compositions=counts)
        return acc, counts

    def _fallback(self, exc: RuntimeError, query: str) -> str:
        """Log (once per accountant: a calibration asks many times) that prv-accountant failed
        and PLD answers instead; return the method's prefix."""
        reason = str(exc).strip().rstrip(".") or type(exc).__name__
        if getattr(self, "_fallback_logged", False):
            return f"prv-accountant failed ({reason}): dp-accounting PLD instead"
        self._fallback_logged = True
        logger.warning(
            "notice: prv-accountant could not discretize this privacy loss (%s); %s is "
            "computed with the pld accountant instead (also an upper bound)",
            reason,
            query,
        )
        return f"prv-accountant failed ({reason}): dp-accounting PLD instead"

    def epsilon(self, event, delta: float) -> Measurement:
        """ε at ``delta``: the upper end of prv-accountant's interval.

        Where prv-accountant's discretization fails (its ``RuntimeError`` "Discrete mean differs
        from continuous mean significantly", e.g. σ = 0.8, q = 1/8, 1000 steps, δ = 10⁻⁶; a finer
        or wider grid fails too), the PLD accountant answers, with a logged warning and the
        method saying so.
        """
        delta = _check_delta(delta)
        events = _library_events(event)
        mu = _gaussian_mu(events)
        if mu is not None and mu > EXACT_MAX_MU:  # almost no noise: closed form
            return self._analytic(mu, delta=delta)
        try:
            acc, counts = self._accountant(events, self.delta_error_ratio * delta)
            _, _, upper = acc.compute_epsilon(delta, counts)
        except RuntimeError as exc:
            note = self._fallback(exc, "epsilon")
            meas = PLDAccountant().epsilon(event, delta)
            return Measurement(meas.epsilon, delta, "pld", "upper_bound", f"{note}: {meas.method}")
        method = f"prv-accountant (eps_error={self.eps_error:g}, upper end)"
        return Measurement(max(float(upper), 0.0), delta, self.name, "upper_bound", method)

    def delta(self, event, epsilon: float) -> Measurement:
        """δ at ``epsilon``: the upper end of prv-accountant's interval (PLD where it fails, as
        for ``epsilon``)."""
        epsilon = _check_epsilon(epsilon)
        events = _library_events(event)
        mu = _gaussian_mu(events)
        if mu is not None and mu > EXACT_MAX_MU:
            return self._analytic(mu, epsilon=epsilon)
        try:
            acc, counts = self._accountant(events, 1e-12)
            _, _, upper = acc.compute_delta(epsilon, counts)
        except RuntimeError as exc:
            note = self._fallback(exc, "delta")
            meas = PLDAccountant().delta(event, epsilon)
            return Measurement(epsilon, meas.delta, "pld", "upper_bound", f"{note}: {meas.method}")
        method = f"prv-accountant (eps_error={self.eps_error:g}, upper end)"
        return Measurement(epsilon, min(max(float(upper), 0.0), 1.0), self.name, "upper_bound", method)


def to_dp_event(event):
    """``event`` as dp-accounting composes it: dpmf's Gaussian and Poisson-subsampled Gaussian
    events and their compositions already are dp-accounting ``DpEvent`` objects
    (``SelfComposedDpEvent`` of ``GaussianDpEvent`` or ``PoissonSampledDpEvent``,
    ``ComposedDpEvent``; ``dpmf.accountants.events``), so this returns the event itself, after
    checking that dp-accounting's accountants measure all of it.

    Raises:
        ValueError: the event contains a mixture of Gaussians (balls-in-bins batching), which
            dp-accounting's accountants do not measure; account it with the Monte Carlo
            accountant.
        TypeError: not an event.
    """
    events = flatten(event)
    if not all(isinstance(e, GaussianEvent | PoissonGaussianEvent) for e in events):
        raise ValueError(
            "event is invalid for to_dp_event: balls-in-bins batching (a mixture of Gaussians) is a "
            "DpEvent dp-accounting's accountants do not measure; account it with "
            "accountant='monte_carlo'"
        )
    if isinstance(event, ComposedEvent | GaussianEvent | PoissonGaussianEvent):
        return event
    return _composed(events)  # a dp-accounting event of dp-accounting's classes, read by flatten
