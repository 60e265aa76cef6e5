"""Closed forms for BLT matrices at any n: sensitivity, MaxSE and MeanSE in O(d³·log n).

A BLT with decays θ and output scales ω (``dpmf.mechanisms.blt``) is the Toeplitz matrix of a
linear state-space system: coefficients t_0 = 1, t_k = cᵀA^{k−1}b (k ≥ 1) with

* BLT(θ, ω) itself: A = diag(θ), b = 1, c = ω;
* its inverse BLT(θ, ω)⁻¹: A = diag(θ) − 1ωᵀ, b = 1, c = −ω (the system run backwards: from
  out_t = z_t + ωᵀs_t, s_{t+1} = diag(θ)s_t + z_t follows z_t = out_t − ωᵀs_t,
  s_{t+1} = (diag(θ) − 1ωᵀ)s_t + out_t). This is real whatever the inverse's decays (complex
  or repeated), so no eigendecomposition is needed.

Every quantity is a quadratic form in sums of the shape L_N(M, X) = Σ_{t<N} M^t X M^tᵀ and
W_N(M, X) = Σ_{t<N} (N − t) M^t X M^tᵀ, computed by doubling on the binary digits of N:

    L_{p+q} = L_p + M^p L_q M^pᵀ,   W_{p+q} = W_p + q·L_p + M^p W_q M^pᵀ

(M^p commutes with every M^t), so a sum over n terms costs O(log n) products of (d+1)×(d+1)
matrices. There is no division by 1 − θ and no difference of geometric sums: with θ ≥ 0 every
term added is non-negative, so the forms stay accurate as decays approach 1, and a decay of
exactly 1 (a buffer that never decays) is allowed. (The textbook closed forms, e.g.
Σ_t h_t² from h_t = β − Σ_iγ_iθ_i^t with γ_i = ω_i/(1 − θ_i), cancel catastrophically there:
relative error ~ ε/(1 − θ)².) The relative error of the doubling grows like n·ε at most (the
error of θ^n by repeated squaring), the same order as the O(n) evaluation's running powers.

* sens² for single participation: Σ_{k<n} t_k² = 1 + cᵀL_{n−1}(A, bbᵀ)c.
* min_sep(b, k) / fixed_epochs: Σ_{m,m'<k} S(n − max(m,m')b, |m − m'|b) with
  S(L, ℓ) = Σ_{u<L} t_u t_{u+ℓ} = t_ℓ + cᵀA^ℓ L_{L−1}(A, bbᵀ) c (ℓ ≥ 1; S(L, 0) as above) —
  the sensitivity when the coefficients are non-negative and non-increasing (min_sep) or
  non-negative (fixed_epochs); ``blt_closed_form`` checks that first (exactly from C's BLT
  parameters where they prove it, else on the n coefficients).
* the prefix-sum workload A₁ with C⁻¹ = T: B = A₁T = Toep(h), h_t = Σ_{k≤t} t_k = 1 + cᵀy_t with
  y_{t+1} = Ay_t + b, y_0 = 0, i.e. x_t = (1, y_t) = M^t e₀ for M = [[1, 0], [b, A]]; the
  largest row of B is the last: max-row² = Σ_{t<n} h_t² = vᵀL_n(M, e₀e₀ᵀ)v with v = (1, c), and
  ‖B‖_F² = Σ_{t<n} (n − t)h_t² = vᵀW_n(M, e₀e₀ᵀ)v.

Gradients (for the optimizer) are by the complex step: every entry of A, b, c, M is a
polynomial in (θ, ω) and doubling uses only products and sums, so f(p + ih·e_j) has imaginary
part h·∂f/∂p_j to machine precision (no subtraction), all 2d directions in one batched pass.

Sources: Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and Near-Optimal Noise
Generation for Streaming Differential Privacy" (FOCS 2024); McMahan, Pillutla et al.,
"Scaling up the Banded Matrix Factorization Mechanism / buffered linear Toeplitz"
(arXiv 2404.16706, closed forms for single participation that do not depend on n); Squire,
Trapp, "Using complex variables to estimate derivatives of real functions" (SIAM Rev. 1998).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int, check_vector
from dpmf.mechanisms.participation import Participation

__all__ = ["BLTClosedForm", "blt_closed_form", "blt_state_space", "check_blt_parameters"]

_MATRICES = ("noise", "strategy")
_STEP = 1e-100  # complex-step size: h² underflows against any value


def check_blt_parameters(theta, omega) -> tuple[np.ndarray, np.ndarray]:
    """θ, ω as float64 vectors of one length d ≥ 1 with every decay in (−1, 1].

    Raises:
        ValueError: different lengths, non-finite entries or a decay outside (−1, 1].
    """
    theta = check_vector("theta", theta)
    omega = check_vector("omega", omega, length=theta.shape[0])
    if np.any(theta > 1.0) or np.any(theta <= -1.0):
        raise ValueError(
            f"theta is invalid: every decay must be in (-1, 1] (1: a buffer that never decays), "
            f"got {theta.tolist()}"
        )
    return theta, omega


def blt_state_space(theta, omega, inverse: bool = False):
    """(A, b, c) with BLT(θ, ω) (or its inverse) = Toep(1, cᵀb, cᵀAb, cᵀA²b, …); shapes
    (…, d, d), (…, d), (…, d) for θ, ω of shape (…, d) (real or complex, batched)."""
    theta = np.asarray(theta)
    omega = np.asarray(omega)
    d = theta.shape[-1]
    A = theta[..., :, None] * np.eye(d)
    b = np.ones(theta.shape, dtype=np.result_type(theta, omega))
    if not inverse:
        return A, b, omega
    return A - b[..., :, None] * omega[..., None, :], b, -omega


def _mT(X):
    return np.swapaxes(X, -1, -2)


def _power(M: np.ndarray, N: int) -> np.ndarray:
    """M^N by repeated squaring (batched)."""
    out = np.broadcast_to(np.eye(M.shape[-1]), M.shape).astype(M.dtype)
    base = M
    while N:
        if N & 1:
            out = out @ base
        N >>= 1
        if N:
            base = base @ base
    return out


def _gram_sums(M: np.ndarray, X: np.ndarray, N: int, weighted: bool):
    """(L_N, W_N) = (Σ_{t<N} M^tXM^tᵀ, Σ_{t<N} (N − t)M^tXM^tᵀ) by doubling on the bits of N,
    batched over leading axes; W is None unless ``weighted``."""
    D = M.shape[-1]
    P = np.broadcast_to(np.eye(D), M.shape).astype(M.dtype)
    L = np.zeros(np.broadcast_shapes(M.shape, X.shape), dtype=np.result_type(M, X))
    W = L.copy() if weighted else None
    count = 0
    for bit in bin(N)[2:] if N > 0 else "":
        if count:  # N → 2N
            if weighted:
                LW = P @ np.stack([L, W]) @ _mT(P)
                W = W + count * L + LW[1]
                L = L + LW[0]
            else:
                L = L + P @ L @ _mT(P)
            P = P @ P
            count *= 2
        if bit == "1":  # N → N + 1: L_{N+1} = L_N + M^N X M^Nᵀ, W_{N+1} = W_N + L_N + M^N X M^Nᵀ
            term = P @ X @ _mT(P)
            if weighted:
                W = W + L + term
            L = L + term
            P = P @ M
            count += 1
    return L, W


def _quad(v: np.ndarray, S: np.ndarray, u: np.ndarray | None = None) -> np.ndarray:
    u = v if u is None else u
    return np.einsum("...i,...ij,...j->...", v, S, u)


def _sensitivity_sq(A, b, c, n: int, k: int, sep: int) -> np.ndarray:
    """Σ_{m,m'<k} S(n − max(m,m')·sep, |m − m'|·sep) (module docstring), batched."""
    bb = b[..., :, None] * b[..., None, :]
    cache: dict[int, np.ndarray] = {}

    def gram(L: int):
        if L not in cache:
            cache[L] = _gram_sums(A, bb, L - 1, False)[0] if L > 1 else np.zeros_like(A @ bb)
        return cache[L]

    def S(L: int, ell: int):
        if L <= 0 or ell >= n:
            return np.zeros(A.shape[:-2])
        if ell == 0:
            return 1.0 + _quad(c, gram(L))
        Al = _power(A, ell)
        t_ell = np.einsum("...i,...ij,...j->...", c, _power(A, ell - 1), b)
        return t_ell + _shifted(c, Al, gram(L))

    total = 0.0
    for m in range(k):
        for mm in range(k):
            total = total + S(n - max(m, mm) * sep, abs(m - mm) * sep)
    return total


