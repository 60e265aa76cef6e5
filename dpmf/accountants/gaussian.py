"""The Gaussian mechanism in closed form: δ(ε), ε(δ) and the noise for a target (ε, δ).

A Gaussian mechanism with sensitivity Δ and noise std σ is μ-GDP with μ = Δ/σ, and its exact
privacy profile is (Balle & Wang, "Improving the Gaussian Mechanism for Differential Privacy",
ICML 2018, Theorem 8; Dong, Roth & Su 2022, Cor. 2.13)

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε · Φ(−ε/μ − μ/2).

k compositions of μ-GDP mechanisms are √k·μ-GDP exactly. ε(δ) and σ(ε, δ) are computed by
dp-accounting's ``get_epsilon_gaussian`` / ``get_sigma_gaussian`` and then checked against the
formula above, moving the answer outwards if the root finder stopped on the wrong side, so that
the returned ε (or σ) always satisfies the target.

Almost no noise. Beyond μ = ``EXACT_MAX_MU`` (ε ≈ 5·10⁵) the two terms of δ(ε) cancel in
floating point and the root finders fail, so the tail bound of the privacy loss
L ~ N(μ²/2, μ²) is used instead (Dong, Roth & Su 2022, Prop. 2.12 and Cor. 2.13: δ(ε) ≤ P[L > ε]):

    δ(ε) ≤ Φ(μ/2 − ε/μ),   hence   ε(δ) ≤ μ²/2 + μ·Φ⁻¹(1 − δ),   μ(ε, δ) ≥ √(z² + 2ε) − z,

with z = Φ⁻¹(1 − δ): an upper bound on ε (a lower bound on μ, so a larger σ) whose relative
gap to the exact value is below 10⁻⁵ there. μ = ∞ (no noise, or a σ so small that 1/σ
overflows) has ε = ∞ at every δ < 1.
"""

from __future__ import annotations

import math

import numpy as np

from dpmf._lazy import lazy_module
from dpmf._validation import check_real

# imported at their first use (about a second of imports together)
_dpa = lazy_module("dp_accounting")
_stats = lazy_module("scipy.stats")

__all__ = ["EXACT_MAX_MU", "gaussian_delta", "gaussian_epsilon", "gaussian_mu"]

# Above this μ the exact profile loses its digits to cancellation: the tail bound is used.
EXACT_MAX_MU = 1e3
# ε of the exact profile at μ = EXACT_MAX_MU is about 5.04·10⁵ for every δ of interest; above
# this target ε, calibration uses the tail bound's closed form for μ.
_EXACT_MAX_EPSILON = 5e5


def _check_mu(mu) -> float:
    """μ > 0, possibly ``inf`` (no noise)."""
    if isinstance(mu, int | float) and not isinstance(mu, bool) and mu == math.inf:
        return math.inf
    return check_real("mu", mu, low=0.0, low_inclusive=False)


def gaussian_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of a μ-GDP Gaussian mechanism (Balle & Wang 2018, Theorem 8).

    Args:
        mu: μ = sensitivity / noise std, > 0; ``inf`` for no noise.
        epsilon: ε ≥ 0.

    Returns:
        δ in [0, 1]: exact up to μ = ``EXACT_MAX_MU``, above it the upper bound Φ(μ/2 − ε/μ);
        1 for μ = ∞.

    Raises:
        ValueError: μ ≤ 0 (or NaN), ε < 0 or not finite.
    """
    mu = _check_mu(mu)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    if math.isinf(mu):
        return 1.0
    if mu > EXACT_MAX_MU:
        return float(_stats.norm.sf(epsilon / mu - mu / 2.0))
    a = _stats.norm.logcdf(-epsilon / mu + mu / 2.0)
    b = epsilon + _stats.norm.logcdf(-epsilon / mu - mu / 2.0)
    if b >= a:
        return 0.0
    return float(min(1.0, math.exp(a) * -math.expm1(b - a)))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for a μ-GDP Gaussian mechanism.

    Args:
        mu: μ = sensitivity / noise std, > 0 (√k/σ for k compositions); ``inf`` for no noise.
        delta: δ in (0, 1).

    Returns:
        ε ≥ 0; 0 when δ(0) ≤ δ; above μ = ``EXACT_MAX_MU`` the upper bound
        μ²/2 + μ·Φ⁻¹(1 − δ) (``inf`` if that overflows); ``inf`` for μ = ∞.

    Raises:
        ValueError: μ ≤ 0 (or NaN), δ outside (0, 1).
    """
    mu = _check_mu(mu)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    if math.isinf(mu):
        return math.inf
    if mu > EXACT_MAX_MU:
        z = float(_stats.norm.isf(delta))
        with np.errstate(over="ignore"):
            return float(np.float64(mu) * (np.float64(mu) / 2.0 + z))
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    eps = float(_dpa.get_epsilon_gaussian(1.0 / mu, delta))
    step = 1e-12 * max(1.0, eps)
    while gaussian_delta(mu, eps) > delta:
        eps += step
        step *= 2.0
    return eps


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The largest μ whose Gaussian mechanism is (ε, δ)-DP (so σ = sensitivity/μ is minimal).

    Args:
        epsilon: ε > 0.
        delta: δ in (0, 1).

    Returns:
        μ > 0 with δ_μ(ε) ≤ δ. Above ε = 5·10⁵ (μ ≈ ``EXACT_MAX_MU``) the tail bound's
        √(z² + 2ε) − z, z = Φ⁻¹(1 − δ), which meets the target and is smaller than the optimum by
        a relative 10⁻⁵ or less.

    Raises:
        ValueError: ε ≤ 0 or not finite, δ outside (0, 1).
    """
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    if epsilon > _EXACT_MAX_EPSILON:
        z = float(_stats.norm.isf(delta))
        # √(z² + 2ε) − z = 2ε/(√(z² + 2ε) + z), written without overflow or cancellation
        root = math.sqrt(2.0) * math.sqrt(epsilon) * math.sqrt(1.0 + z * z / (2.0 * epsilon))
        mu = 2.0 * (epsilon / (root + z))
        while gaussian_delta(mu, epsilon) > delta:  # round-off: move inwards
            mu *= 1.0 - 1e-12
        return float(mu)
    mu = 1.0 / float(_dpa.get_sigma_gaussian(epsilon, delta))
    factor = 1.0 - 1e-12
    while gaussian_delta(mu, epsilon) > delta:
        mu *= factor
        factor = 1.0 - 2.0 * (1.0 - factor)
    return float(np.float64(mu))
