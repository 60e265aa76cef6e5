"""Mechanism-level audit of a ``PrivatePlan``: canaries through the strategy's noise, no model.

The release of a run is B(CG + Z) with Z ~ N(0, σ²ζ²s²) entry-wise; B = A·C⁻¹ with A the
(invertible) workload, so the release is equivalent to the sequence of noisy gradients
ĝ = G + σζs·C⁻¹Z (what dpmf adds at each step) and to x = Cĝ = CG + σζs·Z. A canary is a
gradient u (‖u‖ = ζ after clipping) added to the clipped sum at the steps π where it is sampled;
its contribution to x is C_{:,π}·u (the columns π of C, summed, times u).

The likelihood-ratio (Neyman–Pearson) score. With the other gradients known to the auditor
(white box; here they are zero), x | out ~ N(0, σ²ζ²s²·I) and x | in ~ N(v, σ²ζ²s²·I) with
v = C_{:,π}u. The log-likelihood ratio is (⟨v, x⟩ − ‖v‖²/2)/(σζs)², increasing in

    score(x) = ⟨v, x⟩/‖v‖ = ⟨C_{:,π}u, C ĝ⟩/‖C_{:,π}u‖,

which is N(0, σ²ζ²s²) for "out" and N(‖v‖, σ²ζ²s²) for "in": a Gaussian test with
μ = ‖C_{:,π}u‖/(σζs) = ‖C·1_π‖/(σs), at most 1/σ because s = max_π ‖C·1_π‖ under the scheme's
participation (for C with non-negative CᵀC). So under fixed order the best canary (the worst-case
π) is exactly μ = 1/σ-GDP, the run's claim: an audit with this score measures how tight dpmf's
accounting is, not only whether it is valid. For the identity strategy (DP-SGD) C = I, v = 1_π·u
and score = Σ_{t∈π} ⟨u, ĝ_t⟩/(ζ√|π|): the sum of the per-step projections, DP-SGD's white-box
score. Decorrelating through the strategy (applying C to the noisy gradients) is what makes the
noise white; scoring ĝ directly would weigh the correlated noise wrongly.

Which π the auditor may use is the scheme's threat model: under fixed order and single release
the batches are public (no amplification is claimed), so π is the canary's actual steps; under
cyclic Poisson the canary's group is public and π is every step of its group; under Poisson and
balls-in-bins sampling the batches are secret and π is every step (a valid but weaker score:
the audit then only checks validity).

Many independent trials in one computation: canary i is coordinate i of a d-dimensional run (the
noise is independent across coordinates and each coordinate holds one canary), the dataset's
N examples are the canaries of one sampler draw, and ``runs`` draws are stacked, so the
(in/out, score) pairs are independent trials of the one-canary mechanism — the setting of the
many-run estimators (``epsilon_from_gdp``, ``epsilon_clopper_pearson``).

The components below (``_correlated_noise``/``_stream_noise``, ``_clip``, ``_participation``,
``_possible_steps``)
are module functions so that tests can plant a bug in one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dpmf._validation import check_int, check_real
from dpmf.audit import estimators as E
from dpmf.plan.schemes import BallsInBins, CyclicPoisson, FixedOrder, Poisson, SingleRelease

__all__ = [
    "MechanismAudit",
    "METHODS",
    "audit_mechanism",
    "claim_threshold",
    "empirical_precision",
    "likelihood_scores",
    "mechanism_scores",
    "precision_matrix",
]

METHODS = ("gdp", "clopper-pearson", "one-run", "one-run-fdp")
# schemes whose batches are public to the adversary (no amplification claimed)
PUBLIC_BATCHES = (FixedOrder, SingleRelease)


def _correlated_noise(strategy, steps: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Unit-scale correlated noise (C⁻¹Z), shape (steps, dim), Z standard normal (float64)."""
    z = rng.standard_normal((steps, dim))
    return strategy.C.inverse().matmul(z)


