"""Temporal noise filters on the privatized gradient sequence: DOPPLER here, DiSK in ``disk``.

Both are update stages (``dpmf.optim.transforms``) meant for the ``filter`` hook of the DP
optimizers: they run first on the privatized gradient g̃_t, so any optimizer can follow
(DOPPLER-SGD, DiSK-SGD, DOPPLER-Muon = filter → EMA momentum → Newton–Schulz, …). Both are
linear in their current input and declare the coefficient (``fresh_gain``), so DP-MuonBC's
bias correction still knows the std of the fresh noise after them.

DOPPLER (Zhang, Bu, Hong, Razaviyayn, "DOPPLER: Differentially Private Optimizers with
Low-pass Filter for Privacy Noise Reduction", NeurIPS 2024, arXiv:2408.13460): a linear IIR low-pass
filter with coefficients a = (1, a₁, …, a_{na}) and b = (b₀, …, b_{nb}),

    m_t = −Σ_{τ=1}^{na} a_τ m_{t−τ} + Σ_{τ=0}^{nb} b_τ g̃_{t−τ},      m_t = g̃_t = 0 for t ≤ 0,
    c_t = −Σ_{τ=1}^{na} a_τ c_{t−τ} + Σ_{τ=0}^{min(nb, t−1)} b_τ,    c_t = 0 for t ≤ 0,
    output m̂_t = m_t / c_t.

c_t is the same recursion driven by the constant input 1 from step 1 on, so on a constant
input the output equals the input at every step (DC gain 1 from the first step, not only in
the limit). Default: first order, a = (1, −0.9), b = (0.1,), i.e. m̂_t is the bias-corrected
EMA of the gradients with weight 0.1 (c_t = 1 − 0.9ᵗ).

DiSK, the other temporal filter, lives in ``dpmf.optim.disk`` (its two halves: the correction
stage ``Disk`` and the loop's evaluation plan ``DiskLookahead``); ``make_filter`` builds both
families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpmf._lazy import lazy_module
from dpmf._validation import check_choice, check_vector
from dpmf.optim.disk import Disk, disk_extrapolation_weight, single_pass_gamma
from dpmf.optim.transforms import Transform

_signal = lazy_module("scipy.signal")  # imported at the first filter built (about 0.5 s)

__all__ = [
    "FILTERS",
    "Doppler",
    "Disk",
    "make_filter",
    "single_pass_gamma",
    "disk_extrapolation_weight",
]

#: Names accepted by ``make_filter`` (and by ``dpmf train --filter``).
FILTERS = ("none", "doppler", "disk")

# The step response may not come closer to 0 than this fraction of its largest value.
_MIN_RELATIVE_NORMALIZER = 1e-8
# Longest horizon over which the step response is checked at construction.
_MAX_HORIZON = 1_000_000


def _step_response_horizon(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """Horizon after which the step response equals its limit to double precision, and the
    largest pole modulus ρ."""
    poles = np.roots(a) if a.shape[0] > 1 else np.zeros(0)
    rho = float(np.max(np.abs(poles))) if poles.size else 0.0
    base = a.shape[0] + b.shape[0]
    if rho == 0.0 or rho >= 1.0:
        return base, rho
    # ρ^k·(k^{multiplicity}) < 1e-17 well before k = base + 40/|log ρ|·(1 + #poles).
    k = base + math.ceil(40.0 / -math.log(rho)) * (1 + poles.size)
    return min(k, _MAX_HORIZON), rho


@dataclass(frozen=True)
class Doppler(Transform):
    """DOPPLER's low-pass IIR filter with DC gain 1 at every step (module docstring).

    Args:
        a: feedback coefficients (a₀, a₁, …, a_na), a₀ ≠ 0; stored divided by a₀ (as
            ``scipy.signal.lfilter``), so a₀ = 1 afterwards. The filter must be strictly
            stable: every root of a₀zⁿᵃ + a₁zⁿᵃ⁻¹ + … + a_na inside the unit circle.
        b: feed-forward coefficients (b₀, …, b_nb), b₀ ≠ 0 (else the current gradient would
            not enter the output), Σb ≠ 0 (a low-pass filter passes the DC component).

    State (per parameter): ``outputs`` the na past unnormalized outputs m_{t−1}, …, and
    ``inputs`` the nb past inputs g̃_{t−1}, … (tensors of the update's device and dtype,
    newest first); ``normalizers`` the na past c's and ``normalizer`` = c_t (Python floats,
    exact in float64 and free of device synchronization); ``step`` = t. Memory: (na + nb)
    copies of the parameter — one for the default first-order filter, as heavy-ball momentum.

    Fresh gain: b₀/c_t (1 at the first step).

    Raises:
        TypeError / ValueError: coefficients that are not finite 1-D reals, a₀ = 0, b₀ = 0,
            an unstable a, a DC gain of 0, or a step response that vanishes at some step.
    """

    a: tuple = (1.0, -0.9)
    b: tuple = (0.1,)

    def __post_init__(self):
        a = check_vector("a", self.a)
        b = check_vector("b", self.b)
        if a[0] == 0.0:
            raise ValueError(f"a={self.a!r} is invalid: the leading coefficient a[0] must be nonzero")
        a, b = a / a[0], b / a[0]
        if b[0] == 0.0:
            raise ValueError(
                f"b={self.b!r} is invalid: b[0] must be nonzero (the current gradient must enter the output)"
            )
        horizon, rho = _step_response_horizon(a, b)
        if rho >= 1.0:
            raise ValueError(
                f"a={self.a!r} is invalid: the filter must be strictly stable (all poles inside "
                f"the unit circle); the largest pole has modulus {rho:.6g}"
            )
        if b.sum() == 0.0:
            raise ValueError(
                f"b={self.b!r} is invalid: the DC gain sum(b)/sum(a) is 0; a low-pass filter "
                "must pass constant signals"
            )
        c = _signal.lfilter(b, a, np.ones(horizon))
        small = np.abs(c) < _MIN_RELATIVE_NORMALIZER * np.max(np.abs(c))
        if small.any():
            t = int(np.argmax(small)) + 1
            raise ValueError(
                f"a={self.a!r}, b={self.b!r} are invalid: the filter's step response c_t (its "
                f"normalizer) is {c[t - 1]:.3g} at step t={t}, too close to 0 to divide by"
            )
        object.__setattr__(self, "a", tuple(float(x) for x in a))
        object.__setattr__(self, "b", tuple(float(x) for x in b))

    def init(self, param):
        return {"outputs": [], "inputs": [], "normalizers": [], "normalizer": None, "step": 0}

    def update(self, update, state, param, ctx):
        a, b = self.a, self.b
        t = state["step"] + 1
        m = update * b[0]
        for tau, past in enumerate(state["inputs"], start=1):
            m.add_(past, alpha=b[tau])
        for tau, past in enumerate(state["outputs"], start=1):
            m.add_(past, alpha=-a[tau])
        c = math.fsum(b[: min(len(b), t)]) - math.fsum(
            a[tau] * past for tau, past in enumerate(state["normalizers"], start=1)
        )
        if not abs(c) > 0.0:  # excluded at construction; guards against a corrupted state
            raise ValueError(f"parameter {ctx.name!r}: DOPPLER normalizer c_t = {c!r} at step {t}")
        if len(b) > 1:
            state["inputs"] = [update.detach().clone()] + state["inputs"][: len(b) - 2]
        if len(a) > 1:
            state["outputs"] = [m] + state["outputs"][: len(a) - 2]
            state["normalizers"] = [c] + state["normalizers"][: len(a) - 2]
        state["normalizer"] = c
        state["step"] = t
        return m / c, state

    def fresh_gain(self, state):
        c = state.get("normalizer")
        return None if c is None else self.b[0] / c


def make_filter(
    name: str, *, a=(1.0, -0.9), b=(0.1,), kappa: float = 0.7, gamma: float = 0.5
) -> Transform | None:
    """The filter stage called ``name``: None for "none", ``Doppler(a, b)`` for "doppler",
    ``Disk(kappa, gamma)`` for "disk" (the arguments of the other filters are ignored).

    Raises:
        ValueError / TypeError: an unknown name or invalid coefficients (naming them).
    """
    name = check_choice("filter", name, FILTERS)
    if name == "doppler":
        return Doppler(tuple(a), tuple(b))
    if name == "disk":
        return Disk(kappa, gamma)
    return None
