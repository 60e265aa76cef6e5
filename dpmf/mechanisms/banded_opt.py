"""Banded Toeplitz strategies with optimized coefficients.

========== ============================================ ===========================
name       optimized                                    started from
========== ============================================ ===========================
bisr_opt:p C⁻¹ = Toep(g), g_0 = 1, g_1..g_{p−1} free     BISR (``bisr:p``)
bsr_opt:p  C = Toep(c), c of p coefficients              BSR (``bsr:p``)
========== ============================================ ===========================

The objective is the error of the factorization under the participation pattern: MeanSE² =
sens(C)²·‖A·C⁻¹‖_F²/n (or, for Toeplitz workloads, MaxSE² = sens(C)²·‖h‖², h the last row of
B), minimized over the coefficients by L-BFGS (the error is scale invariant, so one
coefficient is fixed).

Sensitivity: computed exactly by the closed form sens² = ‖Σ_{i<k} shift_{ib}(c)‖², which holds
for min_sep when the coefficients c of C are non-negative and non-increasing (for fixed_epochs
when they are non-negative; always for single participation). The optimization is **constrained
to keep it valid**: for bsr_opt by construction (c_j = Σ_{l≥j} z_l², non-negative and
non-increasing for every z; c_j = z_j² for fixed_epochs), for bisr_opt by rejecting, in the line
search, every step whose C = Toep(g)⁻¹ leaves that region. The returned factorization is
evaluated by ``dpmf.mechanisms.evaluate``, whose sensitivity applies the same closed form after
checking the same condition, so the reported sensitivity is exact.

Never worse than the start: the optimizer keeps its best iterate, and the final factorization
is compared with the starting BISR/BSR under ``evaluate``; the start is returned (under the new
name) if the optimization did not improve it.

Sources: BSR — Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially
Private Model Training" (NeurIPS 2024); BISR — Kalinin, Lampert et al., "Back to Square Roots"
(2025); optimizing the coefficients of a banded strategy for the multi-participation error —
McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML"
(2024) and Choquette-Choo et al., "(Amplified) Banded Matrix Factorization" (NeurIPS 2023).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int
from dpmf.mechanisms._lbfgs import minimize_lbfgs
from dpmf.mechanisms.errors import evaluate
from dpmf.mechanisms.factorizations import Factorization, closed_form
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.mechanisms.toeplitz import inverse_coefficients, toeplitz_product
from dpmf.mechanisms.toeplitz_objective import (
    banded_reciprocal,
    banded_reciprocal_gradient,
    closed_form_valid,
    frobenius_sq,
    gram_diagonals,
    last_row_sq,
    sensitivity_sq,
)
from dpmf.workloads.workload import Workload

__all__ = ["BandedResult", "optimize_banded", "BANDED_OPTIMIZED"]

BANDED_OPTIMIZED = ("bisr_opt", "bsr_opt")
_STARTS = {"bisr_opt": ("bisr", "lr_bisr"), "bsr_opt": ("bsr", "lr_bsr")}


@dataclass(frozen=True, eq=False)
class BandedResult:
    """An optimized banded factorization and its report.

    Attributes:
        factorization: the ``Factorization`` (name ``bisr_opt`` or ``bsr_opt``, bands p).
        start: the factorization the optimization started from (``bisr:p`` / ``bsr:p``).
        objective: ``mean_se`` or ``max_se``.
        value: that error of ``factorization`` under the participation (from ``evaluate``).
        start_value: the same error of ``start``.
        sensitivity_exact: whether ``evaluate`` found the sensitivity exactly (True whenever
            the closed form's condition holds, which the optimization maintains).
        sensitivity_method: the method ``evaluate`` used.
        iterations: L-BFGS iterations.
        evaluations: objective evaluations.
        converged: the optimizer met its tolerance.
        improved: value < start_value (else ``factorization`` holds the start's coefficients).
        gradient_norm: max |gradient| of the log-objective at the end.
        seconds: wall-clock time.
    """

    factorization: Factorization
    start: Factorization
    objective: str
    value: float
    start_value: float
    sensitivity_exact: bool
    sensitivity_method: str
    iterations: int
    evaluations: int
    converged: bool
    improved: bool
    gradient_norm: float
    seconds: float


def optimize_banded(
    workload: Workload,
    name: str,
    bands: int,
    participation: Participation | None = None,
    *,
    objective: str = "mean_se",
    start: str | None = None,
    max_iterations: int = 500,
    cascade: bool = True,
) -> BandedResult:
    """Optimize the p coefficients of a banded Toeplitz strategy.

    Args:
        workload: the workload A (Toeplitz, or Toeplitz with a column scale such as A_χ).
        name: ``bisr_opt`` (banded C⁻¹) or ``bsr_opt`` (banded C).
        bands: p ≥ 1, the number of coefficients (p ≥ n keeps every diagonal).
        participation: single (default), min_sep(b, k) or fixed_epochs(b, k).
        objective: ``mean_se`` (default) or ``max_se`` (Toeplitz workloads only).
        start: the starting strategy: ``bisr``/``lr_bisr`` for bisr_opt, ``bsr``/``lr_bsr``
            for bsr_opt; default ``bisr`` / ``bsr``.
        max_iterations: the most L-BFGS iterations per run.
        cascade: also start from the optimum for ⌈p/2⌉ coefficients padded with zeros
            (recursively), so that more coefficients never do worse than fewer; False runs
            from the start only (faster).

    Returns:
        ``BandedResult``.

    Raises:
        TypeError: ``workload`` or ``participation`` of the wrong type.
        ValueError: unknown name/objective/start, bands < 1, max_se for a non-Toeplitz
            workload, n incompatible with the participation, or a start outside the region of
            the closed-form sensitivity.
    """
    t0 = time.perf_counter()
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    name = check_choice("name", name, BANDED_OPTIMIZED)
    p = check_int("bands", bands, minimum=1)
    participation = participation or Participation.single()
    if not isinstance(participation, Participation):
        raise TypeError(f"participation={participation!r} is invalid: must be a Participation")
    objective = check_choice("objective", objective, ("mean_se", "max_se"))
    start = check_choice("start", start or _STARTS[name][0], _STARTS[name])
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)
    n = workload.n
    participation.check_steps(n)
    if objective == "max_se" and not workload.is_toeplitz:
        last_row_sq(workload, np.ones(n))  # raises the ValueError naming the workload
    p = min(p, n)

    start_fact = closed_form(workload, start, p)
    start_eval = evaluate(start_fact, participation, with_lower_bound=False)
    start_value = getattr(start_eval, objective)

    base = start_fact.C_inverse if name == "bisr_opt" else start_fact.C
    base_coeffs = base.toeplitz_coeffs[:p] / base.toeplitz_coeffs[0]
    check = inverse_coefficients(_pad(base_coeffs, n)) if name == "bisr_opt" else _pad(base_coeffs, n)
    if not closed_form_valid(check, participation):
        raise ValueError(
            f"start={start!r} is invalid for {name}:{p} under {participation.label}: its C has "
            "coefficients outside the closed-form region (non-negative, non-increasing)"
        )
    stats = {"iterations": 0, "evaluations": 0}
    coeffs, converged, gnorm = _optimize_cascade(
        workload, participation, objective, name, base_coeffs, max_iterations, stats, cascade
    )
    if name == "bisr_opt" and participation.participations(n) > 1 and p > 1 and max_iterations > 0:
        # the optimum may lie on the edge of the closed-form region, where L-BFGS stalls:
        # continue with the edge as explicit constraints and judge convergence by KKT
        coeffs, converged, gnorm = _polish_on_region(workload, participation, objective, coeffs, stats)
    iterations, evaluations = stats["iterations"], stats["evaluations"]

    fact = _factorization(name, p, workload, coeffs)
    ev = evaluate(fact, participation, with_lower_bound=False)
    value = getattr(ev, objective)
    improved = value < start_value
    if not improved:
        fact = _factorization(name, p, workload, base_coeffs)
        ev = evaluate(fact, participation, with_lower_bound=False)
        value = getattr(ev, objective)
    return BandedResult(
        factorization=fact,
        start=start_fact,
        objective=objective,
        value=value,
        start_value=start_value,
        sensitivity_exact=ev.sensitivity_exact,
        sensitivity_method=ev.sensitivity_method,
        iterations=iterations,
        evaluations=evaluations,
        converged=converged,
        improved=bool(improved),
        gradient_norm=gnorm,
        seconds=time.perf_counter() - t0,
    )


_KKT_TOL = 1e-5  # projected-gradient tolerance (max-abs, relative to max(1, |f|))
_EDGE = 1e-13  # margins the constrained solve keeps (the region test allows −1e-12)
# the constrained solve takes the n margins as dense constraints: up to this n (beyond, the
# L-BFGS result is kept and only its KKT residual decides ``converged``)
_POLISH_MAX_STEPS = 4096


def _region_margins(c: np.ndarray, participation: Participation) -> tuple[np.ndarray, np.ndarray]:
    """(margins, D): the constraints of the closed-form region as margins m = D·c ≥ 0 —
    c_t − c_{t+1} and c_{n−1} for min_sep (non-increasing, non-negative), c_t for fixed_epochs."""
    n = c.shape[0]
    if participation.kind == "fixed_epochs":
        return c.copy(), np.eye(n)
    D = np.eye(n) - np.eye(n, k=1)
    return D @ c, D


def _polish_on_region(workload, participation, objective, g_start, stats):
    """Minimize the bisr_opt objective with the region's constraints explicit (SLSQP on the
    n margins, Jacobian by dc = −(c∗c)∗dg; n ≤ ``_POLISH_MAX_STEPS``), from the L-BFGS
    result; returns (coefficients,
    converged, projected-gradient norm) of the better of the two. ``converged`` means a KKT
    point: the gradient minus its best non-negative combination of the active constraints'
    gradients (NNLS) is below ``_KKT_TOL``·max(1, |f|) in max-abs."""
    from scipy.optimize import minimize, nnls

    n, p = workload.n, g_start.shape[0]
    error = _error_function(workload, objective, p)

    def parts(x):
        gp = np.concatenate([[1.0], x])
        c = _banded_inverse(gp, n)
        if not np.all(np.isfinite(c)):
            return None
        s2, gs_c = sensitivity_sq(c, participation)
        g = np.zeros(n)
        g[:p] = gp
        e2, ge = error(g)
        if not (np.isfinite(s2) and np.isfinite(e2)) or s2 <= 0 or e2 <= 0:
            return None
        grad = banded_reciprocal_gradient(gs_c, gp, p) / s2 + ge[:p] / e2
        return float(np.log(s2) + np.log(e2)), grad[1:], c

    def jac_c(c):
        cc = toeplitz_product(c, c, n)
        J = np.zeros((n, p - 1))
        for j in range(1, p):
            J[j:, j - 1] = -cc[: n - j]
        return J

    def fun(x):
        with np.errstate(over="ignore", invalid="ignore"):
            out = parts(x)
        stats["evaluations"] += 1
        if out is None:
            return 1e300, np.zeros(p - 1)
        return out[0], out[1]

    def cons(x):
        c = banded_reciprocal(np.concatenate([[1.0], x]), n)
        return _region_margins(c, participation)[0] - _EDGE

    def cons_jac(x):
        c = banded_reciprocal(np.concatenate([[1.0], x]), n)
        return _region_margins(c, participation)[1] @ jac_c(c)

    def kkt(x):
        f, grad, c = parts(x)
        m, D = _region_margins(c, participation)
        active = np.flatnonzero(m <= 1e-9 * max(1.0, float(np.max(np.abs(c)))))
        if active.size == 0:
            r = grad
        else:
            A = (D @ jac_c(c))[active]  # ∇ of the active margins, shape (a, p−1)
            lam, _ = nnls(A.T, grad)  # ∇f ≈ Σ λ_a ∇m_a, λ ≥ 0 (m ≥ 0 constraints)
            r = grad - A.T @ lam
        return f, float(np.max(np.abs(r))) if r.size else 0.0

    x0 = g_start[1:].copy()
    best = x0
    if n <= _POLISH_MAX_STEPS:
        res = minimize(
            fun,
            x0,
            jac=True,
            method="SLSQP",
            constraints=[{"type": "ineq", "fun": cons, "jac": cons_jac}],
            options={"maxiter": 300, "ftol": 1e-14},
        )
        stats["iterations"] += int(res.nit)
        cand = np.asarray(res.x, dtype=np.float64)
        c_new = _banded_inverse(np.concatenate([[1.0], cand]), n)
        if np.all(np.isfinite(c_new)) and closed_form_valid(c_new, participation):
            f_new = parts(cand)
            if f_new is not None and f_new[0] < parts(x0)[0]:
                best = cand
    f, pg = kkt(best)
    return np.concatenate([[1.0], best]), bool(pg <= _KKT_TOL * max(1.0, abs(f))), pg


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[: x.shape[0]] = x
    return out


def _optimize_cascade(workload, participation, objective, name, start, max_iterations, stats, cascade=True):
    """Best of two runs: from ``start`` (p coefficients) and from the optimum for ⌈p/2⌉
    coefficients padded with zeros (recursively), so that p coefficients never do worse than
    fewer. Returns (coefficients, converged, gradient norm) of the run with the lowest objective."""
    p = start.shape[0]
    runs = [start]
    if cascade and p > 1 and max_iterations > 0:
        half = (p + 1) // 2
        src = start[:half]
        sub, _, _ = _optimize_cascade(workload, participation, objective, name, src, max_iterations, stats)
        runs.append(np.concatenate([sub, np.zeros(p - half)]))
    best = None
    for init in runs:
        build = _bisr_problem if name == "bisr_opt" else _bsr_problem
        fun, x0, to_coeffs = build(workload, participation, objective, init)
        if fun(x0) is None:
            continue
        if max_iterations > 0:
            res = minimize_lbfgs(fun, x0, max_iterations=max_iterations)
            stats["iterations"] += res.iterations
            stats["evaluations"] += res.evaluations
            cand = (res.value, to_coeffs(res.x), res.converged, res.gradient_norm)
        else:
            cand = (fun(x0)[0], to_coeffs(x0), False, float("nan"))
        if best is None or cand[0] < best[0]:
            best = cand
    return best[1], best[2], best[3]


def _factorization(name: str, p: int, workload: Workload, coeffs: np.ndarray) -> Factorization:
    n = workload.n
    full = np.zeros(n)
    full[:p] = coeffs
    M = ScaledToeplitz(full)
    if name == "bisr_opt":
        return Factorization(name, p, workload, M.inverse(), M)
    return Factorization(name, p, workload, M, M.inverse())


def _banded_inverse(b: np.ndarray, n: int) -> np.ndarray:
    """The n coefficients of 1/b(x) for the p coefficients b of a banded Toeplitz matrix, by
    its O(n·p) recurrence (``banded_reciprocal``); NaN for a non-finite b or b_0 = 0 (trial
    points of the line search), non-finite entries where the recurrence overflows."""
    if not np.all(np.isfinite(b)) or b[0] == 0:
        return np.full(n, np.nan)
    return banded_reciprocal(b, n)


def _quiet(fun):
    """Run an objective with floating-point overflow silenced (trial points may overflow;
    they are answered as infeasible)."""

    def wrapped(x):
        with np.errstate(over="ignore", invalid="ignore"):
            out = fun(x)
        if out is None or not np.isfinite(out[0]) or not np.all(np.isfinite(out[1])):
            return None
        return out

    return wrapped


# the Gram diagonals of a non-Toeplitz workload are kept between evaluations up to this many
# floats (p(p+1)/2 for bandwidth p; 64 MB): bsr_opt's C⁻¹ is dense (p = n), so n ≤ 4096
_GRAM_CACHE_FLOATS = 1 << 23


def _error_function(workload, objective, bandwidth):
    """error(y) -> (error², gradient) of the objective, with what does not depend on y (the
    Gram diagonals of a non-Toeplitz workload) computed once."""
    n = workload.n
    if objective != "mean_se":
        return lambda y: last_row_sq(workload, y, bandwidth)
    p = n if bandwidth is None else min(bandwidth, n)
    diagonals = None
    if not workload.is_toeplitz and p * (p + 1) // 2 <= _GRAM_CACHE_FLOATS:
        diagonals = gram_diagonals(workload, p)

    def error(y):
        e, ge = frobenius_sq(workload, y, bandwidth, diagonals=diagonals)
        return e / n, ge / n

    return error


def _bisr_problem(workload, participation, objective, g_start):
    """Variables x = g_1..g_{p−1} (g_0 = 1); f = log(sens² · error²)."""
    n, p = workload.n, g_start.shape[0]

    def coeffs(x):
        return np.concatenate([[1.0], x])

    error = _error_function(workload, objective, p)

    @_quiet
    def fun(x):
        gp = coeffs(x)
        g = np.zeros(n)
        g[:p] = gp
        c = _banded_inverse(gp, n)
        if not np.all(np.isfinite(c)) or not closed_form_valid(c, participation):
            return None
        s2, gs_c = sensitivity_sq(c, participation)
        e2, ge = error(g)
        if not (np.isfinite(s2) and np.isfinite(e2)) or s2 <= 0 or e2 <= 0:
            return None
        gs = banded_reciprocal_gradient(gs_c, gp, p)
        grad = gs / s2 + ge[:p] / e2
        return float(np.log(s2) + np.log(e2)), grad[1:]

    return fun, g_start[1:].copy(), coeffs


def _bsr_problem(workload, participation, objective, c_start):
    """Variables z with c = T(z) non-negative and non-increasing (min_sep), non-negative
    (fixed_epochs) or free (single, with c_0 = 1); f = log(sens² · error²)."""
    n, p = workload.n, c_start.shape[0]
    kind = "single" if participation.participations(n) == 1 else participation.kind

    if kind == "min_sep":
        # c_j = Σ_{l ≥ j} z_l², so z_l = √(c_l − c_{l+1})
        diffs = c_start - np.concatenate([c_start[1:], [0.0]])
        x0 = np.sqrt(np.maximum(diffs, 0.0))

        def coeffs(z):
            return np.cumsum((z * z)[::-1])[::-1]

        def chain(z, gc):
            return 2.0 * z * np.cumsum(gc)

    elif kind == "fixed_epochs":
        x0 = np.sqrt(np.maximum(c_start, 0.0))

        def coeffs(z):
            return z * z

        def chain(z, gc):
            return 2.0 * z * gc

    else:
        x0 = c_start[1:].copy()

        def coeffs(z):
            return np.concatenate([[1.0], z])

        def chain(z, gc):
            return gc[1:]

    error = _error_function(workload, objective, None)

    @_quiet
    def fun(z):
        cp = coeffs(z)
        if cp[0] <= 0:
            return None
        c = np.zeros(n)
        c[:p] = cp
        s2, gs = sensitivity_sq(c, participation, p)
        y = _banded_inverse(cp, n)
        if not np.all(np.isfinite(y)):
            return None
        e2, ge_y = error(y)
        if not np.isfinite(e2) or s2 <= 0 or e2 <= 0:
            return None
        ge_c = banded_reciprocal_gradient(ge_y, cp, p)
        gc = gs[:p] / s2 + ge_c / e2
        return float(np.log(s2) + np.log(e2)), chain(z, gc)

    return fun, x0, coeffs
