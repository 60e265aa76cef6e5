"""Accounting of a ``PrivatePlan``: ε of the run, σ for a target, the largest steps / batch size.

``account(plan, σ, δ)`` and ``calibrate(plan, ε, δ)`` return a ``PrivacyResult``; the plan's
scheme supplies the privacy event (``Scheme.event``) and its accountants, the measurement is
``dpmf.accountants`` (PLD, RDP, PRV, Monte Carlo) and the calibration the one generic
``dpmf.accountants.calibration.calibrate_event``. ``max_steps`` and ``max_batch_size`` search
plans for a given σ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.calibration import calibrate_event, check_delta, check_monte_carlo
from dpmf.accountants.events import ComposedEvent, PoissonGaussianEvent
from dpmf.accountants.registry import accountants_for, get_accountant, make_accountant
from dpmf.accountants.result import Measurement, PrivacyResult
from dpmf.plan.schemes import Poisson, check_sigma

__all__ = [
    "account",
    "accountant_of",
    "account_segments",
    "calibrate",
    "max_steps",
    "max_batch_size",
    "privacy_result",
]


def _check_plan(plan):
    """``plan`` if it is a ``dpmf.PrivatePlan`` (checked by its interface: this module is below
    ``dpmf.plan.plan``, which calls it)."""
    if not (callable(getattr(plan, "event", None)) and hasattr(plan, "scheme") and hasattr(plan, "strategy")):
        raise TypeError(f"plan={plan!r} is invalid: must be a dpmf.PrivatePlan")
    return plan


_MC_SETTINGS = ("samples", "seed", "confidence", "progress")


class _Keep:
    """The default of a Monte Carlo setting not given: keep the specification's."""

    def __repr__(self):
        return "<the accountant's>"


KEEP = _Keep()


def accountant_of(plan, accountant=None, **settings):
    """The accountant specification that measures ``plan``: ``accountant`` (a name or an
    ``AccountantSpec``; None: the plan's own, ``plan.accountant``) with any Monte Carlo
    ``settings`` given (``samples``, ``seed``, ``confidence``, ``progress``; ``KEEP`` keeps the
    specification's) applied to a randomized one and ignored by the others.

    Raises:
        ValueError: an accountant the plan's scheme cannot use, or invalid settings.
        TypeError: a setting of another name (a typo would silently keep the default).
    """
    unknown = sorted(set(settings) - set(_MC_SETTINGS))
    if unknown:  # the value is not shown: a misspelled seed is still a seed
        raise TypeError(
            f"setting {unknown[0]!r} is invalid: the accountant settings are {', '.join(_MC_SETTINGS)}"
        )
    given = {k: v for k, v in settings.items() if v is not KEEP}
    check_monte_carlo(given.get("samples"), given.get("seed", 0), given.get("confidence"))  # given: valid
    spec = plan.accountant if accountant is None else plan.scheme.accountant_spec(accountant)
    if given and type(spec).randomized:
        spec = dataclasses.replace(spec, **given)
    return spec


def privacy_result(plan, sigma: float, meas: Measurement, details: dict | None = None) -> PrivacyResult:
    """The ``PrivacyResult`` of ``plan`` at σ from an accountant's ``Measurement``."""
    info = plan.scheme.event(plan, sigma)[1]
    merged = dict(info.details)
    merged.update(details or {})
    return PrivacyResult(
        epsilon=meas.epsilon,
        delta=meas.delta,
        noise_multiplier=sigma,
        scheme=plan.scheme.name,
        accountant=meas.accountant,
        guarantee=meas.guarantee,
        steps=plan.steps,
        sensitivity=info.sensitivity,
        dataset_size=plan.dataset_size,
        batch_size=plan.batch_size,
        sampling_rate=info.sampling_rate,
        factorization=plan.label,
        method=meas.method,
        confidence=meas.confidence,
        samples=meas.samples,
        seed=meas.seed,
        epsilon_estimate=meas.epsilon_estimate,
        delta_estimate=meas.delta_estimate,
        details=merged,
    )


def account(
    plan,
    noise_multiplier: float | None = None,
    *,
    delta: float,
    accountant=None,
    samples=KEEP,
    seed=KEEP,
    confidence=KEEP,
    progress=KEEP,
) -> PrivacyResult:
    """ε at ``delta`` of the run described by ``plan``.

    Args:
        plan: the run.
        noise_multiplier: σ > 0 (default: the plan's); the noise on C·G has std σ·ζ·s
            (s: ``plan.sensitivity``).
        delta: δ in (0, 1).
        accountant: an ``AccountantSpec`` or the name of one of the scheme's ``accountants``
            (None: the plan's ``accountant``, by default the scheme's default — PLD, or Monte
            Carlo for the balls-in-bins schemes).
        samples, seed, confidence, progress: Monte Carlo settings that override the
            specification's (not given: the specification's): samples per direction (default
            ``samples_needed(δ)``), seed (0), confidence 1 − α of the certified ε (0.99; None in
            the specification reports a point estimate, guarantee ``estimate``), progress bar
            (only on a terminal).

    Returns:
        ``PrivacyResult`` (ε ≥ 0, never NaN; 0 when δ(0) ≤ δ).

    Raises:
        ValueError/TypeError: any invalid argument, named, before any work.
    """
    plan = _check_plan(plan)
    sigma = check_sigma(plan.require_noise_multiplier() if noise_multiplier is None else noise_multiplier)
    delta = check_delta(delta, plan.dataset_size)
    spec = accountant_of(
        plan, accountant, samples=samples, seed=seed, confidence=confidence, progress=progress
    )
    meas = spec.build().epsilon(plan.event(sigma), delta)
    return privacy_result(plan, sigma, meas)


