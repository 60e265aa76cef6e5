"""Choosing a factorization for a privacy budget: the numbers behind ``dpmf pick``.

For a training run (N examples, batch size B, n steps, target (ε, δ), learning-rate schedule χ)
every candidate strategy C is accounted under a batch-sampling scheme, its noise multiplier σ is
calibrated to the target, and the candidates are ranked by the noise they put on the trained
model: σ·MaxSE and σ·MeanSE, with MaxSE = s·max_i ‖B_i‖₂ and MeanSE = s·‖B‖_F/√n for the
workload A_χ = B·C, where s is the sensitivity the scheme's accountant normalizes by (the noise
on C·G has std σ·ζ·s). In units of the clip norm ζ per expected batch: dividing the noisy sum of
clipped gradients by the expected batch size B (a public constant) divides every entry by B.

Candidates: DP-SGD (identity), sqrt_prefix, lr_aware, bsr/bisr/lr_bsr/lr_bisr with p ∈ {2, 4,
8, …} up to ``max_bands``, and (``optimized``) bisr_opt and bsr_opt with p = ``max_bands``,
BLT with 2 and 4 buffers (at most ``max_bands``) and the dense strategy when n ≤
``dense_max_steps`` — each optimized for the participation notion of the scheme it is accounted
under (single participation for the amplified schemes, whose accountants normalize by the
largest column norm; fixed_epochs(b, ⌈n/b⌉) for ``fixed_order``).

Schemes (``dpmf.accountants.schemes``; b = ⌈N/B⌉ steps per epoch):

=================  =====================================================================
scheme             matrix mechanisms                          DP-SGD (identity)
=================  =====================================================================
auto (default)     cyclic_poisson when C is banded with p ≤ b  poisson
                   (min_sep = p), else fixed_order
cyclic_poisson     banded C only (others are skipped)          poisson
fixed_order        every strategy (no amplification)           fixed_order
balls_in_bins      every strategy with CᵀC ≥ 0 (Monte Carlo,   poisson
                   minutes per candidate)
single_release     every strategy (n ≤ b)                      single_release
=================  =====================================================================

The events of the Poisson and Gaussian schemes depend on C only through its bands (cyclic
Poisson) or not at all (fixed order, single release), so σ is calibrated once per distinct event
and shared; the sensitivity s is each candidate's own.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
from tqdm.auto import tqdm

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.api import _check_accountant, _check_mc, calibrate
from dpmf.accountants.schemes import MAX_BINS, build_event, check_run, strategy_bandwidth
from dpmf.mechanisms import Participation, b_row_norms, factorize
from dpmf.mechanisms.dense import DENSE_MAX_STEPS
from dpmf.workloads import Schedule, from_schedule

__all__ = [
    "PICK_SCHEMES",
    "PickEntry",
    "PickResult",
    "build_strategy",
    "candidate_specs",
    "participation_for_scheme",
    "pick",
]

PICK_SCHEMES = ("auto", "cyclic_poisson", "fixed_order", "balls_in_bins", "single_release")
_DPSGD_SCHEME = {
    "auto": "poisson",
    "cyclic_poisson": "poisson",
    "balls_in_bins": "poisson",
    "fixed_order": "fixed_order",
    "single_release": "single_release",
}


@dataclass(frozen=True)
class PickEntry:
    """One candidate, calibrated and evaluated.

    Attributes:
        factorization: the label (``bisr:16``, ``blt:4``, ``identity`` …).
        scheme: the scheme it was accounted under.
        noise_multiplier: the calibrated σ.
        sensitivity: s, the accountant's normalization of the noise on C·G.
        max_se, mean_se: s·max_i ‖B_i‖ and s·‖B‖_F/√n (clip norm 1, σ = 1).
        noise_max_se, noise_mean_se: σ·max_se and σ·mean_se — the noise on the trained model in
            units of the clip norm per expected batch.
        epsilon: the ε the accountant certifies at σ (≤ the target).
        delta: δ.
        accountant: the accountant used.
        guarantee: ``upper_bound``, ``certified`` or ``estimate``.
        bands: number of non-zero diagonals of C.
        seconds: time spent on this candidate (building, optimizing, evaluating, accounting).
    """

    factorization: str
    scheme: str
    noise_multiplier: float
    sensitivity: float
    max_se: float
    mean_se: float
    noise_max_se: float
    noise_mean_se: float
    epsilon: float
    delta: float
    accountant: str
    guarantee: str
    bands: int
    seconds: float


@dataclass(frozen=True)
class PickResult:
    """The ranking of ``pick``.

    Attributes:
        ranking: the candidates, best (smallest σ × ``metric``) first.
        recommendation: ``ranking[0]``.
        skipped: (factorization, reason) for candidates the scheme cannot account.
        metric: ``mean_se`` or ``max_se``, what the ranking compares (σ × metric).
        dataset_size, batch_size, steps: the run.
        target_epsilon, delta: the privacy target.
        schedule: the learning-rate schedule's name; beta its final multiplier.
        scheme: the scheme option.
        seconds: total time.
    """

    ranking: tuple[PickEntry, ...]
    recommendation: PickEntry
    skipped: tuple[tuple[str, str], ...]
    metric: str
    dataset_size: int
    batch_size: int
    steps: int
    target_epsilon: float
    delta: float
    schedule: str
    beta: float
    scheme: str
    seconds: float

    def to_dict(self) -> dict:
        """JSON-ready dict: the recommendation's ``epsilon``, ``delta``, ``noise_multiplier``,
        ``scheme``, ``accountant``, ``guarantee`` and ``steps`` at the top level, then
        ``ranking``, ``recommendation``, ``skipped`` and the run."""
        rec = self.recommendation
        return {
            "epsilon": rec.epsilon,
            "delta": rec.delta,
            "noise_multiplier": rec.noise_multiplier,
            "scheme": rec.scheme,
            "accountant": rec.accountant,
            "guarantee": rec.guarantee,
            "steps": self.steps,
            "factorization": rec.factorization,
            "metric": self.metric,
            "target_epsilon": self.target_epsilon,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "schedule": self.schedule,
            "beta": self.beta,
            "scheme_option": self.scheme,
            "recommendation": asdict(rec),
            "ranking": [asdict(e) for e in self.ranking],
            "skipped": [{"factorization": f, "reason": r} for f, r in self.skipped],
            "seconds": self.seconds,
        }


def candidate_specs(schedule: Schedule, n: int, max_bands: int, *, optimized: bool, dense_max_steps: int):
    """The candidate factorization names (see the module docstring), without duplicates."""
    lr = schedule.name != "constant" and schedule.beta != 1.0
    specs = ["identity", "sqrt_prefix"] + (["lr_aware"] if lr else [])
    grid = sorted({p for p in (2**i for i in range(1, 31)) if p <= max_bands} | {max_bands})
    grid = [p for p in grid if 2 <= p <= n]
    for p in grid:
        specs += [f"bsr:{p}", f"bisr:{p}"]
        if lr:
            specs += [f"lr_bsr:{p}", f"lr_bisr:{p}"]
    if optimized:
        top = min(max_bands, n)
        if top >= 2:
            specs += [f"bisr_opt:{top}", f"bsr_opt:{top}"]
        specs += [f"blt:{d}" for d in (2, 4) if d <= max_bands]
        if n <= dense_max_steps:
            specs.append("dense")
    return specs


def pick(
    *,
    dataset_size: int,
    batch_size: int,
    steps: int,
    epsilon: float,
    delta: float,
    schedule: Schedule,
    max_bands: int = 64,
    scheme: str = "auto",
    metric: str = "mean_se",
    optimized: bool = True,
    dense_max_steps: int = 1024,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float | None = 0.99,
    progress: bool | None = None,
) -> PickResult:
    """Rank the candidate strategies of a training run by σ × error at a privacy target.

    Args:
        dataset_size: N ≥ 1.
        batch_size: B in [1, N].
        steps: n ≥ 1.
        epsilon: target ε > 0.
        delta: δ in (0, 1).
        schedule: the learning-rate schedule (workload A_χ; constant: the prefix sum).
        max_bands: the memory budget: at most this many bands (or BLT buffers), ≥ 1.
        scheme: one of ``PICK_SCHEMES`` (module docstring).
        metric: ``mean_se`` or ``max_se``: rank by σ·MeanSE or σ·MaxSE.
        optimized: include the optimized strategies (bisr_opt, bsr_opt, blt, dense).
        dense_max_steps: include ``dense`` when n ≤ this (O(n³) work), ≤ 8192.
        accountant: for the Poisson schemes ``pld`` (default), ``rdp`` or ``prv``.
        samples, seed, confidence: Monte Carlo settings for ``balls_in_bins``.
        progress: progress bar over the candidates (None: only on a terminal).

    Returns:
        ``PickResult``.

    Raises:
        ValueError/TypeError: any invalid argument, named, before any work (also a run that no
            candidate can be accounted for).
    """
    t0 = time.perf_counter()
    run0 = check_run("poisson", dataset_size, batch_size, steps)
    N, B, n = run0.dataset_size, run0.batch_size, run0.steps
    b = run0.steps_per_epoch
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule={schedule!r} is invalid: must be a dpmf.workloads.Schedule")
    max_bands = check_int("max_bands", max_bands, minimum=1)
    scheme = check_choice("scheme", scheme, PICK_SCHEMES)
    metric = check_choice("metric", metric, ("mean_se", "max_se"))
    dense_max_steps = check_int("dense_max_steps", dense_max_steps, minimum=1, maximum=DENSE_MAX_STEPS)
    if accountant is not None and accountant not in ("pld", "rdp", "prv"):
        raise ValueError(f"accountant={accountant!r} is invalid: must be one of pld, rdp, prv")
    samples, seed, confidence = _check_mc(samples, seed, confidence)
    if scheme == "single_release" and n > b:
        raise ValueError(
            f"steps={n} is invalid for scheme='single_release': at most ceil(N/B)={b} steps "
            "(one epoch); use auto or fixed_order"
        )
    if scheme == "balls_in_bins" and b > MAX_BINS:
        raise ValueError(f"batch_size={B} is invalid for scheme='balls_in_bins': {b} bins > {MAX_BINS}")
    if scheme == "balls_in_bins":
        _check_accountant("monte_carlo", "balls_in_bins")

    workload = from_schedule(schedule, n)
    specs = candidate_specs(schedule, n, max_bands, optimized=optimized, dense_max_steps=dense_max_steps)
    cache: dict = {}
    entries, skipped = [], []
    bar = tqdm(specs, desc="pick", unit="strategy", disable=None if progress is None else not progress)
    for spec in bar:
        bar.set_postfix_str(spec)
        t1 = time.perf_counter()
        name = spec.partition(":")[0]
        try:
            f, sch = _build(workload, spec, name, scheme, b, N, B)
        except (_Skip, ValueError) as exc:  # ValueError: an optimized strategy infeasible/unsolved
            skipped.append((spec, str(exc)))
            continue
        try:
            entry = _account(
                f, spec, sch, N, B, n, epsilon, delta, accountant, samples, seed, confidence, cache, t1
            )
        except ValueError as exc:  # a scheme precondition (e.g. CᵀC ≥ 0 for balls_in_bins)
            skipped.append((spec, str(exc)))
            continue
        entries.append(entry)
    bar.close()
    if not entries:
        raise ValueError(f"scheme={scheme!r} is invalid for this run: no candidate could be accounted")
    key = "noise_mean_se" if metric == "mean_se" else "noise_max_se"
    entries.sort(key=lambda e: (getattr(e, key), e.factorization))
    return PickResult(
        ranking=tuple(entries),
        recommendation=entries[0],
        skipped=tuple(skipped),
        metric=metric,
        dataset_size=N,
        batch_size=B,
        steps=n,
        target_epsilon=epsilon,
        delta=delta,
        schedule=schedule.name,
        beta=schedule.beta if schedule.name != "constant" else 1.0,
        scheme=scheme,
        seconds=time.perf_counter() - t0,
    )


class _Skip(Exception):
    pass


def _banded_spec(name: str) -> bool:
    return name in ("identity", "bsr", "lr_bsr", "bsr_opt")


def participation_for_scheme(scheme: str, steps_per_epoch: int, steps: int) -> Participation:
    """The participation an optimized strategy is optimized for under ``scheme``.

    ``fixed_order`` with more than one epoch: fixed_epochs(b, ⌈n/b⌉) (its accountant's
    sensitivity); every other scheme normalizes by the largest column norm of C (the amplified
    schemes) or has one participation, so single participation.

    Args:
        scheme: a scheme of ``dpmf.accountants.schemes``.
        steps_per_epoch: b = ⌈N/B⌉ ≥ 1.
        steps: n ≥ 1.

    Raises:
        ValueError: b or n < 1.
    """
    b = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    n = check_int("steps", steps, minimum=1)
    k = math.ceil(n / b)
    return Participation.fixed_epochs(b, k) if scheme == "fixed_order" and k > 1 else Participation.single()


# bounded effort for the optimized strategies: one start, no cascade, capped iterations (what
# matters for choosing is the ranking; ``optimize_*`` directly give fully converged strategies)
PICK_OPTIONS = {
    "blt": {"starts": 1, "max_iterations": 150},
    "bsr_opt": {"max_iterations": 100, "cascade": False},
    "bisr_opt": {"max_iterations": 200},
}


def build_strategy(workload, spec: str, scheme: str, steps_per_epoch: int):
    """The factorization ``spec`` of ``workload`` for a run accounted under ``scheme``.

    The optimized strategies (dense, bisr_opt, bsr_opt, blt) are optimized for
    ``participation_for_scheme(scheme, steps_per_epoch, n)`` with the effort of ``PICK_OPTIONS``
    (``dpmf pick`` and ``dpmf train`` build the same strategy); the others are ``factorize``'s.

    Args:
        workload: an n-step workload.
        spec: a factorization name (``bsr:16``, ``blt:4``, ``dense`` …).
        scheme: the batch-sampling scheme the run is accounted under.
        steps_per_epoch: b = ⌈N/B⌉.

    Returns:
        a ``Factorization``.

    Raises:
        ValueError: an invalid spec, or an optimized strategy infeasible for the participation.
    """
    name = spec.partition(":")[0]
    if name in PICK_OPTIONS or name == "dense":
        participation = participation_for_scheme(scheme, steps_per_epoch, workload.n)
        return factorize(workload, spec, participation=participation, **PICK_OPTIONS.get(name, {}))
    return factorize(workload, spec)


def _build(workload, spec, name, scheme, b, N, B):
    """The factorization and its scheme (optimized ones for that scheme's participation)."""
    if name == "identity":
        return factorize(workload, "identity"), _DPSGD_SCHEME[scheme]
    if scheme == "auto":
        sch = "cyclic_poisson" if _banded_spec(name) and _bands_of(spec) <= min(b, N // B) else "fixed_order"
    else:
        sch = scheme
    if sch == "cyclic_poisson":
        p = _bands_of(spec)
        if not _banded_spec(name):
            raise _Skip("C is not banded (cyclic_poisson needs a banded strategy)")
        if p > N // B:
            raise _Skip(f"{p} bands need q = B·p/N > 1")
    f = build_strategy(workload, spec, sch, b)
    if f.n != workload.n:  # pragma: no cover - internal consistency
        raise AssertionError("factorization of the wrong size")
    return f, sch


def _bands_of(spec: str) -> int:
    _, _, p = spec.partition(":")
    return int(p) if p else 1


def _account(f, spec, sch, N, B, n, epsilon, delta, accountant, samples, seed, confidence, cache, t1):
    run = check_run(sch, N, B, n, None if spec == "identity" else f)
    _, info = build_event(run, 1.0)  # the sensitivity; raises on a scheme precondition
    s = float(info["sensitivity"])
    bands = 1 if spec == "identity" else strategy_bandwidth(f.C)
    if sch in ("poisson", "fixed_order", "single_release"):
        key = (sch,)
    elif sch == "cyclic_poisson":
        key = (sch, bands)
    else:
        key = None
    res = cache.get(key) if key is not None else None
    if res is None:
        kwargs = dict(dataset_size=N, batch_size=B, steps=n, delta=delta)
        if sch == "balls_in_bins":
            kwargs.update(samples=samples, seed=seed, confidence=confidence, progress=False)
        else:
            kwargs.update(accountant=accountant)
        res = calibrate(sch, epsilon=epsilon, factorization=run.factorization, **kwargs)
        if key is not None:
            cache[key] = res
    rows = b_row_norms(f)
    max_se = s * float(np.max(rows))
    mean_se = s * float(np.sqrt(np.mean(rows**2)))
    sigma = res.noise_multiplier
    return PickEntry(
        factorization=f.label,
        scheme=sch,
        noise_multiplier=sigma,
        sensitivity=s,
        max_se=max_se,
        mean_se=mean_se,
        noise_max_se=sigma * max_se,
        noise_mean_se=sigma * mean_se,
        epsilon=res.epsilon,
        delta=res.delta,
        accountant=res.accountant,
        guarantee=res.guarantee,
        bands=bands,
        seconds=time.perf_counter() - t1,
    )
