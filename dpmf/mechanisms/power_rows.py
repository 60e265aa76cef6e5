"""Cross terms of the row norms of A₁·diag(w)·Toep(g) for an inverse power w_j = a + b·(j + 1)^{−γ}.

The inverse-power learning-rate schedule (``dpmf.workloads.schedules``) has no shift-separable
form (``shift_basis``): t^{−γ} is not a finite sum of products φ(m)ψ(a). It is, to round-off,
a sum of decaying exponentials. From Γ(γ)·t^{−γ} = ∫ exp(γx − eˣt) dx (x = log s in
t^{−γ} = Γ(γ)⁻¹∫₀^∞ s^{γ−1}e^{−st} ds), the trapezoidal rule with step h,

    t^{−γ} ≈ Σ_r c_r·e^{−s_r t},   s_r = e^{x_r},   c_r = h·e^{γx_r}/Γ(γ),

converges like e^{−π²/h} (the integrand is analytic in the strip |Im x| < π/2; Beylkin &
Monzón, "Approximation by exponential sums revisited", ACHA 2010, §3). The step shrinks until
the sum reproduces t^{−γ} to 1e-14 and its error summed over t ≤ n is below 1e-11 (or its
relative error reaches round-off), estimated on a log-spaced grid: the row-norm recurrence
adds one cross term per row, so a bias in w accumulates over the rows. The pass below checks
every entry of w against the sum (the form is refused, and the caller falls back to the
general divide and conquer, when one entry is off by more than 1e-13·max|w|). Terms with
s_r·n below 1e-18 are constants over the whole range and join the constant term. About
60–250 terms.

With w_m = Σ_r c'_r·e^{−s_r m} (the constant a is the term s = 0) the cross term of the
row-norm recurrence of ``prefix_rows``,

    y_i = Σ_{0≤k<q≤i} g_k g_q w_{i−(q−k)} = Σ_r c'_r Σ_{q≤i} e^{−s_r(i−q)}·g_q·H_r(q),
    H_r(q) = Σ_{k<q} g_k e^{−s_r k},

is two one-pole recurrences per term: O(n·R) time, O(R·L) memory for a chunk length L. Within
a chunk the powers e^{∓s_r j} (j < L) are computed once; slow terms (s_r·L ≤ 30) run the
outer recurrence as a scaled running sum, fast ones through ``scipy.signal.lfilter`` (their
memory is short, so the rounding of e^{−s_r} does not accumulate). No power e^{s·k} of a
global index is ever formed, so nothing overflows.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lgamma

import numpy as np

from dpmf.mechanisms._fft import lfilter

__all__ = ["InversePower", "inverse_power_form", "power_cross_terms"]

_CHUNK = 1024  # steps per chunk of the streamed recurrences
_SLOW = 30.0  # s·L at most this: scaled running sums (e^{s·j} ≤ e^30 within a chunk)
_SUM_TOL = 1e-11  # Σ_{t≤n} |Σ_r c_r e^{−s_r t} − t^{−γ}|
_W_TOL = 1e-13  # every entry of w reproduced to this times max|w|
_MIN_N = 4096  # below this the divide and conquer is as fast


@dataclass(frozen=True)
class InversePower:
    """w_j = a + b·(j + 1)^{−γ}, j = 0..n−1, with an exponential sum for (j + 1)^{−γ}.

    Attributes:
        n: the length of w.
        a, b, gamma: the fitted form (γ > 0).
        rates: s_r > 0 of the exponential terms, shape (R,).
        weights: c_r·e^{−s_r} (the sum in the step index j), shape (R,).
        constant: a + b·Σ of the terms that are constant over [1, n].
    """

    n: int
    a: float
    b: float
    gamma: float
    rates: np.ndarray
    weights: np.ndarray
    constant: float


def _exponential_sum(gamma: float, n: int) -> tuple[np.ndarray, np.ndarray, float] | None:
    """(s_r, c_r, c₀): t^{−γ} ≈ c₀ + Σ_r c_r e^{−s_r t} for t ∈ [1, n] (module docstring) with
    Σ_{t≤n} |error(t)| ≤ ``_SUM_TOL`` (or a relative error of 4e-15, the round-off floor,
    where the power stays large over the range), or None when no step reaches either.

    The summed error is what matters: the row-norm recurrence adds one cross term per row, so
    a bias δw_t in every entry moves the last row norm by about Σ_t |δw_t|·max|w|·Σg². The sum
    over t is estimated on a log-spaced grid (∫|error| dt = ∫|error|·t d log t)."""
    t = np.unique(np.round(np.geomspace(1.0, float(n), 4000)))
    dlog = np.gradient(np.log(t))
    log_norm = lgamma(gamma)
    # the left tail below 1e-3·_SUM_TOL/n at every t (it is at most e^{γx_lo}/(γΓ(γ)))
    x_lo = (np.log(1e-3 * _SUM_TOL * gamma / n) - log_norm) / gamma
    h = 0.4
    for _ in range(8):
        x_hi = 1.0
        while gamma * x_hi - np.exp(x_hi) > np.log(1e-20):
            x_hi += h
        x = np.arange(x_hi, x_lo, -h)[::-1]
        s = np.exp(x)
        c = h * np.exp(gamma * x - log_norm)
        const = s * n < 1e-18  # e^{−st} = 1 to round-off on [1, n]
        c0 = float(np.sum(c[const]))
        s, c = s[~const], c[~const]
        err = np.abs(c0 + np.exp(-np.outer(t, s)) @ c - t**-gamma)
        summed = float(np.sum(err * t * dlog)) + float(err[0])
        if np.max(err * t**gamma) <= 4e-15 or (np.max(err) <= 1e-14 and summed <= _SUM_TOL):
            return s, c, c0
        h *= 0.85
    return None


def inverse_power_form(w) -> InversePower | None:
    """The form w_j = a + b·(j + 1)^{−γ} of w (shape (n,)), or None when w is not one.

    a, b and γ come from w₀, w₁, w₃ (w₀ − w₁ = b(1 − 2^{−γ}), w₁ − w₃ = 2^{−γ}(w₀ − w₁)); the
    form is returned when those reproduce w at 64 log-spaced entries to 1e-13·max|w|. Every
    entry is checked again against the exponential sum by ``power_cross_terms``. O(1) work
    here; the exponential sum costs O(R·4000).
    """
    w = np.asarray(w, dtype=np.float64)
    n = w.shape[0]
    if n < _MIN_N or not np.all(np.isfinite(w[[0, 1, 3]])):
        return None
    d1, d2 = w[0] - w[1], w[1] - w[3]
    if d1 == 0.0 or d2 == 0.0 or (d1 > 0) != (d2 > 0) or not d1 / d2 > 1.0:
        return None
    gamma = float(np.log2(d1 / d2))
    if not 1e-3 <= gamma <= 16.0:
        return None
    b = d1 / (1.0 - 2.0**-gamma)
    a = w[0] - b
    scale = float(np.max(np.abs(w)))
    idx = np.unique(np.round(np.geomspace(1, n, 64)).astype(np.int64)) - 1
    if np.max(np.abs(a + b * (idx + 1.0) ** -gamma - w[idx])) > _W_TOL * scale:
        return None
    found = _exponential_sum(gamma, n)
    if found is None:
        return None
    s, c, c0 = found
    return InversePower(n, float(a), float(b), gamma, s, b * c * np.exp(-s), float(a + b * c0))


def _fast_terms(g: np.ndarray, n: int, rates: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_r c'_r·y_r for the fast terms, each over the whole range: H_r(q) stops changing once
    e^{−s_r k} underflows (k > 745/s_r), and the outer recurrence is one ``lfilter`` call."""
    y = np.zeros(n)
    p = g.shape[0]
    for s, c in zip(rates, weights, strict=False):
        top = min(p, int(np.ceil(745.0 / s)) + 1)
        terms = g[:top] * np.exp(-s * np.arange(top))
        H = np.empty(top)
        H[0] = 0.0
        np.cumsum(terms[:-1], out=H[1:])
        x = np.zeros(n)
        x[:top] = g[:top] * H
        x[top:p] = g[top:] * (H[-1] + terms[-1])
        y += c * lfilter([1.0], [1.0, -np.exp(-s)], x)
    return y