def calibrate(
    plan,
    *,
    epsilon: float,
    delta: float,
    accountant=None,
    samples=KEEP,
    seed=KEEP,
    confidence=KEEP,
    rtol: float = 1e-3,
    progress=KEEP,
) -> PrivacyResult:
    """The smallest noise multiplier σ that meets (ε, δ) for ``plan`` under the accountant.

    One generic calibrator for every scheme (``calibrate_event`` on the plan's event at σ = 1):
    closed form for Gaussian-only events under PLD, bracketing and Brent's method on log σ for
    the library accountants (PLD coarse, then refined), certified candidate rounds for Monte
    Carlo, never above the Gaussian bound without amplification.

    Args:
        plan: the run.
        epsilon: target ε > 0.
        delta: target δ in (0, 1).
        accountant, samples, seed, progress: as in ``account``.
        confidence: 1 − α of the Monte Carlo certificate, in (0, 1) (not given: the
            specification's, 0.99 by default).
        rtol: relative tolerance on σ for the library accountants, in (0, 0.1].

    Returns:
        ``PrivacyResult`` whose ``noise_multiplier`` is the calibrated σ and ``epsilon`` its ε
        (≤ the target; for Monte Carlo the target itself, certified).

    Raises:
        ValueError/TypeError: invalid arguments, named, before any work.
    """
    plan = _check_plan(plan)
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = check_delta(delta, plan.dataset_size)
    spec = accountant_of(
        plan, accountant, samples=samples, seed=seed, confidence=confidence, progress=progress
    )
    mc = {k: getattr(spec, k) for k in _MC_SETTINGS} if type(spec).randomized else {}
    if type(spec).randomized and mc["confidence"] is None:
        raise ValueError("confidence=None is invalid for calibrate: must be in (0, 1)")
    rtol = check_real("rtol", rtol, low=0.0, high=0.1, low_inclusive=False)
    sigma, meas, extra = calibrate_event(plan.event(1.0), epsilon, delta, type(spec).name, rtol=rtol, **mc)
    return privacy_result(plan, sigma, meas, extra)


# --------------------------------------------------------------------------------------------
# Largest steps / batch size for a given σ


