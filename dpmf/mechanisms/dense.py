"""Optimized dense strategies: the Gram matrix X = CᵀC that minimizes the error of a workload.

For a workload A (n×n, lower-triangular, invertible) the strategy C enters the error only through
X = CᵀC: with B = A·C⁻¹, ‖B‖_F² = tr(A X⁻¹ Aᵀ), the squared row norms of B are the diagonal of
A X⁻¹ Aᵀ, and the sensitivity is a function of X. The optimal dense strategy solves the convex
program

    minimize  tr(W X⁻¹)                 (W = AᵀA; MeanSE² = tr(W X⁻¹)/n at sens = 1)
    over      X ≻ 0
    subject to the participation's sensitivity constraints, sens(X)² ≤ 1:

=================  =====================================================================
participation      constraints on X
=================  =====================================================================
single             X_ii ≤ 1 (the squared column norms of C)
fixed_epochs(b,k)  Σ_{i∈s} X_ii ≤ 1 and X_ij = 0 (i ≠ j) within each class s = {s, s+b, …}
min_sep(b,k)       uᵀ X_π u ≤ 1 for every admissible set π (|π| ≤ k, gaps ≥ b), u ∈ {±1}^π,
                   then normalized by the vector sensitivity (below)
=================  =====================================================================

The fixed_epochs constraints are those of Choquette-Choo et al., "Multi-Epoch Matrix
Factorization Mechanisms for Private Machine Learning" (ICML 2023, Sec. 4): columns of C that
one example touches are orthogonal, so sens² is the class sum of the diagonal, exactly. Their
optimum equals that of the class-sum constraint Σ_{i,j∈s} |X_ij| ≤ 1 (the bound of
``dpmf.mechanisms.sensitivity``): the dual of both is max over Λ ≻ 0 supported on the class
blocks; the class-sum dual asks |Λ_ij| ≤ t_s, Λ_ii ≤ t_s, the orthogonal one Λ_ii = v_s, and a
positive definite Λ with equal diagonal within a block already has |Λ_ij| ≤ v_s, while raising
a diagonal entry to t_s only increases the dual objective. The min_sep constraints are the
b-min-sep sensitivity for scalar gradients (Choquette-Choo et al., eq. 3 and Theorem 2.1; sign
vectors u), enforced by cutting planes found by exhaustive search (small n only). For vector
gradients the sensitivity is the larger max over correlation matrices Y of ⟨X_π, Y⟩ (see
``dpmf.mechanisms.sensitivity``), so the sign planes are a relaxation: the dual value stays a
lower bound on the error of every strategy feasible for vector gradients, and the returned
strategy is normalized by ``sensitivity`` (exact, or a certified upper bound), so it is feasible
for vector gradients and ``gap`` measures exactly what the relaxation lost (nothing when the
optimum of the sign planes needs no more than signs).

Solver (Denisov, McMahan, Rush, Smith, Thakurta, "Improved Differential Privacy for SGD via
Optimal Private Linear Operators on Adaptive Streams", NeurIPS 2022, Sec. 4; the multi-epoch
paper's Sec. 4 for structured constraints): Lagrange duality. With multipliers y for the
constraints ⟨S_c, X⟩ ≤ r_c and Λ = Σ_c y_c S_c ≻ 0, the minimum of tr(W X⁻¹) + ⟨Λ, X⟩ is at the
solution of X Λ X = W,

    X(Λ) = L⁻ᵀ (LᵀWL)^{1/2} L⁻¹   (Λ = LLᵀ),   dual g(y) = 2 tr((LᵀWL)^{1/2}) − rᵀy,

a concave function whose gradient is the constraint residual ⟨S_c, X(Λ)⟩ − r_c. It is
maximized by Newton's method with conjugate gradients: with LᵀWL = Q diag(μ²) Qᵀ and
E = L⁻ᵀQ, differentiating XΛX = W gives dX = −E [G ∘ (Eᵀ dΛ E)] Eᵀ, G_ab = μ_aμ_b/(μ_a+μ_b),
so a Hessian-vector product costs four n×n matrix products. Each Newton step costs one
symmetric eigendecomposition (an SVD of A·L near convergence, for accuracy). Two safeguards keep
the ascent going when the min_sep cutting planes outnumber the directions Λ can move in (tiny n)
or the multipliers span many orders (steep learning-rate decays): a step whose line search fails
and that is far larger than the multipliers is recomputed with Levenberg–Marquardt damping (the
Hessian is singular there), and a multiplier shrinks by at most a factor 100 per step instead of
being projected to 0 (several zeroed at once leave Λ singular, where X(Λ) and the gradient blow
up). The Newton steps are truncated (at most 20 conjugate-gradient steps). The duality gap
certifies the result: the dual value is a lower bound on the optimal error, the returned
factorization (normalized to be exactly feasible) an upper bound.

MaxSE (max_i (A X⁻¹ Aᵀ)_ii) is minimized through the saddle point
min_X max_{p∈Δ} tr(Aᵀ diag(p) A X⁻¹) = max_{p∈Δ} OPT(Aᵀ diag(p) A): the inner problem is the
MeanSE problem with weighted rows (solved inexactly, warm-started, a few Newton steps per
update), and the weights follow the multiplicative update p ← p∘(e/⟨p, e⟩)^γ, γ = 4 (e the
squared row errors, the gradient of the concave outer function). The dual value of the inner
problem is a lower bound on MaxSE², max_i e_i of the normalized X an upper bound; convergence is
sublinear (default tolerance 1e-4). MaxSE is offered for single and fixed_epochs participation;
with the min_sep cutting planes the two loops did not converge reliably, so that combination is
refused.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.linalg import LinAlgError, cholesky, eigh, solve_triangular, svd
from scipy.sparse.linalg import LinearOperator, cg

from dpmf._memory import check_memory
from dpmf._validation import check_choice, check_int, check_real
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.sensitivity import _admissible_sets, count_admissible_sets, sensitivity
from dpmf.mechanisms.structured import DenseLowerTriangular
from dpmf.workloads.workload import Workload

__all__ = [
    "DenseResult",
    "optimize_dense",
    "dense_factorization",
    "reverse_cholesky",
    "DENSE_MAX_STEPS",
]

OBJECTIVES = ("mean_se", "max_se")
DENSE_MAX_STEPS = 8192
_MIN_SEP_SET_LIMIT = 2_000_000


@dataclass(frozen=True, eq=False)
class DenseResult:
    """An optimized dense factorization and the solver's convergence report.

    Attributes:
        factorization: the ``Factorization`` (name ``dense``; C and C⁻¹ dense lower-triangular,
            B = A·C⁻¹ stored explicitly), normalized so that sens(C) = 1 (≤ 1 when only a bound is
            known: the reported sensitivity is then that bound, 1).
        objective: ``mean_se`` or ``max_se``, the error that was minimized.
        value: that error of ``factorization`` (unsquared, sens included).
        lower_bound: a certified lower bound on that error for every dense strategy under the
            same constraints (the dual value); ``value/lower_bound − 1`` is the relative gap.
        gap: value/lower_bound − 1.
        converged: gap ≤ the requested tolerance.
        iterations: Newton iterations (summed over outer loops).
        cg_iterations: Hessian-vector products (conjugate-gradient steps).
        outer_iterations: cutting-plane rounds (min_sep) or weight updates (max_se); 1 otherwise.
        gradient_norm: max |constraint residual| of the last dual iterate (the dual gradient,
            zero at the optimum), before the final normalization.
        constraint: the constraint set solved (see the module table).
        seconds: wall-clock time.
        dual: the dual variables, reusable as ``warm_start`` (same n and constraints).
        weights: the row weights p of the MaxSE saddle point (None for MeanSE).
    """

    factorization: Factorization
    objective: str
    value: float
    lower_bound: float
    gap: float
    converged: bool
    iterations: int
    cg_iterations: int
    outer_iterations: int
    gradient_norm: float
    constraint: str
    seconds: float
    dual: np.ndarray
    weights: np.ndarray | None = None


def reverse_cholesky(X) -> np.ndarray:
    """The lower-triangular C with CᵀC = X and a positive diagonal ("reverse" Cholesky).

    With J the exchange matrix, JXJ = LLᵀ (ordinary Cholesky) gives X = (JLJ)(JLJ)ᵀ with JLJ
    upper-triangular, so C = (JLJ)ᵀ. Shape (n, n), O(n³).

    Raises:
        ValueError: X not square, not symmetric, or not positive definite.
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] != X.shape[1]:
        raise ValueError(f"X is invalid: must be square, got shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError("X is invalid: contains NaN or infinite entries")
    scale = float(np.max(np.abs(X))) if X.size else 0.0
    if np.max(np.abs(X - X.T)) > 1e-10 * max(scale, 1e-300):
        raise ValueError("X is invalid: must be symmetric")
    try:
        L = cholesky(X[::-1, ::-1], lower=True)
    except LinAlgError:
        raise ValueError("X is invalid: must be positive definite") from None
    return np.ascontiguousarray(L[::-1, ::-1].T)


# --------------------------------------------------------------------------------------------
# Constraint sets: each constraint c is ⟨S_c, X⟩ ≤ r_c (or = r_c) with S_c = Σ_l α_l w_l w_lᵀ, a
# combination of "atoms" w_l (sparse vectors). Λ(y) = Σ_l α_l y_{c(l)} w_l w_lᵀ.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Constraints:
    n: int
    atoms: sparse.csr_matrix | None  # (L, n); None means the identity (atom i = e_i)
    alpha: np.ndarray  # (L,)
    owner: np.ndarray  # (L,) constraint index of each atom
    rhs: np.ndarray  # (m,)
    inequality: np.ndarray  # (m,) bool; equalities have free multipliers
    diagonal: bool  # Λ(y) is diagonal (atoms are unit vectors)
    label: str

    @property
    def m(self) -> int:
        return int(self.rhs.shape[0])

    def lam(self, y: np.ndarray):
        """Λ(y): a vector (its diagonal) when ``diagonal``, else a dense n×n array."""
        beta = self.alpha * y[self.owner]
        if self.atoms is None:
            return beta.copy()
        if self.diagonal:
            col = self.atoms.indices
            return np.bincount(col, weights=beta * self.atoms.data**2, minlength=self.n)
        M = self.atoms.T @ sparse.diags(beta) @ self.atoms
        return M.toarray()

    def rows(self, E: np.ndarray) -> np.ndarray:
        """The rows r_l = w_lᵀE, shape (L, n)."""
        if self.atoms is None:
            return E
        return np.asarray(self.atoms @ E)

    def collect(self, atom_values: np.ndarray) -> np.ndarray:
        """Σ_{l∈c} α_l t_l for every constraint c."""
        return np.bincount(self.owner, weights=self.alpha * atom_values, minlength=self.m)


def _single_constraints(n: int) -> _Constraints:
    return _Constraints(
        n=n,
        atoms=None,
        alpha=np.ones(n),
        owner=np.arange(n),
        rhs=np.ones(n),
        inequality=np.ones(n, dtype=bool),
        diagonal=True,
        label="single: X_ii <= 1",
    )


def _fixed_epochs_constraints(n: int, b: int) -> _Constraints:
    """Class sums of the diagonal ≤ 1 and orthogonality within each class."""
    rows, cols, vals, alpha, owner = [], [], [], [], []
    atom = 0
    # one class-sum constraint per class s: atoms e_i, i in class, alpha = 1
    n_classes = min(b, n)
    for i in range(n):
        rows.append(atom)
        cols.append(i)
        vals.append(1.0)
        alpha.append(1.0)
        owner.append(i % b)
        atom += 1
    m = n_classes
    # one equality per pair (i, j) of the same class: X_ij = 0, S = e_ie_jᵀ + e_je_iᵀ
    # = ½(e_i+e_j)(e_i+e_j)ᵀ − ½(e_i−e_j)(e_i−e_j)ᵀ
    for s in range(n_classes):
        members = np.arange(s, n, b)
        for a in range(members.shape[0]):
            for c in range(a + 1, members.shape[0]):
                i, j = int(members[a]), int(members[c])
                for sign, coef in ((1.0, 0.5), (-1.0, -0.5)):
                    rows += [atom, atom]
                    cols += [i, j]
                    vals += [1.0, sign]
                    alpha.append(coef)
                    owner.append(m)
                    atom += 1
                m += 1
    atoms = sparse.csr_matrix((vals, (rows, cols)), shape=(atom, n))
    rhs = np.zeros(m)
    rhs[:n_classes] = 1.0
    inequality = np.zeros(m, dtype=bool)
    inequality[:n_classes] = True
    return _Constraints(
        n=n,
        atoms=atoms,
        alpha=np.asarray(alpha),
        owner=np.asarray(owner),
        rhs=rhs,
        inequality=inequality,
        diagonal=m == n_classes,
        label=f"fixed_epochs(b={b}): class sums of diag(X) <= 1, X_ij = 0 within a class",
    )


def _rank_one_constraints(n: int, sets: list[tuple[np.ndarray, np.ndarray]], label: str) -> _Constraints:
    """Constraints uᵀX_πu ≤ 1, one per (π, u)."""
    rows, cols, vals = [], [], []
    for c, (idx, u) in enumerate(sets):
        rows += [c] * len(idx)
        cols += list(map(int, idx))
        vals += list(map(float, u))
    m = len(sets)
    atoms = sparse.csr_matrix((vals, (rows, cols)), shape=(m, n))
    return _Constraints(
        n=n,
        atoms=atoms,
        alpha=np.ones(m),
        owner=np.arange(m),
        rhs=np.ones(m),
        inequality=np.ones(m, dtype=bool),
        diagonal=all(len(idx) == 1 for idx, _ in sets),
        label=label,
    )


# --------------------------------------------------------------------------------------------
# The dual function and its Newton-CG maximization
# --------------------------------------------------------------------------------------------


@dataclass
class _DualPoint:
    y: np.ndarray
    value: float  # g(y)
    grad: np.ndarray  # constraint residual ⟨S_c, X⟩ − r_c
    mu: np.ndarray  # (n,) square roots of the eigenvalues of LᵀWL
    E: np.ndarray  # (n, n) L⁻ᵀQ: X = E diag(μ) Eᵀ
    R: np.ndarray  # (L, n) atom rows w_lᵀE
    L: np.ndarray  # Λ = LLᵀ: the vector √Λ_ii when Λ is diagonal, else the Cholesky factor


def _evaluate_dual(F: np.ndarray, W: np.ndarray, cons: _Constraints, y: np.ndarray, precise: bool):
    """g(y) and its gradient, or None when Λ(y) is not positive definite.

    F is a matrix with FᵀF = W (the weighted workload); ``precise`` takes the eigenvalues from an
    SVD of F·L (relative accuracy in the small ones) instead of an eigendecomposition of LᵀWL.
    """
    lam = cons.lam(y)
    if cons.diagonal:
        if np.any(lam <= 0):
            return None
        s = np.sqrt(lam)
        if precise:
            _, sig, Qt = svd(F * s[None, :], full_matrices=False, lapack_driver="gesdd")
            mu, Q = sig, Qt.T
        else:
            ev, Q = eigh(s[:, None] * W * s[None, :])
            mu = np.sqrt(np.maximum(ev, ev[-1] * 1e-300))
        E = Q / s[:, None]
        L = s
    else:
        try:
            L = cholesky(lam, lower=True)
        except LinAlgError:
            return None
        if precise:
            _, sig, Qt = svd(F @ L, full_matrices=False, lapack_driver="gesdd")
            mu, Q = sig, Qt.T
        else:
            ev, Q = eigh(L.T @ W @ L)
            mu = np.sqrt(np.maximum(ev, ev[-1] * 1e-300))
        E = solve_triangular(L, Q, lower=True, trans="T")
    if not np.all(np.isfinite(mu)) or mu.min() <= 0:
        return None
    R = cons.rows(E)
    atom_values = (R * R) @ mu
    grad = cons.collect(atom_values) - cons.rhs
    value = 2.0 * float(np.sum(mu)) - float(cons.rhs @ y)
    return _DualPoint(y=y, value=value, grad=grad, mu=mu, E=E, R=R, L=L)


def _free_mask(cons: _Constraints, pt: _DualPoint, eps: float) -> np.ndarray:
    """Variables the Newton step may move: equalities, and inequalities that are not within
    ``eps`` of their bound with a gradient pushing them down (Bertsekas' ε-active set)."""
    at_bound = cons.inequality & (pt.y <= eps) & (pt.grad < 0.0)
    return ~at_bound


def _residual(cons: _Constraints, pt: _DualPoint) -> float:
    """KKT residual of the dual: |grad| for free variables, max(grad, 0) at the bound (a
    multiplier below 1e-12 of the largest counts as at the bound: they approach it
    geometrically, see ``_BOUNDARY_FRACTION``)."""
    r = np.abs(pt.grad)
    top = float(np.max(pt.y[cons.inequality])) if np.any(cons.inequality) else 0.0
    at_bound = cons.inequality & (pt.y <= _AT_BOUND * top)
    r[at_bound] = np.maximum(pt.grad[at_bound], 0.0)
    return float(np.max(r)) if r.size else 0.0


def _newton_direction(
    cons: _Constraints, pt: _DualPoint, free: np.ndarray, rtol: float, maxiter: int, damping: float = 0.0
):
    """Solve (−∇²g + ν·D) d = ∇g on the free variables by preconditioned conjugate gradients,
    D the Jacobi diagonal of −∇²g and ν = ``damping`` (Levenberg–Marquardt; ν = 0 is Newton).

    With more cutting planes than directions in which Λ can move (min_sep: the planes of the
    sets sharing a support), −∇²g is singular, the undamped system has no bounded solution, and
    conjugate gradients return a step of 1e30 that no line search can shorten; the damped
    system is positive definite."""
    mu, R = pt.mu, pt.R
    G = np.outer(mu, mu) / (mu[:, None] + mu[None, :])
    R2 = R * R
    atom_diag = np.sum((R2 @ G) * R2, axis=1)
    precond = cons.collect(cons.alpha * atom_diag)
    precond = np.maximum(precond, 1e-300)
    idx = np.flatnonzero(free)
    count = [0]

    # with many sparse atoms (cutting planes), go through the n×n matrices: Rᵀdiag(β)R =
    # Eᵀ Λ_β E with Λ_β = Σ β_l w_l w_lᵀ, and r_lᵀ Z r_l = w_lᵀ (E Z Eᵀ) w_l: O(n³ + L·k·n) per
    # product instead of O(L·n²)
    through_n = cons.atoms is not None and cons.atoms.shape[0] > R.shape[1]
    E, W_atoms = pt.E, cons.atoms

    def hess(u_free):
        count[0] += 1
        u = np.zeros(cons.m)
        u[idx] = u_free
        beta = cons.alpha * u[cons.owner]
        if through_n:
            lam_beta = (W_atoms.T @ sparse.diags(beta) @ W_atoms).toarray()
            Z = G * (E.T @ lam_beta @ E)
            M = E @ Z @ E.T
            t = np.asarray(W_atoms.multiply(W_atoms @ M).sum(axis=1)).ravel()
        else:
            Y = R.T @ (beta[:, None] * R)
            Z = G * Y
            t = np.sum((R @ Z) * R, axis=1)
        return cons.collect(t)[idx] + damping * precond[idx] * u_free

    k = idx.shape[0]
    op = LinearOperator((k, k), matvec=hess, dtype=np.float64)
    pre = LinearOperator((k, k), matvec=lambda r: r / precond[idx], dtype=np.float64)
    # variables held at their bound go to it; Newton (or a scaled gradient) for the others
    d = pt.grad / precond
    held = ~free
    d[held] = -pt.y[held]
    if k:
        d_free, _ = cg(op, pt.grad[idx], rtol=rtol, maxiter=maxiter, M=pre)
        if np.all(np.isfinite(d_free)) and float(d_free @ pt.grad[idx]) > 0:
            d[idx] = d_free
    return d, count[0]


_WILD_STEP = 10.0  # a direction larger than this times max|y| is damped when its line search fails
_MIN_DAMPING, _MAX_DAMPING = 1e-6, 1e8
_BOUNDARY_FRACTION = 0.01
_CG_MAXITER = 20  # truncated Newton: conjugate-gradient steps per Newton step
# min_sep cutting planes: planes added per round (× n), the residual of intermediate solves
# (at most _CUT_ROUND_TOL, else this ratio times the largest violation), and the multiplier
# (relative to the largest) below which a plane that is not nearly tight is dropped
_CUTS_PER_ROUND = 4
_NEARLY_TIGHT = 0.99
_CUT_ROUND_TOL = 1e-3
_CUT_TOL_RATIO = 0.1
_KEEP = 1e-9
_AT_BOUND = 1e-12


@dataclass
class _DualRun:
    point: _DualPoint
    iterations: int
    cg_iterations: int
    residual: float


def _maximize_dual(
    F: np.ndarray,
    W: np.ndarray,
    cons: _Constraints,
    y0: np.ndarray,
    *,
    tol: float,
    max_iterations: int,
    callback=None,
) -> _DualRun:
    """Projected Newton-CG ascent on the dual; keeps the best iterate."""
    y = np.array(y0, dtype=np.float64)
    y[cons.inequality] = np.maximum(y[cons.inequality], 0.0)
    precise = False
    pt = _evaluate_dual(F, W, cons, y, precise)
    if pt is None:
        raise ValueError(
            "warm_start is invalid: its multipliers do not give a positive definite Λ "
            "(they must be positive on the inequality constraints)"
        )
    # Best scaling t·y (g is maximized in closed form along the ray).
    ry = float(cons.rhs @ y)
    if ry > 0:
        t = (float(np.sum(pt.mu)) / ry) ** 2
        scaled = _evaluate_dual(F, W, cons, y * t, precise)
        if scaled is not None and scaled.value > pt.value:
            pt = scaled
    iterations = cg_total = stalls = 0
    damping = 0.0
    res = _residual(cons, pt)
    while iterations < max_iterations and res > tol and stalls < 2:
        eps = min(1e-3 * float(np.max(pt.y[cons.inequality])), res) if np.any(cons.inequality) else 0.0
        free = _free_mask(cons, pt, eps)
        rtol = min(0.1, np.sqrt(res))
        d, n_cg = _newton_direction(cons, pt, free, rtol=rtol, maxiter=_CG_MAXITER, damping=damping)
        cg_total += n_cg
        iterations += 1
        slope = float(pt.grad @ d)
        if slope <= 1e-14 * abs(pt.value):
            break  # the predicted increase is below the round-off of g: numerically optimal
        # multipliers shrink at most to a fraction of their value per step (fraction to the
        # boundary): projecting several to 0 at once can leave Λ singular along the columns
        # they alone covered, where X(Λ) and the gradient blow up and the ascent stalls
        floor = _BOUNDARY_FRACTION * pt.y[cons.inequality]
        step, accepted = 1.0, None
        for _ in range(12):
            y_new = pt.y + step * d
            y_new[cons.inequality] = np.maximum(y_new[cons.inequality], floor)
            cand = _evaluate_dual(F, W, cons, y_new, precise)
            if cand is not None and cand.value >= pt.value + 1e-4 * step * max(slope, 0.0):
                if cand.value > pt.value or _residual(cons, cand) < res:
                    accepted = cand
                    break
            step *= 0.5
        if accepted is None:
            # a step far beyond the multipliers' scale comes from a (nearly) singular Hessian:
            # damp it; otherwise it is the round-off of the eigendecomposition: use SVDs
            y_scale = max(float(np.max(np.abs(pt.y))), 1e-300)
            if float(np.max(np.abs(d))) > _WILD_STEP * y_scale and damping < _MAX_DAMPING:
                damping = max(_MIN_DAMPING, 100.0 * damping)
                continue
            if precise:
                break
            precise = True
            pt = _evaluate_dual(F, W, cons, pt.y, precise) or pt
            res = _residual(cons, pt)
            continue
        if damping and step == 1.0:
            damping = 0.0 if damping <= _MIN_DAMPING else damping / 10.0
        stalls = stalls + 1 if accepted.value - pt.value <= 1e-14 * abs(pt.value) else 0
        pt = accepted
        res = _residual(cons, pt)
        if callback is not None:
            callback(iterations, pt.value, res)
    return _DualRun(point=pt, iterations=iterations, cg_iterations=cg_total, residual=res)


def _initial_multipliers(cons: _Constraints, W: np.ndarray) -> np.ndarray:
    """Multipliers whose Λ is diag(W) restricted to the constraint structure."""
    y = np.zeros(cons.m)
    diag = np.diag(W)
    if cons.atoms is None:
        return diag.copy()
    # inequality constraints made of unit atoms get the mean of diag(W) over their support
    sums = np.zeros(cons.m)
    counts = np.zeros(cons.m)
    A = cons.atoms.tocoo()
    single = np.bincount(A.row, minlength=A.shape[0]) == 1
    for l_idx in np.flatnonzero(single):
        c = cons.owner[l_idx]
        if cons.inequality[c]:
            j = cons.atoms.indices[cons.atoms.indptr[l_idx]]
            sums[c] += diag[j]
            counts[c] += 1
    ok = counts > 0
    y[ok] = sums[ok] / counts[ok]
    return y


# --------------------------------------------------------------------------------------------
# min_sep: cutting planes with an exhaustive separation oracle
# --------------------------------------------------------------------------------------------


def _most_violated(X: np.ndarray, b: int, k: int, threshold: float, limit: int):
    """All (π, u) with uᵀX_πu > threshold, the largest first (at most ``limit``), and the
    maximum over every admissible (π, u) (the squared sensitivity)."""
    n = X.shape[0]
    found = []
    best = 0.0
    for sets in _admissible_sets(n, b, k):
        m = sets.shape[1]
        signs = np.ones((1, m))
        if m > 1:
            grid = np.array(np.meshgrid(*([[1.0, -1.0]] * (m - 1)), indexing="ij")).reshape(m - 1, -1).T
            signs = np.hstack([np.ones((grid.shape[0], 1)), grid])
        chunk = max(1, 2_000_000 // (m * m * signs.shape[0]))
        for start in range(0, sets.shape[0], chunk):
            S = sets[start : start + chunk]
            Q = X[S[:, :, None], S[:, None, :]]
            vals = np.einsum("ui,nij,uj->nu", signs, Q, signs, optimize=True)
            best = max(best, float(vals.max()))
            flat = np.flatnonzero(vals > threshold)
            if flat.shape[0] > limit:
                flat = flat[np.argpartition(-vals.ravel()[flat], limit)[:limit]]
            for si, ui in zip(*np.unravel_index(flat, vals.shape), strict=True):
                found.append((float(vals[si, ui]), S[si].copy(), signs[ui].copy()))
    found.sort(key=lambda t: -t[0])
    return found[:limit], best


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def optimize_dense(
    workload: Workload,
    participation: Participation | None = None,
    *,
    objective: str = "mean_se",
    tol: float | None = None,
    max_iterations: int = 200,
    max_outer_iterations: int | None = None,
    warm_start=None,
    search_limit: int = _MIN_SEP_SET_LIMIT,
    callback=None,
    blas_threads: int | None = None,
) -> DenseResult:
    """The optimal dense strategy for ``workload`` under ``participation`` (default single).

    Args:
        workload: the n×n workload A (any lower-triangular ``Workload``), n ≤ ``DENSE_MAX_STEPS``.
        participation: single, fixed_epochs(b, k) or min_sep(b, k) (see the module table).
        objective: ``mean_se`` (default) or ``max_se``.
        tol: target relative gap value/lower_bound − 1 of the unsquared error; default 1e-8 for
            MeanSE and 1e-4 for MaxSE (whose outer iteration converges sublinearly).
        max_iterations: the most Newton iterations per dual solve.
        max_outer_iterations: the most cutting-plane rounds (min_sep, default 50) or weight
            updates (max_se, default 1000).
        warm_start: a previous ``DenseResult`` for the same constraints, or its ``dual``
            array. For single participation a dual vector of another length is interpolated
            (e.g. the solution at n/2 to start n).
        search_limit: for min_sep, the most (set, sign) pairs the exhaustive separation may
            enumerate.
        callback: called as ``callback(iteration, dual_value, residual)`` after each Newton step.
        blas_threads: limit the BLAS threads to this number during the solve (needs
            ``threadpoolctl``); default: 1 for n ≤ 256, the environment's setting otherwise.

    Returns:
        ``DenseResult`` with the factorization (sens(C) = 1) and the convergence report.

    Raises:
        TypeError: ``workload`` or ``participation`` of the wrong type.
        ValueError: bad objective, tol, iteration counts, warm_start; n > ``DENSE_MAX_STEPS``;
            n incompatible with the participation; min_sep with more admissible (set, sign)
            pairs than ``search_limit``, or with objective ``max_se`` (not supported).

    Cost: O(n³) per Newton step (an eigendecomposition and a few matrix products per
    Hessian-vector product); O(n²) memory. Small problems run single-threaded (BLAS threads
    only slow small matrices down, and on a loaded machine large ones too: see
    ``blas_threads``).
    """
    start_time = time.perf_counter()
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    participation = participation or Participation.single()
    if not isinstance(participation, Participation):
        raise TypeError(f"participation={participation!r} is invalid: must be a Participation")
    objective = check_choice("objective", objective, OBJECTIVES)
    if tol is None:
        tol = 1e-8 if objective == "mean_se" else 1e-4
    tol = check_real("tol", tol, low=0.0, high=1.0, low_inclusive=False)
    max_iterations = check_int("max_iterations", max_iterations, minimum=1)
    if max_outer_iterations is None:
        max_outer_iterations = 50 if objective == "mean_se" else 1000
    max_outer_iterations = check_int("max_outer_iterations", max_outer_iterations, minimum=1)
    search_limit = check_int("search_limit", search_limit, minimum=1)
    if blas_threads is not None:
        blas_threads = check_int("blas_threads", blas_threads, minimum=1)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback={callback!r} is invalid: must be callable or None")
    n = workload.n
    if n > DENSE_MAX_STEPS:
        raise ValueError(
            f"n={n} is invalid for the dense strategy: must be <= {DENSE_MAX_STEPS} "
            f"(O(n³) time, O(n²) memory: {8 * n * n / 1e9:.3g} GB per n×n array); use a "
            "banded (bisr_opt:p), BLT (blt:d) or learning-rate-aware (lr_aware) strategy"
        )
    participation.check_steps(n)
    k = participation.participations(n)
    b = participation.min_sep
    kind = participation.kind if k > 1 else "single"
    if kind == "min_sep" and objective == "max_se":
        raise ValueError(
            "objective='max_se' is invalid with min_sep participation for the dense strategy "
            "(the weight updates and the cutting planes do not converge together reliably); "
            "use objective='mean_se', or fixed_epochs participation"
        )
    if kind == "min_sep":
        count = count_admissible_sets(n, b, k, signed=True)
        if count > search_limit:
            raise ValueError(
                f"participation={participation.label} is invalid for the dense strategy at n={n}: "
                f"{count:.3g} admissible (set, sign) pairs exceed search_limit={search_limit}; "
                "use fixed_epochs, a smaller n, or a larger search_limit"
            )
    check_memory(
        f"the dense strategy at n={n} under {participation.label}",
        _dense_bytes(kind, n, b, k),
        "use a smaller n, fewer participations (max_participations), min_sep participation, or "
        "a banded/BLT strategy (O(n) memory)",
    )
    cons = _constraints_for(kind, n, b, k)
    y0 = _warm_start_dual(warm_start, cons, n)
    with _blas_threads(blas_threads if blas_threads is not None else (1 if n <= 256 else None)):
        solver = _Solver(workload.dense(), kind, b, k, max_iterations, max_outer_iterations, callback)
        if objective == "mean_se":
            run, cons, lower = solver.mean_se(cons, y0)
            weights = None
        else:
            run, cons, lower, weights = solver.max_se(cons, y0, tol)
        fact, sens = _build_factorization(workload, run.point, cons, kind, participation, b)
    rows = np.linalg.norm(fact.B_dense(), axis=1)
    if objective == "mean_se":
        value = sens * float(np.sqrt(np.mean(rows**2)))
    else:
        value = sens * float(np.max(rows))
    lower = min(lower, value)  # equal up to round-off at the optimum
    gap = value / lower - 1.0 if lower > 0 else float("inf")
    return DenseResult(
        factorization=fact,
        objective=objective,
        value=value,
        lower_bound=lower,
        gap=gap,
        converged=bool(gap <= tol),
        iterations=solver.iterations,
        cg_iterations=solver.cg_iterations,
        outer_iterations=solver.outer_iterations,
        gradient_norm=run.residual,
        constraint=cons.label,
        seconds=time.perf_counter() - start_time,
        dual=run.point.y.copy(),
        weights=weights,
    )


def _dense_bytes(kind: str, n: int, b: int, k: int) -> float:
    """Estimated peak bytes of ``optimize_dense``: about 12 dense n×n arrays (X, W, L, E, the
    Hessian products) plus 3 dense (atoms × n) arrays (the rows r_l = w_lᵀE, their squares and
    products). Atoms: n for single; for fixed_epochs n plus 2 per pair of columns of a class;
    for min_sep the singletons, the evenly spaced sets and up to ``_CUTS_PER_ROUND``·n planes."""
    if kind == "fixed_epochs":
        sizes = np.bincount(np.arange(n) % b)
        atoms = n + float(np.sum(sizes * (sizes - 1)))  # 2·C(size, 2) per class
    elif kind == "min_sep":
        atoms = (2 + _CUTS_PER_ROUND) * n
    else:
        atoms = n
    return 8.0 * (12.0 * n * n + 3.0 * atoms * n)


def _constraints_for(kind: str, n: int, b: int, k: int) -> _Constraints:
    if kind == "single":
        return _single_constraints(n)
    if kind == "fixed_epochs":
        return _fixed_epochs_constraints(n, b)
    # min_sep: start from the singletons and the evenly spaced sets {i, i+b, …} with u = 1
    sets = [(np.array([i]), np.ones(1)) for i in range(n)]
    for i in range(n):
        idx = np.arange(i, n, b)[:k]
        if idx.shape[0] > 1:
            sets.append((idx, np.ones(idx.shape[0])))
    return _rank_one_constraints(n, sets, f"min_sep(b={b}, k={k}): u^T X_pi u <= 1, all (pi, u)")


class _Solver:
    """Dual solves for one workload; counts iterations across calls."""

    _INNER_TOL = 1e-10
    _MAXSE_POWER = 4.0  # exponent of the multiplicative weight update
    _MAXSE_INNER = 3  # Newton steps per weight update (warm-started)

    def __init__(self, A, kind, b, k, max_iterations, max_outer_iterations, callback):
        self.A, self.kind, self.b, self.k = A, kind, b, k
        self.max_iterations = max_iterations
        self.max_outer = max_outer_iterations
        self.callback = callback
        self.iterations = self.cg_iterations = self.outer_iterations = 0

    def solve(self, F, cons, y0, max_iterations=None, tol=None):
        W = F.T @ F
        if y0 is None:
            y0 = _initial_multipliers(cons, W)
        run = _maximize_dual(
            F,
            W,
            cons,
            y0,
            tol=self._INNER_TOL if tol is None else tol,
            max_iterations=max_iterations or self.max_iterations,
            callback=self.callback,
        )
        self.iterations += run.iterations
        self.cg_iterations += run.cg_iterations
        return run

    def solve_with_cuts(self, F, cons, y0, max_iterations=None):
        """Solve on ``cons``; for min_sep add the violated (π, u) until none is left.

        Intermediate rounds are solved to a residual proportional to the largest violation
        left (an accurate dual for planes that are about to change is wasted work); the last
        round, when the separation finds nothing new, to the full tolerance. Between rounds
        the singletons, the planes with positive multipliers and the nearly tight ones are
        kept (dropping those makes the separation add them back, round after round).

        Returns (run, constraints, max constraint value of the primal X over every admissible
        (π, u)): the squared sensitivity of the unnormalized X."""
        if self.kind != "min_sep":
            run = self.solve(F, cons, y0, max_iterations)
            return run, cons, _max_constraint(run.point, cons)
        n = F.shape[1]
        rounds = 0
        tol = _CUT_ROUND_TOL
        run = self.solve(F, cons, y0, max_iterations, tol)
        while True:
            # planes violated by less than the current ones (the solve's residual) are not news
            threshold = 1.0 + max(1e-9, run.residual)
            found, best = _most_violated(
                _primal(run.point), self.b, self.k, threshold, limit=_CUTS_PER_ROUND * n
            )
            old_sets = _sets_of(cons)
            known = {_key(idx, u) for idx, u in old_sets}
            new = [(idx, u) for _, idx, u in found if _key(idx, u) not in known]
            rounds += 1
            if not new and tol > self._INNER_TOL:
                tol = self._INNER_TOL  # polish on the final planes, then separate again
                run = self.solve(F, cons, run.point.y, max_iterations, tol)
                continue
            if not new or rounds >= self.max_outer:
                self.outer_iterations += rounds
                return run, cons, best
            tol = max(self._INNER_TOL, min(_CUT_ROUND_TOL, _CUT_TOL_RATIO * (best - 1.0)))
            top = float(np.max(run.point.y))
            values = run.point.grad + 1.0
            keep = [
                c
                for c, (idx, _) in enumerate(old_sets)
                if len(idx) == 1 or run.point.y[c] > _KEEP * top or values[c] > _NEARLY_TIGHT
            ]
            sets = [old_sets[c] for c in keep] + new
            y = np.concatenate([run.point.y[keep], np.zeros(len(new))])
            cons = _rank_one_constraints(n, sets, cons.label)
            run = self.solve(F, cons, y, max_iterations, tol)

    def mean_se(self, cons, y0):
        run, cons, _ = self.solve_with_cuts(self.A, cons, y0)
        if self.kind != "min_sep":
            self.outer_iterations += 1
        n = self.A.shape[0]
        return run, cons, float(np.sqrt(max(run.point.value, 0.0) / n))

    def max_se(self, cons, y0, tol):
        """Saddle point over row weights p (see the module docstring); single and
        fixed_epochs participation."""
        n = self.A.shape[0]
        return self._max_se_on(cons, y0, np.full(n, 1.0 / n), tol)

    def _max_se_on(self, cons, y0, p, tol):
        """Multiplicative weight updates p ← p∘(e/⟨p, e⟩)^γ with warm-started inexact inner
        solves; returns the iterate with the smallest MaxSE seen and the best dual bound."""
        A = self.A
        y = y0
        best = (np.inf, None, p)
        lower = 0.0
        for _ in range(self.max_outer):
            F = np.sqrt(p)[:, None] * A
            run = self.solve(F, cons, y, self._MAXSE_INNER)
            y = run.point.y
            self.outer_iterations += 1
            e = _row_errors(A, run.point) * max(_max_constraint(run.point, cons), 0.0)
            lower = max(lower, float(np.sqrt(max(run.point.value, 0.0))))
            upper = float(np.sqrt(np.max(e)))
            if upper < best[0]:
                best = (upper, run, p.copy())
            if best[0] / lower - 1.0 <= tol / 2:
                break
            q = p * (e / float(p @ e)) ** self._MAXSE_POWER
            p = np.maximum(q / q.sum(), 1e-300)
            p /= p.sum()
        _, run, weights = best
        return run, cons, lower, weights


def dense_factorization(
    workload: Workload, participation: Participation | None = None, **options
) -> Factorization:
    """``optimize_dense(workload, participation, **options).factorization``."""
    return optimize_dense(workload, participation, **options).factorization


def _primal(pt: _DualPoint) -> np.ndarray:
    X = (pt.E * pt.mu[None, :]) @ pt.E.T
    return 0.5 * (X + X.T)


def _max_constraint(pt: _DualPoint, cons: _Constraints) -> float:
    vals = pt.grad + cons.rhs
    return float(np.max(vals[cons.inequality]))


def _row_errors(A: np.ndarray, pt: _DualPoint) -> np.ndarray:
    """(A X⁻¹ Aᵀ)_ii for X = E diag(μ) Eᵀ, E = L⁻ᵀQ: X⁻¹ = LQ diag(1/μ) QᵀLᵀ."""
    Q = pt.E * pt.L[:, None] if pt.L.ndim == 1 else pt.L.T @ pt.E
    AL = A * pt.L[None, :] if pt.L.ndim == 1 else A @ pt.L
    ALQ = AL @ Q
    return np.sum(ALQ**2 / pt.mu[None, :], axis=1)


def _sets_of(cons: _Constraints) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    A = cons.atoms
    for r in range(A.shape[0]):
        lo, hi = A.indptr[r], A.indptr[r + 1]
        out.append((A.indices[lo:hi].copy(), A.data[lo:hi].copy()))
    return out


def _key(idx, u) -> tuple:
    order = np.argsort(idx)
    idx, u = np.asarray(idx)[order], np.asarray(u)[order]
    if u[0] < 0:
        u = -u
    return tuple(int(i) for i in idx), tuple(float(v) for v in u)


def _warm_start_dual(warm_start, cons: _Constraints, n: int):
    if warm_start is None:
        return None
    y = warm_start.dual if isinstance(warm_start, DenseResult) else warm_start
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 1 or not np.all(np.isfinite(y)):
        raise ValueError("warm_start is invalid: must be a DenseResult or a finite 1-D dual vector")
    if y.shape[0] == cons.m:
        return y
    if cons.atoms is None and y.shape[0] >= 2:
        # single participation: interpolate the multipliers on the grid (t + ½)/n
        src = (np.arange(y.shape[0]) + 0.5) / y.shape[0]
        dst = (np.arange(n) + 0.5) / n
        return np.interp(dst, src, y) * (y.shape[0] / n)
    raise ValueError(
        f"warm_start is invalid: its dual has length {y.shape[0]}, the constraints need {cons.m}"
    )


def _build_factorization(workload, pt, cons, kind, participation, b):
    """Normalize X to be exactly feasible, factor it (C = reverse Cholesky, C⁻¹ and
    B = A·C⁻¹ dense) and return the Factorization with its sensitivity (exact, or the
    certified upper bound of ``sensitivity`` for vector gradients: C/s is then feasible)."""
    X = _primal(pt)
    n = X.shape[0]
    if kind == "single":
        d = np.sqrt(np.diag(X))
        X = X / d[:, None] / d[None, :]
    elif kind == "fixed_epochs":
        # zero the within-class off-diagonal entries (equal to 0 up to the solver's residual)
        # and scale every class to a diagonal sum of 1
        classes = np.arange(n) % b
        same = (classes[:, None] == classes[None, :]) & ~np.eye(n, dtype=bool)
        sums = np.bincount(classes, weights=np.diag(X))
        scale = np.sqrt(sums[classes])
        Xz = np.where(same, 0.0, X) / scale[:, None] / scale[None, :]
        try:
            reverse_cholesky(Xz)
            X = Xz
        except ValueError:
            X = X / scale[:, None] / scale[None, :]
    C = reverse_cholesky(X)
    s = sensitivity(C, participation, search_limit=4 * _MIN_SEP_SET_LIMIT)
    C = C / s.value
    C_inv = solve_triangular(C, np.eye(n), lower=True)
    B = workload.dense() @ C_inv
    fact = Factorization(
        "dense",
        None,
        workload,
        DenseLowerTriangular(np.tril(C)),
        DenseLowerTriangular(np.tril(C_inv)),
        B,
    )
    return fact, sensitivity(fact.C, participation, search_limit=4 * _MIN_SEP_SET_LIMIT).value


def _blas_threads(limit: int | None):
    """A context limiting BLAS threads (a no-op for None or without threadpoolctl)."""
    if limit is None:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - optional
        return contextlib.nullcontext()
    return threadpool_limits(limits=limit, user_api="blas")
