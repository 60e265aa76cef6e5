"""DP-λCGD: noise correlated with the previous step only, C⁻¹ = Toep(1, −λ).

Step t receives the noise z_t − λ·z_{t−1}: the strategy is C = Toep(1, λ, λ², …) (the power
series of 1/(1 − λx)), B = A·Toep(1, −λ). The generator keeps one past raw noise vector (or
none, regenerating z_{t−1} from the seed), so the memory is that of DP-SGD plus at most d floats.

* ``lcgd(workload, λ)`` — a fixed λ ∈ [0, 1) (λ = 0 is DP-SGD noise);
* ``optimize_lcgd(workload, participation)`` — λ minimizing MeanSE (or MaxSE) under the
  participation: a grid over [0, 1) and a bounded Brent refinement around the best grid point;
  the result is never worse than the best grid value.

For λ ∈ [0, 1) the coefficients of C are non-negative and non-increasing, so the min_sep
sensitivity has its Toeplitz closed form and CᵀC ≥ 0 (fixed_epochs exact; balls-in-bins
admissible).

Source: Kalinin, McKenna, Pagh & Lampert, "DP-λCGD" (ICML 2026, arXiv 2601.22334).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

from dpmf._validation import check_choice, check_int, check_real
from dpmf.mechanisms.errors import evaluate
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.workloads.workload import Workload

__all__ = ["LCGDFactorization", "LCGDResult", "lcgd", "optimize_lcgd", "LAMBDA_MAX"]

#: the largest λ considered by ``optimize_lcgd`` (C's coefficients λ^k stay representable)
LAMBDA_MAX = 0.9999


@dataclass(frozen=True, eq=False)
class LCGDFactorization(Factorization):
    """A λCGD ``Factorization``; labelled ``lcgd:λ`` (``lcgd_opt`` when λ was optimized).

    Attributes (besides ``Factorization``'s):
        lam: λ in [0, 1).
    """

    lam: float = 0.0

    @property
    def label(self) -> str:
        return "lcgd_opt" if self.name == "lcgd_opt" else f"lcgd:{self.lam!r}"


def lcgd(workload: Workload, lam: float, *, name: str = "lcgd") -> LCGDFactorization:
    """The λCGD factorization of ``workload``: C⁻¹ = Toep(1, −λ), C = Toep(1, λ, λ², …).

    Args:
        workload: the n×n workload A.
        lam: λ in [0, 1).
        name: ``lcgd`` (fixed λ) or ``lcgd_opt`` (λ chosen by ``optimize_lcgd``).

    Returns:
        ``LCGDFactorization`` (C and C⁻¹ as ``ScaledToeplitz``, O(n) memory).

    Raises:
        TypeError: ``workload`` not a ``Workload``.
        ValueError: λ outside [0, 1).
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    lam = check_real("lambda", lam, low=0.0, high=1.0, high_inclusive=False)
    n = workload.n
    g = np.zeros(n)
    g[0] = 1.0
    if n > 1:
        g[1] = -lam
    C = ScaledToeplitz(lam ** np.arange(n, dtype=np.float64))
    return LCGDFactorization(name, None, workload, C, ScaledToeplitz(g), lam=float(lam))


@dataclass(frozen=True, eq=False)
class LCGDResult:
    """An optimized λ and its report.

    Attributes:
        factorization: the ``LCGDFactorization`` at the optimum (name ``lcgd_opt``).
        lam: the optimal λ.
        objective: ``mean_se`` or ``max_se``.
        value: that error at λ under the participation.
        grid_best: the best value on the grid (``value`` ≤ ``grid_best``).
        evaluations: error evaluations spent.
    """

    factorization: LCGDFactorization
    lam: float
    objective: str
    value: float
    grid_best: float
    evaluations: int


def optimize_lcgd(
    workload: Workload,
    participation: Participation | None = None,
    *,
    objective: str = "mean_se",
    grid: int = 41,
) -> LCGDResult:
    """The λ ∈ [0, ``LAMBDA_MAX``] minimizing ``objective`` of λCGD under ``participation``.

    Evaluates λ on a uniform grid of ``grid`` points over [0, LAMBDA_MAX], then runs bounded
    Brent's method (scipy's ``minimize_scalar``, xatol 1e-6) on the bracket around the best grid
    point; returns the better of the two. Each evaluation is ``evaluate`` (exact sensitivity,
    O(n log n) to O(n²) errors).

    Args:
        workload: the n×n workload A.
        participation: default single participation.
        objective: ``mean_se`` or ``max_se``.
        grid: number of grid points, ≥ 3.

    Returns:
        ``LCGDResult``.

    Raises:
        TypeError: ``workload`` or ``participation`` of the wrong type.
        ValueError: unknown objective, grid < 3, or n incompatible with the participation.
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    participation = participation or Participation.single()
    if not isinstance(participation, Participation):
        raise TypeError(f"participation={participation!r} is invalid: must be a Participation")
    objective = check_choice("objective", objective, ("mean_se", "max_se"))
    grid = check_int("grid", grid, minimum=3)
    participation.check_steps(workload.n)
    count = 0

    def value(lam: float) -> float:
        nonlocal count
        count += 1
        return float(getattr(evaluate(lcgd(workload, lam), participation, with_lower_bound=False), objective))

    lams = np.linspace(0.0, LAMBDA_MAX, grid)
    vals = np.array([value(float(x)) for x in lams])
    i = int(np.argmin(vals))
    best_lam, best = float(lams[i]), float(vals[i])
    lo, hi = float(lams[max(i - 1, 0)]), float(lams[min(i + 1, grid - 1)])
    res = minimize_scalar(value, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    if res.fun < best:
        best_lam, best = float(res.x), float(res.fun)
    return LCGDResult(
        lcgd(workload, best_lam, name="lcgd_opt"), best_lam, objective, best, float(vals[i]), count
    )
