"""Shift-separable forms of a learning-rate schedule: w_{m+a} = Σ_r φ_r(m)·ψ_r(a).

A schedule w ∈ ℝⁿ whose values are a polynomial of low degree in τ = l/(n−1) (constant,
linear, the polynomial schedule with an integer power) or a combination of 1, cos πτ and
sin πτ (cosine) lies in a space of functions that is closed under shifts, so

    w(τ_m + α_a) = Σ_r φ_r(m)·ψ_r(a),   α_a = a/(n−1),

with a handful of terms R: for a polynomial of degree Q the Taylor expansion
φ_q(m) = w^{(q)}(τ_m)/q!, ψ_q(a) = α_a^q (R = Q + 1); for c₀ + c₁cos πτ + c₂sin πτ the
addition theorems (R = 3). ``prefix_rows`` turns such a form into R convolutions instead of a
divide and conquer over all pairs of coefficients.

The form is found from the values alone: the coefficients are fitted on a few points and
accepted only when the fit reproduces every entry of w to ``rtol``·max|w| (the schedules of
``dpmf.workloads.schedules`` are reproduced to round-off, about 1e-16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import comb

import numpy as np

__all__ = ["ShiftSeparable", "shift_separable"]

_MAX_DEGREE = 4
_SAMPLES = 64
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ShiftSeparable:
    """w_{m+a} = Σ_r φ_r(m)·ψ_r(a) for 0 ≤ m, a and m + a < n.

    Attributes:
        kind: ``polynomial`` or ``cosine`` (the family the values were found in).
        n: the length of w.
        coeffs: the fitted coefficients (monomials τ^q, or 1, cos πτ, sin πτ).
        max_residual: max_l |w_l − fit_l| / max|w| over every entry.
    """

    kind: str
    n: int
    coeffs: tuple[float, ...]
    max_residual: float

    @property
    def rank(self) -> int:
        """R, the number of terms."""
        return len(self.coeffs)

    def psi(self, r: int, d: np.ndarray) -> np.ndarray:
        """ψ_r(d) for integer offsets d (float64 array), shape of d."""
        alpha = d * (1.0 / (self.n - 1))
        if self.kind == "polynomial":
            return alpha**r
        return (np.ones_like(alpha), np.cos(np.pi * alpha), np.sin(np.pi * alpha))[r]

    def phi_coefficients(self) -> np.ndarray:
        """φ_r in the family's basis, shape (R, K): monomials τ^k (k ≤ Q, real) for a
        polynomial, e^{imπτ} (m = −1, 0, 1, complex) for a cosine."""
        c = self.coeffs
        if self.kind == "polynomial":
            deg = len(c) - 1
            out = np.zeros((deg + 1, deg + 1))
            for q in range(deg + 1):
                for j in range(q, deg + 1):
                    out[q, j - q] = c[j] * comb(j, q)
            return out
        a, b = c[1], c[2]
        return np.array(
            [
                [0.0, c[0], 0.0],
                [(a + 1j * b) / 2, 0.0, (a - 1j * b) / 2],
                [(b - 1j * a) / 2, 0.0, (b + 1j * a) / 2],
            ],
            dtype=np.complex128,
        )

    def terms(self, p: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (φ_r of shape (n,), ψ_r of shape (p,)), r = 0..R−1, one pair at a time."""
        n = self.n
        h = 1.0 / (n - 1) if n > 1 else 0.0
        tau = np.arange(n, dtype=np.float64) * h
        alpha = np.arange(p, dtype=np.float64) * h
        c = self.coeffs
        if self.kind == "polynomial":
            deg = len(c) - 1
            for q in range(deg + 1):
                # w^{(q)}(τ)/q! = Σ_{j≥q} c_j·binom(j, q)·τ^{j−q}, by Horner
                phi = np.full(n, c[deg] * comb(deg, q))
                for j in range(deg - 1, q - 1, -1):
                    phi *= tau
                    phi += c[j] * comb(j, q)
                yield phi, alpha**q
            return
        cos_t, sin_t = np.cos(np.pi * tau), np.sin(np.pi * tau)
        yield np.full(n, c[0]), np.ones(p)
        yield c[1] * cos_t + c[2] * sin_t, np.cos(np.pi * alpha)
        yield c[2] * cos_t - c[1] * sin_t, np.sin(np.pi * alpha)


def _bases(kind: str, degree: int) -> Callable[[np.ndarray], np.ndarray]:
    if kind == "polynomial":
        return lambda tau: np.vander(tau, degree + 1, increasing=True)
    return lambda tau: np.stack([np.ones_like(tau), np.cos(np.pi * tau), np.sin(np.pi * tau)], axis=1)


def _max_residual(w: np.ndarray, basis, coeffs: np.ndarray) -> float:
    n = w.shape[0]
    h = 1.0 / (n - 1)
    worst = 0.0
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        tau = np.arange(lo, hi, dtype=np.float64) * h
        worst = max(worst, float(np.max(np.abs(basis(tau) @ coeffs - w[lo:hi]))))
    return worst


def shift_separable(w, *, rtol: float = 1e-13) -> ShiftSeparable | None:
    """The shift-separable form of w (shape (n,)), or None when w is in none of the families.

    Tries polynomials in τ = l/(n−1) of degree 0..4, then c₀ + c₁cos πτ + c₂sin πτ; the first
    whose fit (least squares on 64 Chebyshev-spaced entries) reproduces every entry to
    ``rtol``·max|w| is returned. O(n·R) time, O(R·2²⁰) extra memory.
    """
    w = np.asarray(w, dtype=np.float64)
    n = w.shape[0]
    if n < 2 * _SAMPLES:
        return None
    scale = float(np.max(np.abs(w)))
    if scale == 0.0 or not np.isfinite(scale):
        return None
    nodes = np.unique(np.round((n - 1) * (1 - np.cos(np.pi * np.arange(_SAMPLES) / (_SAMPLES - 1))) / 2))
    idx = nodes.astype(np.int64)
    tau_s = idx / (n - 1.0)
    for kind, degree in [("polynomial", d) for d in range(_MAX_DEGREE + 1)] + [("cosine", 2)]:
        basis = _bases(kind, degree)
        coeffs = np.linalg.lstsq(basis(tau_s), w[idx], rcond=None)[0]
        if np.max(np.abs(basis(tau_s) @ coeffs - w[idx])) > rtol * scale:
            continue
        res = _max_residual(w, basis, coeffs) / scale
        if res <= rtol:
            return ShiftSeparable(kind, n, tuple(float(x) for x in coeffs), res)
    return None
