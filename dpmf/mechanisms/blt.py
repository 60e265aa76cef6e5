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

* sensitivity, MaxSE and MeanSE of the prefix-sum workload with a BLT noise or strategy, for
  any n in O(k²·d³·log n) (``blt_closed_form`` in ``dpmf.mechanisms.blt_closed``: sums of
  matrix powers by doubling, accurate as decays approach 1, decays of exactly 1 allowed):
  ``blt_sensitivity`` (sens(C) of C = BLT(θ̂, ω̂); for min_sep and fixed_epochs it needs c
  non-negative and non-increasing, proven when θ̂ ∈ [0, 1], ω̂ ≥ 0 and Σω̂ ≤ 1, else checked
  on the coefficients) and ``blt_prefix_error`` (B = A₁·C⁻¹ = Toep(h), h_t = Σ_{k≤t} g_k; the
  largest row is the last). The optimizer uses them (with complex-step gradients) for single
  participation and the prefix sum, so its cost does not grow with n.
* error for A = A₁·diag(χ), any schedule (``blt_frobenius_sq``): column j of B = A·Toep(g)
  has entries s_j(t) = χ_j + Σ_i ω_i u_{ij}(t), u_{ij}(t) = Σ_{j<l≤t} χ_l θ_i^{l−j−1}, and
  ‖B‖_F² = Σ_j (n−j)χ_j² + 2Σ_i ω_i P_i + Σ_{ii'} ω_iω_{i'} R_{ii'} with
  P_i = Σ_j χ_j U_i(j), U_i(j) = Σ_{t≥j} u_{ij}(t) = Σ_{l>j} (n−l)χ_l θ_i^{l−j−1}, and
  R_{ii'} = Σ_{m≥1} [(n−m)χ_m² + χ_m(θ_iU_i(m) + θ_{i'}U_{i'}(m))]·G(θ_iθ_{i'}, m), from the
  recursion u_{ij} = χ_{j+1} + θ_i u_{i,j+1}. The U_i are first-order linear recursions
  (``scipy.signal.lfilter``), so value and gradient cost O(n·d²) in a fixed number of
  vectorized passes, with no n×n (or n-long Python) loop.
* the inverse's parameters as a differentiable map: 1/θ̂_k are the zeros of the BLT's power
  series, i.e. θ̂_k solves the secular equation F(λ) = 1 + Σ_i ω_i/(λ − θ_i) = 0, and ω̂_k =
  1/F′(θ̂_k) (the residue of 1/F); implicit differentiation gives the vector–Jacobian product
  in O(d²) (``_inverse_vjp``). The optimizer uses it to evaluate each parametrization's
  error and sensitivity from the closed forms of the other matrix.

Optimization (``optimize_blt``): minimize MeanSE (or MaxSE for Toeplitz workloads) under the
participation by L-BFGS on (logit θ, ω), in two parametrizations — C = BLT(θ̂, ω̂) (the
landscape is benign there: every start we tried reaches the same optimum) and C⁻¹ = BLT(θ, ω)
(starting from a least-squares fit of the square-root strategy's noise) — keeping the best
result whose C⁻¹ is a real BLT (the noise generator needs real θ, ω). For multi-participation
the iterates are kept where the closed-form sensitivity holds (C's coefficients non-negative
and non-increasing). The returned factorization is evaluated by ``dpmf.mechanisms.evaluate``.
For the prefix sum (a·A₁) under single participation the optimizer instead works on the pair
of decay sets x = (logit θ of C, logit θ̂ of C⁻¹), the output scales of both following by
partial fractions (``blt_closed.pair_output_scales``; C(x) = Π(1 − θ̂_kx)/Π(1 − θ_ix)), with the
closed forms and complex-step gradients of ``blt_closed`` (O(d³ log n) per evaluation, so the
cost does not grow with n; 4 starts by default, the timescales of C's poles and zeros
interlaced); beyond n = 131072 the result is evaluated by the closed forms too.

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
from dpmf.mechanisms._fft import lfilter
from dpmf.mechanisms._lbfgs import minimize_lbfgs
from dpmf.mechanisms.blt_closed import (
    BLTClosedForm,
    blt_closed_form,
    check_blt_parameters,
    objective_terms,
    pair_objective_terms,
    pair_output_scales,
)
from dpmf.mechanisms.errors import evaluate
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.streaming import BLTLayout, NoiseLayout
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.mechanisms.toeplitz import (
    inverse_coefficients,
    inverse_sqrt_coefficients,
    is_nonincreasing_nonnegative,
)
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
    "blt_frobenius_sq",
    "blt_closed_form",
    "BLTClosedForm",
    "optimize_blt",
    "BLT_MAX_BUFFERS",
]

