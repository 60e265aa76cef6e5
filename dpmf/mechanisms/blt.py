"""Buffered linear Toeplitz (BLT) strategies: noise correlation with a few buffers.

A BLT with d buffers, decays θ ∈ (0, 1)^d and output scales ω ∈ ℝ^d is the lower-triangular
Toeplitz matrix with coefficients

    g_0 = 1,   g_k = Σ_i ω_i θ_i^{k−1}  (k ≥ 1),

i.e. the power series 1 + Σ_i ω_i x/(1 − θ_i x). Here the noise correlation C⁻¹ is a BLT, so
the noise of step t is generated with d numbers of state per parameter:

    noise_t = z_t + Σ_i ω_i s_{i,t},   s_{i,t+1} = θ_i s_{i,t} + z_t,   s_{i,1} = 0

(``blt_noise`` is the reference implementation). The strategy C = (C⁻¹)⁻¹ is a BLT too: writing
C⁻¹ as the state-space system s ↦ diag(θ)s + z, out = z + ωᵀs, its inverse has state matrix
diag(θ) − 1ωᵀ, so C's decays θ̂ are the eigenvalues of diag(θ) − 1ωᵀ and, with
diag(θ) − 1ωᵀ = V diag(θ̂) V⁻¹, its output scales are ω̂ = −(Vᵀω)∘(V⁻¹1)
(``blt_inverse_parameters``; real when the eigenvalues are).

Closed forms (checked on the conditions under which they hold):

* sensitivity of C = BLT(θ̂, ω̂) (``blt_sensitivity``): with S(L, ℓ) = Σ_{u<L} c_u c_{u+ℓ},
  S(L, 0) = 1 + Σ_ij ω̂_iω̂_j G(θ̂_iθ̂_j, L−1), S(L, ℓ) = c_ℓ + Σ_ij ω̂_iω̂_j θ̂_j^ℓ G(θ̂_iθ̂_j, L−1)
  (G(q, N) = Σ_{u<N} q^u), and sens² = Σ_{m,m'<k} S(n − max(m,m')b, |m−m'|b). Always valid for
  single participation (k = 1); for min_sep and fixed_epochs it needs c non-negative and
  non-increasing, guaranteed when θ̂ ∈ [0, 1), ω̂ ≥ 0 and Σω̂ ≤ 1 (then c_k is a sum of
  non-negative decreasing geometric sequences with c_1 ≤ c_0 = 1).
* error for the prefix-sum workload (``blt_prefix_error``): B = A₁·C⁻¹ = Toep(h) with
  h_t = β − Σ_i γ_i θ_i^t, γ_i = ω_i/(1 − θ_i), β = 1 + Σγ_i, so Σ_t h_t² (MaxSE², the last row)
  and Σ_t (n−t) h_t² (n·MeanSE²) are geometric sums in O(d²), for any n.

Optimization (``optimize_blt``): minimize MeanSE (or MaxSE for Toeplitz workloads) under the
participation by L-BFGS on (logit θ, ω), in two parametrizations — C = BLT(θ̂, ω̂) (the
landscape is benign there: every start we tried reaches the same optimum) and C⁻¹ = BLT(θ, ω)
(starting from a least-squares fit of the square-root strategy's noise) — keeping the best
result whose C⁻¹ is a real BLT (the noise generator needs real θ, ω). For multi-participation
the iterates are kept where the closed-form sensitivity holds (C's coefficients non-negative
and non-increasing). The returned factorization is evaluated by ``dpmf.mechanisms.evaluate``.

Sources: Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and Near-Optimal Noise
Generation for Streaming Differential Privacy" (FOCS 2024) — BLTs, their inverse and streaming
noise; McMahan, Pillutla, Steinke et al., "Hassle-Free Mechanisms for Differentially Private
Machine Learning" / BLT multi-participation (2024) — sensitivity of decreasing non-negative BLTs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int, check_vector
from dpmf.mechanisms._lbfgs import minimize_lbfgs
from dpmf.mechanisms.errors import evaluate
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.streaming import BLTLayout, NoiseLayout
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.mechanisms.toeplitz import inverse_coefficients, inverse_sqrt_coefficients
from dpmf.mechanisms.toeplitz_objective import (
    closed_form_valid,
    frobenius_sq,
    last_row_sq,
    reciprocal_gradient,
    sensitivity_sq,
)
from dpmf.workloads.workload import Workload

__all__ = [
    "BufferedToeplitz",
    "BLTFactorization",
    "BLTResult",
    "blt_coefficients",
    "blt_inverse_parameters",
    "blt_noise",
    "blt_sensitivity",
    "blt_prefix_error",
    "optimize_blt",
    "BLT_MAX_BUFFERS",
]

BLT_MAX_BUFFERS = 16


def _check_parameters(theta, omega) -> tuple[np.ndarray, np.ndarray]:
    theta = check_vector("theta", theta)
    omega = check_vector("omega", omega, length=theta.shape[0])
    if np.any(np.abs(theta) >= 1.0):
        raise ValueError(f"theta is invalid: every decay must be in (-1, 1), got {theta.tolist()}")
    return theta, omega


def blt_coefficients(theta, omega, n: int) -> np.ndarray:
    """Coefficients g of BLT(θ, ω): g_0 = 1, g_k = Σ_i ω_i θ_i^{k−1}; shape (n,).

    Raises:
        ValueError: θ, ω of different lengths, non-finite, |θ_i| ≥ 1, or n < 1.
    """
    theta, omega = _check_parameters(theta, omega)
    n = check_int("n", n, minimum=1)
    g = np.empty(n)
    g[0] = 1.0
    if n > 1:
        powers = theta[:, None] ** np.arange(n - 1)[None, :]
        g[1:] = omega @ powers
    return g


def blt_inverse_parameters(theta, omega) -> tuple[np.ndarray, np.ndarray]:
    """Decays and output scales (θ̂, ω̂) of BLT(θ, ω)⁻¹ (module docstring), decays sorted.

    Raises:
        ValueError: invalid θ, ω; or the inverse is not a real BLT with d buffers (complex or
            repeated decays, or a decay of modulus ≥ 1).
    """
    theta, omega = _check_parameters(theta, omega)
    d = theta.shape[0]
    M = np.diag(theta) - np.outer(np.ones(d), omega)
    ev, V = np.linalg.eig(M)
    if np.max(np.abs(ev.imag)) > 1e-10 * max(1.0, float(np.max(np.abs(ev)))):
        raise ValueError("theta, omega are invalid for an inverse BLT: its decays are complex")
    ev, V = ev.real, V.real
    if d > 1 and np.min(np.diff(np.sort(ev))) <= 1e-12:
        raise ValueError("theta, omega are invalid for an inverse BLT: its decays are repeated")
    if np.any(np.abs(ev) >= 1.0):
        raise ValueError(f"theta, omega are invalid for an inverse BLT: decays {ev.tolist()} leave (-1, 1)")
    omega_hat = -(V.T @ omega) * np.linalg.solve(V, np.ones(d))
    order = np.argsort(ev)
    return ev[order], omega_hat[order]


def blt_noise(theta, omega, z) -> np.ndarray:
    """The streaming noise C⁻¹z of BLT(θ, ω), one step at a time with d buffers of state.

    noise_t = z_t + Σ_i ω_i s_{i,t},  s_{i,t+1} = θ_i s_{i,t} + z_t,  s_{i,0} = 0.

    Args:
        theta, omega: the decays and output scales, shape (d,).
        z: independent noise, shape (n,) or (n, dim).

    Returns:
        Array of the shape of z.

    Raises:
        ValueError: invalid parameters or z with no steps.
    """
    theta, omega = _check_parameters(theta, omega)
    z = np.asarray(z, dtype=np.float64)
    if z.ndim not in (1, 2) or z.shape[0] < 1:
        raise ValueError(f"z is invalid: must have shape (n,) or (n, dim) with n >= 1, got {z.shape}")
    zz = z[:, None] if z.ndim == 1 else z
    state = np.zeros((theta.shape[0], zz.shape[1]))
    out = np.empty_like(zz)
    for t in range(zz.shape[0]):
        out[t] = zz[t] + omega @ state
        state = theta[:, None] * state + zz[t][None, :]
    return out[:, 0] if z.ndim == 1 else out


def _geo(q: np.ndarray, N: int) -> np.ndarray:
    """Σ_{u<N} q^u elementwise (N ≥ 0)."""
    q = np.asarray(q, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (1.0 - q**N) / (1.0 - q)
    return np.where(np.abs(1.0 - q) < 1e-15, float(N), out)


def _weighted_geo(q: np.ndarray, n: int) -> np.ndarray:
    """Σ_{t<n} (n − t) q^t = Σ_{j=1}^{n} G(q, j) elementwise."""
    q = np.asarray(q, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (n - q * _geo(q, n)) / (1.0 - q)
    return np.where(np.abs(1.0 - q) < 1e-15, n * (n + 1) / 2.0, out)


def blt_sensitivity(theta_hat, omega_hat, n: int, participation: Participation | None = None) -> float:
    """Closed-form sens(C) of the strategy C = BLT(θ̂, ω̂), O(k²d²) for any n (module docstring).

    Raises:
        ValueError: invalid parameters, n incompatible with the participation, or (min_sep,
            fixed_epochs) parameters outside θ̂ ∈ [0, 1), ω̂ ≥ 0, Σω̂ ≤ 1, where the closed form
            is not proven.
    """
    th, om = _check_parameters(theta_hat, omega_hat)
    participation = participation or Participation.single()
    n = participation.check_steps(check_int("n", n, minimum=1))
    k = participation.participations(n)
    b = participation.min_sep
    if participation.kind != "single" and k > 1:
        if np.any(th < 0) or np.any(om < 0) or float(np.sum(om)) > 1.0 + 1e-12:
            raise ValueError(
                f"theta_hat, omega_hat are invalid for the closed-form {participation.label} "
                "sensitivity: needs decays in [0, 1), output scales >= 0 summing to <= 1"
            )
    q = th[:, None] * th[None, :]
    W = om[:, None] * om[None, :]

    def coeff(ell: int) -> float:
        return 1.0 if ell == 0 else float(om @ th ** (ell - 1))

    def S(L: int, ell: int) -> float:
        if L <= 0:
            return 0.0
        if ell >= n:
            return 0.0
        base = 1.0 if ell == 0 else coeff(ell)
        return base + float(np.sum(W * th[None, :] ** ell * _geo(q, L - 1)))

    total = 0.0
    for m in range(k):
        for mm in range(k):
            total += S(n - max(m, mm) * b, abs(m - mm) * b)
    return math.sqrt(max(total, 0.0))


def blt_prefix_error(theta, omega, n: int, objective: str = "max_se") -> float:
    """MaxSE (or MeanSE) at unit sensitivity of the prefix sum A₁ = B·C with C⁻¹ = BLT(θ, ω),
    in closed form (module docstring); multiply by sens(C). O(d²) for any n.

    Raises:
        ValueError: invalid parameters, n < 1 or unknown objective.
    """
    theta, omega = _check_parameters(theta, omega)
    n = check_int("n", n, minimum=1)
    objective = check_choice("objective", objective, ("max_se", "mean_se"))
    gamma = omega / (1.0 - theta)
    beta = 1.0 + float(np.sum(gamma))
    q = theta[:, None] * theta[None, :]
    GG = gamma[:, None] * gamma[None, :]
    if objective == "max_se":
        total = n * beta**2 - 2.0 * beta * float(gamma @ _geo(theta, n)) + float(np.sum(GG * _geo(q, n)))
        return math.sqrt(max(total, 0.0))
    total = (
        beta**2 * n * (n + 1) / 2.0
        - 2.0 * beta * float(gamma @ _weighted_geo(theta, n))
        + float(np.sum(GG * _weighted_geo(q, n)))
    )
    return math.sqrt(max(total, 0.0) / n)


@dataclass(frozen=True, eq=False)
class BufferedToeplitz(ScaledToeplitz):
    """A lower-triangular Toeplitz matrix that is a BLT: coefficients 1, Σω_iθ_i^{k−1}.

    It is a ``ScaledToeplitz`` (every Toeplitz algorithm applies) that also carries the
    streaming parameters ``theta`` and ``omega`` (shape (d,)) for an O(d)-state generator.
    Build it with ``BufferedToeplitz.from_buffers(theta, omega, n)``.
    """

    theta: np.ndarray | None = None
    omega: np.ndarray | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.theta is None or self.omega is None:
            raise ValueError("theta, omega are invalid: a BufferedToeplitz needs both")
        theta, omega = _check_parameters(self.theta, self.omega)
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "omega", omega)

    @classmethod
    def from_buffers(cls, theta, omega, n: int) -> BufferedToeplitz:
        """BLT(θ, ω) as an n×n matrix."""
        return cls(blt_coefficients(theta, omega, n), None, None, theta, omega)

    @property
    def buffers(self) -> int:
        return int(self.theta.shape[0])

    def inverse(self) -> ScaledToeplitz:
        """The inverse: a ``BufferedToeplitz`` when its parameters are real, else the
        power-series inverse as a ``ScaledToeplitz``."""
        try:
            th, om = blt_inverse_parameters(self.theta, self.omega)
        except ValueError:
            return super().inverse()
        return BufferedToeplitz(inverse_coefficients(self.coeffs), None, None, th, om)


@dataclass(frozen=True, eq=False)
class BLTFactorization(Factorization):
    """A ``Factorization`` whose C⁻¹ is a BLT; labelled ``blt:d``.

    Attributes (besides ``Factorization``'s):
        buffers: d.
    """

    buffers: int = 0

    @property
    def label(self) -> str:
        return f"blt:{self.buffers}"

    def noise_layout(self, mode: str | None = None) -> NoiseLayout:
        """``BLTLayout`` (d buffers) unless a Toeplitz-inverse ``mode`` is forced."""
        Ci = self.C_inverse
        if mode is None and isinstance(Ci, BufferedToeplitz):
            return BLTLayout(self.n, Ci.omega, Ci.theta, Ci.row_scale, Ci.col_scale)
        return super().noise_layout(mode)

    @property
    def theta(self) -> np.ndarray:
        """Decays of the noise generator (C⁻¹), shape (d,)."""
        return self.C_inverse.theta

    @property
    def omega(self) -> np.ndarray:
        """Output scales of the noise generator (C⁻¹), shape (d,)."""
        return self.C_inverse.omega


@dataclass(frozen=True, eq=False)
class BLTResult:
    """An optimized BLT factorization and its report.

    Attributes:
        factorization: ``BLTFactorization`` (C⁻¹ = BLT(theta, omega), C its inverse).
        theta, omega: the noise generator's decays and output scales, shape (d,).
        strategy_theta, strategy_omega: C's parameters (None when not real).
        objective: ``mean_se`` or ``max_se``.
        value: that error under the participation (``evaluate``).
        sensitivity: ``evaluate``'s sensitivity (exact when ``sensitivity_exact``).
        sensitivity_exact: whether it is exact.
        sensitivity_closed_form: ``blt_sensitivity`` from C's parameters where its conditions
            hold, else None.
        error_closed_form: ``blt_prefix_error``·sens for the prefix-sum workload, else None.
        iterations: L-BFGS iterations of the best start.
        converged: the best start met its tolerance.
        starts: number of starting points tried.
        seconds: wall-clock time.
    """

    factorization: BLTFactorization
    theta: np.ndarray
    omega: np.ndarray
    strategy_theta: np.ndarray | None
    strategy_omega: np.ndarray | None
    objective: str
    value: float
    sensitivity: float
    sensitivity_exact: bool
    sensitivity_closed_form: float | None
    error_closed_form: float | None
    iterations: int
    converged: bool
    starts: int
    seconds: float


def blt_factorization(workload: Workload, theta, omega) -> BLTFactorization:
    """The factorization of ``workload`` with noise correlation C⁻¹ = BLT(θ, ω)."""
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    Ci = BufferedToeplitz.from_buffers(theta, omega, workload.n)
    return BLTFactorization("blt", None, workload, Ci.inverse(), Ci, None, buffers=Ci.buffers)


def optimize_blt(
    workload: Workload,
    buffers: int,
    participation: Participation | None = None,
    *,
    objective: str = "mean_se",
    max_iterations: int = 3000,
    starts: int = 2,
    cascade: bool = True,
) -> BLTResult:
    """Optimize the decays and output scales of a BLT noise correlation C⁻¹.

    Args:
        workload: the workload A (Toeplitz, or Toeplitz with a column scale such as A_χ).
        buffers: d, 1 ≤ d ≤ ``BLT_MAX_BUFFERS``.
        participation: single (default), min_sep(b, k) or fixed_epochs(b, k).
        objective: ``mean_se`` (default) or ``max_se`` (Toeplitz workloads).
        max_iterations: the most L-BFGS iterations per start.
        starts: number of starting timescale grids (1 to 4) per parametrization.
        cascade: with multiple participations, also start from the optimum for d − 1 buffers
            (recursively), so that more buffers never do worse than fewer; False is faster.

    Returns:
        ``BLTResult``.

    Raises:
        TypeError: ``workload`` or ``participation`` of the wrong type.
        ValueError: bad buffers, objective, iteration counts; max_se with a non-Toeplitz
            workload; n incompatible with the participation.

    Cost: O(n log n) per objective evaluation for Toeplitz workloads, O(n²) for A·diag(χ).
    """
    t0 = time.perf_counter()
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    d = check_int("buffers", buffers, minimum=1, maximum=BLT_MAX_BUFFERS)
    participation = participation or Participation.single()
    if not isinstance(participation, Participation):
        raise TypeError(f"participation={participation!r} is invalid: must be a Participation")
    objective = check_choice("objective", objective, ("mean_se", "max_se"))
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)
    starts = check_int("starts", starts, minimum=1, maximum=4)
    n = workload.n
    participation.check_steps(n)
    if objective == "max_se" and not workload.is_toeplitz:
        last_row_sq(workload, np.ones(n))  # raises the ValueError naming the workload

    stats = {"tried": 0}
    best = _search(workload, participation, objective, d, starts, max_iterations, stats, cascade)
    if best is None:
        raise ValueError(
            f"buffers={d} is invalid for {workload.name!r} under {participation.label}: no "
            "starting point gives a BLT in the region of the closed-form sensitivity"
        )
    _, theta, omega, res = best
    tried = stats["tried"]
    fact = blt_factorization(workload, theta, omega)
    ev = evaluate(fact, participation, with_lower_bound=False)
    try:
        s_theta, s_omega = blt_inverse_parameters(theta, omega)
    except ValueError:
        s_theta = s_omega = None
    sens_cf = None
    if s_theta is not None:
        try:
            sens_cf = blt_sensitivity(s_theta, s_omega, n, participation)
        except ValueError:
            sens_cf = None
    err_cf = None
    if workload.is_toeplitz and np.all(workload.coeffs == workload.coeffs[0]):
        scale = abs(float(workload.toeplitz_coeffs[0]))
        err_cf = scale * ev.sensitivity * blt_prefix_error(theta, omega, n, objective)
    return BLTResult(
        factorization=fact,
        theta=theta,
        omega=omega,
        strategy_theta=s_theta,
        strategy_omega=s_omega,
        objective=objective,
        value=getattr(ev, objective),
        sensitivity=ev.sensitivity,
        sensitivity_exact=ev.sensitivity_exact,
        sensitivity_closed_form=sens_cf,
        error_closed_form=err_cf,
        iterations=res.iterations if res else 0,
        converged=bool(res.converged) if res else False,
        starts=tried,
        seconds=time.perf_counter() - t0,
    )


def _search(workload, participation, objective, d, starts, max_iterations, stats, cascade=True):
    """The best (value, θ, ω, L-BFGS result) over the starting points of both
    parametrizations, C⁻¹ = BLT(θ, ω) real; None when no start is feasible.

    With multiple participations the closed-form region can stop the line search at its
    boundary, so d buffers also start from the optimum for d − 1 buffers with one more buffer
    of zero output scale (the same strategy): more buffers never do worse than fewer."""
    multi = participation.kind != "single" and participation.participations(workload.n) > 1
    multi = multi and cascade
    extra = []
    if multi and d > 1:
        prev = _search(workload, participation, objective, d - 1, starts, max_iterations, stats, cascade)
        if prev is not None:
            # a new decay away from the others (on the timescale 1/(1 − θ))
            tau = 1.0 / (1.0 - prev[1])
            fresh = 1.0 - 1.0 / (np.sqrt(2.0) * float(np.max(tau)) + 1.0)
            th_n = np.append(prev[1], fresh)
            extra.append(("noise", np.concatenate([np.log(th_n / (1.0 - th_n)), np.append(prev[2], 0.0)])))
            try:
                th_c, om_c = blt_inverse_parameters(prev[1], prev[2])
            except ValueError:
                th_c = None
            if th_c is not None and np.all(th_c > 0):
                tau_c = 1.0 / (1.0 - th_c)
                th_s = np.append(th_c, 1.0 - 1.0 / (np.sqrt(2.0) * float(np.max(tau_c)) + 1.0))
                x0 = np.concatenate([np.log(th_s / (1.0 - th_s)), np.append(om_c, 0.0)])
                extra.append(("strategy", x0))
    candidates = []
    for param in ("strategy", "noise"):
        fun = _objective(workload, participation, objective, d, param)
        points = list(_starting_points(workload, participation, d, starts, param))
        points += [x for kind, x in extra if kind == param]
        for x0 in points:
            if fun(x0) is None:
                continue
            stats["tried"] += 1
            res = minimize_lbfgs(fun, x0, max_iterations=max_iterations) if max_iterations else None
            x, val = (res.x, res.value) if res else (x0, fun(x0)[0])
            th, om = _unpack(x, d)
            if param == "strategy":
                try:  # the noise generator needs C⁻¹ as a real BLT
                    th, om = blt_inverse_parameters(th, om)
                except ValueError:
                    continue
            if not _well_conditioned(th, om):
                continue
            candidates.append((val, th, om, res))
    return min(candidates, key=lambda t: t[0]) if candidates else None


_MAX_OUTPUT_SCALE = 10.0
_MIN_DECAY_GAP = 1e-6


def _well_conditioned(theta: np.ndarray, omega: np.ndarray) -> bool:
    """Noise parameters the streaming generator can run in low precision: decays in (0, 1)
    that are distinct (relative gap of 1 − θ at least 1e-6) and output scales |ω| ≤ 10 (two
    nearly equal decays with huge opposite scales emulate a double pole by cancellation)."""
    if np.any(theta <= 0.0) or np.any(theta >= 1.0) or np.any(np.abs(omega) > _MAX_OUTPUT_SCALE):
        return False
    if theta.shape[0] > 1:
        r = np.sort(1.0 - theta)
        if np.any(np.diff(r) <= _MIN_DECAY_GAP * r[1:]):
            return False
    return True


def _real_inverse(theta: np.ndarray, omega: np.ndarray) -> bool:
    """Whether BLT(θ, ω)⁻¹ is a well-conditioned real BLT (what the noise generator needs)."""
    try:
        th, om = blt_inverse_parameters(theta, omega)
    except ValueError:
        return False
    return _well_conditioned(th, om)


def _unpack(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    theta = 1.0 / (1.0 + np.exp(-x[:d]))
    return theta, x[d:].copy()


def _objective(workload, participation, objective, d, param):
    """x = (logit θ, ω) ↦ (log(sens² · error²), gradient), None outside the closed-form region
    (or where C blows up). ``param`` says which matrix is BLT(θ, ω): ``noise`` (C⁻¹) or
    ``strategy`` (C); the other is its power-series reciprocal."""
    n = workload.n
    ks = np.arange(n - 1, dtype=np.float64)

    def fun(x):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            theta, omega = _unpack(x, d)
            if np.any(theta >= 1.0) or np.any(theta <= 0.0):
                return None
            if param == "strategy" and not _real_inverse(theta, omega):
                return None
            if param == "noise" and not _well_conditioned(theta, omega):
                return None
            powers = np.exp(ks[None, :] * np.log(theta)[:, None])  # θ_i^{k−1}, k = 1..n−1
            u = np.empty(n)
            u[0] = 1.0
            u[1:] = omega @ powers
            if not np.all(np.isfinite(u)):
                return None
            try:
                v = inverse_coefficients(u)
            except ValueError:
                return None
            if not np.all(np.isfinite(v)):
                return None
            g, c = (u, v) if param == "noise" else (v, u)
            if not closed_form_valid(c, participation):
                return None
            s2, gs_c = sensitivity_sq(c, participation)
            if objective == "mean_se":
                e2, ge_g = frobenius_sq(workload, g)
            else:
                e2, ge_g = last_row_sq(workload, g)
            if not (np.isfinite(s2) and np.isfinite(e2)) or s2 <= 0 or e2 <= 0:
                return None
            if param == "noise":
                G = reciprocal_gradient(gs_c, c, n) / s2 + ge_g / e2  # ∂f/∂g
            else:
                G = gs_c / s2 + reciprocal_gradient(ge_g, g, n) / e2  # ∂f/∂c
            Gk = G[1:]
            grad_omega = powers @ Gk
            # ∂u_k/∂θ_i = ω_i (k−1) θ_i^{k−2}
            dpow = np.zeros_like(powers)
            dpow[:, 1:] = ks[None, 1:] * powers[:, :-1]
            grad_theta = omega * (dpow @ Gk)
            grad = np.concatenate([grad_theta * theta * (1.0 - theta), grad_omega])
            value = float(np.log(s2) + np.log(e2))
        if not np.isfinite(value) or not np.all(np.isfinite(grad)):
            return None
        return value, grad

    return fun


def _starting_points(workload, participation, d, starts, param):
    """Log-spaced timescales τ_i (θ_i = 1 − 1/τ_i) over a few ranges. For the strategy C the
    output scales start at 0.6·(1 − θ_i)/d (positive, summing below 1: a non-negative,
    non-increasing C); for the noise C⁻¹ they are fitted by least squares to the square-root
    strategy's noise coefficients, shrunk toward 0 until C stays bounded and in the closed-form
    region."""
    n = workload.n
    ranges = [(1.2, n / 4.0), (2.0, float(n)), (5.0, 5.0 * n), (1.5, float(n))]
    if param == "noise":
        base = workload.toeplitz_coeffs if workload.is_toeplitz else np.asarray(workload.coeffs)
        target = inverse_sqrt_coefficients(base / base[0])
        m = min(n - 1, 4096)
    for lo, hi in ranges[:starts]:
        hi = max(hi, lo * 1.5)
        tau = np.exp(np.linspace(np.log(lo), np.log(hi), d)) if d > 1 else np.array([np.sqrt(lo * hi)])
        theta = 1.0 - 1.0 / tau
        if param == "strategy":
            yield np.concatenate([np.log(theta / (1.0 - theta)), 0.6 * (1.0 - theta) / d])
            continue
        P = theta[None, :] ** np.arange(m)[:, None]  # (m, d)
        omega, *_ = np.linalg.lstsq(P, target[1 : m + 1], rcond=None)
        for _ in range(60):
            g = blt_coefficients(theta, omega, n)
            try:
                c = inverse_coefficients(g)
            except ValueError:
                c = np.full(n, np.nan)
            # C must not blow up (its decays inside the unit disc: max |c| stays small)
            tame = np.all(np.isfinite(c)) and float(np.max(np.abs(c))) <= 2.0
            if tame and closed_form_valid(c, participation):
                break
            omega = 0.7 * omega
        else:
            omega = np.zeros(d)
        yield np.concatenate([np.log(theta / (1.0 - theta)), omega])