def _largest_feasible_int(feasible: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest x in [lo, hi] with feasible(x), assuming feasibility is monotone (down-closed).

    Doubles from ``lo`` until infeasible (so large, costly x are evaluated only when needed),
    then bisects.
    """
    if not feasible(lo):
        return None
    good, x = lo, lo
    while True:
        x = min(hi, 2 * x)
        if not feasible(x):
            bad = x
            break
        good = x
        if x == hi:
            return hi
    while bad - good > 1:
        mid = (good + bad) // 2
        if feasible(mid):
            good = mid
        else:
            bad = mid
    return good


def _search_int(name, make_plan, sigma, epsilon, delta, lo, hi, samples, seed, confidence, progress):
    """Largest integer x (steps or batch size) whose plan meets (ε, δ); certified for Monte Carlo
    by verifying the answer on fresh samples (attempt i at α/2^i, stepping down 3% on failure)."""
    mc = get_accountant(name).randomized
    acc = make_accountant(name, samples, seed, None, False) if mc else make_accountant(name)

    def eps_of(x):
        return acc.epsilon(make_plan(x).event(sigma), delta).epsilon

    x = _largest_feasible_int(lambda v: eps_of(v) <= epsilon, lo, hi)
    if x is None:
        return None
    plan = make_plan(x)
    if not mc:
        return privacy_result(plan, sigma, acc.epsilon(plan.event(sigma), delta))
    alpha = 1.0 - confidence
    for i in range(1, 8):
        ver = make_accountant(name, samples, seed + i, 1.0 - alpha / 2.0**i, progress)
        meas = ver.epsilon(plan.event(sigma), delta)
        if meas.epsilon <= epsilon:
            meas = dataclasses.replace(meas, confidence=confidence)
            return privacy_result(plan, sigma, meas, {"verification_attempts": i})
        x = max(lo, int(x * 0.97))
        plan = make_plan(x)
    return None


def _strategy_for(strategy, n: int):
    """A spec passes through (built per plan); a callable n → Factorization is called."""
    if strategy is None:
        return "identity"
    if callable(strategy) and not isinstance(strategy, str):
        return strategy(n)
    return strategy


def max_steps(
    plan,
    *,
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    strategy=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    limit: int = 1_000_000,
    progress: bool | None = None,
) -> PrivacyResult | None:
    """The largest number of steps n ≤ ``limit`` whose run meets (ε, δ) at σ.

    Args:
        plan: the run (its N, B, scheme and schedule; its steps are ignored).
        strategy: None (the plan's strategy spec, rebuilt for each n), a spec such as
            ``"bisr:16"``, or a callable n → Factorization.
        limit: the largest n considered (≥ 1).
        others: as in ``account``.

    Returns:
        The ``PrivacyResult`` at the largest feasible n, or None when even n = 1 fails. Monte
        Carlo answers are searched on point estimates and then certified on fresh samples.

    Raises:
        ValueError/TypeError: invalid arguments, named, before any work.
    """
    plan = _check_plan(plan)
    sigma = check_sigma(noise_multiplier)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    delta = check_delta(delta, plan.dataset_size)
    limit = check_int("limit", limit, minimum=1)
    name = type(accountant_of(plan, accountant)).name
    samples, seed, conf = check_monte_carlo(samples, seed, confidence)
    spec = plan.label if strategy is None else strategy
    if isinstance(spec, str):
        plan.replace(steps=1, strategy=spec)  # validates the spec before any work

    def make_plan(n):
        return plan.replace(steps=n, strategy=_strategy_for(spec, n))

    return _search_int(
        name, make_plan, sigma, epsilon, delta, 1, limit, samples, seed, conf or 0.99, progress
    )


def max_batch_size(
    plan,
    *,
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    steps: int | None = None,
    epochs: int | None = None,
    strategy=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    progress: bool | None = None,
) -> PrivacyResult | None:
    """The largest batch size B ≤ N whose run meets (ε, δ) at σ.

    Exactly one of ``steps`` (fixed n) or ``epochs`` (n = epochs·⌈N/B⌉, so n changes with B)
    is given. Other arguments as in ``max_steps``.

    Returns:
        The ``PrivacyResult`` at the largest feasible B, or None when even B = 1 fails.

    Raises:
        ValueError/TypeError: invalid arguments (including both or neither of steps/epochs).
    """
    plan = _check_plan(plan)
    sigma = check_sigma(noise_multiplier)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    delta = check_delta(delta, plan.dataset_size)
    if (steps is None) == (epochs is None):
        raise ValueError("steps/epochs is invalid: give exactly one of steps or epochs")
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
    else:
        epochs = check_int("epochs", epochs, minimum=1)
    name = type(accountant_of(plan, accountant)).name
    samples, seed, conf = check_monte_carlo(samples, seed, confidence)
    spec = plan.label if strategy is None else strategy
    N = plan.dataset_size

    def make_plan(B):
        n = steps if steps is not None else epochs * (-(-N // B))
        return plan.replace(batch_size=B, steps=n, strategy=_strategy_for(spec, n))

    return _search_int(name, make_plan, sigma, epsilon, delta, 1, N, samples, seed, conf or 0.99, progress)


def account_segments(
    segments: Sequence[tuple[float, float, int]], *, delta: float, accountant: str = "pld"
) -> PrivacyResult:
    """ε at ``delta`` of DP-SGD run in segments, each (σ_i, q_i, steps_i), composed in order.

    Covers noise schedules and per-round noise levels set by an external rule.

    Args:
        segments: non-empty sequence of (noise_multiplier > 0, sampling_rate in (0, 1], steps ≥ 1).
        delta: δ in (0, 1).
        accountant: an accountant of Poisson-subsampled Gaussian events
            (``accountants_for(PoissonGaussianEvent)``: ``pld``, ``rdp`` or ``prv``).

    Returns:
        ``PrivacyResult`` with scheme ``poisson``, ``noise_multiplier`` the smallest σ_i,
        ``steps`` the total, and the segments in ``details``.

    Raises:
        ValueError: an empty list, a malformed or invalid segment (named by its index), δ or the
            accountant invalid.
    """
    delta = check_delta(delta)
    check_choice("accountant", accountant, accountants_for(PoissonGaussianEvent))
    segs = list(segments)
    if not segs:
        raise ValueError(
            "segments is invalid: must contain at least one (noise_multiplier, sampling_rate, steps)"
        )
    events = []
    for i, seg in enumerate(segs):
        if len(seg) != 3:
            raise ValueError(
                f"segments[{i}]={seg!r} is invalid: must be (noise_multiplier, sampling_rate, steps)"
            )
        try:
            events.append(PoissonGaussianEvent(*seg))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"segments[{i}]: {exc}") from None
    meas = make_accountant(accountant).epsilon(ComposedEvent(tuple(events)), delta)
    return PrivacyResult(
        epsilon=meas.epsilon,
        delta=delta,
        noise_multiplier=min(e.noise_multiplier for e in events),
        scheme=Poisson.name,
        accountant=meas.accountant,
        guarantee=meas.guarantee,
        steps=sum(e.steps for e in events),
        sensitivity=1.0,
        method=meas.method,
        details={"segments": [[e.noise_multiplier, e.sampling_rate, e.steps] for e in events]},
    )