BLT_MAX_BUFFERS = 16


def _check_parameters(theta, omega) -> tuple[np.ndarray, np.ndarray]:
    return check_blt_parameters(theta, omega)


_POWER_BLOCK = 1 << 16


def _decay_powers(theta: float, count: int) -> np.ndarray:
    """θ^k for k = 0..count−1, shape (count,): exact powers within a block of 65536, times the
    exact power at the block's start (relative error ≤ 3ε, O(count) memory)."""
    m = min(count, _POWER_BLOCK)
    head = theta ** np.arange(m, dtype=np.float64)
    if count <= m:
        return head
    out = np.empty(count)
    for start in range(0, count, m):
        stop = min(count, start + m)
        np.multiply(head[: stop - start], theta**start, out=out[start:stop])
    return out


def blt_coefficients(theta, omega, n: int) -> np.ndarray:
    """Coefficients g of BLT(θ, ω): g_0 = 1, g_k = Σ_i ω_i θ_i^{k−1}; shape (n,).

    Cost: O(n·d) time, O(n) memory.

    Raises:
        ValueError: θ, ω of different lengths, non-finite, a decay outside (−1, 1], or n < 1.
    """
    theta, omega = _check_parameters(theta, omega)
    n = check_int("n", n, minimum=1)
    g = np.zeros(n)
    g[0] = 1.0
    if n > 1:
        for th, om in zip(theta.tolist(), omega.tolist(), strict=True):
            g[1:] += om * _decay_powers(th, n - 1)
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


def blt_sensitivity(theta_hat, omega_hat, n: int, participation: Participation | None = None) -> float:
    """Closed-form sens(C) of the strategy C = BLT(θ̂, ω̂) for any n, O(k²·d³·log n)
    (``blt_closed.blt_closed_form``; accurate as decays approach 1, decays of exactly 1 allowed).

    Raises:
        ValueError: invalid parameters, n incompatible with the participation, or (min_sep,
            fixed_epochs) a C whose coefficients (decays, output scales) break the closed form's
            condition (non-negative, and non-increasing for min_sep).
    """
    return blt_closed_form(theta_hat, omega_hat, n, participation, matrix="strategy").sensitivity


def blt_prefix_error(theta, omega, n: int, objective: str = "max_se") -> float:
    """MaxSE (or MeanSE) at unit sensitivity of the prefix sum A₁ = B·C with C⁻¹ = BLT(θ, ω),
    in closed form for any n, O(d³·log n), accurate as decays approach 1
    (``blt_closed.blt_closed_form``); multiply by sens(C).

    Raises:
        ValueError: invalid parameters, n < 1 or unknown objective.
    """
    objective = check_choice("objective", objective, ("max_se", "mean_se"))
    cf = blt_closed_form(theta, omega, n)
    return math.sqrt(max(cf.max_row_sq if objective == "max_se" else cf.mean_row_sq, 0.0))


def blt_frobenius_sq(theta, omega, chi) -> tuple[float, np.ndarray, np.ndarray]:
    """‖A₁·diag(χ)·BLT(θ, ω)‖_F² and its gradients in θ and ω (module docstring).

    n·MeanSE² at unit sensitivity of the learning-rate workload A_χ = A₁·diag(χ) (the prefix
    sum for χ = 1) with the noise correlation C⁻¹ = BLT(θ, ω).

    Args:
        theta: decays in (0, 1), shape (d,).
        omega: output scales, shape (d,).
        chi: the schedule χ, shape (n,), entries > 0.

    Returns:
        (value, ∂/∂θ of shape (d,), ∂/∂ω of shape (d,)).

    Raises:
        ValueError: invalid θ, ω (see ``blt_coefficients``), a decay outside (0, 1), or χ
            empty, non-finite or with an entry ≤ 0.

    Cost: O(n·d²) time, O(n·d) memory, for any χ.
    """
    theta, omega = _check_parameters(theta, omega)
    if np.any(theta <= 0.0):
        raise ValueError(f"theta is invalid: decays must be in (0, 1), got {theta.tolist()}")
    chi = check_vector("chi", chi, positive=True)
    return _frobenius_sq(theta, omega, chi)


