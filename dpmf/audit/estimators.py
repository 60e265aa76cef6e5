"""Empirical privacy estimators: an ε lower bound (or attack statistics) from canary scores.

An audit inserts m canaries, each independently "in" (used by the training run) or "out" with
probability ½, and gives each a score that should be higher for "in" canaries. The functions
here turn the two score arrays into statistics of the membership attack "guess in when the
score is ≥ τ" and, at a significance level α, into a number ε̂ such that, if the run were
(ε, δ)-DP with ε < ε̂, observing scores at least as separated as these would have probability
at most α. ε̂ is a lower bound on the run's true ε with confidence 1 − α; ε̂ > claimed ε means
the claim is wrong (or an event of probability ≤ α happened).

Names and meaning follow jax-privacy 2.0.0's ``jax_privacy.auditing.CanaryScoreAuditor``
(same thresholds, same corrections, same root-finding tolerances), so results agree to ~1e-12
(``benchmarks/bench_audit_estimators.py`` compares them). Conventions common to every function:

* ``in_scores`` (shape (m_in,)) and ``out_scores`` (shape (m_out,)): 1-D, non-empty, no NaN;
  higher means "in" (negate a loss before calling).
* Thresholds: every distinct score and +∞; only the thresholds on the concave hull of the ROC
  curve are kept (classifiers that randomize between two thresholds dominate the others). The
  Bonferroni correction divides the significance by the number of kept thresholds.
* ``threshold_strategy``: ``Bonferroni()`` (default: every threshold, corrected), ``Split``
  (choose τ on one random part of the canaries, bound on the rest), or ``Explicit(τ)`` (a τ fixed
  before seeing the scores).

numpy/scipy only.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from dpmf._validation import check_real

__all__ = [
    "Bonferroni",
    "Explicit",
    "Split",
    "attack_auroc",
    "epsilon_clopper_pearson",
    "epsilon_from_gdp",
    "epsilon_one_run",
    "epsilon_one_run_fdp",
    "roc_hull",
    "tpr_at_given_fpr",
]

_norm = scipy.stats.norm
_binom = scipy.stats.binom


# -- threshold strategies ---------------------------------------------------------------------


@dataclass(frozen=True)
class Bonferroni:
    """Search every threshold; divide the significance by their number."""


@dataclass(frozen=True)
class Explicit:
    """Use one threshold τ, fixed independently of the scores (no correction)."""

    threshold: float


@dataclass(frozen=True)
class Split:
    """Choose the threshold on a random ``fraction`` of the in and of the out canaries (seeded by
    ``seed``), then bound ε at that threshold on the remaining canaries (no correction)."""

    fraction: float = 0.5
    seed: int | None = None

    def __post_init__(self):
        check_real("fraction", self.fraction, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)


# -- input checks -----------------------------------------------------------------------------


def _scores(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            f"{name} is invalid: shape {arr.shape}; must be a non-empty 1-D array of scores (one per canary)"
        )
    if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise TypeError(f"{name} is invalid: dtype {arr.dtype}; must be real numbers")
    arr = arr.astype(np.float64)
    if np.isnan(arr).any():
        raise ValueError(
            f"{name} is invalid: it holds NaN at index {int(np.flatnonzero(np.isnan(arr))[0])}; "
            "scores must be numbers (drop or fix the canaries whose score is NaN)"
        )
    return arr


def _significance(value, high: float) -> float:
    return check_real("significance", value, low=0.0, high=high, low_inclusive=False, high_inclusive=False)


def _delta(value, *, allow_zero: bool) -> float:
    return check_real("delta", value, low=0.0, high=1.0, low_inclusive=allow_zero)


def _strategy(value):
    if not isinstance(value, (Bonferroni, Explicit, Split)):
        raise TypeError(
            f"threshold_strategy={value!r} is invalid: must be Bonferroni(), Split(fraction, seed) or "
            "Explicit(threshold) from dpmf.audit.estimators"
        )
    return value


# -- the ROC hull -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Counts:
    """Counts at the thresholds of the ROC's concave hull, increasing thresholds."""

    in_scores: np.ndarray
    out_scores: np.ndarray
    thresholds: np.ndarray
    fn: np.ndarray  # in-canaries with score < τ (false negatives)
    tn: np.ndarray  # out-canaries with score < τ (true negatives)

    @property
    def n_in(self) -> int:
        return int(self.fn[-1])

    @property
    def n_out(self) -> int:
        return int(self.tn[-1])