def _shifted(c, Al, G):
    """cᵀ A^ℓ G c (batched)."""
    return np.einsum("...i,...ij,...jk,...k->...", c, Al, G, c)


def _prefix_sums(A, b, c, n: int, weighted: bool):
    """(Σ_{t<n} h_t², Σ_{t<n} (n − t)h_t²) for h = cumsum of Toep(1, cᵀA^{k−1}b) (batched)."""
    d = A.shape[-1]
    shape = A.shape[:-2]
    M = np.zeros(shape + (d + 1, d + 1), dtype=np.result_type(A, b))
    M[..., 0, 0] = 1.0
    M[..., 1:, 0] = b
    M[..., 1:, 1:] = A
    X = np.zeros((d + 1, d + 1))
    X[0, 0] = 1.0
    L, W = _gram_sums(M, X, n, weighted)
    v = np.concatenate([np.ones(shape + (1,), dtype=c.dtype), c], axis=-1)
    return _quad(v, L), (_quad(v, W) if weighted else None)


@dataclass(frozen=True)
class BLTClosedForm:
    """Sensitivity and errors of the factorization A₁ = B·C of the prefix sum (n×n) with a BLT.

    ``matrix="noise"``: C⁻¹ = BLT(θ, ω); ``"strategy"``: C = BLT(θ, ω). Unit noise multiplier
    and clip norm; multiply the errors by |a₀| for the workload a₀·A₁.

    Attributes:
        n: steps.
        sensitivity_sq: sens(C)² under the participation.
        max_row_sq: the largest squared row norm of B (its last row).
        mean_row_sq: ‖B‖_F²/n.
        max_se_sq, mean_se_sq: sens²·max_row_sq, sens²·mean_row_sq.
    """

    n: int
    sensitivity_sq: float
    max_row_sq: float
    mean_row_sq: float

    @property
    def max_se_sq(self) -> float:
        return self.sensitivity_sq * self.max_row_sq

    @property
    def mean_se_sq(self) -> float:
        return self.sensitivity_sq * self.mean_row_sq

    @property
    def sensitivity(self) -> float:
        return math.sqrt(self.sensitivity_sq)

    @property
    def max_se(self) -> float:
        return math.sqrt(self.max_se_sq)

    @property
    def mean_se(self) -> float:
        return math.sqrt(self.mean_se_sq)


