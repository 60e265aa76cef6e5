"""Sampling-free accounting of balls-in-bins sampling (random allocation).

In the balls-in-bins scheme every example sits in exactly one of b bins, chosen uniformly; for
DP-SGD (``epoch_balls_in_bins``) a fresh bin every epoch, for matrix mechanisms
(``balls_in_bins``) one bin for the whole run. Its dominating pair is the
``MixtureGaussianEvent`` P = (1/b) Σ_j N(v_j, σ²I) against Q = N(0, σ²I). This module measures
it *deterministically* (no sampling, no confidence level).

Orthogonal bins (G_ij = ⟨v_i, v_j⟩ diagonal): the random-allocation setting of Feldman &
Shenfeld, "Privacy amplification by random allocation" (arXiv 2502.08202) and "Efficient
privacy loss accounting for subsampling and random allocation" (arXiv 2602.17284): DP-SGD with
1-out-of-b allocation per epoch (G = I), its last partial epoch (G = diag(1, …, 1, 0, …, 0)),
and fixed bins for C = I (G = diag of the participations per bin).

The reduction to one sum. With μ_j² = G_jj/σ², under Q the likelihood ratio is

    L = P/Q = (1/b) Σ_j X_j,   X_j = exp(μ_j z_j − μ_j²/2),   z_j i.i.d. N(0, 1),

so the whole pair is the law of a sum of b independent log-normal variables under Q (the P-law
is its tilt: dP = L·dQ). For e epochs (independent copies L_1, …, L_e) the two hockey-stick
divergences are (Balle et al. 2018, Thm 1; the PLD form of Koskela et al. 2020)

    remove:  δ_R(ε) = E_Q[(Π_k L_k − e^ε)₊],    add:  δ_A(ε) = E_Q[(1 − e^ε Π_k L_k)₊].

Both integrands are convex in each L_k separately. So replacing the law of each L_k by one that
dominates it in the **convex order** (E f(L') ≥ E f(L) for every convex f) can only increase
both δ's, for every number of epochs (Fubini, one coordinate at a time). Convex order is kept
by independent sums and produced by *mean-preserving spreads*; that is the discretization here:

1. each X_j is spread onto the grid {iΔ}: the Q-mass of every cell [iΔ, (i+1)Δ) goes to its
   two end points with the cell's exact conditional mean kept (normal-cdf formulas,
   E[X·1{z∈[a,c]}] = Φ(c−μ) − Φ(a−μ)). The sum is split by the number N of summands above
   a threshold x_c: N = 0 (every summand on the fine grid [0, x_c]), N = 1 (the big summand
   on a grid K times coarser up to x_cap, with the others spread onto it too) and N ≥ 2,
   charged in full as infinite loss (a union bound), as is a summand above x_cap;
2. the summands are added exactly on their grid (FFT convolutions, binary powering);
3. the remove direction drops mass above the top of the grid and charges it by a Chernoff
   bound, E_Q[L·1{S > s}] ≤ (e^{−λs}/b)·(Π_j ψ_j(λ))·Σ_j ψ_j'(λ)/ψ_j(λ) with ψ_j(λ) =
   E[e^{λX_j}] of the spread law (an upper bound: e^{λx} and x·e^{λx} are convex); below the
   useful range it moves mass *up* (increasing convex order suffices for δ_R); the add
   direction clamps mass above the top down and sends the far lower tail to L = 0 (infinite
   loss);
4. the per-epoch law becomes two dp-accounting PMFs with losses rounded *up* to the grid of
   ``value_discretization_interval`` (remove: P-mass q·L at log L; add: Q-mass q at −log L),
   whose far tails (at most the tail budget) are moved up, and which dp-accounting composes
   (``self_compose`` / ``compose``, pessimistic tail truncation).

Correlated bins (a banded strategy under fixed bins). If the bins split into classes J_c of
pairwise uncorrelated bins (``independent_classes``; for a p-banded C with p ≤ b, ⌊b/p⌋ bins
per class), then with weights w_c = |J_c|/b, L = Σ_c w_c·M_c where M_c, the mean of its
class's X_j, is a sum of *independent* log-normals (jointly Gaussian, uncorrelated). Jensen's
inequality, f(L) ≤ Σ_c w_c·f(M_c) for convex f, bounds L in the convex order by the mixture of
the laws of the M_c: an orthogonal allocation over |J_c| bins each. This is a simpler and
looser argument than the Rényi/dynamic-programming and conditional-composition bounds of
Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random
Allocation" (arXiv 2601.21636): it keeps amplification by ⌊b/p⌋ bins, not b. When no two bins
are uncorrelated (a strategy that is not banded, or bands > b/2) there is no amplification
left; ``supports`` says no and ``epsilon`` refuses by name (the Monte Carlo accountant measures
those).

Every step is an upper bound on both δ's (the spreads only add variance ≤ Δ²/4 per summand;
second order, not a shift), so the reported ε is an ``upper_bound``, never above the Gaussian
bound without amplification (μ = max_j ‖v_j‖/σ per copy, joint convexity), which is reported
instead when smaller. The only departures from exact arithmetic are floating point and FFT
round-off (negative round-off clipped to 0), as in dp-accounting's own PLD composition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as _fft
from scipy.special import logsumexp, ndtr, ndtri

from dpmf._lazy import lazy_module
from dpmf._validation import check_real
from dpmf.accountants.events import GaussianEvent, MixtureGaussianEvent, flatten
from dpmf.accountants.gaussian import gaussian_delta, gaussian_epsilon, gaussian_mu
from dpmf.accountants.result import Measurement

# imported at their first use (dp-accounting takes about a second to import)
pld_pmf = lazy_module("dp_accounting.pld.pld_pmf")
_pld = lazy_module("dp_accounting.pld.privacy_loss_distribution")

__all__ = [
    "AllocationPLDAccountant",
    "calibrate_allocation",
    "independent_classes",
    "is_orthogonal_mixture",
]

_MAX_POINTS = 1 << 20  # grid points of a summand's big part (beyond it the grid is coarsened)
_LOW_TAIL = 1e-30  # mass cut below a partial sum's useful range (moved up / to L = 0)
_MAX_MU = 12.0  # per-bin μ = ‖v‖/σ beyond which only the Gaussian bound is used (ε ≳ 70)
_MAX_LOG_X = 200.0  # log of the largest summand value on a grid (beyond: Gaussian bound)


class _NoiseTooSmall(ArithmeticError):
    """The per-bin μ is so large that the summands' range does not fit a float grid."""


