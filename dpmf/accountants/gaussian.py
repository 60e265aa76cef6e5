"""The Gaussian mechanism in closed form: δ(ε), ε(δ) and the noise for a target (ε, δ).

A Gaussian mechanism with sensitivity Δ and noise std σ is μ-GDP with μ = Δ/σ, and its exact
privacy profile is (Balle & Wang, "Improving the Gaussian Mechanism for Differential Privacy",
ICML 2018, Theorem 8; Dong, Roth & Su 2022, Cor. 2.13)

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε · Φ(−ε/μ − μ/2).

k compositions of μ-GDP mechanisms are √k·μ-GDP exactly. ε(δ) and σ(ε, δ) are computed by
dp-accounting's ``get_epsilon_gaussian`` / ``get_sigma_gaussian`` and then checked against the
formula above, moving the answer outwards if the root finder stopped on the wrong side, so that
the returned ε (or σ) always satisfies the target.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting import get_epsilon_gaussian, get_sigma_gaussian
from scipy.stats import norm

from dpmf._validation import check_real

__all__ = ["gaussian_delta", "gaussian_epsilon", "gaussian_mu"]


def gaussian_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of a μ-GDP Gaussian mechanism (Balle & Wang 2018, Theorem 8).

    Args:
        mu: μ = sensitivity / noise std, > 0.
        epsilon: ε ≥ 0.

    Returns:
        δ in [0, 1].

    Raises:
        ValueError: μ ≤ 0 or ε < 0 (or not finite).
    """
    mu = check_real("mu", mu, low=0.0, low_inclusive=False)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    a = norm.logcdf(-epsilon / mu + mu / 2.0)
    b = epsilon + norm.logcdf(-epsilon / mu - mu / 2.0)
    if b >= a:
        return 0.0
    return float(min(1.0, math.exp(a) * -math.expm1(b - a)))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for a μ-GDP Gaussian mechanism.

    Args:
        mu: μ = sensitivity / noise std, > 0 (√k/σ for k compositions).
        delta: δ in (0, 1).

    Returns:
        ε ≥ 0; 0 when δ(0) ≤ δ.

    Raises:
        ValueError: μ ≤ 0, δ outside (0, 1).
    """
    mu = check_real("mu", mu, low=0.0, low_inclusive=False)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    if gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    eps = float(get_epsilon_gaussian(1.0 / mu, delta))
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
        μ > 0 with δ_μ(ε) ≤ δ.

    Raises:
        ValueError: ε ≤ 0, δ outside (0, 1).
    """
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    mu = 1.0 / float(get_sigma_gaussian(epsilon, delta))
    factor = 1.0 - 1e-12
    while gaussian_delta(mu, epsilon) > delta:
        mu *= factor
        factor = 1.0 - 2.0 * (1.0 - factor)
    return float(np.float64(mu))