def _region_check(theta, omega, matrix: str, n: int, participation: Participation) -> None:
    """Raise unless C's coefficients satisfy the closed-form sensitivity's condition."""
    from dpmf.mechanisms.toeplitz import inverse_coefficients, is_nonincreasing_nonnegative

    if matrix == "strategy" and np.all(theta >= 0) and np.all(omega >= 0) and float(np.sum(omega)) <= 1.0:
        return  # a sum of non-negative decreasing geometric sequences with c_1 ≤ c_0
    powers = theta[:, None] ** np.arange(max(n - 1, 0))[None, :]
    g = np.concatenate([[1.0], omega @ powers])
    c = g if matrix == "strategy" else inverse_coefficients(g)
    if participation.kind == "fixed_epochs":
        ok = bool(np.all(c >= -1e-12 * float(np.max(np.abs(c)))))
    else:
        ok = is_nonincreasing_nonnegative(c)
    if not ok:
        raise ValueError(
            f"theta, omega (decays, output scales) are invalid for the closed-form {participation.label} "
            "sensitivity: "
            "the strategy's coefficients must be non-negative"
            + ("" if participation.kind == "fixed_epochs" else " and non-increasing")
            + "; use dpmf.mechanisms.sensitivity for other strategies"
        )


def blt_closed_form(
    theta, omega, n: int, participation: Participation | None = None, *, matrix: str = "noise"
) -> BLTClosedForm:
    """Sensitivity, MaxSE² and MeanSE² of the prefix sum A₁ = B·C with a BLT, O(k²·d³·log n).

    Args:
        theta: decays, shape (d,), each in (−1, 1] (1 allowed: a buffer that never decays).
        omega: output scales, shape (d,).
        n: steps, ≥ 1.
        participation: single (default), min_sep(b, k) or fixed_epochs(b, k).
        matrix: ``noise`` (C⁻¹ = BLT(θ, ω), how dpmf parametrizes a BLT strategy) or
            ``strategy`` (C = BLT(θ, ω)).

    Returns:
        ``BLTClosedForm``.

    Raises:
        ValueError: invalid θ, ω, n or matrix; n incompatible with the participation; or, with
            several participations, a strategy whose coefficients break the closed form's
            condition (non-negative and non-increasing for min_sep, non-negative for
            fixed_epochs), checked from C's parameters or, where they do not prove it, on its n
            coefficients (O(n log n)).
    """
    theta, omega = check_blt_parameters(theta, omega)
    matrix = check_choice("matrix", matrix, _MATRICES)
    participation = participation or Participation.single()
    if not isinstance(participation, Participation):
        raise TypeError(f"participation={participation!r} is invalid: must be a Participation")
    n = participation.check_steps(check_int("n", n, minimum=1))
    k = participation.participations(n)
    if participation.kind != "single" and k > 1:
        _region_check(theta, omega, matrix, n, participation)
    with np.errstate(over="ignore", invalid="ignore"):  # a C that blows up gives inf
        A, b, c = blt_state_space(theta, omega, inverse=matrix == "noise")
        s2 = float(_sensitivity_sq(A, b, c, n, k, participation.min_sep))
        A, b, c = blt_state_space(theta, omega, inverse=matrix == "strategy")
        last, frob = _prefix_sums(A, b, c, n, True)
    return BLTClosedForm(n=n, sensitivity_sq=s2, max_row_sq=float(last), mean_row_sq=float(frob) / n)