def is_orthogonal_mixture(event) -> bool:
    """Whether ``event`` is a ``MixtureGaussianEvent`` whose Gram matrix is diagonal."""
    if not isinstance(event, MixtureGaussianEvent):
        return False
    G = event.gram
    return not np.any(G - np.diag(np.diag(G)))


def independent_classes(gram) -> list[np.ndarray]:
    """A partition of the bins into classes of pairwise uncorrelated bins (G_ij = 0).

    For a diagonal G: one class. Otherwise let w be the largest *cyclic* distance
    min(|i − j|, b − |i − j|) of a non-zero G_ij (for a p-banded strategy with p ≤ b under
    fixed bins, w ≤ p − 1: a column only meets the next p − 1 columns, across the epoch
    boundary too). The cycle of b bins is cut into q = ⌊b/(w + 1)⌋ segments of ⌊b/q⌋ or
    ⌈b/q⌉ consecutive bins, and class c holds the c-th bin of every segment: two bins of one
    class are at least w + 1 apart. Every class is checked (G restricted to it must be
    diagonal); when q ≤ 1 or a check fails, every bin is its own class.

    Args:
        gram: the b×b Gram matrix.

    Returns:
        The classes, as arrays of bin indices, sizes non-increasing.
    """
    G = np.asarray(gram, dtype=np.float64)
    b = G.shape[0]
    off = G - np.diag(np.diag(G))
    i, j = np.nonzero(off)
    if i.size == 0:
        return [np.arange(b)]
    d = np.abs(i - j)
    w = int(np.max(np.minimum(d, b - d)))
    q = b // (w + 1)
    singletons = [np.array([k]) for k in range(b)]
    if q <= 1:
        return singletons
    base, extra = divmod(b, q)
    lengths = [base + 1] * extra + [base] * (q - extra)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    classes = []
    for c in range(max(lengths)):
        members = np.array([st + c for st, ln in zip(starts, lengths, strict=True) if c < ln], dtype=np.int64)
        sub = off[np.ix_(members, members)]
        if np.any(sub):
            return singletons
        classes.append(members)
    return classes


def _amplifies(event: MixtureGaussianEvent) -> bool:
    return len(independent_classes(event.gram)) < event.bins or event.bins == 1


def _check_supported(event) -> list:
    parts = flatten(event)
    for e in parts:
        if isinstance(e, GaussianEvent):
            continue
        if isinstance(e, MixtureGaussianEvent):
            if not _amplifies(e):
                raise ValueError(
                    "event is invalid for the allocation_pld accountant: every pair of its "
                    f"{e.bins} bins is correlated (no two bins are more than b/2 apart with "
                    "G_ij = 0, e.g. a strategy that is not banded with bands <= bins/2), so the "
                    "bound has no amplification; use accountant='monte_carlo'"
                )
            continue
        raise ValueError(
            f"event {type(e).__name__} is not supported by the allocation_pld accountant: it "
            "measures balls-in-bins (MixtureGaussianEvent) and Gaussian events"
        )
    return parts


# --------------------------------------------------------------------------------------------
# The law of one log-normal summand, spread onto the grid


