"""A small limited-memory BFGS minimizer that respects a feasible region.

The optimized Toeplitz strategies keep their iterates where the closed-form sensitivity is valid
(coefficients of C non-negative and non-increasing). That region is not a box, so a general
quasi-Newton code cannot be told about it; here the objective may answer ``None`` ("infeasible")
and the backtracking line search then shortens the step. The best feasible point seen is
returned, so the result is never worse than the start.

Algorithm: Nocedal & Wright, "Numerical Optimization" (2006), Algorithm 7.4 (two-loop
recursion) with an Armijo backtracking line search (Algorithm 3.1) and the initial scaling
γ = sᵀy/yᵀy; curvature pairs with sᵀy ≤ 0 are skipped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["LbfgsResult", "minimize_lbfgs"]


@dataclass(frozen=True)
class LbfgsResult:
    """Outcome of ``minimize_lbfgs``.

    Attributes:
        x: the best feasible point, shape (m,).
        value: the objective there.
        gradient_norm: max |gradient| there.
        iterations: accepted steps.
        evaluations: objective evaluations.
        converged: stopped by the gradient or the relative-decrease test (not by the
            iteration limit or a failed line search).
        message: why it stopped.
    """

    x: np.ndarray
    value: float
    gradient_norm: float
    iterations: int
    evaluations: int
    converged: bool
    message: str


def minimize_lbfgs(
    fun,
    x0,
    *,
    max_iterations: int = 500,
    memory: int = 10,
    gtol: float = 1e-9,
    ftol: float = 1e-13,
    max_backtracks: int = 50,
) -> LbfgsResult:
    """Minimize ``fun`` from ``x0``.

    Args:
        fun: x ↦ (value, gradient) with gradient of shape (m,), or None where x is infeasible.
        x0: a feasible starting point, shape (m,).
        max_iterations: the most accepted steps.
        memory: number of curvature pairs kept.
        gtol: stop when max |gradient| ≤ gtol·max(1, |value|).
        ftol: stop when a step lowers the value by less than ftol·max(1, |value|) three times in
            a row.
        max_backtracks: the most step halvings per line search.

    Returns:
        ``LbfgsResult`` at the best point seen.

    Raises:
        ValueError: ``x0`` is infeasible or gives a non-finite value.
    """
    x = np.array(x0, dtype=np.float64)
    out = fun(x)
    if out is None or not np.isfinite(out[0]) or not np.all(np.isfinite(out[1])):
        raise ValueError("x0 is invalid: the objective is infeasible or not finite there")
    f, g = float(out[0]), np.asarray(out[1], dtype=np.float64)
    evaluations = 1
    pairs: deque = deque(maxlen=memory)
    iterations = small = 0
    message = "iteration limit"
    converged = False
    while iterations < max_iterations:
        gnorm = float(np.max(np.abs(g))) if g.size else 0.0
        if gnorm <= gtol * max(1.0, abs(f)):
            message, converged = "gradient tolerance", True
            break
        d = -_two_loop(g, pairs)
        slope = float(g @ d)
        if not slope < 0:
            pairs.clear()
            d, slope = -g, -float(g @ g)
        step = 1.0 if pairs else min(1.0, 1.0 / max(gnorm, 1e-300))
        accepted = None
        for _ in range(max_backtracks):
            x_new = x + step * d
            out = fun(x_new)
            evaluations += 1
            if out is not None and np.isfinite(out[0]) and np.all(np.isfinite(out[1])):
                if out[0] <= f + 1e-4 * step * slope:
                    accepted = (x_new, float(out[0]), np.asarray(out[1], dtype=np.float64))
                    break
            step *= 0.5
        if accepted is None:
            if pairs:
                pairs.clear()  # retry once along the gradient
                continue
            message = "line search failed"
            converged = gnorm <= 1e3 * gtol * max(1.0, abs(f))
            break
        x_new, f_new, g_new = accepted
        s, y = x_new - x, g_new - g
        if float(s @ y) > 1e-12 * float(np.sqrt((s @ s) * (y @ y))):
            pairs.append((s, y))
        decrease = f - f_new
        x, f, g = x_new, f_new, g_new
        iterations += 1
        small = small + 1 if decrease <= ftol * max(1.0, abs(f)) else 0
        if small >= 3:
            message, converged = "relative decrease tolerance", True
            break
    return LbfgsResult(
        x=x,
        value=f,
        gradient_norm=float(np.max(np.abs(g))) if g.size else 0.0,
        iterations=iterations,
        evaluations=evaluations,
        converged=converged,
        message=message,
    )


def _two_loop(g: np.ndarray, pairs) -> np.ndarray:
    """H·g for the L-BFGS inverse-Hessian approximation H (Nocedal & Wright, Alg. 7.4)."""
    q = g.copy()
    alphas = []
    for s, y in reversed(pairs):
        rho = 1.0 / float(y @ s)
        a = rho * float(s @ q)
        q -= a * y
        alphas.append((rho, a))
    if pairs:
        s, y = pairs[-1]
        q *= float(s @ y) / float(y @ y)
    for (s, y), (rho, a) in zip(pairs, reversed(alphas), strict=True):
        b = rho * float(y @ q)
        q += (a - b) * s
    return q
