"""The dense-strategy problem written for a general convex solver (cvxpy): an independent
certificate of ``optimize_dense`` for small n.

    minimize  tr(A X⁻¹ Aᵀ) = matrix_frac(Aᵀ, X)        (MeanSE)
              or  max_i a_iᵀ X⁻¹ a_i = max_i matrix_frac(a_i, X)   (MaxSE)
    over      X ⪰ 0
    subject to
        single             diag(X) ≤ 1
        fixed_epochs(b,k)  Σ_{i,j∈s} |X_ij| ≤ 1 for every class s = {s, s+b, …} (the class-sum
                           bound of the sensitivity, exact when X ≥ 0 within the class)
        min_sep(b,k)       uᵀ X_π u ≤ 1 for every admissible π and u ∈ {±1}^π (exact)

matrix_frac(P, X) = tr(Pᵀ X⁻¹ P) is convex and cvxpy turns it into a semidefinite constraint
(a Schur complement), solved here by the interior-point solver Clarabel. The fixed_epochs
formulation is the class-sum form, not the orthogonal form ``optimize_dense`` solves; the two
have the same optimum (see ``dpmf.mechanisms.dense``), so agreement is a real check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.sensitivity import _admissible_sets, count_admissible_sets
from dpmf.workloads.workload import Workload

__all__ = ["CvxpyCertificate", "dense_cvxpy", "CVXPY_MAX_STEPS"]

CVXPY_MAX_STEPS = 64


def _import_cvxpy():
    """cvxpy, imported when first needed: dpmf itself works without it."""
    try:
        import cvxpy
    except ImportError as exc:
        raise ImportError(
            "dense_cvxpy needs cvxpy, an optional dependency of dpmf: pip install cvxpy "
            "(or pip install 'dpmf[test]')"
        ) from exc
    return cvxpy


@dataclass(frozen=True, eq=False)
class CvxpyCertificate:
    """The optimum of the convex program.

    Attributes:
        objective: ``mean_se`` or ``max_se``.
        value: the optimal error (unsquared): √(optimum/n) for MeanSE, √optimum for MaxSE.
        X: the optimal Gram matrix, shape (n, n).
        status: the solver's status string.
        solver: the solver used.
    """

    objective: str
    value: float
    X: np.ndarray
    status: str
    solver: str


def dense_cvxpy(
    workload: Workload,
    participation: Participation | None = None,
    *,
    objective: str = "mean_se",
    solver: str = "CLARABEL",
    max_sets: int = 200_000,
) -> CvxpyCertificate:
    """Solve the dense-strategy program with cvxpy (n ≤ ``CVXPY_MAX_STEPS``).

    Args:
        workload: the workload A, n ≤ 64.
        participation: single (default), fixed_epochs or min_sep.
        objective: ``mean_se`` or ``max_se``.
        solver: a cvxpy solver name that handles semidefinite programs.
        max_sets: the most (set, sign) constraints written for min_sep.

    Returns:
        ``CvxpyCertificate``.

    Raises:
        ValueError: n > 64, bad objective, too many min_sep constraints, or a solver failure.
        ImportError: cvxpy is not installed (it is an optional dependency, in the ``test`` extra).
    """
    cp = _import_cvxpy()

    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    participation = participation or Participation.single()
    objective = check_choice("objective", objective, ("mean_se", "max_se"))
    max_sets = check_int("max_sets", max_sets, minimum=1)
    n = workload.n
    if n > CVXPY_MAX_STEPS:
        raise ValueError(f"n={n} is invalid for the cvxpy certificate: must be <= {CVXPY_MAX_STEPS}")
    participation.check_steps(n)
    k = participation.participations(n)
    b = participation.min_sep
    kind = participation.kind if k > 1 else "single"

    A = workload.dense()
    X = cp.Variable((n, n), PSD=True)
    constraints = []
    if kind == "single":
        constraints.append(cp.diag(X) <= 1)
    elif kind == "fixed_epochs":
        for s in range(min(b, n)):
            idx = np.arange(s, n, b)
            constraints.append(cp.sum(cp.abs(X[np.ix_(idx, idx)])) <= 1)
    else:
        count = count_admissible_sets(n, b, k, signed=True)
        if count > max_sets:
            raise ValueError(f"max_sets={max_sets} is too small: min_sep needs {count:.0f} constraints")
        rows = []
        for sets in _admissible_sets(n, b, k):
            m = sets.shape[1]
            for u_tail in np.ndindex(*([2] * (m - 1))):
                u = np.array([1.0] + [1.0 - 2.0 * t for t in u_tail])
                for S in sets:
                    w = np.zeros(n)
                    w[S] = u
                    rows.append(w)
        Wc = np.array(rows)
        # uᵀX_πu = w Xwᵀ: the diagonal of Wc X Wcᵀ, written linearly in X
        constraints.append(cp.sum(cp.multiply(Wc @ X, Wc), axis=1) <= 1)
    if objective == "mean_se":
        prob = cp.Problem(cp.Minimize(cp.matrix_frac(A.T, X)), constraints)
    else:
        t = cp.Variable()
        cons = constraints + [cp.matrix_frac(A[i], X) <= t for i in range(n)]
        prob = cp.Problem(cp.Minimize(t), cons)
    prob.solve(solver=solver)
    if prob.status not in ("optimal", "optimal_inaccurate") or prob.value is None:
        raise ValueError(f"solver={solver!r} failed: status {prob.status}")
    opt = float(prob.value)
    value = math.sqrt(opt / n) if objective == "mean_se" else math.sqrt(opt)
    return CvxpyCertificate(objective, value, np.asarray(X.value), str(prob.status), solver)