def _cdf_diff(a: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Φ(c) − Φ(a) for a ≤ c elementwise, accurate in both tails."""
    upper = a > 0
    return np.where(upper, ndtr(-a) - ndtr(-c), ndtr(c) - ndtr(a))


def _spread(mu: float, step: float, first: int, last: int) -> np.ndarray:
    """Mean-preserving spread of Q(X ∈ ·, firstΔ ≤ X ≤ lastΔ) onto {firstΔ, …, lastΔ}.

    X = exp(μz − μ²/2), z ~ N(0, 1). Each cell [iΔ, (i+1)Δ) sends its Q-mass m_i to its end
    points with the cell's mean E[X; cell] = Φ(c − μ) − Φ(a − μ) kept (a, c: the cell's ends
    in z). Returns the masses, shape (last − first + 1,).
    """
    edges = np.arange(first, last + 1) * step
    with np.errstate(divide="ignore"):
        z = (np.log(edges) + mu * mu / 2.0) / mu  # -inf at x = 0
    m = _cdf_diff(z[:-1], z[1:])
    mean = _cdf_diff(z[:-1] - mu, z[1:] - mu)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(m > 0, (mean / np.where(m > 0, m, 1.0) - edges[:-1]) / step, 0.0)
    frac = np.clip(frac, 0.0, 1.0)
    out = np.zeros(last - first + 1)
    out[:-1] += m * (1.0 - frac)
    out[1:] += m * frac
    return out


@dataclass(frozen=True, eq=False)
class _Group:
    """``count`` bins with the same μ: the summand's law split at x_c = kΔ into a small part
    (X ≤ x_c, on {0, …, k}) and a big part (x_c < X ≤ x_cap, on {k, …, top})."""

    mu: float
    count: int
    small: np.ndarray
    big: np.ndarray | None  # on the coarse grid KΔ, indices k/K..top/K; None: X = 1
    k: int
    p_big: float  # P_Q(X > x_c)
    a_big: float  # E_Q[X; X > x_c] = P(X > x_c | z ~ N(μ, 1))
    p_top: float  # P_Q(X > x_cap)
    a_top: float  # E_Q[X; X > x_cap]


def _group(mu: float, count: int, step: float, z_small: float, z_top: float, coarse: int) -> _Group:
    if mu == 0.0:  # an empty bin: X = 1 exactly, spread onto its two grid neighbours
        pos = 1.0 / step
        i = int(math.floor(pos))
        small = np.zeros(i + 2)
        small[i] += 1.0 - (pos - i)
        small[i + 1] += pos - i
        return _Group(0.0, count, small, None, i + 1, 0.0, 0.0, 0.0, 0.0)
    big_step = coarse * step
    kc = max(int(math.ceil(math.exp(mu * z_small - mu * mu / 2.0) / big_step)), 2)
    topc = max(int(math.ceil(math.exp(mu * z_top - mu * mu / 2.0) / big_step)), kc + 1)
    k, top = kc * coarse, topc * coarse
    small = _spread(mu, step, 0, k)
    big = _spread(mu, big_step, kc, topc)  # on the coarse grid {kc, …, topc}·KΔ
    zk = (math.log(k * step) + mu * mu / 2.0) / mu
    zt = (math.log(top * step) + mu * mu / 2.0) / mu
    return _Group(
        mu,
        count,
        small,
        big,
        k,
        float(ndtr(-zk)),
        float(ndtr(-(zk - mu))),
        float(ndtr(-zt)),
        float(ndtr(-(zt - mu))),
    )


# --------------------------------------------------------------------------------------------
# Sums on the grid


def _convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = a.size + b.size - 1
    size = _fft.next_fast_len(n, real=True)
    out = _fft.irfft(_fft.rfft(a, size) * _fft.rfft(b, size), size)[:n]
    np.maximum(out, 0.0, out=out)  # FFT round-off
    return out


class _Law:
    """A sub-probability law on {(lo + i)Δ}, with the mass it has sent to S = 0."""

    __slots__ = ("lo", "p", "to_zero")

    def __init__(self, lo: int, p: np.ndarray, to_zero: float = 0.0):
        self.lo, self.p, self.to_zero = lo, p, to_zero


def _truncate(law: _Law, cap: int, remove: bool) -> _Law:
    """Cut the law to indices ≤ cap and drop its negligible lower tail, in the direction's
    safe way: remove drops mass above the cap (charged by the Chernoff bound) and moves the
    lower tail up; add clamps mass above the cap down to it and sends the lower tail to 0."""
    lo, p = law.lo, law.p
    to_zero = law.to_zero
    if lo + p.size - 1 > cap:
        keep = max(cap - lo + 1, 1)
        if not remove:
            p[keep - 1] += p[keep:].sum()
        p = p[:keep]
    c = np.cumsum(p)
    cut = int(np.searchsorted(c, _LOW_TAIL, side="right"))
    if 0 < cut < p.size:
        low = c[cut - 1]
        p = p[cut:].copy()
        if remove:
            p[0] += low
        else:
            to_zero += low
        lo += cut
    return _Law(lo, p, to_zero)


def _add(a: _Law, b: _Law, cap: int, remove: bool) -> _Law:
    out = _Law(a.lo + b.lo, _convolve(a.p, b.p), a.to_zero + b.to_zero)
    return _truncate(out, cap, remove)


def _power(law: _Law | None, n: int, cap: int, remove: bool) -> _Law | None:
    """The n-fold sum (None for n = 0)."""
    result = None
    base = law
    while n:
        if n & 1:
            result = base if result is None else _add(result, base, cap, remove)
        n >>= 1
        if n:
            base = _add(base, base, cap, remove)
    return result


def _coarsen(law: _Law, factor: int) -> _Law:
    """Mean-preserving spread of a law on {jΔ} onto {i·factor·Δ}."""
    j = law.lo + np.arange(law.p.size)
    q, r = np.divmod(j, factor)
    frac = r / factor
    q0 = int(q[0])
    n = int(q[-1]) - q0 + 2
    out = np.bincount(q - q0, weights=law.p * (1.0 - frac), minlength=n)
    out += np.bincount(q - q0 + 1, weights=law.p * frac, minlength=n)
    return _Law(q0, out, law.to_zero)


def _sum(laws, cap: int, remove: bool) -> _Law | None:
    out = None
    for law in laws:
        if law is not None:
            out = law if out is None else _add(out, law, cap, remove)
    return out


def _log_mgf(p: np.ndarray, step: float, lam: float) -> tuple[float, float]:
    """log ψ(λ) and log ψ'(λ) of a law on {0, Δ, …} (ψ(λ) = Σ p_i e^{λiΔ})."""
    keep = np.flatnonzero(p > 0)
    x = keep * step
    a = np.log(p[keep]) + lam * x
    with np.errstate(divide="ignore"):
        return float(logsumexp(a)), float(logsumexp(a + np.log(x)))