def _slow_terms(g, w, rates, weights, tol: float) -> np.ndarray | None:
    """Σ_r c'_r·y_r for the slow terms (s_r·L ≤ 30), streamed in chunks of L steps; None as
    soon as a chunk has |w_j − Σ_r c'_r e^{−s_r j}| > tol (all terms; a NaN fails too)."""
    n, p = w.shape[0], g.shape[0]
    L = _CHUNK
    slow = rates * L <= _SLOW
    s, c = rates[slow], weights[slow]
    j = np.arange(L, dtype=np.float64)
    e_minus = np.exp(-np.outer(s, j))  # e^{−s_r j}
    e_plus = np.exp(np.outer(s, j))  # e^{s_r j} ≤ e^30
    e_all = np.exp(-np.outer(rates[~slow], j))  # the fast terms, for the check of w only
    c_fast = weights[~slow]
    lam = np.exp(-s)
    H = np.zeros(s.shape[0])  # H_r(k0) = Σ_{k<k0} g_k e^{−s_r k}
    Y = np.zeros(s.shape[0])  # y_r(k0 − 1)
    A = np.empty((s.shape[0], L))
    y = np.empty(n)
    for k0 in range(0, n, L):
        m = min(L, n - k0)
        d_slow = np.exp(-s * k0)
        fit = (c * d_slow) @ e_minus[:, :m] + (c_fast * np.exp(-rates[~slow] * k0)) @ e_all[:, :m]
        if not float(np.max(np.abs(fit - w[k0 : k0 + m]))) <= tol:
            return None
        a = A[:, :m]
        if k0 < p:
            gc = np.zeros(m)
            gc[: min(m, p - k0)] = g[k0 : min(k0 + m, p)]
            np.multiply(gc, e_minus[:, :m], out=a)
            np.cumsum(a, axis=1, out=a)  # Σ_{k0≤k≤q} g_k e^{−s(k−k0)}
            total = a[:, -1].copy()
            a[:, 1:] = a[:, :-1]  # exclusive: k < q
            a[:, 0] = 0.0
            a *= d_slow[:, None]
            a += H[:, None]  # H_r(q)
            a *= gc  # x_r(q) = g_q H_r(q)
            H = H + d_slow * total
        else:
            a[:] = 0.0
        # y_r(k0 + j) = e^{−s j}·(e^{−s}·y_r(k0 − 1) + Σ_{u≤j} e^{s u} x_r(k0 + u))
        a *= e_plus[:, :m]
        a[:, 0] += lam * Y
        np.cumsum(a, axis=1, out=a)
        a *= e_minus[:, :m]
        Y = a[:, -1].copy()
        y[k0 : k0 + m] = c @ a
    return y


def power_cross_terms(w, g, form: InversePower) -> np.ndarray | None:
    """y_i = Σ_{0≤k<q≤i} g_k g_q w_{i−(q−k)} for w of the inverse-power ``form``, shape (n,):
    the cross terms of the row-norm recurrence of ``prefix_rows``.

    O(n·R) time (R exponential terms, module docstring), O(R·L) extra memory. Returns None
    when an entry of w differs from the form's exponential sum by more than 1e-13·max|w| (the
    caller then takes the general path).

    Args:
        w: shape (n,), the values the form was found from.
        g: the first p ≤ n coefficients of C⁻¹, shape (p,).
        form: ``inverse_power_form(w)``.
    """
    w = np.asarray(w, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    n = w.shape[0]
    rates = np.concatenate([[0.0], form.rates])
    weights = np.concatenate([[form.constant], form.weights])
    y = _slow_terms(g, w, rates, weights, _W_TOL * float(np.max(np.abs(w))))
    if y is None:
        return None
    fast = rates * _CHUNK > _SLOW
    y += _fast_terms(g, n, rates[fast], weights[fast])
    return y
