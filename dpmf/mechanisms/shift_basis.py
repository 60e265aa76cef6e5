"""Shift-separable forms of a learning-rate schedule: w_{m+a} = Σ_r φ_r(m)·ψ_r(a).

A schedule w ∈ ℝⁿ whose values are a polynomial of low degree in τ = l/(n−1) (constant,
linear, the polynomial schedule with an integer power) or a combination of 1, cos πτ and
sin πτ (cosine) lies in a space of functions that is closed under shifts, so

    w(τ_m + α_a) = Σ_r φ_r(m)·ψ_r(a),   α_a = a/(n−1),

with a handful of terms R: for a polynomial of degree Q the Taylor expansion
φ_q(m) = w^{(q)}(τ_m)/q!, ψ_q(a) = α_a^q (R = Q + 1); for c₀ + c₁cos πτ + c₂sin πτ the
addition theorems (R = 3). ``prefix_rows`` turns such a form into one streamed pass of running
sums (the row norms of A₁·diag(w)·Toep(g), O(n·R²)) instead of a divide and conquer over all
pairs of coefficients, and ``toeplitz`` multiplies series by w in O(n·R) (``product``) inside
its Newton iterations.

The form is found from the values alone: the coefficients are fitted on a few points and
accepted only when the fit reproduces every entry of w to ``rtol``·max|w| (the schedules of
``dpmf.workloads.schedules`` are reproduced to round-off, about 1e-16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
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

    @cached_property
    def _trig(self) -> tuple[np.ndarray, np.ndarray]:
        """cos πτ_k and sin πτ_k for k = 0..n−1 (cosine family only), computed once."""
        tau = np.arange(self.n, dtype=np.float64) * (1.0 / (self.n - 1))
        return np.cos(np.pi * tau), np.sin(np.pi * tau)

    def trig(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos πτ_k, sin πτ_k) for k = lo..hi−1, 0 ≤ lo ≤ hi ≤ n (views of one table)."""
        cos_t, sin_t = self._trig
        return cos_t[lo:hi], sin_t[lo:hi]

    def psi(self, r: int, lo: int, hi: int, sign: float = 1.0) -> np.ndarray:
        """ψ_r(sign·d) for d = lo..hi−1 (sign = ±1), shape (hi − lo,)."""
        if self.kind == "polynomial":
            alpha = np.arange(lo, hi, dtype=np.float64) * (sign / (self.n - 1))
            return alpha**r
        if r == 0:
            return np.ones(hi - lo)
        cos_t, sin_t = self.trig(lo, hi)
        return cos_t.copy() if r == 1 else sign * sin_t

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

    def phi(self, r: int, lo: int, hi: int) -> np.ndarray:
        """φ_r(k) for k = lo..hi−1, shape (hi − lo,)."""
        c = self.coeffs
        if self.kind == "polynomial":
            tau = np.arange(lo, hi, dtype=np.float64) * (1.0 / (self.n - 1))
            deg = len(c) - 1
            # w^{(r)}(τ)/r! = Σ_{j≥r} c_j·binom(j, r)·τ^{j−r}, by Horner
            out = np.full(tau.shape, c[deg] * comb(deg, r))
            for j in range(deg - 1, r - 1, -1):
                out *= tau
                out += c[j] * comb(j, r)
            return out
        if r == 0:
            return np.full(hi - lo, c[0])
        cos_t, sin_t = self.trig(lo, hi)
        return c[1] * cos_t + c[2] * sin_t if r == 1 else c[2] * cos_t - c[1] * sin_t

    def terms(self, p: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (φ_r of shape (n,), ψ_r of shape (p,)), r = 0..R−1, one pair at a time."""
        for r in range(self.rank):
            yield self.phi(r, 0, self.n), self.psi(r, 0, p)

    def product(self, a) -> np.ndarray:
        """The first m coefficients of w·a (``Toep(w)·Toep(a)``'s first column) for a of shape
        (m,), m ≤ n: (w·a)_k = Σ_{d≤k} w_{k−d}a_d = Σ_r φ_r(k)·Σ_{d≤k} ψ_r(−d)a_d (the
        separable form at a negative shift), R running sums, O(m·R).

        Raises:
            ValueError: m > n.
        """
        a = np.asarray(a, dtype=np.float64)
        m = a.shape[0]
        if m > self.n:
            raise ValueError(f"a has {m} coefficients: must be at most n={self.n}")
        out = np.zeros(m)
        for r in range(self.rank):
            out += self.phi(r, 0, m) * np.cumsum(self.psi(r, 0, m, -1.0) * a)
        return out


def _bases(kind: str, degree: int) -> Callable[[np.ndarray], np.ndarray]:
    if kind == "polynomial":
        return lambda tau: np.vander(tau, degree + 1, increasing=True)
    return lambda tau: np.stack([np.ones_like(tau), np.cos(np.pi * tau), np.sin(np.pi * tau)], axis=1)


def _max_residual(w: np.ndarray, form: ShiftSeparable) -> float:
    """max_l |w_l − Σ_q c_q·b_q(τ_l)| in chunks (Horner for a polynomial; the form's cosine table)."""
    n = w.shape[0]
    c = form.coeffs
    worst = 0.0
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        if form.kind == "polynomial":
            tau = np.arange(lo, hi, dtype=np.float64) * (1.0 / (n - 1))
            fit = np.full(hi - lo, c[-1])
            for q in c[-2::-1]:
                fit *= tau
                fit += q
        else:
            cos_t, sin_t = form.trig(lo, hi)
            fit = c[0] + c[1] * cos_t + c[2] * sin_t
        worst = max(worst, float(np.max(np.abs(fit - w[lo:hi]))))
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
        form = ShiftSeparable(kind, n, tuple(float(x) for x in coeffs), 0.0)
        res = _max_residual(w, form) / scale
        if res <= rtol:
            object.__setattr__(form, "max_residual", res)
            return form
    return None
