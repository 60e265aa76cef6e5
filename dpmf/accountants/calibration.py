"""Calibration: the smallest noise multiplier σ whose privacy event meets (ε, δ).

One generic calibrator for every scheme: ``calibrate_event`` takes the run's privacy event built
at σ = 1 (every noise multiplier in it scales with σ) and an accountant name, and returns the
smallest σ (within a relative tolerance) that the accountant certifies. It never looks at the
scheme: a scheme only supplies its event (``dpmf.plan.schemes``).

Algorithms:

* Gaussian-only events (no amplification, q = 1) under PLD: closed form σ = √(Σ count)/μ(ε, δ)
  (analytic Gaussian mechanism, Balle & Wang, ICML 2018, Theorem 8), nudged outwards against
  round-off;
* library accountants (PLD, RDP, PRV): geometric bracketing and Brent's method on log σ; PLD
  searches a coarse grid (value_discretization_interval 1e-3, pessimistic) and then refines on
  the default grid with a few secant steps; every returned σ was evaluated and meets the target;
* random allocation (``allocation_pld``): ``calibrate_allocation`` (coarse grid and Brent's
  method, confirmed on the fine grid);
* Monte Carlo: a pilot of m/4 samples places 8 candidates; each round draws m fresh samples per
  direction and certifies every candidate at level α/(2^round·8), so all rounds together fail
  with probability ≤ α; the answer never exceeds the Gaussian bound without amplification.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
from scipy.optimize import brentq

from dpmf._memory import MemoryLimitError
from dpmf._validation import check_int, check_real
from dpmf.accountants.events import ComposedEvent, GaussianEvent, PoissonGaussianEvent, flatten
from dpmf.accountants.gaussian import gaussian_mu
from dpmf.accountants.library import NoiseTooSmallError, PLDAccountant
from dpmf.accountants.montecarlo import (
    certified_delta,
    check_confidence,
    delta_means,
    samples_needed,
)
from dpmf.accountants.registry import ACCOUNTANTS, get_accountant, make_accountant
from dpmf.accountants.result import Measurement

__all__ = [
    "ACCOUNTANTS",
    "make_accountant",
    "calibrate_event",
    "rescaled",
    "check_delta",
    "check_monte_carlo",
]


def check_delta(delta, dataset_size: int | None = None) -> float:
    """δ in (0, 1); raises ValueError naming it otherwise.

    With ``dataset_size`` N, δ ≥ 1/N is accepted (ε at such δ is well defined, e.g. for δ(ε)
    curves) but is not a meaningful guarantee — a mechanism that publishes one random example
    in full is (0, 1/N)-DP — so one warning line goes to the ``dpmf`` logger (stderr when
    logging is not configured), once per (δ, N) in a process. The field's convention, as in
    Opacus, is δ ≪ 1/N.
    """
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    if dataset_size is not None and delta * dataset_size >= 1.0:
        key = (delta, int(dataset_size))
        if key not in _WARNED_DELTAS:
            _WARNED_DELTAS.add(key)
            logging.getLogger("dpmf").warning(
                "warning: delta=%g >= 1/N = %.3g (N=%d): (epsilon, delta) at such delta is not a "
                "meaningful privacy guarantee; use delta << 1/N, e.g. %.1g",
                delta,
                1.0 / dataset_size,
                dataset_size,
                min(1e-5, 0.1 / dataset_size),
            )
    return delta


_WARNED_DELTAS: set = set()


def check_monte_carlo(samples, seed, confidence):
    """Validate the Monte Carlo settings: samples ≥ 1 or None, seed ≥ 0, confidence in (0, 1)
    or None; returns them."""
    samples = None if samples is None else check_int("samples", samples, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    if confidence is not None:
        confidence = check_confidence(confidence)
    return samples, seed, confidence


def calibrate_event(
    event1,
    epsilon: float,
    delta: float,
    accountant: str,
    *,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    rtol: float = 1e-3,
    progress: bool | None = None,
):
    """The smallest σ such that ``event1`` with every noise multiplier scaled by σ meets (ε, δ).

    Args:
        event1: the privacy event at σ = 1 (``dpmf.accountants.events``).
        epsilon: target ε > 0.
        delta: target δ in (0, 1).
        accountant: a name of ``ACCOUNTANTS`` (``dpmf.accountants.registry``): ``pld``,
            ``rdp``, ``prv``, ``monte_carlo`` or ``allocation_pld``
            (``dpmf.accountants.allocation``: deterministic balls-in-bins bound).
        samples: Monte Carlo samples per direction and round (None: ``samples_needed`` for δ at
            the round-1 level).
        seed: Monte Carlo seed.
        confidence: 1 − α of the Monte Carlo certificate.
        rtol: relative tolerance on σ for the library accountants.
        progress: Monte Carlo progress bar.

    Returns:
        (σ, ``Measurement`` at σ, details dict).

    Raises:
        ValueError: the target cannot be met in σ ∈ [1e-6, 1e6], or too few Monte Carlo samples.
    """
    if get_accountant(accountant).randomized:
        m = (
            samples
            if samples is not None
            else samples_needed(delta, confidence=1.0 - (1.0 - confidence) / 16.0)
        )
        return _calibrate_monte_carlo(event1, epsilon, delta, m, seed, confidence, progress)
    return _calibrate_library(accountant, event1, epsilon, delta, rtol)


def rescaled(event, sigma: float):
    """The same event with every noise multiplier multiplied by ``sigma`` (built at σ = 1)."""
    if isinstance(event, ComposedEvent):
        return ComposedEvent(tuple(rescaled(e, sigma) for e in event.events))
    return event.with_noise(event.noise_multiplier * sigma)


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
        except (NoiseTooSmallError, MemoryLimitError):  # σ the accountant cannot measure: infeasible
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
        acc = make_accountant(name)
        meas = acc.epsilon(rescaled(event1, sigma), delta)
        step = 1e-12
        while meas.epsilon > epsilon:  # round-off: move outwards, growing steps
            sigma *= 1.0 + step
            step *= 2.0
            meas = acc.epsilon(rescaled(event1, sigma), delta)
        return sigma, meas, {"calibration": "closed form"}
    guess = math.sqrt(mu2) / gaussian_mu(epsilon, delta) if mu2 is not None else 1.0
    if name != "pld":
        acc = make_accountant(name)
        sigma, _, ev = _smallest_feasible(
            lambda s: acc.epsilon(rescaled(event1, s), delta).epsilon, epsilon, guess, rtol
        )
        return sigma, acc.epsilon(rescaled(event1, sigma), delta), {"evaluations": len(ev)}
    # PLD: search on a coarse grid (pessimistic, fast), then refine on the default grid.
    coarse = PLDAccountant(value_discretization_interval=1e-3)
    fine = PLDAccountant()
    sigma_c, _, ev = _smallest_feasible(
        lambda s: coarse.epsilon(rescaled(event1, s), delta).epsilon, epsilon, guess, rtol
    )
    slope = _log_slope(ev, sigma_c)
    s = sigma_c

    def fine_or_none(sigma):  # None where the fine grid cannot measure σ (too little noise)
        try:
            return fine.epsilon(rescaled(event1, sigma), delta)
        except (NoiseTooSmallError, MemoryLimitError):
            return None

    meas = fine_or_none(s)
    evals = 1
    while meas is None or meas.epsilon > epsilon:  # the coarse grid was not more pessimistic
        s *= 1.0 + rtol  # here: step up
        meas = fine_or_none(s)
        evals += 1
        if evals > 10_000:
            raise ValueError(
                f"epsilon={epsilon:g} is invalid for the pld accountant: no noise multiplier near "
                f"{sigma_c:g} is measured on its grid; use accountant='rdp'"
            )
    best, best_meas = s, meas
    for _ in range(3):  # secant steps towards the target, rtol/4 on the safe side
        if slope <= 0:
            break
        s2 = best * math.exp(max((best_meas.epsilon - epsilon) / slope, -0.5) + rtol / 4.0)
        if s2 >= best * (1.0 - rtol / 4.0):
            break
        try:
            meas2 = fine.epsilon(rescaled(event1, s2), delta)
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