def _frobenius_sq(theta: np.ndarray, omega: np.ndarray, chi: np.ndarray):
    n, d = chi.shape[0], theta.shape[0]
    value = float(np.sum(np.arange(n, 0, -1) * chi * chi))
    if n == 1:
        return value, np.zeros(d), np.zeros(d)
    # U_i(j) by the recursion U_i(j) = (n−j−1)χ_{j+1} + θ_i U_i(j+1), run from j = n−1 down
    # (in reversed time r = n−1−j it is lfilter's x_r + θ y_{r−1}), and ∂U_i/∂θ_i likewise
    drive = np.zeros(n)
    drive[1:] = np.arange(1, n) * chi[::-1][: n - 1]
    U = np.empty((d, n))
    dU = np.empty((d, n))
    for i in range(d):
        rev = lfilter([1.0], [1.0, -theta[i]], drive)
        lagged = np.zeros(n)
        lagged[1:] = rev[:-1]
        U[i] = rev[::-1]
        dU[i] = lfilter([1.0], [1.0, -theta[i]], lagged)[::-1]
    P, dP = U @ chi, dU @ chi
    V, dV = U[:, 1:] * chi[None, 1:], dU[:, 1:] * chi[None, 1:]  # m = 1..n−1
    base = np.arange(n - 1, 0, -1) * chi[1:] ** 2
    u = np.arange(1, n - 1, dtype=np.float64)
    powers = _powers(theta, n - 1)
    R = np.empty((d, d))
    dR = np.empty((d, d))  # dR[k, i] = ∂R_{ki}/∂θ_k with θ_i held
    for k in range(d):  # pairs (k, i ≥ k) at once
        q_pow = powers[k][None, :] * powers[k:]  # q^u, u = 0..n−2, q = θ_kθ_i
        G = np.cumsum(q_pow, axis=1)  # G(q, m) = Σ_{u<m} q^u, m = 1..n−1
        dG = np.zeros_like(G)
        np.cumsum(u[None, :] * q_pow[:, :-1], axis=1, out=dG[:, 1:])  # ∂G/∂q
        f = base[None, :] + theta[k] * V[k][None, :] + theta[k:, None] * V[k:]
        fdG = np.einsum("ij,ij->i", f, dG)
        R[k, k:] = R[k:, k] = np.einsum("ij,ij->i", f, G)
        dR[k, k:] = np.einsum("ij,j->i", G, V[k] + theta[k] * dV[k]) + theta[k:] * fdG
        dR[k:, k] = np.einsum("ij,ij->i", G, V[k:] + theta[k:, None] * dV[k:]) + theta[k] * fdG
    value += 2.0 * float(omega @ P) + float(omega @ R @ omega)
    grad_omega = 2.0 * P + 2.0 * (R @ omega)
    grad_theta = 2.0 * omega * (dP + dR @ omega)
    return value, grad_theta, grad_omega


_SECULAR_GAP = 1e-7


def _inverse_vjp(theta: np.ndarray, omega: np.ndarray):
    """(θ̂, ω̂) of BLT(θ, ω)⁻¹ from the secular equation (module docstring), possibly complex,
    and the vector–Jacobian product (ā, b̄) ↦ (∂/∂θ, ∂/∂ω) of Σ_k ā_kθ̂_k + b̄_kω̂_k; None when
    the map is ill-conditioned there (a decay of the inverse within 1e-7 of another or of a
    decay θ_i, as when some ω_i = 0)."""
    d = theta.shape[0]
    lam = np.linalg.eigvals(np.diag(theta) - np.outer(np.ones(d), omega)).astype(np.complex128)
    scale = max(1.0, float(np.max(np.abs(lam))))
    gaps = np.abs(lam[:, None] - theta[None, :])
    if np.min(gaps) <= _SECULAR_GAP * scale:
        return None
    if d > 1:
        sep = np.abs(lam[:, None] - lam[None, :]) + np.eye(d) * scale
        if np.min(sep) <= _SECULAR_GAP * scale:
            return None
    R = 1.0 / (lam[:, None] - theta[None, :])  # R_ki = 1/(θ̂_k − θ_i)
    R2, R3 = R * R, R * R * R
    omega_hat = -1.0 / (R2 @ omega)  # 1/F′(θ̂_k), F′(λ) = −Σ ω_i/(λ − θ_i)²
    if not (np.all(np.isfinite(omega_hat)) and np.all(np.isfinite(lam))):
        return None

    def vjp(a: np.ndarray, b: np.ndarray):
        beta = b * omega_hat**2
        a_t = a - 2.0 * beta * (R3 @ omega)
        coef = -a_t * omega_hat
        g_theta = omega * (coef @ R2 + 2.0 * (beta @ R3))
        g_omega = coef @ R + beta @ R2
        return g_theta, g_omega

    return lam, omega_hat, vjp