def objective_terms(theta: np.ndarray, omega: np.ndarray, n: int, objective: str, param: str):
    """(sens², error², ∂sens²/∂(θ, ω), ∂error²/∂(θ, ω)) for single participation and the prefix
    sum A₁, where ``param`` names the matrix that is BLT(θ, ω) (``noise`` or ``strategy``);
    error² is the last row's (``max_se``) or ‖B‖_F² (``mean_se``). Gradients by the complex
    step, shape (2d,) ordered (θ, ω). O(d³ log n)."""
    d = theta.shape[0]
    p = np.concatenate([theta, omega]).astype(np.complex128)
    P = np.repeat(p[None, :], 2 * d, axis=0)
    P[np.arange(2 * d), np.arange(2 * d)] += 1j * _STEP
    th, om = P[:, :d], P[:, d:]
    A, b, c = blt_state_space(th, om, inverse=param == "noise")
    bb = b[..., :, None] * b[..., None, :]
    G = _gram_sums(A, bb, n - 1, False)[0] if n > 1 else np.zeros_like(A)
    s2 = 1.0 + _quad(c, G)
    A, b, c = blt_state_space(th, om, inverse=param == "strategy")
    last, frob = _prefix_sums(A, b, c, n, objective == "mean_se")
    e2 = last if objective == "max_se" else frob
    return float(s2[0].real), float(e2[0].real), s2.imag / _STEP, e2.imag / _STEP


def pair_output_scales(theta, theta_hat):
    """Output scales of the BLT pair C = BLT(θ, ω), C⁻¹ = BLT(θ̂, ω̂) fixed by the decays:
    C(x) = Π_k(1 − θ̂_kx)/Π_i(1 − θ_ix), so by partial fractions
    ω_i = Π_k(θ_i − θ̂_k)/Π_{j≠i}(θ_i − θ_j) and ω̂_k = Π_i(θ̂_k − θ_i)/Π_{l≠k}(θ̂_k − θ̂_l)
    (batched over leading axes; real or complex). Needs distinct decays within each set."""
    theta = np.asarray(theta)
    theta_hat = np.asarray(theta_hat)
    d = theta.shape[-1]
    eye = np.eye(d, dtype=bool)

    def scales(a, z):
        num = np.prod(a[..., :, None] - z[..., None, :], axis=-1)
        diff = a[..., :, None] - a[..., None, :]
        den = np.prod(np.where(eye, 1.0, diff), axis=-1)
        return num / den

    return scales(theta, theta_hat), scales(theta_hat, theta)


def pair_objective_terms(theta: np.ndarray, theta_hat: np.ndarray, n: int, objective: str):
    """(sens², error², ∂sens²/∂(θ, θ̂), ∂error²/∂(θ, θ̂)) for single participation and the prefix
    sum with C = BLT(θ, ω) and C⁻¹ = BLT(θ̂, ω̂), the output scales from ``pair_output_scales``:
    both matrices diagonal systems, every sum over non-negative powers. Complex-step
    gradients, shape (2d,). O(d³ log n)."""
    d = theta.shape[0]
    p = np.concatenate([theta, theta_hat]).astype(np.complex128)
    P = np.repeat(p[None, :], 2 * d, axis=0)
    P[np.arange(2 * d), np.arange(2 * d)] += 1j * _STEP
    th, th_hat = P[:, :d], P[:, d:]
    om, om_hat = pair_output_scales(th, th_hat)
    A, b, c = blt_state_space(th, om)
    bb = b[..., :, None] * b[..., None, :]
    G = _gram_sums(A, bb, n - 1, False)[0] if n > 1 else np.zeros_like(A)
    s2 = 1.0 + _quad(c, G)
    A, b, c = blt_state_space(th_hat, om_hat)
    last, frob = _prefix_sums(A, b, c, n, objective == "mean_se")
    e2 = last if objective == "max_se" else frob
    return float(s2[0].real), float(e2[0].real), s2.imag / _STEP, e2.imag / _STEP