def _chernoff(groups, counts, bins: int, step: float, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each λ: (log of (1/b)·Π_g ψ_g^{c_g}·Σ_g c_g ψ_g'/ψ_g, λ) for the small-part sums.

    E_Q[(S/b)·1{S > s}] ≤ e^{−λs}·(1/b)·E[S e^{λS}] = e^{−λs}·(that), for every λ ≥ 0; the
    spread laws' ψ, ψ' bound the true ones (e^{λx} and x·e^{λx} are convex).
    """
    out = np.full(lam.size, -math.log(bins))
    for j, value in enumerate(lam):
        total, ratio = 0.0, -math.inf
        for g, c in zip(groups, counts, strict=True):
            if c == 0:
                continue
            lp, ld = _log_mgf(g.small, step, float(value))
            total += c * lp
            ratio = np.logaddexp(ratio, math.log(c) + ld - lp)
        out[j] += total + ratio
    return out, lam


def _chernoff_cap(groups, bins: int, step: float, tail: float) -> int:
    """Index s/Δ with E_Q[(S/b)·1{S > s}] ≤ tail for the sum of all the small parts."""
    mean = sum(g.count * float(np.dot(g.small, np.arange(g.small.size))) for g in groups) * step
    lam = np.geomspace(0.02 / max(g.k for g in groups) / step, 20.0 / step, 24)
    log_f, lam = _chernoff(groups, [g.count for g in groups], bins, step, lam)
    need = (log_f - math.log(tail)) / lam
    return int(math.ceil(max(float(np.min(need)), 1.5 * mean) / step))


def _chernoff_at(groups, counts, bins: int, step: float, cap: int) -> float:
    """min over λ of the Chernoff bound at s = cap·Δ (see ``_chernoff``)."""
    lam = np.geomspace(0.02 / max(g.k for g in groups) / step, 20.0 / step, 24)
    log_f, lam = _chernoff(groups, counts, bins, step, lam)
    return float(np.exp(np.min(log_f - lam * cap * step)))


# --------------------------------------------------------------------------------------------
# From one mixture to a dp-accounting PLD


def _grid_step(mus, counts, resolution: float, tail: float) -> float:
    """The summand grid step Δ (= 1/K, or an integer ≥ 1).

    Δ ≈ ``resolution`` · (root-mean-square std of the summands), and small enough that the
    atom at S = 0 (every summand in its first cell, infinite add-direction loss) has Q-mass
    ≤ ``tail`` when no bin is empty.
    """
    var = np.expm1(mus**2)
    rms = math.sqrt(float(np.sum(counts * var) / np.sum(counts)))
    target = resolution * max(rms, 1e-6)
    if np.all(mus > 0):  # no empty bin: keep P(S < Δ) below the tail
        n = int(np.sum(counts))
        z = float(ndtri(tail ** (1.0 / n)))
        target = min(target, float(np.min(np.exp(mus * z - mus**2 / 2.0))))
    if target >= 1.0:
        return float(math.ceil(target))
    return 1.0 / math.floor(1.0 / target)


def _split_point(mus, counts, tail: float) -> float:
    """z_c with (max_g P(z > z_c − μ_g))·nP(z > z_c) + (nP(z > z_c))²/2 ≤ tail: the P-mass
    of two or more summands above their x_c (n: the bins with μ > 0)."""
    n = float(np.sum(counts[mus > 0]))
    mu_max = float(np.max(mus))

    def excess(z):
        p = n * float(ndtr(-z))
        return float(ndtr(-(z - mu_max))) * p + p * p / 2.0 - tail

    lo, hi = 0.0, 40.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def _mixture_pmfs(event: MixtureGaussianEvent, vdi: float, tail: float, resolution: float):
    """The (remove, add) dp-accounting PMFs of one copy of an orthogonal mixture.

    The sum S is split by the number N of summands above their x_c: N = 0 (all small),
    N = 1 (one big summand on its own grid, convolved with the other small ones) and N ≥ 2
    (charged in full, with the summands above x_cap). The budget ``tail`` is split in six.
    """
    b = event.bins
    g = np.diag(event.gram)
    values, counts = np.unique(g, return_counts=True)
    mus = np.sqrt(values) / event.noise_multiplier
    if float(np.max(mus)) > _MAX_MU:
        raise _NoiseTooSmall()
    per = tail / 6.0
    step = _grid_step(mus, counts, resolution, per)
    if np.any(mus > 0):
        z_small = _split_point(mus, counts, per)
        n = float(np.sum(counts[mus > 0]))
        z_top = max(-float(ndtri(per / (2.0 * n))), float(np.max(mus)) - float(ndtri(per / 2.0)))
        z_top = max(z_top, z_small + 0.5)
    else:
        z_small = z_top = 0.0
    if float(np.max(mus * z_top - mus**2 / 2.0)) > _MAX_LOG_X:
        raise _NoiseTooSmall()
    x_top = float(np.max(np.exp(mus * z_top - mus**2 / 2.0)))
    if x_top / step > _MAX_POINTS:  # a coarser grid is only looser, never less private
        step = x_top / _MAX_POINTS
        step = float(math.ceil(step)) if step >= 1.0 else 1.0 / math.floor(1.0 / step)
    # the term with one big summand lives on a grid K times coarser: its S ≥ x_c is large, so
    # the spread's extra variance (KΔ)²/4 is negligible next to that of the other summands
    var_sum = float(np.sum(counts * np.expm1(mus**2)))
    coarse = max(1, int(0.05 * math.sqrt(var_sum) / step))
    groups = [
        _group(float(m), int(c), step, z_small, z_top, coarse) for m, c in zip(mus, counts, strict=True)
    ]
    p_big = sum(gr.count * gr.p_big for gr in groups)
    a_max = max(gr.a_big for gr in groups)
    # P-mass of N ≥ 2 and of a summand above x_cap (union bounds); Q-masses for the add side
    charge_p = a_max * p_big + p_big * p_big / 2.0
    charge_p += max(gr.a_top for gr in groups) + sum(gr.count * gr.p_top for gr in groups)
    charge_q = p_big * p_big / 2.0 + sum(gr.count * gr.p_top for gr in groups)
    cap = _chernoff_cap(groups, b, step, per)
    pmfs = []
    for remove in (True, False):
        smalls = [_Law(0, gr.small.copy()) for gr in groups]
        lower = [_power(sm, gr.count - 1, cap, remove) for sm, gr in zip(smalls, groups, strict=True)]
        full = [
            sm if lo_ is None else _add(lo_, sm, cap, remove) for sm, lo_ in zip(smalls, lower, strict=True)
        ]
        n0 = _sum(full, cap, remove)  # N = 0
        atoms = [(n0.lo + np.arange(n0.p.size), n0.p)]  # (index on the Δ grid, Q-mass)
        to_zero = n0.to_zero
        infinity = charge_p + per if remove else charge_q
        for i, gr in enumerate(groups):
            if gr.big is None:
                continue
            others = _sum([lower[i]] + full[:i] + full[i + 1 :], cap, remove)
            big = _Law(gr.k // coarse, gr.big * gr.count)
            if others is not None:
                oc = _coarsen(others, coarse)
                to_zero += oc.to_zero
                big = _Law(oc.lo + big.lo, _convolve(oc.p, big.p))
            atoms.append(((big.lo + np.arange(big.p.size)) * coarse, big.p))
            if remove and others is not None:
                # the others' mass dropped above s = capΔ, inside this term: with R the
                # others' sum and C ≥ E[(R/b)·1{R > s}] (Chernoff), its P-mass is
                # (c/b)·(E[X; big]·P(R > s) + P(big)·E[R·1{R > s}]) ≤ c·C·(a_big/s + p_big)
                counts_i = [gr2.count - (1 if j == i else 0) for j, gr2 in enumerate(groups)]
                chern = _chernoff_at(groups, counts_i, b, step, cap)
                infinity += gr.count * chern * (gr.a_big / (cap * step) + gr.p_big)
        idx = np.concatenate([a[0] for a in atoms])
        q = np.concatenate([a[1] for a in atoms])
        pos = (idx > 0) & (q > 0)
        ell = np.log(idx[pos] * (step / b))
        if remove:
            mass = q[pos] * idx[pos] * (step / b)  # P-mass of an atom = its Q-mass · L
            k = np.ceil(ell / vdi)
        else:
            mass = q[pos]
            k = np.ceil(-ell / vdi)
            infinity += to_zero + float(q[(idx <= 0) & (q > 0)].sum())
        k = k.astype(np.int64)
        kmin = int(k.min())
        probs = np.bincount(k - kmin, weights=mass)
        # in loss space moving mass up is always pessimistic (δ grows by at most the mass
        # moved): the lower tail (at most ``per``) goes up to the first kept loss, the upper
        # tail (at most ``per``) to +inf
        c = np.cumsum(probs)
        first = int(np.searchsorted(c, per, side="right"))
        r = np.cumsum(probs[::-1])
        last = probs.size - int(np.searchsorted(r, per, side="right"))
        if first < last:
            infinity += float(probs[last:].sum())
            kept = probs[first:last].copy()
            kept[0] += float(probs[:first].sum())
            probs, kmin = kept, kmin + first
        pmfs.append(pld_pmf.DensePLDPmf(vdi, kmin, probs, min(1.0, infinity), True))
    return pmfs[0], pmfs[1], step


def _combine(pmfs, weights, vdi: float) -> pld_pmf.DensePLDPmf:
    """The PMF of the mixture Σ_c w_c·(law c): masses and infinite masses add linearly."""
    lower = min(p._lower_loss for p in pmfs)  # noqa: SLF001 (dp-accounting's PMF fields)
    upper = max(p._lower_loss + p._probs.size for p in pmfs)  # noqa: SLF001
    probs = np.zeros(upper - lower)
    infinity = 0.0
    for p, w in zip(pmfs, weights, strict=True):
        start = p._lower_loss - lower  # noqa: SLF001
        probs[start : start + p._probs.size] += w * p._probs  # noqa: SLF001
        infinity += w * p._infinity_mass  # noqa: SLF001
    return pld_pmf.DensePLDPmf(vdi, lower, probs, min(1.0, infinity), True)


def _class_pmfs(event: MixtureGaussianEvent, vdi: float, tail: float, resolution: float):
    """(remove, add) PMFs of one copy of any mixture, through its independent classes.

    With classes J_1, …, J_r of pairwise uncorrelated bins (``independent_classes``),
    L = Σ_c (|J_c|/b)·M_c with M_c = (1/|J_c|)·Σ_{j∈J_c} X_j, and Jensen's inequality gives
    f(L) ≤ Σ_c (|J_c|/b)·f(M_c) for every convex f: L is dominated in the convex order by the
    *mixture* of the laws of the M_c, each an orthogonal mixture of |J_c| independent bins.
    Within a class the squared norms are rounded up to the class size's largest (log-normals
    of mean 1 grow in the convex order with their variance), so classes of one size share
    one computation.
    """
    if is_orthogonal_mixture(event):
        rem, add, _ = _mixture_pmfs(event, vdi, tail, resolution)
        return rem, add
    classes = independent_classes(event.gram)
    g = np.diag(event.gram)
    b = event.bins
    by_size: dict[int, float] = {}
    for members in classes:
        by_size[members.size] = max(by_size.get(members.size, 0.0), float(np.max(g[members])))
    rems, adds, weights = [], [], []
    for size, top in sorted(by_size.items()):
        n_classes = sum(1 for m in classes if m.size == size)
        sub = MixtureGaussianEvent(event.noise_multiplier, np.eye(size) * top, 1)
        rem, add, _ = _mixture_pmfs(sub, vdi, tail, resolution)
        rems.append(rem)
        adds.append(add)
        weights.append(size * n_classes / b)
    return _combine(rems, weights, vdi), _combine(adds, weights, vdi)


def _event_pld(event, vdi: float, tail: float, resolution: float):
    """The composed PLD; at most ``tail`` mass is charged as infinite loss in all (half in
    the per-copy discretizations, half in dp-accounting's pessimistic tail truncations)."""
    parts = _check_supported(event)
    total = None
    copies = sum(e.count if isinstance(e, GaussianEvent) else e.repetitions for e in parts)
    per_copy = tail / 2.0 / max(copies, 1)
    per_op = tail / 2.0 / (2 * len(parts))  # each self_compose / compose truncates once
    for e in parts:
        if isinstance(e, GaussianEvent):
            pld = _pld.from_gaussian_mechanism(
                e.noise_multiplier, value_discretization_interval=vdi, pessimistic_estimate=True
            ).self_compose(e.count, tail_mass_truncation=per_op)
        else:
            rem, add = _class_pmfs(e, vdi, per_copy, resolution)
            pld = _pld.PrivacyLossDistribution(rem, add)
            if e.repetitions > 1:
                pld = pld.self_compose(e.repetitions, tail_mass_truncation=per_op)
        total = pld if total is None else total.compose(pld, tail_mass_truncation=per_op)
    return total


def _gaussian_bound_mu(parts) -> float:
    """μ of the Gaussian that dominates the event without amplification (joint convexity)."""
    mu2 = 0.0
    for e in parts:
        if isinstance(e, GaussianEvent):
            mu2 += e.count / e.noise_multiplier**2
        else:
            mu2 += e.repetitions * (e.max_norm / e.noise_multiplier) ** 2
    return math.sqrt(mu2)


class AllocationPLDAccountant:
    """Deterministic PLD accountant for balls-in-bins sampling (random allocation).

    Measures ``MixtureGaussianEvent`` s (DP-SGD under random allocation,
    ``epoch_balls_in_bins``; fixed bins, ``balls_in_bins``, for C = I exactly and for banded
    strategies through classes of uncorrelated bins), ``GaussianEvent`` s and their
    compositions, by the convex-order discretization described in the module docstring.
    The reported ε is the smaller of that bound and the Gaussian bound without amplification
    (both valid). Mixtures with no pair of uncorrelated bins are refused.

    Args:
        value_discretization_interval: the loss grid of the dp-accounting PMFs (default 1e-4).
        resolution: the summand grid step Δ relative to the summands' standard deviation
            (default 0.03; smaller is slower and tighter, never less private).
        tail_fraction: the mass charged as infinite loss, as a fraction of δ (default 1e-3:
            the reported ε meets δ with 0.1% of it spent on truncated tails; for ``delta``
            queries 1e-12 is charged instead).

    Raises:
        ValueError: any argument not positive (resolution and tail_fraction also ≤ 0.5).
    """

    name = "allocation_pld"

    def __init__(
        self,
        value_discretization_interval: float = 1e-4,
        resolution: float = 0.03,
        tail_fraction: float = 1e-3,
    ):
        self.value_discretization_interval = check_real(
            "value_discretization_interval",
            value_discretization_interval,
            low=0.0,
            high=0.1,
            low_inclusive=False,
        )
        self.resolution = check_real("resolution", resolution, low=0.0, high=0.5, low_inclusive=False)
        self.tail_fraction = check_real(
            "tail_fraction", tail_fraction, low=0.0, high=0.5, low_inclusive=False
        )

    def supports(self, event) -> bool:
        """Whether ``event`` is made of orthogonal mixtures and Gaussian events."""
        try:
            _check_supported(event)
        except (ValueError, TypeError):
            return False
        return True

    def _method(self, parts=()) -> str:
        classes = [
            len(independent_classes(e.gram))
            for e in parts
            if isinstance(e, MixtureGaussianEvent) and not is_orthogonal_mixture(e)
        ]
        extra = (
            f"; correlated bins bounded through {max(classes)} classes of uncorrelated bins (Jensen)"
            if classes
            else ""
        )
        return (
            "random-allocation PLD, convex-order discretization of the log-normal sum "
            "(Feldman & Shenfeld 2025, arXiv 2502.08202 / 2602.17284 setting; "
            f"value_discretization_interval={self.value_discretization_interval:g}, "
            f"resolution={self.resolution:g}{extra})"
        )

    def pld(self, event, tail: float = 1e-12):
        """The dp-accounting ``PrivacyLossDistribution`` bounding ``event`` (both directions).

        Args:
            event: a supported event (see the class docstring).
            tail: total mass charged as infinite loss for truncations, in (0, 0.5].

        Raises:
            ValueError: an unsupported event or tail; ArithmeticError when a bin's μ = ‖v‖/σ
                is too large for the grid (σ far below 0.1·‖v‖): use the Gaussian bound.
        """
        tail = check_real("tail", tail, low=0.0, high=0.5, low_inclusive=False)
        return _event_pld(event, self.value_discretization_interval, tail, self.resolution)

    def epsilon(self, event, delta: float) -> Measurement:
        """ε at ``delta``: an upper bound (deterministic).

        Raises:
            ValueError: δ outside (0, 1); an event with correlated bins or of another kind.
        """
        delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        parts = _check_supported(event)
        eps_gauss = gaussian_epsilon(_gaussian_bound_mu(parts), delta)
        try:
            pld = self.pld(event, tail=self.tail_fraction * delta)
            eps = float(pld.get_epsilon_for_delta(delta))
        except _NoiseTooSmall:
            eps = math.inf
        if eps_gauss <= eps:
            method = "Gaussian bound without amplification (joint convexity; smaller than the PLD)"
            return Measurement(eps_gauss, delta, self.name, "upper_bound", method)
        return Measurement(max(eps, 0.0), delta, self.name, "upper_bound", self._method(parts))

    def delta(self, event, epsilon: float) -> Measurement:
        """δ at ``epsilon``: an upper bound (deterministic)."""
        epsilon = check_real("epsilon", epsilon, low=0.0)
        parts = _check_supported(event)
        d_gauss = gaussian_delta(_gaussian_bound_mu(parts), epsilon)
        try:
            d = float(self.pld(event, tail=1e-12).get_delta_for_epsilon(epsilon))
        except _NoiseTooSmall:
            d = math.inf
        if d_gauss <= d:
            method = "Gaussian bound without amplification (joint convexity; smaller than the PLD)"
            return Measurement(epsilon, d_gauss, self.name, "upper_bound", method)
        method = self._method(parts)
        return Measurement(epsilon, min(max(d, 0.0), 1.0), self.name, "upper_bound", method)


def calibrate_allocation(event1, epsilon: float, delta: float, rtol: float = 1e-3, accountant=None):
    """The smallest σ multiplier (within ``rtol``) whose event meets (ε, δ), and its measurement.

    ``event1`` is built at σ = 1; every noise multiplier in it is multiplied by the returned σ.
    The search relies on ε(σ) being non-increasing: it brackets by halving from the Gaussian
    bound without amplification (which always meets the target), runs Brent's method on
    log σ on a coarse grid (value_discretization_interval 1e-3, resolution 0.1: more
    pessimistic, faster), then evaluates the accountant's own grid at that σ and tries one
    secant step below it. Every returned σ was evaluated on the fine grid and meets the target.

    Args:
        event1: the event at σ = 1 (see ``AllocationPLDAccountant``).
        epsilon: target ε > 0.
        delta: target δ in (0, 1).
        rtol: relative tolerance on σ in (0, 0.1].
        accountant: the ``AllocationPLDAccountant`` for the final answer (None: default).

    Returns:
        (σ, Measurement at σ, details) with details ``{"evaluations": k}``.

    Raises:
        ValueError: invalid arguments or an unsupported event.
    """

    from scipy.optimize import brentq

    from dpmf.accountants.events import ComposedEvent

    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    rtol = check_real("rtol", rtol, low=0.0, high=0.1, low_inclusive=False)
    parts = _check_supported(event1)
    fine = accountant if accountant is not None else AllocationPLDAccountant()
    coarse = AllocationPLDAccountant(1e-3, max(fine.resolution, 0.1), fine.tail_fraction)

    def scaled(s):
        def one(e):
            return e.with_noise(e.noise_multiplier * s)

        if isinstance(event1, ComposedEvent):
            return ComposedEvent(tuple(one(e) for e in parts))
        return one(event1)

    history: dict[float, float] = {}

    def f(x: float) -> float:
        s = math.exp(x)
        history[s] = coarse.epsilon(scaled(s), delta).epsilon
        return min(history[s], 1e6) - epsilon

    hi = _gaussian_bound_mu(parts) / gaussian_mu(epsilon, delta)  # meets the target
    lo = hi / 2.0
    while f(math.log(lo)) <= 0:
        hi, lo = lo, lo / 2.0
        if lo < 1e-4:
            raise ValueError("calibration failed: the target is met for every noise multiplier >= 1e-4")
    if math.log(hi) - math.log(lo) > rtol / 4.0:
        brentq(f, math.log(lo), math.log(hi), xtol=rtol / 4.0, rtol=1e-12)
    s_coarse = min(s for s, e in history.items() if e <= epsilon)
    evals = len(history)
    meas = fine.epsilon(scaled(s_coarse), delta)
    evals += 1
    s = s_coarse
    while meas.epsilon > epsilon:  # the fine grid was not tighter here: step up
        s *= 1.0 + rtol
        meas = fine.epsilon(scaled(s), delta)
        evals += 1
    # one secant step below, with the slope of the coarse evaluations near the answer
    near = sorted((math.log(t), e) for t, e in history.items() if abs(math.log(t / s)) < 0.2)
    if len(near) >= 2 and meas.epsilon < epsilon:
        x = np.array([p[0] for p in near])
        y = np.array([p[1] for p in near])
        slope = -float(np.polyfit(x, y, 1)[0])
        if slope > 0:
            s2 = s * math.exp(-(epsilon - meas.epsilon) / slope + rtol / 4.0)
            if s2 < s * (1.0 - rtol / 2.0):
                meas2 = fine.epsilon(scaled(s2), delta)
                evals += 1
                if meas2.epsilon <= epsilon:
                    s, meas = s2, meas2
    return s, meas, {"evaluations": evals, "coarse_noise_multiplier": s_coarse}
