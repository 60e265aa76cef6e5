"""Learning-rate schedules χ ∈ ℝⁿ, the multipliers of a base learning rate.

Every schedule starts at χ₁ = 1 and ends at χ_n = β (0 < β ≤ 1) with τ = (t−1)/(n−1):

=============  ==========================================================
name           χ_t
=============  ==========================================================
constant       1
exponential    β^τ  (= α^{t−1}, α = β^{1/(n−1)})
linear         1 − (1−β)τ
cosine         β + (1−β)(1 + cos πτ)/2
polynomial     β + (1−β)(1−τ)^γ          (PyTorch ``PolynomialLR`` shape, floor β)
inverse_power  β + (1−β)(t^{−γ} − n^{−γ})/(1 − n^{−γ})
=============  ==========================================================

Source: Table 1 of "Learning Rate Scheduling with Matrix Factorization for Private
Training"; the inverse-power form is the one of that paper's public code. For n = 1 every
schedule is the single value χ₁ = 1 (the first step always has the base learning rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int, check_real

__all__ = ["SCHEDULES", "MIN_BETA", "Schedule", "schedule"]

SCHEDULES = ("constant", "exponential", "linear", "cosine", "polynomial", "inverse_power")
_DEFAULT_GAMMA = {"polynomial": 2.0, "inverse_power": 1.0}


_POWERED = ("polynomial", "inverse_power")
# the smallest final multiplier β: the lower bound works with 1/β⁴, which overflows float64
# (1e308) below β ≈ 1e-77
MIN_BETA = 1e-60


@dataclass(frozen=True)
class Schedule:
    """A named learning-rate schedule with its final value β and power γ.

    Attributes:
        name: one of ``SCHEDULES``.
        beta: final multiplier χ_n, in (0, 1]. Ignored by ``constant`` (which is β = 1).
        gamma: power of ``polynomial`` (default 2) and ``inverse_power`` (default 1), > 0;
            ``None`` selects the default; refused by the other schedules (they have no power).

    Raises:
        ValueError: unknown name, β outside (0, 1], γ ≤ 0 or not finite, γ for a schedule
            without a power.
    """

    name: str = "constant"
    beta: float = 1.0
    gamma: float | None = None

    def __post_init__(self):
        check_choice("schedule", self.name, SCHEDULES)
        beta = check_real("beta", self.beta, low=0.0, high=1.0, low_inclusive=False)
        if beta < MIN_BETA:
            raise ValueError(
                f"beta={beta!r} is invalid: must be in [{MIN_BETA:g}, 1] (the lower bound of "
                "the error works with 1/β⁴, which overflows float64 below about 1e-77); use a "
                "larger final learning-rate multiplier"
            )
        object.__setattr__(self, "beta", beta)
        if self.gamma is not None:
            if self.name not in _POWERED:
                raise ValueError(
                    f"gamma={self.gamma!r} is invalid for schedule={self.name!r}: only "
                    f"{' and '.join(_POWERED)} have a power (drop gamma)"
                )
            g = check_real("gamma", self.gamma, low=0.0, low_inclusive=False)
            object.__setattr__(self, "gamma", g)

    @property
    def power(self) -> float:
        """The γ in use (the default of the schedule when none was given)."""
        return self.gamma if self.gamma is not None else _DEFAULT_GAMMA.get(self.name, 1.0)

    def values(self, n: int) -> np.ndarray:
        """Return χ as a float64 array of shape (n,), with χ[0] = 1 and χ[n−1] = β (n ≥ 2).

        Raises:
            ValueError: n < 1.
        """
        n = check_int("n", n, minimum=1)
        if n == 1:
            return np.ones(1)
        beta = 1.0 if self.name == "constant" else self.beta
        t = np.arange(1, n + 1, dtype=np.float64)
        tau = (t - 1.0) / (n - 1.0)
        if self.name == "constant" or beta == 1.0:
            chi = np.ones(n)
        elif self.name == "exponential":
            chi = np.exp(tau * np.log(beta))
        elif self.name == "linear":
            chi = 1.0 - (1.0 - beta) * tau
        elif self.name == "cosine":
            chi = beta + (1.0 - beta) * (1.0 + np.cos(np.pi * tau)) / 2.0
        elif self.name == "polynomial":
            chi = beta + (1.0 - beta) * (1.0 - tau) ** self.power
        else:  # inverse_power
            g = self.power
            if g * np.log(n) > 1e-3:
                tail = float(n) ** (-g)
                chi = beta + (1.0 - beta) * (t ** (-g) - tail) / (1.0 - tail)
            else:  # 1 − n^{−γ} cancels: n^{−γ}·(e^{γ ln(n/t)} − 1)/(1 − e^{−γ ln n}) by expm1
                frac = np.exp(-g * np.log(n)) * np.expm1(g * np.log(n / t)) / -np.expm1(-g * np.log(n))
                chi = beta + (1.0 - beta) * frac
        chi[0], chi[-1] = 1.0, beta
        return chi


def schedule(name: str, n: int, beta: float = 1.0, gamma: float | None = None) -> np.ndarray:
    """Shorthand for ``Schedule(name, beta, gamma).values(n)``: χ of shape (n,)."""
    return Schedule(name, beta, gamma).values(n)
