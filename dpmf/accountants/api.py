"""The accounting entry points: ε of a run, σ for a target, and the largest steps / batch size.

``account`` and ``calibrate`` take a run (scheme, N, B, n, strategy) and return a
``PrivacyResult``; ``max_steps`` and ``max_batch_size`` search the run's length or batch size
for a given σ. The scheme table and its sources are in ``dpmf.accountants.schemes``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import brentq

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonGaussianEvent,
    flatten,
)
from dpmf.accountants.gaussian import gaussian_mu
from dpmf.accountants.library import NoiseTooSmallError, PLDAccountant, PRVAccountant, RDPAccountant
from dpmf.accountants.montecarlo import (
    MonteCarloAccountant,
    certified_delta,
    check_confidence,
    delta_means,
    samples_needed,
)
from dpmf.accountants.result import Measurement, PrivacyResult
from dpmf.accountants.schemes import MONTE_CARLO_SCHEMES, Run, build_event, check_run

__all__ = [
    "ACCOUNTANTS",
    "account",
    "account_segments",
    "calibrate",
    "max_steps",
    "max_batch_size",
    "default_accountant",
]

ACCOUNTANTS = ("pld", "rdp", "prv", "monte_carlo")
_GAUSSIAN_SCHEMES = ("single_release", "fixed_order")


def default_accountant(scheme: str) -> str:
    """``monte_carlo`` for the balls-in-bins schemes, ``pld`` otherwise."""
    return "monte_carlo" if scheme in MONTE_CARLO_SCHEMES else "pld"


def _check_accountant(accountant, scheme: str) -> str:
    if accountant is None:
        return default_accountant(scheme)
    check_choice("accountant", accountant, ACCOUNTANTS)
    if scheme in MONTE_CARLO_SCHEMES and accountant != "monte_carlo":
        raise ValueError(
            f"accountant={accountant!r} is invalid for scheme={scheme!r}: only monte_carlo "
            "measures "
            "balls-in-bins sampling"
        )
    if accountant == "monte_carlo" and scheme not in MONTE_CARLO_SCHEMES + _GAUSSIAN_SCHEMES:
        raise ValueError(
            f"accountant='monte_carlo' is invalid for scheme={scheme!r}: use pld, rdp or prv for "
            "Poisson sampling"
        )
    return accountant


def _check_mc(samples, seed, confidence):
    samples = None if samples is None else check_int("samples", samples, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    if confidence is not None:
        confidence = check_confidence(confidence)
    return samples, seed, confidence


def _check_delta(delta) -> float:
    return check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)


def _make(name: str, samples, seed, confidence, progress):
    if name == "pld":
        return PLDAccountant()
    if name == "rdp":
        return RDPAccountant()
    if name == "prv":
        return PRVAccountant()
    return MonteCarloAccountant(samples, seed, confidence, progress)


def _result(run: Run, sigma: float, info: dict, meas: Measurement, **extra) -> PrivacyResult:
    details = dict(info["details"])
    details.update(extra.pop("details", {}))
    return PrivacyResult(
        epsilon=meas.epsilon,
        delta=meas.delta,
        noise_multiplier=sigma,
        scheme=run.scheme,
        accountant=meas.accountant,
        guarantee=meas.guarantee,
        steps=run.steps,
        sensitivity=info["sensitivity"],
        dataset_size=run.dataset_size,
        batch_size=run.batch_size,
        sampling_rate=info["sampling_rate"],
        factorization=run.label,
        method=meas.method,
        confidence=meas.confidence,
        samples=meas.samples,
        seed=meas.seed,
        epsilon_estimate=meas.epsilon_estimate,
        delta_estimate=meas.delta_estimate,
        details=details,
        **extra,
    )


def account(
    scheme: str,
    *,
    noise_multiplier: float,
    dataset_size: int,
    batch_size: int,
    steps: int,
    delta: float,
    factorization=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float | None = 0.99,
    min_sep: int | None = None,
    progress: bool | None = None,
) -> PrivacyResult:
    """ε at ``delta`` of a training run.

    Args:
        scheme: one of ``SCHEMES`` (see ``dpmf.accountants.schemes`` for each definition).
        noise_multiplier: σ > 0; the noise on C·G has std σ·ζ·s (s: ``result.sensitivity``).
        dataset_size: N ≥ 1.
        batch_size: B in [1, N]; q = B/N, b = ⌈N/B⌉ steps per epoch.
        steps: n ≥ 1.
        delta: δ in (0, 1).
        factorization: a ``dpmf.mechanisms.Factorization`` with n = steps, or None (C = I).
        accountant: ``pld``, ``rdp``, ``prv`` or ``monte_carlo``; None picks ``pld``, or
            ``monte_carlo`` for the balls-in-bins schemes.
        samples: Monte Carlo samples per direction; None: ``samples_needed(δ)``.
        seed: Monte Carlo seed.
        confidence: Monte Carlo confidence 1 − α of the certified ε; None reports a point
            estimate (guarantee ``estimate``).
        min_sep: b' of ``cyclic_poisson`` (default: the bands of C).
        progress: Monte Carlo progress bar (None: only on a terminal).

    Returns:
        ``PrivacyResult`` (ε ≥ 0, never NaN; 0 when δ(0) ≤ δ).

    Raises:
        ValueError/TypeError: any invalid argument, named, before any work (see ``check_run``).
    """
    run = check_run(scheme, dataset_size, batch_size, steps, factorization, min_sep)
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
    delta = _check_delta(delta)
    name = _check_accountant(accountant, run.scheme)
    samples, seed, confidence = _check_mc(samples, seed, confidence)
    event, info = build_event(run, sigma)
    meas = _make(name, samples, seed, confidence, progress).epsilon(event, delta)
    return _result(run, sigma, info, meas)


def account_segments(
    segments: Sequence[tuple[float, float, int]], *, delta: float, accountant: str = "pld"
) -> PrivacyResult:
    """ε at ``delta`` of DP-SGD run in segments, each (σ_i, q_i, steps_i), composed in order.

    Covers noise schedules and per-round noise levels set by an external rule.

    Args:
        segments: non-empty sequence of (noise_multiplier > 0, sampling_rate in (0, 1], steps ≥ 1).
        delta: δ in (0, 1).
        accountant: ``pld``, ``rdp`` or ``prv``.

    Returns:
        ``PrivacyResult`` with scheme ``poisson``, ``noise_multiplier`` the smallest σ_i,
        ``steps`` the total, and the segments in ``details``.

    Raises:
        ValueError: an empty list, a malformed or invalid segment (named by its index), δ or the
            accountant invalid.
    """
    delta = _check_delta(delta)
    check_choice("accountant", accountant, ("pld", "rdp", "prv"))
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
    meas = _make(accountant, None, 0, None, None).epsilon(ComposedEvent(tuple(events)), delta)
    return PrivacyResult(
        epsilon=meas.epsilon,
        delta=delta,
        noise_multiplier=min(e.noise_multiplier for e in events),
        scheme="poisson",
        accountant=meas.accountant,
        guarantee=meas.guarantee,
        steps=sum(e.steps for e in events),
        sensitivity=1.0,
        method=meas.method,
        details={"segments": [[e.noise_multiplier, e.sampling_rate, e.steps] for e in events]},
    )


# --------------------------------------------------------------------------------------------
# Calibration


def _rescaled(event, sigma: float):
    """The same event with every noise multiplier multiplied by ``sigma`` (built at σ = 1)."""
    if isinstance(event, ComposedEvent):
        return ComposedEvent(tuple(_rescaled(e, sigma) for e in event.events))
    return dataclasses.replace(event, noise_multiplier=event.noise_multiplier * sigma)


def _smallest_feasible(eps_of: Callable[[float], float], target: float, sigma0: float, rtol: float):
    """The smallest σ (within relative ``rtol``) among evaluated points with ε(σ) ≤ target.

    ε(σ) must be non-increasing. Brackets geometrically from ``sigma0``, then runs Brent's
    method on log σ; every returned σ was evaluated and met the target.

    Returns:
        (σ, ε(σ), evaluated): ``evaluated`` maps σ → ε for every evaluation.
    """
    evaluated: dict[float, float] = {}

    def f(x: float) -> float:
        s = math.exp(x)
        try:
            e = eps_of(s)
        except NoiseTooSmallError:  # below what the accountant can measure: treat as infeasible
            return 1e6
        evaluated[s] = e
        return (min(e, 1e6) - target) if math.isfinite(e) else 1e6

    x = math.log(sigma0)
    fx = f(x)
    step = math.log(2.0)
    if fx <= 0:
        hi, lo = x, x - step
        while f(lo) <= 0:
            hi, lo = lo, lo - step
            if lo < math.log(1e-6):
                raise ValueError("calibration failed: the target is met for every noise multiplier >= 1e-6")
    else:
        lo, hi = x, x + step
        while f(hi) > 0:
            lo, hi = hi, hi + step
            if hi > math.log(1e6):
                raise ValueError("calibration failed: the target is not met by any noise multiplier <= 1e6")
    brentq(f, lo, hi, xtol=rtol / 4.0, rtol=1e-12)
    feasible = [s for s, e in evaluated.items() if e <= target]
    best = min(feasible)
    return best, evaluated[best], evaluated


def _gaussian_mu2(event) -> float | None:
    """Σ count/σ² when every part is Gaussian (q = 1 Poisson counts), else None."""
    total = 0.0
    for e in flatten(event):
        if isinstance(e, GaussianEvent):
            total += e.count / e.noise_multiplier**2
        elif isinstance(e, PoissonGaussianEvent) and e.sampling_rate == 1.0:
            total += e.steps / e.noise_multiplier**2
        else:
            return None
    return total


def _calibrate_library(name: str, event1, epsilon: float, delta: float, rtol: float):
    """σ multiplier for a library accountant; returns (σ, Measurement at σ, details)."""
    mu2 = _gaussian_mu2(event1)
    if mu2 is not None and name == "pld":
        sigma = math.sqrt(mu2) / gaussian_mu(epsilon, delta)  # exact (analytic PLD)
        acc = _make(name, None, 0, None, None)
        meas = acc.epsilon(_rescaled(event1, sigma), delta)
        step = 1e-12
        while meas.epsilon > epsilon:  # round-off: move outwards, growing steps
            sigma *= 1.0 + step
            step *= 2.0
            meas = acc.epsilon(_rescaled(event1, sigma), delta)
        return sigma, meas, {"calibration": "closed form"}
    guess = math.sqrt(mu2) / gaussian_mu(epsilon, delta) if mu2 is not None else 1.0
    if name != "pld":
        acc = _make(name, None, 0, None, None)
        sigma, _, ev = _smallest_feasible(
            lambda s: acc.epsilon(_rescaled(event1, s), delta).epsilon, epsilon, guess, rtol
        )
        return sigma, acc.epsilon(_rescaled(event1, sigma), delta), {"evaluations": len(ev)}
    # PLD: search on a coarse grid (pessimistic, fast), then refine on the default grid.
    coarse = PLDAccountant(value_discretization_interval=1e-3)
    fine = PLDAccountant()
    sigma_c, _, ev = _smallest_feasible(
        lambda s: coarse.epsilon(_rescaled(event1, s), delta).epsilon, epsilon, guess, rtol
    )
    slope = _log_slope(ev, sigma_c)
    s = sigma_c
    meas = fine.epsilon(_rescaled(event1, s), delta)
    evals = 1
    while meas.epsilon > epsilon:  # the coarse grid was not more pessimistic here: step up
        s *= 1.0 + rtol
        meas = fine.epsilon(_rescaled(event1, s), delta)
        evals += 1
    best, best_meas = s, meas
    for _ in range(3):  # secant steps towards the target, rtol/4 on the safe side
        if slope <= 0:
            break
        s2 = best * math.exp(max((best_meas.epsilon - epsilon) / slope, -0.5) + rtol / 4.0)
        if s2 >= best * (1.0 - rtol / 4.0):
            break
        try:
            meas2 = fine.epsilon(_rescaled(event1, s2), delta)
        except NoiseTooSmallError:
            break
        evals += 1
        if meas2.epsilon <= epsilon:
            best, best_meas = s2, meas2
        else:
            slope *= 2.0  # overshot: take shorter steps
    return best, best_meas, {"evaluations": len(ev) + evals}


def _log_slope(evaluated: dict, center: float) -> float:
    """−dε/d log σ near ``center``: least squares over evaluations within a factor 1.15 of it."""
    pts = [
        (math.log(s), e)
        for s, e in evaluated.items()
        if math.isfinite(e) and center / 1.15 <= s <= center * 1.15
    ]
    if len(pts) < 2:
        return 0.0
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    if np.ptp(x) == 0:
        return 0.0
    slope = -np.polyfit(x, y, 1)[0]
    return float(slope) if slope > 0 else 0.0


def _mixture_mu2(event1) -> float:
    """μ² of the Gaussian that dominates every mixture component (no amplification), σ = 1.

    By joint convexity of the hockey-stick divergence, a mixture of N(v_j, I) against N(0, I)
    is no less private than its worst component: μ = max_j ‖v_j‖ per copy; copies add μ².
    """
    total = 0.0
    for e in flatten(event1):
        if isinstance(e, GaussianEvent):
            total += e.count / e.noise_multiplier**2
        else:
            total += e.repetitions * (e.max_norm / e.noise_multiplier) ** 2
    return total


def _calibrate_monte_carlo(event1, epsilon, delta, samples, seed, confidence, progress):
    """Smallest certified σ by Monte Carlo; see ``calibrate``. Returns (σ, Measurement, details)."""
    alpha = 1.0 - confidence
    K = 8
    mu2 = _mixture_mu2(event1)
    sigma_gauss = math.sqrt(mu2) / gaussian_mu(epsilon, delta)
    m = samples
    # the largest point estimate that can still certify delta in round 1
    level1 = 1.0 - alpha / 2.0 / K
    if certified_delta(0.0, m, level1) > delta:
        need = samples_needed(delta, ratio=0.0, confidence=level1)
        raise ValueError(
            f"samples={m} is too few to calibrate at delta={delta:g} with confidence "
            f"{confidence:g}: "
            f"at least {need} are needed (about {samples_needed(delta, confidence=level1)} for a "
            "tight answer)"
        )
    lo_d, hi_d = 0.0, delta
    for _ in range(100):
        mid = 0.5 * (lo_d + hi_d)
        if certified_delta(mid, m, level1) <= delta:
            lo_d = mid
        else:
            hi_d = mid
    d_star = lo_d
    # pilot: point estimates on a wide grid, to place the candidates
    m0 = max(1000, m // 4)
    pilot = sigma_gauss * np.geomspace(1 / 30, 1.0, 12)
    pr, pa = delta_means(event1, pilot, epsilon, m0, seed=seed, stream=1, progress=progress)
    sigma_p = _crossing(pilot, np.maximum(pr, pa), max(d_star, 1e-300))
    best, best_info = None, None
    tested = []
    grid = np.array([0.97, 0.99, 1.01, 1.03, 1.06, 1.09, 1.13, 1.18])
    cands = sigma_p * grid
    for r in range(1, 4):
        alpha_r = alpha / 2.0**r
        level = 1.0 - alpha_r / K
        cands = np.minimum(cands, sigma_gauss)
        mr, ma = delta_means(event1, cands, epsilon, m, seed=seed, stream=1 + r, progress=progress)
        cert = np.array(
            [
                max(certified_delta(x, m, level), certified_delta(y, m, level))
                for x, y in zip(mr, ma, strict=True)
            ]
        )
        tested.extend(float(c) for c in cands)
        ok = np.flatnonzero(cert <= delta)
        if ok.size:
            i = int(ok[0])
            if best is None or cands[i] < best:
                best = float(cands[i])
                best_info = (float(max(mr[i], ma[i])), float(cert[i]), r)
            if i > 0:
                break  # the crossing lies inside this round's grid
            cands = cands[0] * grid / grid[-1] / 1.01  # all passed: look lower
        else:
            cands = cands[-1] * grid / grid[0] * 1.03  # none passed: look higher
    details = {
        "pilot_samples": m0,
        "rounds": len(tested) // K,
        "candidates_tested": len(tested),
        "gaussian_bound_noise_multiplier": sigma_gauss,
    }
    if best is None or best >= sigma_gauss:
        meas = Measurement(
            epsilon,
            delta,
            "monte_carlo",
            "upper_bound",
            "Gaussian bound without amplification (Monte Carlo did not certify a smaller noise)",
        )
        return sigma_gauss, meas, details
    d_est, d_cert, r = best_info
    details.update({"certified_delta": d_cert, "certified_in_round": r})
    method = (
        f"Monte Carlo calibration: {K} candidates per round on fresh streams, each certified at "
        f"alpha/(2^round*{K}) ({m} samples per direction, seed {seed})"
    )
    meas = Measurement(epsilon, delta, "monte_carlo", "certified", method, confidence, m, seed, None, d_est)
    return best, meas, details


def _crossing(sigmas: np.ndarray, deltas: np.ndarray, target: float) -> float:
    """σ where the (decreasing) estimates cross ``target``, by log-log interpolation."""
    pos = deltas > 0
    above = np.flatnonzero(deltas > target)
    if above.size == 0:
        return float(sigmas[0])
    i = int(above[-1])
    if i + 1 < len(sigmas) and deltas[i + 1] > 0:
        j = i + 1
    else:
        idx = np.flatnonzero(pos[: i + 1])
        if idx.size < 2:
            return float(sigmas[min(i + 1, len(sigmas) - 1)])
        i, j = int(idx[-2]), int(idx[-1])
    x0, x1 = math.log(sigmas[i]), math.log(sigmas[j])
    y0, y1 = math.log(deltas[i]), math.log(deltas[j])
    if y1 >= y0:
        return float(sigmas[j])
    x = x0 + (math.log(target) - y0) * (x1 - x0) / (y1 - y0)
    return float(min(math.exp(x), sigmas[-1]))


def calibrate(
    scheme: str,
    *,
    epsilon: float,
    delta: float,
    dataset_size: int,
    batch_size: int,
    steps: int,
    factorization=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    min_sep: int | None = None,
    rtol: float = 1e-3,
    progress: bool | None = None,
) -> PrivacyResult:
    """The smallest noise multiplier σ that meets (ε, δ) under the accountant (conservative).

    Gaussian-only runs (``single_release``, ``fixed_order``, q = 1) are solved in closed form.
    Library accountants: geometric bracketing and Brent's method on log σ; the returned σ was
    evaluated and meets the target, within ``rtol`` of the smallest such σ (PLD searches on a
    coarse grid, value_discretization_interval 1e-3, then refines on the default 1e-4 grid).
    Monte Carlo: a pilot of m/4 samples (stream 1) places 8 candidate σ; each round draws
    m fresh samples per direction (stream 1 + round) and certifies every candidate at level
    α/(2^round·8), so all rounds together fail with probability ≤ α; the smallest certified
    candidate is returned. The answer never exceeds the Gaussian bound without amplification
    (μ = max_j ‖v_j‖/σ, valid by joint convexity), returned as ``upper_bound`` when Monte Carlo
    cannot certify anything smaller.

    Args:
        scheme, dataset_size, batch_size, steps, factorization, accountant, seed, min_sep,
        progress: as in ``account``.
        epsilon: target ε > 0.
        delta: target δ in (0, 1).
        samples: Monte Carlo samples per direction and round; None: ``samples_needed`` for δ at
            the round-1 level.
        confidence: 1 − α of the Monte Carlo certificate.
        rtol: relative tolerance on σ for the library accountants, in (0, 0.1].

    Returns:
        ``PrivacyResult`` whose ``noise_multiplier`` is the calibrated σ and ``epsilon`` its ε
        (≤ the target; for Monte Carlo the target itself, certified).

    Raises:
        ValueError/TypeError: invalid arguments, named, before any work.
    """
    run = check_run(scheme, dataset_size, batch_size, steps, factorization, min_sep)
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = _check_delta(delta)
    name = _check_accountant(accountant, run.scheme)
    samples, seed, conf = _check_mc(samples, seed, confidence)
    if conf is None:
        raise ValueError("confidence=None is invalid for calibrate: must be in (0, 1)")
    rtol = check_real("rtol", rtol, low=0.0, high=0.1, low_inclusive=False)
    event1, info = build_event(run, 1.0)
    if name == "monte_carlo":
        m = samples if samples is not None else samples_needed(delta, confidence=1.0 - (1.0 - conf) / 16.0)
        sigma, meas, extra = _calibrate_monte_carlo(event1, epsilon, delta, m, seed, conf, progress)
    else:
        sigma, meas, extra = _calibrate_library(name, event1, epsilon, delta, rtol)
    return _result(run, sigma, info, meas, details=extra)


# --------------------------------------------------------------------------------------------
# Largest steps / batch size for a given σ


def _factorization_for(factorization, schedule, n: int):
    if factorization is None:
        return None
    if callable(factorization) and not isinstance(factorization, str):
        return factorization(n)
    from dpmf.mechanisms import factorize
    from dpmf.workloads import from_schedule, prefix_sum

    workload = prefix_sum(n) if schedule is None else from_schedule(schedule, n)
    return factorize(workload, factorization)


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


def _search_int(name, make_run, sigma, epsilon, delta, lo, hi, samples, seed, confidence, progress):
    """Largest integer x (steps or batch size) whose run meets (ε, δ); certified for Monte Carlo
    by verifying the answer on fresh samples (attempt i at α/2^i, stepping down 3% on failure)."""
    mc = name == "monte_carlo"
    acc = (
        _make(name, samples, seed, None if mc else confidence, False)
        if mc
        else _make(name, None, 0, None, None)
    )

    def eps_of(x):
        run = make_run(x)
        event, _ = build_event(run, sigma)
        return acc.epsilon(event, delta).epsilon

    x = _largest_feasible_int(lambda v: eps_of(v) <= epsilon, lo, hi)
    if x is None:
        return None, None
    run = make_run(x)
    if not mc:
        event, info = build_event(run, sigma)
        return run, _result(run, sigma, info, acc.epsilon(event, delta))
    alpha = 1.0 - confidence
    for i in range(1, 8):
        event, info = build_event(run, sigma)
        ver = MonteCarloAccountant(samples, seed + i, 1.0 - alpha / 2.0**i, progress)
        meas = ver.epsilon(event, delta)
        if meas.epsilon <= epsilon:
            meas = dataclasses.replace(meas, confidence=confidence)
            return run, _result(run, sigma, info, meas, details={"verification_attempts": i})
        x = max(lo, int(x * 0.97))
        run = make_run(x)
    return None, None


def max_steps(
    scheme: str,
    *,
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    dataset_size: int,
    batch_size: int,
    factorization=None,
    schedule=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    min_sep: int | None = None,
    limit: int = 1_000_000,
    progress: bool | None = None,
) -> PrivacyResult | None:
    """The largest number of steps n ≤ ``limit`` whose run meets (ε, δ) at σ.

    Args:
        factorization: None (C = I), a spec such as ``"bisr:16"`` (built for each n on the
            prefix sum, or on ``schedule``'s workload A_χ), or a callable n → Factorization.
        schedule: a ``dpmf.workloads.Schedule`` for spec strings, or None.
        limit: the largest n considered (≥ 1).
        others: as in ``account``.

    Returns:
        The ``PrivacyResult`` at the largest feasible n, or None when even n = 1 fails.
        Monte Carlo answers are searched on point estimates and then certified on fresh samples.

    Raises:
        ValueError/TypeError: invalid arguments, named, before any work.
    """
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    delta = _check_delta(delta)
    limit = check_int("limit", limit, minimum=1)
    check_run(scheme, dataset_size, batch_size, 1, None, min_sep)
    name = _check_accountant(accountant, scheme)
    samples, seed, conf = _check_mc(samples, seed, confidence)
    if isinstance(factorization, str):
        from dpmf.mechanisms import parse_factorization

        parse_factorization(factorization)

    def make_run(n):
        return check_run(
            scheme,
            dataset_size,
            batch_size,
            n,
            _factorization_for(factorization, schedule, n),
            min_sep,
        )

    _, result = _search_int(
        name, make_run, sigma, epsilon, delta, 1, limit, samples, seed, conf or 0.99, progress
    )
    return result


def max_batch_size(
    scheme: str,
    *,
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    dataset_size: int,
    steps: int | None = None,
    epochs: int | None = None,
    factorization=None,
    schedule=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    min_sep: int | None = None,
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
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    delta = _check_delta(delta)
    N = check_int("dataset_size", dataset_size, minimum=1)
    if (steps is None) == (epochs is None):
        raise ValueError("steps/epochs is invalid: give exactly one of steps or epochs")
    if steps is not None:
        steps = check_int("steps", steps, minimum=1)
    else:
        epochs = check_int("epochs", epochs, minimum=1)
    check_run(scheme, N, 1, 1, None, min_sep)
    name = _check_accountant(accountant, scheme)
    samples, seed, conf = _check_mc(samples, seed, confidence)

    def make_run(B):
        n = steps if steps is not None else epochs * (-(-N // B))
        return check_run(scheme, N, B, n, _factorization_for(factorization, schedule, n), min_sep)

    _, result = _search_int(
        name, make_run, sigma, epsilon, delta, 1, N, samples, seed, conf or 0.99, progress
    )
    return result