_TINY_LOG = -700.0  # log of a power below which it is set to 0 (e^{−700} ≈ 1e-304)


def _powers(theta: np.ndarray, count: int) -> np.ndarray:
    """θ_i^k for k = 0..count−1, shape (d, count), by a running product (relative error
    O(k·ε), no exponentials); powers below 1e-304 are 0 (subnormal numbers would slow every
    later operation on the array a hundredfold)."""
    d = theta.shape[0]
    out = np.zeros((d, count), dtype=theta.dtype)
    if count == 0:
        return out
    with np.errstate(divide="ignore"):
        logs = np.log(np.abs(theta))
    for i in range(d):
        m = count if logs[i] >= 0 else int(min(count, max(1, np.floor(_TINY_LOG / logs[i]))))
        out[i, 0] = 1.0
        if m > 1:
            np.cumprod(np.full(m - 1, theta[i]), out=out[i, 1:m])
    return out


def _coefficients_and_chain(theta: np.ndarray, omega: np.ndarray, n: int):
    """The (real) coefficients 1, Σ_i ω_iθ_i^{k−1} of BLT(θ, ω), for real or conjugate-paired
    complex parameters, and the map ∂f/∂coefficients ↦ (∂f/∂θ, ∂f/∂ω) (complex for complex
    parameters)."""
    if np.iscomplexobj(theta) or np.iscomplexobj(omega):
        if np.all(theta.imag == 0) and np.all(np.imag(omega) == 0):
            theta, omega = theta.real.copy(), np.real(omega).copy()
        else:
            theta, omega = theta.astype(np.complex128), omega.astype(np.complex128)
    powers = _powers(theta, n - 1)  # θ_i^{k−1}, k = 1..n−1
    coeffs = np.empty(n)
    coeffs[0] = 1.0
    coeffs[1:] = np.real(np.einsum("i,ij->j", omega, powers))  # (a vector–matrix BLAS call stalls)
    k = np.arange(1, n - 1, dtype=np.float64)

    def chain(grad: np.ndarray):
        gk = grad[1:]
        return omega * (powers[:, : n - 2] @ (k * gk[1:])), powers @ gk

    return coeffs, chain


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
        power-series inverse as a ``ScaledToeplitz``. Its coefficients are the power-series
        reciprocal (O(n log n)) up to n = 131072 and, beyond, the inverse's own BLT
        coefficients (O(n·d)) when its parameters are well conditioned."""
        try:
            th, om = blt_inverse_parameters(self.theta, self.omega)
        except ValueError:
            return super().inverse()
        n = self.coeffs.shape[0]
        if n > _SERIES_INVERSE_MAX and _well_conditioned(th, om):
            return BufferedToeplitz(blt_coefficients(th, om, n), None, None, th, om)
        return BufferedToeplitz(inverse_coefficients(self.coeffs), None, None, th, om)


_SERIES_INVERSE_MAX = 1 << 17


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
    starts: int | None = None,
    cascade: bool = True,
) -> BLTResult:
    """Optimize the decays and output scales of a BLT noise correlation C⁻¹.

    Args:
        workload: the workload A (Toeplitz, or Toeplitz with a column scale such as A_χ).
        buffers: d, 1 ≤ d ≤ ``BLT_MAX_BUFFERS``.
        participation: single (default), min_sep(b, k) or fixed_epochs(b, k).
        objective: ``mean_se`` (default) or ``max_se`` (Toeplitz workloads).
        max_iterations: the most L-BFGS iterations per start.
        starts: number of starting timescale grids (1 to 4) per parametrization; default 4
            where the closed forms apply (single participation, the prefix sum: each start
            costs milliseconds at any n), else 2.
        cascade: with multiple participations, also start from the optimum for d − 1 buffers
            (recursively), so that more buffers never do worse than fewer; False is faster.

    Returns:
        ``BLTResult``.

    Raises:
        TypeError: ``workload`` or ``participation`` of the wrong type.
        ValueError: bad buffers, objective, iteration counts; max_se with a non-Toeplitz
            workload; n incompatible with the participation.

    Cost per objective evaluation: O(d³·log n) for single participation and the prefix sum
    (``blt_closed``; the result is then evaluated by the closed forms beyond n = 131072, by
    ``evaluate`` up to it); otherwise O(n·d²) for MeanSE of A₁·diag(χ) (``blt_frobenius_sq``;
    the sensitivity from the strategy's coefficients, O(n·(d + k))), O(n log n) for other
    Toeplitz workloads. Where the secular map is ill-conditioned (an output scale near 0, as
    at the starts that add a buffer) the power-series reciprocal is used, at its former cost
    (O(n²) for the error of A₁·diag(χ) in the strategy parametrization).
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
    n = workload.n
    participation.check_steps(n)
    prefix_sq = _prefix_scale_sq(workload, participation)
    if starts is None:
        starts = 4 if prefix_sq else 2
    starts = check_int("starts", starts, minimum=1, maximum=4)
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
        cf = blt_closed_form(theta, omega, n)
        rows_sq = cf.max_row_sq if objective == "max_se" else cf.mean_row_sq
        sens_value = sens_cf if sens_cf is not None else cf.sensitivity
        err_cf = scale * sens_value * math.sqrt(max(rows_sq, 0.0))
    if prefix_sq and n > _SERIES_INVERSE_MAX:
        value, sens_value, sens_exact = err_cf, sens_cf if sens_cf is not None else cf.sensitivity, True
    else:
        ev = evaluate(fact, participation, with_lower_bound=False)
        value, sens_value, sens_exact = getattr(ev, objective), ev.sensitivity, ev.sensitivity_exact
    return BLTResult(
        factorization=fact,
        theta=theta,
        omega=omega,
        strategy_theta=s_theta,
        strategy_omega=s_omega,
        objective=objective,
        value=value,
        sensitivity=sens_value,
        sensitivity_exact=sens_exact,
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
    params = ("pair",) if _prefix_scale_sq(workload, participation) else ("strategy", "noise")
    for param in params:
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
            if param == "pair":  # x = (logit θ of C, logit θ̂ of C⁻¹): the noise is BLT(θ̂, ω̂)
                th = 1.0 / (1.0 + np.exp(-x[d:]))
                om = pair_output_scales(1.0 / (1.0 + np.exp(-x[:d])), th)[1]
            elif param == "strategy":
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


def _inside_with_margin(c: np.ndarray, participation: Participation) -> bool:
    """``closed_form_valid`` with half its round-off tolerance (5e-13·max|c|)."""
    n = c.shape[0]
    k = participation.participations(n)
    if participation.kind == "single" or k == 1:
        return True
    if participation.kind == "fixed_epochs":
        return bool(np.all(c >= -5e-13 * float(np.max(np.abs(c)))))
    return is_nonincreasing_nonnegative(c, rtol=5e-13)


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
    ``strategy`` (C).

    Each matrix's coefficients come from its own BLT parameters, the other's parameters from
    the secular equation (``_inverse_vjp``), and gradients flow back through its
    vector–Jacobian product; where that map is ill-conditioned (an output scale near 0) the
    other matrix is the power-series reciprocal instead. The error of A₁·diag(χ) (MeanSE) is
    ``blt_frobenius_sq``, O(n·d²); other workloads use the Toeplitz objectives of
    ``toeplitz_objective`` on the noise coefficients."""
    n = workload.n
    a = np.asarray(workload.coeffs)
    closed_error = objective == "mean_se" and bool(np.all(a == a[0]))
    chi = workload.scale
    a0_sq = float(a[0] * a[0])
    prefix_sq = _prefix_scale_sq(workload, participation)

    def error(theta_n, omega_n):
        """error² and its gradient in the noise parameters (θ, ω)."""
        if closed_error:
            e2, gt, go = _frobenius_sq(theta_n, omega_n, chi)
            return a0_sq * e2, a0_sq * gt, a0_sq * go
        g, chain = _coefficients_and_chain(theta_n, omega_n, n)
        e2, ge = frobenius_sq(workload, g) if objective == "mean_se" else last_row_sq(workload, g)
        gt, go = chain(ge)
        return e2, gt, go

    def pair(x):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            theta = 1.0 / (1.0 + np.exp(-x[:d]))
            theta_hat = 1.0 / (1.0 + np.exp(-x[d:]))
            if not (_distinct(theta) and _distinct(theta_hat)):
                return None
            if not _well_conditioned(theta_hat, pair_output_scales(theta, theta_hat)[1]):
                return None
            s2, e2, gs, ge = pair_objective_terms(theta, theta_hat, n, objective)
            if not (np.isfinite(s2) and np.isfinite(e2) and s2 > 0 and e2 > 0):
                return None
            t = np.concatenate([theta, theta_hat])
            grad = (gs / s2 + ge / e2) * t * (1.0 - t)
            value = float(np.log(s2) + np.log(e2) + np.log(prefix_sq))
        if not np.isfinite(value) or not np.all(np.isfinite(grad)):
            return None
        return value, grad

    def fun(x):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            theta, omega = _unpack(x, d)
            if np.any(theta >= 1.0) or np.any(theta <= 0.0):
                return None
            if param == "strategy":
                if not _real_inverse(theta, omega):
                    return None
                out = _closed_terms(theta, omega) if prefix_sq else _strategy_terms(theta, omega)
            else:
                if not _well_conditioned(theta, omega):
                    return None
                out = _closed_terms(theta, omega) if prefix_sq else _noise_terms(theta, omega)
            if out is None:
                return None
            value, grad_theta, grad_omega = out
            grad = np.concatenate([np.real(grad_theta) * theta * (1.0 - theta), np.real(grad_omega)])
        if not np.isfinite(value) or not np.all(np.isfinite(grad)):
            return None
        return value, grad

    def _closed_terms(theta, omega):
        # single participation, prefix sum: closed forms in O(d³ log n) (blt_closed)
        s2, e2, gs, ge = objective_terms(theta, omega, n, objective, param)
        if not (np.isfinite(s2) and np.isfinite(e2) and s2 > 0 and e2 > 0):
            return None
        grad = gs / s2 + ge / e2
        return float(np.log(s2) + np.log(e2) + np.log(prefix_sq)), grad[:d], grad[d:]

    def sens(c, series=False):
        # coefficients from the parameters differ from the power series that evaluate() uses
        # by round-off: test them with half the tolerance, so that an optimum on the region's
        # boundary stays inside it for the power series too
        if not np.all(np.isfinite(c)) or not closed_form_valid(c, participation):
            return None
        if not series and not _inside_with_margin(c, participation):
            return None
        s2, gs = sensitivity_sq(c, participation)
        return (s2, gs) if np.isfinite(s2) and s2 > 0 else None

    def _noise_terms(theta, omega):
        e2, ge_t, ge_o = error(theta, omega)
        if not np.isfinite(e2) or e2 <= 0:
            return None
        inv = _inverse_vjp(theta, omega)
        if inv is not None:
            th_c, om_c, vjp = inv
            c, chain_c = _coefficients_and_chain(th_c, om_c, n)
            out = sens(c)
            if out is None:
                return None
            s2, gs = out
            gt, go = vjp(*chain_c(gs))
        else:  # power-series reciprocal
            u, chain_u = _coefficients_and_chain(theta, omega, n)
            try:
                c = inverse_coefficients(u)
            except ValueError:
                return None
            out = sens(c, series=True)
            if out is None:
                return None
            s2, gs = out
            gt, go = chain_u(reciprocal_gradient(gs, c, n))
        value = float(np.log(s2) + np.log(e2))
        return value, gt / s2 + ge_t / e2, go / s2 + ge_o / e2

    def _strategy_terms(theta, omega):
        c, chain_c = _coefficients_and_chain(theta, omega, n)
        out = sens(c)
        if out is None:
            return None
        s2, gs = out
        gs_t, gs_o = chain_c(gs)
        inv = _inverse_vjp(theta, omega)
        if inv is not None and np.all(np.abs(np.imag(inv[0])) == 0) and np.all(np.real(inv[0]) > 0):
            th_n, om_n, vjp = inv
            e2, ge_t, ge_o = error(np.real(th_n), np.real(om_n))
            ge_t, ge_o = vjp(ge_t.astype(np.complex128), ge_o.astype(np.complex128))
        else:  # power-series reciprocal
            try:
                g = inverse_coefficients(c)
            except ValueError:
                return None
            e2, ge = frobenius_sq(workload, g) if objective == "mean_se" else last_row_sq(workload, g)
            ge_t, ge_o = chain_c(reciprocal_gradient(ge, g, n))
        if not np.isfinite(e2) or e2 <= 0:
            return None
        value = float(np.log(s2) + np.log(e2))
        return value, gs_t / s2 + ge_t / e2, gs_o / s2 + ge_o / e2

    return pair if param == "pair" else fun


def _distinct(theta: np.ndarray) -> bool:
    """Decays in (0, 1) with relative gaps of 1 − θ of at least 1e-6 (see ``_well_conditioned``)."""
    if np.any(theta <= 0.0) or np.any(theta >= 1.0):
        return False
    r = np.sort(1.0 - theta)
    return bool(np.all(np.diff(r) > _MIN_DECAY_GAP * r[1:]))


def _prefix_scale_sq(workload: Workload, participation: Participation) -> float | None:
    """a² when the workload is a·A₁ (the prefix sum up to a constant: Toeplitz with equal
    coefficients and a constant column scale) under single participation, where the closed
    forms of ``blt_closed`` give the objective at any n; None otherwise."""
    n = workload.n
    a = np.asarray(workload.coeffs)
    if participation.participations(n) > 1 and participation.kind != "single":
        return None
    if not workload.is_toeplitz or not np.all(a == a[0]):
        return None
    scale = float(workload.scale[0]) if workload.column_scale is not None else 1.0
    return float((a[0] * scale) ** 2)


def _starting_points(workload, participation, d, starts, param):
    """Log-spaced timescales τ_i (θ_i = 1 − 1/τ_i) over a few ranges. For the strategy C the
    output scales start at 0.6·(1 − θ_i)/d (positive, summing below 1: a non-negative,
    non-increasing C); for the noise C⁻¹ they are fitted by least squares to the square-root
    strategy's noise coefficients, shrunk toward 0 until C stays bounded and in the closed-form
    region."""
    n = workload.n
    ranges = [(1.2, n / 4.0), (2.0, float(n)), (5.0, 5.0 * n), (1.5, float(n))]
    if param == "pair":
        # 2d log-spaced timescales, alternating between the noise's decays θ̂ (the shortest
        # first) and the strategy's θ: zeros and poles interlaced like those of rational
        # approximations of (1 − x)^{∓1/2}
        for lo, hi in ranges[:starts]:
            tau = np.exp(np.linspace(np.log(lo), np.log(max(hi, 2.0 * lo)), 2 * d))
            theta = 1.0 - 1.0 / tau
            yield np.log(theta / (1.0 - theta))[np.r_[1 : 2 * d : 2, 0 : 2 * d : 2]]
        return
    # single participation needs no check of C beyond bounded growth: test it on a prefix of
    # its coefficients (and its decays inside the unit disc), not all n
    multi = participation.kind != "single" and participation.participations(n) > 1
    n_check = n if multi else min(n, 8192)
    if param == "noise":
        base = workload.toeplitz_coeffs if workload.is_toeplitz else np.asarray(workload.coeffs)
        m = min(n - 1, 4096)
        target = inverse_sqrt_coefficients(base[: m + 1] / base[0])
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
            g = blt_coefficients(theta, omega, n_check)
            try:
                c = inverse_coefficients(g)
            except ValueError:
                c = np.full(n_check, np.nan)
            # C must not blow up (its decays inside the unit disc: max |c| stays small)
            tame = np.all(np.isfinite(c)) and float(np.max(np.abs(c))) <= 2.0
            if n_check < n:
                radius = np.max(np.abs(np.linalg.eigvals(np.diag(theta) - np.outer(np.ones(d), omega))))
                tame = tame and radius < 1.0
            if tame and closed_form_valid(c, participation):
                break
            omega = 0.7 * omega
        else:
            omega = np.zeros(d)
        yield np.concatenate([np.log(theta / (1.0 - theta)), omega])