def _stream_noise(strategy, steps: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """The same noise from dpmf's training generator (``dpmf.optim.noise``, torch, float64),
    seeded from ``rng``: audits the streaming generator the private step uses."""
    import torch

    from dpmf.optim.noise import noise_for_factorization

    gen = noise_for_factorization(strategy, dim, seed=int(rng.integers(2**31 - 1)), dtype=torch.float64)
    return np.stack([gen.next().numpy() for _ in range(steps)])


def _clip(norm: float, clip_norm: float) -> float:
    """The norm of a gradient of norm ``norm`` after clipping to ζ (global ℓ2 clipping)."""
    return norm * min(1.0, clip_norm / norm) if norm > 0 else 0.0


def _participation(plan, seed: int) -> tuple[np.ndarray, object]:
    """The batches of one run of the plan's sampler, a read-only boolean (steps, N) matrix, and
    the sampler (its public structure: groups)."""
    sampler = plan.sampler(seed)
    out = np.zeros((plan.steps, plan.dataset_size), dtype=bool)
    for t in range(plan.steps):
        out[t, sampler.next()] = True
    out.flags.writeable = False
    return out, sampler


def _possible_steps(plan, sampler, participation: np.ndarray) -> np.ndarray:
    """The steps the auditor may score each example at, (steps, N) boolean (see the module doc)."""
    if isinstance(plan.scheme, PUBLIC_BATCHES):
        return participation
    if isinstance(plan.scheme, CyclicPoisson):
        groups = plan.scheme.groups(plan)
        t = np.arange(plan.steps)[:, None]
        return (t % groups) == np.asarray(sampler.assignment)[None, :]
    return np.ones_like(participation)


def precision_matrix(plan, std: float) -> np.ndarray:
    """P = CᵀC/(σζs)²: the inverse covariance of the noise dpmf adds to the gradients
    (Cov(σζs·C⁻¹Z) = (σζs)²·C⁻¹C⁻ᵀ), shape (steps, steps)."""
    C = plan.strategy.C.dense()
    return C.T @ C / std**2


def empirical_precision(noise_only: np.ndarray) -> np.ndarray:
    """The pseudo-inverse of the empirical covariance of noise-only coordinates (steps, d):
    eigenvalues below 1e-12 of the largest are treated as 1e-12 of it (a noise direction that
    vanishes — a reused draw — then weighs 10¹²-fold)."""
    cov = noise_only @ noise_only.T / noise_only.shape[1]
    lam, vec = np.linalg.eigh(cov)
    lam = np.maximum(lam, lam.max() * 1e-12)
    return (vec / lam) @ vec.T


def likelihood_scores(
    plan, sampler, noisy: np.ndarray, possible: np.ndarray, contribution: float, P: np.ndarray
) -> np.ndarray:
    """The exact log-likelihood ratio of "in" against "out" under the scheme's sampling.

    With a_t = c·(Pĝ)_t − c²·P_tt/2 (c the clipped contribution, P the noise's inverse
    covariance):

    * Poisson (C = I) and cyclic Poisson (bands ≤ min_sep, so the columns C·e_t of a group's
      steps do not overlap and the steps' statistics are independent): the canary joins each
      possible step with probability q, so log LR = Σ_{t∈π} log(1 − q + q·e^{a_t});
    * balls-in-bins: the canary is in one of b bins (uniform), at the steps t ≡ j (mod b), so
      log LR = log (1/b) Σ_j exp(c·⟨P1_{S_j}, ĝ⟩ − c²·1_{S_j}ᵀP1_{S_j}/2);
    * schemes with public batches: ``possible`` are the canary's steps and the log LR is
      affine in the linear score ⟨P1_π, ĝ⟩/√(1_πᵀP1_π), which is returned.

    Args:
        plan, sampler: the run's plan and the sampler of the draw.
        noisy: shape (n, k), each canary's noisy gradients (projections).
        possible: shape (n, k), boolean, the canaries' possible steps.
        contribution: c, the clipped canary norm (in the units of ``noisy``).
        P: shape (n, n).

    Returns:
        shape (k,): the scores (higher ⇒ "in").
    """
    Pg = P @ noisy
    w = possible.astype(np.float64)
    if isinstance(plan.scheme, (Poisson, CyclicPoisson)):
        q = float(plan.sampling_rate)
        a = contribution * Pg - contribution**2 * np.diag(P)[:, None] / 2
        with np.errstate(divide="ignore"):
            terms = np.logaddexp(np.log1p(-q) if q < 1 else -np.inf, np.log(q) + a)
        return (terms * w).sum(axis=0)
    if isinstance(plan.scheme, BallsInBins):
        from scipy.special import logsumexp

        b = plan.steps_per_epoch
        bins = np.zeros((plan.steps, b))
        bins[np.arange(plan.steps), np.arange(plan.steps) % b] = 1.0
        lin = bins.T @ Pg
        quad = np.einsum("tj,tj->j", bins, P @ bins)
        return logsumexp(contribution * lin - contribution**2 * quad[:, None] / 2, axis=0) - np.log(b)
    q = np.einsum("tk,tk->k", w, P @ w)
    return np.einsum("tk,tk->k", P @ w, noisy) / np.sqrt(np.where(q > 0, q, 1.0))


@dataclass(frozen=True)
class MechanismAudit:
    """The result of ``audit_mechanism``.

    Attributes:
        claimed_epsilon, delta: the plan's accounted (ε, δ).
        epsilon_lower_bound: ε̂ of ``method`` at ``significance``.
        method, significance: the estimator and α.
        trials: canaries scored (in + out).
        auroc: the attack's AUROC.
        mu_lower_bound: the GDP μ lower bound (``gdp_mu_lower_bound``), for reference.
        mu_claimed: 1/σ·max‖C1_π‖/s over the scored canaries (the μ of the best one).
        in_scores, out_scores: the scores (not compared by ==).
    """

    claimed_epsilon: float
    delta: float
    epsilon_lower_bound: float
    method: str
    significance: float
    trials: int
    auroc: float
    mu_lower_bound: float
    mu_claimed: float
    in_scores: np.ndarray = field(repr=False, compare=False)
    out_scores: np.ndarray = field(repr=False, compare=False)

    @property
    def tightness(self) -> float:
        """ε̂ / claimed ε (1 = the accounting is tight; > 1 = the claim is violated)."""
        return self.epsilon_lower_bound / self.claimed_epsilon if self.claimed_epsilon > 0 else math.inf


def mechanism_scores(
    plan,
    *,
    runs: int,
    seed: int = 0,
    clip_norm: float = 1.0,
    canary_norm: float | None = None,
    canaries: str = "worst",
    score: str = "strategy",
    noise: str = "numpy",
    repeats: int = 1,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Scores of ``runs``·N independent canaries through the plan's mechanism.

    Each of the N examples of each of ``runs`` sampler draws is a canary, included with
    probability ½; its gradient has norm ``canary_norm`` (default ζ) before clipping to ζ. The
    noisy gradients are ĝ = G + σζs·C⁻¹Z; with v the canary's clipped contribution at its
    possible steps π and P the noise's inverse covariance, the score is the likelihood-ratio
    statistic ⟨Pv, ĝ⟩/√(vᵀPv) — with P = CᵀC/(σζs)² (``score="strategy"``) this is
    ⟨C_{:,π}u, Cĝ⟩/(σζs·‖C_{:,π}u‖) of the module doc, N(0, 1) for "out" canaries. With
    ``score="empirical"`` P is estimated from 50·steps (at least 10⁴) noise-only coordinates of
    the release: the auditor then does not trust the strategy's C and whitens the noise it
    actually sees (catching a noise generator that is not C⁻¹Z).

    Args:
        plan: a ``PrivatePlan`` with its σ.
        runs: R ≥ 1 sampler draws (seeds seed, seed+1, …).
        seed: of the samplers, the in/out bits and the noise (an audit seed, not a secret).
        clip_norm: ζ > 0.
        canary_norm: the canary's gradient norm before clipping (> 0; default ζ).
        canaries: ``worst`` keeps only the canaries with the largest vᵀPv (the worst case the
            accounting assumes; the auditor may choose them as π is public whenever it is
            used), ``all`` keeps every canary.
        score: ``strategy`` or ``empirical`` (see above), or ``likelihood``: the exact
            likelihood ratio under the scheme's sampling (``likelihood_scores``; stronger under
            amplification, the linear score when the batches are public).
        noise: ``numpy`` (C⁻¹Z by a triangular solve of the plan's C) or ``stream`` (dpmf's
            streaming generator of the private step, ``plan.noise``; needs torch).
        repeats: k ≥ 1 canaries per kept example and draw: k coordinates of the release with
            the example's participation, each with its own in/out bit and its own noise (the
            trials stay independent given the public participation; k·R·N trials at the cost
            of R sampler draws).

    Returns:
        (in_scores, out_scores, mu): the scores (in units of the noise) and
        μ = max‖C1_π‖·(clipped norm/ζ)/(σs) over the kept canaries (the μ-GDP of the best
        one if the accounting's σ and s hold).

    Raises:
        ValueError: a plan without σ, runs < 1, ζ or canary_norm ≤ 0, an unknown ``canaries``
            or ``score``.
    """
    sigma = plan.require_noise_multiplier()
    runs = check_int("runs", runs, minimum=1)
    repeats = check_int("repeats", repeats, minimum=1)
    zeta = check_real("clip_norm", clip_norm, low=0.0, low_inclusive=False)
    raw = (
        zeta if canary_norm is None else check_real("canary_norm", canary_norm, low=0.0, low_inclusive=False)
    )
    if canaries not in ("worst", "all"):
        raise ValueError(f"canaries={canaries!r} is invalid: must be 'worst' or 'all'")
    if score not in ("strategy", "empirical", "likelihood"):
        raise ValueError(f"score={score!r} is invalid: must be 'strategy', 'empirical' or 'likelihood'")
    if noise not in ("numpy", "stream"):
        raise ValueError(f"noise={noise!r} is invalid: must be 'numpy' or 'stream'")
    draw = _correlated_noise if noise == "numpy" else _stream_noise
    std = plan.noise_std(zeta)
    contribution = _clip(raw, zeta)
    n = plan.steps
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xA0D17]))
    if score in ("strategy", "likelihood"):
        P = precision_matrix(plan, std)
    else:
        blank = max(50 * n, 10_000)
        P = empirical_precision(std * draw(plan.strategy, n, blank, rng))
    C = plan.strategy.C
    ins, outs, best = [], [], 0.0
    for r in range(runs):
        part, sampler = _participation(plan, int(seed) + r)
        possible = _possible_steps(plan, sampler, part).astype(np.float64)
        Pv = P @ possible
        q = np.einsum("tk,tk->k", possible, Pv)  # vᵀPv per unit contribution
        keep = np.flatnonzero(q > 0)
        if canaries == "worst":
            keep = np.flatnonzero(q >= q.max() * (1 - 1e-9))
        keep_all = np.tile(keep, repeats)  # the kept examples, each ``repeats`` times
        bits = rng.random(keep_all.size) < 0.5
        g = part[:, keep_all] * (bits[None, :] * contribution)  # clipped canary sums, (n, k)
        noisy = g + std * draw(plan.strategy, n, keep_all.size, rng)
        if score == "likelihood":
            s = likelihood_scores(plan, sampler, noisy, possible[:, keep_all] > 0, contribution, P)
        else:
            s = np.einsum("tk,tk->k", Pv[:, keep_all], noisy) / np.sqrt(q[keep_all])
        ins.append(s[bits])
        outs.append(s[~bits])
        wn = np.linalg.norm(C.matmul(possible[:, keep] * part[:, keep]), axis=0)
        best = max(best, float(wn.max()))
    mu = best * contribution / zeta / (sigma * plan.sensitivity)
    return np.concatenate(ins), np.concatenate(outs), mu


def _estimate(method: str, ins, outs, delta: float, significance: float) -> float:
    if method == "gdp":
        return E.epsilon_from_gdp(ins, outs, delta=delta, significance=significance)
    if method == "clopper-pearson":
        return E.epsilon_clopper_pearson(ins, outs, delta=delta, significance=significance)
    if method == "one-run":
        return E.epsilon_one_run(ins, outs, delta=delta, significance=significance)
    if method == "one-run-fdp":
        return E.epsilon_one_run_fdp(ins, outs, delta=delta, significance=significance)
    raise ValueError(f"method={method!r} is invalid: must be one of {', '.join(METHODS)}")


def audit_mechanism(
    plan,
    *,
    delta: float,
    runs: int,
    method: str = "gdp",
    significance: float = 0.05,
    seed: int = 0,
    clip_norm: float = 1.0,
    canary_norm: float | None = None,
    canaries: str = "worst",
    score: str = "strategy",
    noise: str = "numpy",
    claimed_epsilon: float | None = None,
    repeats: int = 1,
    threshold: str = "all",
) -> MechanismAudit:
    """Audit the plan's mechanism: ε̂ from ``mechanism_scores`` against the accounted ε.

    Args:
        plan: a ``PrivatePlan`` with its σ (e.g. ``plan.calibrate(ε, δ)``).
        delta: δ of the claim.
        runs, seed, clip_norm, canary_norm, canaries, score, noise, repeats: as
            ``mechanism_scores``.
        method: one of ``METHODS`` (``gdp``: the many-run GDP bound; the trials are independent).
        significance: α.
        claimed_epsilon: the claim to compare with; default ``plan.account(delta=delta)``.
        threshold: ``clopper-pearson`` only: ``all`` (every threshold, Bonferroni) or ``claim``
            (the one threshold ``claim_threshold`` fixes from the claimed μ and the numbers of
            canaries before any score is seen: no correction; needs the linear score of
            public batches, ``score="strategy"``).

    Returns:
        A ``MechanismAudit``.

    Raises:
        ValueError: an unknown method, δ or α out of range (before any work), and as
            ``mechanism_scores``.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {', '.join(METHODS)}")
    check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    check_real("significance", significance, low=0.0, high=0.5, low_inclusive=False, high_inclusive=False)
    if threshold not in ("all", "claim"):
        raise ValueError(f"threshold={threshold!r} is invalid: must be 'all' or 'claim'")
    if threshold == "claim" and (method != "clopper-pearson" or score != "strategy"):
        raise ValueError(
            f"threshold='claim' is invalid with method={method!r}, score={score!r}: it fixes a "
            "Clopper–Pearson threshold for the linear score; use method='clopper-pearson', score='strategy'"
        )
    if claimed_epsilon is None:
        claimed_epsilon = float(plan.account(delta=delta).epsilon)
    ins, outs, mu = mechanism_scores(
        plan,
        runs=runs,
        seed=seed,
        clip_norm=clip_norm,
        canary_norm=canary_norm,
        canaries=canaries,
        score=score,
        noise=noise,
        repeats=repeats,
    )
    if threshold == "claim":
        # μ of the kept canaries under the plan's σ and s (public: no score is used)
        tau = claim_threshold(mu, ins.size, outs.size, delta=delta, significance=significance)
        eps = E.epsilon_clopper_pearson(
            ins, outs, delta=delta, significance=significance, threshold_strategy=E.Explicit(tau)
        )
    else:
        eps = _estimate(method, ins, outs, delta, significance)
    return MechanismAudit(
        claimed_epsilon=float(claimed_epsilon),
        delta=float(delta),
        epsilon_lower_bound=float(eps),
        method=method,
        significance=float(significance),
        trials=int(ins.size + outs.size),
        auroc=E.attack_auroc(ins, outs),
        mu_lower_bound=E.gdp_mu_lower_bound(ins, outs, significance=significance),
        mu_claimed=float(mu),
        in_scores=ins,
        out_scores=outs,
    )


def claim_threshold(
    mu: float, n_in: int, n_out: int, *, delta: float, significance: float = 0.05, grid: int = 1401
) -> float:
    """The threshold τ that a Clopper–Pearson test of a μ-GDP claim should use, fixed before
    any score is seen (``estimators.Explicit(τ)``, no multiplicity correction).

    For scores in noise units ("out" ~ N(0, 1), "in" ~ N(μ, 1) when the claim is exactly
    met: the linear score of the mechanism audit with public batches), τ maximises the
    Clopper–Pearson bound log((TPR_lb − δ)/FPR_ub) evaluated at the expected counts
    n_in·Φ̄(τ − μ) and n_out·Φ̄(τ), over ``grid`` points of [0, μ + 8]. τ depends only on the
    claim and the numbers of canaries, so the test at τ keeps its level whatever the scores
    (a pre-registered threshold); if the claim is wrong the threshold is merely not optimal.

    Args:
        mu: the claimed μ > 0 (``mechanism_scores``' third output).
        n_in, n_out: the numbers of "in" and "out" canaries (≥ 1).
        delta: δ of the claim; significance: α in (0, 0.5).

    Returns:
        τ (float).

    Raises:
        ValueError: μ ≤ 0, counts < 1, δ outside [0, 1), α outside (0, 0.5).
    """
    import scipy.stats

    mu = check_real("mu", mu, low=0.0, low_inclusive=False)
    n_in, n_out = check_int("n_in", n_in, minimum=1), check_int("n_out", n_out, minimum=1)
    delta = check_real("delta", delta, low=0.0, high=1.0, high_inclusive=False)
    alpha = check_real(
        "significance", significance, low=0.0, high=0.5, low_inclusive=False, high_inclusive=False
    )
    tau = np.linspace(0.0, mu + 8.0, int(grid))
    tp = np.rint(n_in * scipy.stats.norm.sf(tau - mu))
    fp = np.rint(n_out * scipy.stats.norm.sf(tau))
    tpr_lb = np.where(tp > 0, scipy.stats.beta.ppf(alpha / 2, np.maximum(tp, 1), n_in - tp + 1), 0.0)
    fpr_ub = np.where(fp < n_out, scipy.stats.beta.ppf(1 - alpha / 2, fp + 1, np.maximum(n_out - fp, 1)), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(tpr_lb > delta, np.log(np.maximum(tpr_lb - delta, 1e-300)) - np.log(fpr_ub), -np.inf)
    return float(tau[int(np.argmax(value))])