def _upper_hull(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the vertices of the upper concave hull of the points (x_i, y_i), given in
    non-decreasing x; collinear points are dropped (Andrew's monotone chain)."""
    keep: list[int] = []
    for i in range(len(x)):
        while len(keep) >= 2:
            o, a = keep[-2], keep[-1]
            cross = (y[a] - y[o]) * (x[i] - x[a]) - (y[i] - y[a]) * (x[a] - x[o])
            if cross <= 0:
                keep.pop()
            else:
                break
        keep.append(i)
    return np.asarray(keep, dtype=np.int64)


def _counts(in_scores, out_scores) -> _Counts:
    ins = _scores("in_scores", in_scores)
    outs = _scores("out_scores", out_scores)
    thresholds = np.concatenate([np.union1d(ins, outs), [np.inf]])
    fn = np.searchsorted(np.sort(ins), thresholds, side="left")
    tn = np.searchsorted(np.sort(outs), thresholds, side="left")
    keep = _upper_hull(fn.astype(np.float64), tn.astype(np.float64))
    return _Counts(ins, outs, thresholds[keep], fn[keep], tn[keep])


def roc_hull(in_scores, out_scores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The concave hull of the attack's ROC curve.

    Args:
        in_scores: shape (m_in,), scores of the "in" canaries (higher means "in").
        out_scores: shape (m_out,), scores of the "out" canaries.

    Returns:
        (thresholds, fpr, tpr), each of shape (k,), for decreasing thresholds (fpr and tpr
        non-decreasing from the point at τ = +∞, (0, 0), to the lowest score, (1, 1)).

    Raises:
        ValueError: an array that is empty, not 1-D, or holds NaN.
        TypeError: scores that are not real numbers.
    """
    c = _counts(in_scores, out_scores)
    fpr = (c.n_out - c.tn) / c.n_out
    tpr = (c.n_in - c.fn) / c.n_in
    return c.thresholds[::-1], fpr[::-1], tpr[::-1]


# -- attack statistics ------------------------------------------------------------------------


def attack_auroc(in_scores, out_scores) -> float:
    """Area under the (concave hull of the) ROC curve of the attack "in if score ≥ τ".

    The trapezoid area under the hull of ``roc_hull``, i.e. of the classifiers that may
    randomize between two thresholds (jax-privacy's ``attack_auroc``). It equals the
    Mann–Whitney statistic P[s_in > s_out] + ½·P[s_in = s_out] when the empirical ROC curve is
    concave, and is never below it. Threat model: none (a descriptive statistic, no guarantee).

    Args:
        in_scores: shape (m_in,); out_scores: shape (m_out,) (see the module's conventions).

    Returns:
        AUROC in [0, 1]; ½ means the scores carry no membership information.

    Raises:
        ValueError, TypeError: as ``roc_hull``.
    """
    c = _counts(in_scores, out_scores)
    tnr = c.tn / c.n_out
    fnr = c.fn / c.n_in
    return float(0.5 * np.dot(tnr[:-1] + tnr[1:], np.diff(fnr)))


def tpr_at_given_fpr(in_scores, out_scores, fpr):
    """The largest true-positive rate at false-positive rate ``fpr`` (on the ROC's concave
    hull, linear between its vertices: a classifier randomizing between two thresholds).

    Args:
        in_scores: shape (m_in,); out_scores: shape (m_out,) (see the module's conventions).
        fpr: a float or an array of any shape, each in [0, 1].

    Returns:
        TPR of the same shape as ``fpr`` (a float for a scalar).

    Raises:
        ValueError: fpr outside [0, 1] or NaN; bad score arrays (as ``roc_hull``).
    """
    f = np.asarray(fpr, dtype=np.float64)
    if not np.all((f >= 0) & (f <= 1)):
        raise ValueError(f"fpr={fpr!r} is invalid: must be in [0, 1]")
    c = _counts(in_scores, out_scores)
    tp = (c.n_in - c.fn)[::-1]
    fp = (c.n_out - c.tn)[::-1]
    target = c.n_out * f
    right = np.minimum(np.searchsorted(fp, target, side="right"), fp.size - 1)
    left = right - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        w = (target - fp[left]) / (fp[right] - fp[left])
    out = (tp[left] + w * (tp[right] - tp[left])) / c.n_in
    return float(out) if out.ndim == 0 else out


# -- Clopper–Pearson --------------------------------------------------------------------------


def clopper_pearson_upper(k, n: int, alpha: float) -> np.ndarray:
    """The one-sided (1 − α) Clopper–Pearson upper bound on a binomial rate: the p with
    P[Bin(n, p) ≤ k] = α, i.e. the (1 − α) quantile of Beta(k + 1, n − k); 1 when k = n.

    Args:
        k: successes, int or array (0 ≤ k ≤ n); n: trials ≥ 1; alpha: in (0, 1).
    """
    k = np.asarray(k)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(k < n, scipy.stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)


def _cp_all(c: _Counts, alpha: float, delta: float, one_sided: bool, threshold: float | None):
    if threshold is None:
        fn, tn = c.fn, c.tn
    else:
        fn = np.array([np.sum(c.in_scores < threshold)])
        tn = np.array([np.sum(c.out_scores < threshold)])
    fnr_ub = clopper_pearson_upper(fn, c.n_in, alpha / 2)
    fpr_ub = clopper_pearson_upper(c.n_out - tn, c.n_out, alpha / 2)

    def best(miss_ub, false_ub):
        hit_lb = 1 - miss_ub
        ok = np.flatnonzero(hit_lb > delta)
        if ok.size == 0:
            return 0.0, -1
        with np.errstate(divide="ignore"):
            eps = np.log(hit_lb[ok] - delta) - np.log(false_ub[ok])
        j = int(np.argmax(eps))
        return max(0.0, float(eps[j])), int(ok[j])

    eps, idx = best(fnr_ub, fpr_ub)
    if not one_sided:
        eps2, idx2 = best(fpr_ub, fnr_ub)
        if eps2 > eps:
            eps, idx = eps2, idx2
    return eps, (c.thresholds[idx] if threshold is None else threshold)


def epsilon_clopper_pearson(
    in_scores,
    out_scores,
    *,
    delta: float = 0.0,
    significance: float = 0.05,
    one_sided: bool = True,
    threshold_strategy=Bonferroni(),
) -> float:
    """ε lower bound from Clopper–Pearson bounds on the attack's TPR and FPR.

    Source: Nasr, Song, Thakurta, Papernot & Carlini, "Adversary Instantiation: Lower Bounds for
    Differentially Private Machine Learning", IEEE S&P 2021 (arXiv 2101.04535). An (ε, δ)-DP
    mechanism gives every test TPR ≤ e^ε·FPR + δ, so ε ≥ log((TPR_lb − δ)/FPR_ub) with TPR_lb,
    FPR_ub one-sided Clopper–Pearson bounds at α/2 each (α = significance; Bonferroni over the
    hull's thresholds by default). ``one_sided=False`` also tries the reversed test (TNR/FNR).

    Threat model: the scores of independent trials — each canary's in/out bit drawn
    independently and the score distributions those of one canary in one run (many runs, or
    canaries whose scores do not interact, as in ``dpmf.audit.mechanism``).

    Args:
        in_scores: shape (m_in,); out_scores: shape (m_out,) (see the module's conventions).
        delta: δ in [0, 1] of the claim tested.
        significance: α in (0, 0.5).
        one_sided: only "in if score ≥ τ" (True) or also its reverse.
        threshold_strategy: ``Bonferroni()``, ``Split(...)`` or ``Explicit(τ)``.

    Returns:
        ε̂ ≥ 0.

    Raises:
        ValueError: α outside (0, 0.5), δ outside [0, 1], bad score arrays.
        TypeError: an unknown threshold strategy; non-numeric scores.
    """
    sig = _significance(significance, 0.5)
    d = _delta(delta, allow_zero=True)
    return _with_strategy(
        in_scores,
        out_scores,
        threshold_strategy,
        lambda c, a, t: _cp_all(c, a, d, bool(one_sided), t),
        sig,
    )


# -- one run (Steinke, Nasr & Jagielski 2023) -------------------------------------------------


def _one_run_p_value(m: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """P-value of ``correct`` right guesses out of ``guesses`` under (ε, δ)-DP with m canaries
    (Steinke, Nasr & Jagielski 2023, Theorem 3.1/Prop. 5.2: Bin(r, e^ε/(1+e^ε)) tail plus the
    δ term 2m·δ·max_i (P[Bin ≥ v − i] − P[Bin ≥ v])/i)."""
    q = scipy.special.expit(eps)
    tail = _binom.sf(correct - 1, guesses, q)
    if delta == 0:
        return float(tail)
    i = np.arange(1, correct + 1)
    extra = np.max((_binom.sf(correct - i - 1, guesses, q) - tail) / i, initial=0.0)
    return float(min(tail + extra * delta * 2 * m, 1.0))


def _largest_rejected(objective, eps_lo: float) -> float:
    """The largest ε ≥ eps_lo with objective(ε) > 0 (objective decreasing), by doubling then
    Brent's method (xtol 1e-6); eps_lo when objective(eps_lo) ≤ 0."""
    if objective(eps_lo) <= 0:
        return eps_lo
    eps_hi = max(1.0, 2 * eps_lo)
    while objective(eps_hi) > 0:
        eps_lo, eps_hi = eps_hi, 2 * eps_hi
    return float(scipy.optimize.brentq(objective, eps_lo, eps_hi, xtol=1e-6))


def _one_run_eps(eps_lo, m, guesses, correct, alpha, delta) -> float:
    if _one_run_p_value(m, guesses, correct, eps_lo, 0.0) > alpha:
        return eps_lo
    return _largest_rejected(lambda e: alpha - _one_run_p_value(m, guesses, correct, e, delta), eps_lo)


def _log_delta_gaussian(sigma: float, eps: float) -> float:
    """log δ(ε) of the Gaussian mechanism with sensitivity 1 and noise σ (Balle & Wang 2018,
    Thm 8), in the log domain."""
    t = eps * sigma + 1 / (2 * sigma)
    x = _norm.logcdf(1 / sigma - t)
    y = eps + _norm.logcdf(-t)
    return x + np.log1p(-np.exp(y - x)) if y <= x else -np.inf


def _gaussian_sigma(eps: float, delta: float) -> float:
    """σ of the sensitivity-1 Gaussian mechanism that is exactly (ε, δ)-DP (brentq, xtol 1e-12)."""
    if delta == 1 or eps == np.inf:
        return 0.0
    log_delta = math.log(delta)
    lo, hi = 0.1, 1.0
    while _log_delta_gaussian(lo, eps) < log_delta:
        hi, lo = lo, lo / 10
    while _log_delta_gaussian(hi, eps) > log_delta:
        lo, hi = hi, hi * 10
    return float(scipy.optimize.brentq(lambda s: _log_delta_gaussian(s, eps) - log_delta, lo, hi, xtol=1e-12))


_SIGMA_CACHE: dict[tuple[float, float], float] = {}


def _one_run_fdp_eps(eps_lo, m, guesses, correct, alpha, delta) -> float:
    """Mahloujifar et al. 2024, Algorithm "audit_rh_with_cap" for the Gaussian trade-off curve
    of the (ε, δ) claim: positive when the guesses falsify it."""

    def objective(eps):
        key = (eps, delta)
        if key not in _SIGMA_CACHE:
            if len(_SIGMA_CACHE) > 4096:
                _SIGMA_CACHE.clear()
            _SIGMA_CACHE[key] = _gaussian_sigma(eps, delta)
        sigma = _SIGMA_CACHE[key]

        def inverse_blow_up(x):
            if sigma == 0:
                return float(x == 1.0)
            return _norm.cdf(_norm.ppf(x) - 1 / sigma)

        r = alpha * correct / m
        h = alpha * (guesses - correct) / m
        for i in range(correct - 1, -1, -1):
            h_new = max(h, inverse_blow_up(r))
            if h == h_new:
                break
            r = min(r + (i / (guesses - i)) * (h_new - h), 1.0)
            h = h_new
        return r + h - guesses / m

    return _largest_rejected(objective, eps_lo)


def _one_run_all(c: _Counts, alpha, delta, threshold, fdp: bool):
    audit = _one_run_fdp_eps if fdp else _one_run_eps
    m = c.n_in + c.n_out
    if threshold is not None:
        tp = int(np.sum(c.in_scores >= threshold))
        fp = int(np.sum(c.out_scores >= threshold))
        return audit(0, m, tp + fp, tp, alpha, delta), threshold
    tp = c.n_in - c.fn
    fp = c.n_out - c.tn
    guesses = tp + fp
    # try thresholds by decreasing lower bound on precision: later ones are then mostly skipped
    precision_lb = 1.0 - clopper_pearson_upper(fp, guesses, alpha)
    best_eps, best_idx, best_q = 0, -1, 0.5
    for idx in np.argsort(-precision_lb):
        g, k = int(guesses[idx]), int(tp[idx])
        if g == 0 or k / g <= best_q:
            continue  # the raw precision cannot beat the best ε so far
        eps = audit(best_eps, m, g, k, alpha, delta)
        if eps > best_eps:
            best_eps, best_idx, best_q = eps, idx, scipy.special.expit(eps)
    return best_eps, c.thresholds[best_idx]


def epsilon_one_run(
    in_scores,
    out_scores,
    *,
    delta: float,
    significance: float = 0.05,
    threshold_strategy=Bonferroni(),
) -> float:
    """ε lower bound from ONE training run with m canaries (Steinke, Nasr & Jagielski,
    "Privacy Auditing with One (1) Training Run", NeurIPS 2023, arXiv 2305.08846).

    The attacker guesses "in" for the canaries scoring ≥ τ (r guesses, v correct). Under
    (ε, δ)-DP the number of correct guesses is stochastically dominated by Bin(r, e^ε/(1+e^ε))
    up to a δ term (their Theorem 3.1, with 2m·δ); ε̂ is the largest ε whose p-value is ≤ α.
    Only guesses of "in" (k₋ = 0) are used, as in jax-privacy.

    Threat model: one run in which each of the m = m_in + m_out canaries was included
    independently with probability ½, and the scores computed from that run's output (any
    auditor, white-box or black-box). Canaries' scores may depend on each other.

    Args:
        in_scores: shape (m_in,); out_scores: shape (m_out,) (see the module's conventions).
        delta: δ in (0, 1] of the claim tested.
        significance: α in (0, 1).
        threshold_strategy: ``Bonferroni()``, ``Split(...)`` or ``Explicit(τ)``.

    Returns:
        ε̂ ≥ 0 (Brent's method, tolerance 1e-6).

    Raises:
        ValueError: α outside (0, 1), δ outside (0, 1], bad score arrays.
        TypeError: an unknown threshold strategy; non-numeric scores.
    """
    sig = _significance(significance, 1.0)
    d = _delta(delta, allow_zero=False)
    return _with_strategy(
        in_scores, out_scores, threshold_strategy, lambda c, a, t: _one_run_all(c, a, d, t, False), sig
    )


def epsilon_one_run_fdp(
    in_scores,
    out_scores,
    *,
    delta: float,
    significance: float = 0.05,
    threshold_strategy=Bonferroni(),
) -> float:
    """ε lower bound from one run, through f-DP (Mahloujifar, Melis & Chaudhuri, "Auditing
    f-Differential Privacy in One Run", arXiv 2410.22235, Algorithm ``audit_rh_with_cap``).

    The (ε, δ) claim is read as the trade-off curve of the Gaussian mechanism that is exactly
    (ε, δ)-DP (μ-GDP with σ = 1/μ from Balle & Wang 2018); the guesses falsify it when the
    recursive bound on the expected numbers of right and wrong guesses is exceeded. Tighter than
    ``epsilon_one_run`` for Gaussian mechanisms.

    Threat model, arguments, returns and raises: as ``epsilon_one_run``.
    """
    sig = _significance(significance, 1.0)
    d = _delta(delta, allow_zero=False)
    return _with_strategy(
        in_scores, out_scores, threshold_strategy, lambda c, a, t: _one_run_all(c, a, d, t, True), sig
    )


# -- Gaussian DP ------------------------------------------------------------------------------


def _gdp_mu_direction(c: _Counts, alpha: float, delta: float) -> float:
    k = len(c.fn)
    fpr_ub = clopper_pearson_upper(c.n_out - c.tn, c.n_out, alpha / (2 * k))
    fnr_ub = clopper_pearson_upper(c.fn, c.n_in, alpha / (2 * k))
    ok = np.maximum(fpr_ub, fnr_ub) < 1 - delta
    if not ok.any():
        return 0.0
    return max(0.0, float(np.max(_norm.isf(fpr_ub[ok]) - _norm.ppf(fnr_ub[ok]))))


def _gdp_mu(ins, outs, alpha: float, delta: float, one_sided: bool) -> float:
    """The largest valid μ lower bound over the hull's thresholds (see ``epsilon_from_gdp``)."""
    if one_sided:
        return _gdp_mu_direction(_counts(ins, outs), alpha, delta)
    # the reversed test "in if score < τ" is the test "in if −score ≥ −τ" (on its own hull);
    # each direction at α/2
    return max(
        _gdp_mu_direction(_counts(ins, outs), alpha / 2, delta),
        _gdp_mu_direction(
            _counts(-_scores("in_scores", ins), -_scores("out_scores", outs)), alpha / 2, delta
        ),
    )


def epsilon_from_gdp(
    in_scores,
    out_scores,
    *,
    delta: float,
    significance: float = 0.05,
    one_sided: bool = True,
    eps_tol: float = 1e-6,
) -> float:
    """ε lower bound assuming the attack's trade-off curve is Gaussian (μ-GDP).

    Source: Nasr et al., "Tight Auditing of Differentially Private Machine Learning", USENIX
    Security 2023 (arXiv 2302.07956), as described in arXiv 2406.04827. At each hull threshold,
    one-sided Clopper–Pearson upper bounds on FPR and FNR (Bonferroni over 2k tests for k
    thresholds) give μ ≥ Φ⁻¹(1 − FPR_ub) − Φ⁻¹(FNR_ub) (Dong, Roth & Su 2022, Eq. 6); the
    largest μ is converted to ε at δ with the Gaussian profile δ(ε) = Φ(−ε/μ + μ/2) −
    e^ε·Φ(−ε/μ − μ/2) (their Cor. 2.13), ε searched in [0, 100] by Brent's method.

    Deliberate difference from jax-privacy 2.0.0: jax-privacy takes the largest |μ|, reading a
    negative value as a bound for the reversed test. A negative value computed from UPPER bounds
    on FPR and FNR is not a bound for the reversed test (that needs upper bounds on TNR and TPR),
    and on scores with no signal at all it yields large ε (e.g. ε̂ ≈ 2–11 at δ = 1e-5 for two
    N(0, 1) samples of 200–20000 scores: every run a false alarm). Here only the direction
    "in if score ≥ τ" is used (``one_sided=True``), or both directions, each on its own ROC hull
    with its own upper bounds at α/2, with ``one_sided=False``. Where jax-privacy's maximum is
    attained in the valid direction the two agree exactly.

    Threat model: independent trials, as ``epsilon_clopper_pearson``, and a mechanism whose
    trade-off curve is (close to) Gaussian — true of the Gaussian mechanisms of dpmf without
    amplification; with amplification by sampling the bound is heuristic.

    Args:
        in_scores: shape (m_in,); out_scores: shape (m_out,) (see the module's conventions).
        delta: δ in (0, 1).
        significance: α in (0, 0.5).
        one_sided: only "in if score ≥ τ" (True) or also its reverse.
        eps_tol: Brent's tolerance on ε (> 0).

    Returns:
        ε̂ in [0, 100].

    Raises:
        ValueError: α outside (0, 0.5), δ outside (0, 1], eps_tol ≤ 0, bad score arrays.
    """
    sig = _significance(significance, 0.5)
    d = _delta(delta, allow_zero=False)
    tol = check_real("eps_tol", eps_tol, low=0.0, low_inclusive=False)
    mu = _gdp_mu(in_scores, out_scores, sig, d, bool(one_sided))
    if mu <= 0:
        return 0.0

    def gap(eps):
        x = _norm.logcdf(-eps / mu + mu / 2)
        y = eps + _norm.logcdf(-eps / mu - mu / 2)
        with np.errstate(divide="ignore"):
            return x + np.log1p(-np.exp(y - x)) - math.log(d)

    if gap(0.0) <= 0:
        return 0.0
    if gap(100.0) >= 0:
        return 100.0
    return float(scipy.optimize.brentq(gap, 0.0, 100.0, xtol=tol))


def gdp_mu_lower_bound(in_scores, out_scores, *, significance: float = 0.05, one_sided: bool = True) -> float:
    """The μ lower bound of ``epsilon_from_gdp`` before its conversion to ε (thresholds whose
    bounds are 1 skipped), ≥ 0.

    Raises:
        ValueError: α outside (0, 0.5), bad score arrays.
    """
    sig = _significance(significance, 0.5)
    return _gdp_mu(in_scores, out_scores, sig, 0.0, bool(one_sided))


# -- threshold strategies, applied ------------------------------------------------------------


def _with_strategy(in_scores, out_scores, strategy, audit_all, alpha: float) -> float:
    """ε̂ of ``audit_all(counts, α, τ or None) -> (ε, τ)`` under a threshold strategy."""
    strategy = _strategy(strategy)
    if isinstance(strategy, Explicit):
        t = strategy.threshold
        if not isinstance(t, numbers.Real) or math.isnan(t):
            raise ValueError(f"threshold={t!r} is invalid: must be a real number (not NaN)")
        # one threshold: the counts at τ only (no ROC hull to build)
        ins, outs = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
        c = _Counts(ins, outs, np.array([np.inf]), np.array([ins.size]), np.array([outs.size]))
        return float(audit_all(c, alpha, float(t))[0])
    c = _counts(in_scores, out_scores)
    if isinstance(strategy, Split):
        rng = np.random.default_rng(strategy.seed)

        def part(scores):
            perm = rng.permutation(len(scores))
            cut = int(len(scores) * strategy.fraction)
            return scores[perm[:cut]], scores[perm[cut:]]

        in_a, in_b = part(c.in_scores)
        out_a, out_b = part(c.out_scores)
        for name, arr in (("in", in_a), ("in", in_b), ("out", out_a), ("out", out_b)):
            if arr.size == 0:
                raise ValueError(
                    f"threshold_strategy={strategy!r} is invalid: a part of the {name} scores is empty; "
                    "use more canaries or a fraction nearer 0.5"
                )
        _, t = audit_all(_counts(in_a, out_a), alpha, None)
        return float(audit_all(_counts(in_b, out_b), alpha, t)[0])
    return float(audit_all(c, alpha / len(c.fn), None)[0])
