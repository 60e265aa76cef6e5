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
BLT with 2 and 4 buffers (at most ``max_bands``), λCGD with λ optimized (``lcgd_opt``) and the
dense strategy when n ≤ ``dense_max_steps`` — each registered strategy's own ``candidates``
(``dpmf.mechanisms.registry``), each optimized for the participation notion of the scheme it is accounted
under (single participation for the amplified schemes, whose accountants normalize by the
largest column norm; fixed_epochs(b, ⌈n/b⌉) for ``fixed_order``).

Schemes (``dpmf.plan.schemes``; each scheme's ``refuse_candidate``, ``dpsgd_counterpart`` and
``auto_scheme``; b = ⌈N/B⌉ steps per epoch):

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

Every candidate is one ``PrivatePlan``. The events of the Poisson and Gaussian schemes depend on
C only through its bands (cyclic Poisson) or not at all (fixed order, single release): plans
with equal ``Scheme.event_key`` share one calibrated σ; the sensitivity s is each plan's own.

Work: building a candidate (optimizing it, evaluating its errors) and calibrating an event are
independent tasks, run on ``jobs`` worker processes (``jobs=1``: in this process). Each σ is
calibrated once per event key, from the first candidate built with that key; the ranking does
not depend on ``jobs`` or on the order in which the tasks finish.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, fields

import numpy as np
from tqdm import tqdm

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.calibration import check_monte_carlo
from dpmf.accountants.registry import ACCOUNTANTS, get_accountant
from dpmf.mechanisms.dense import DENSE_MAX_STEPS
from dpmf.mechanisms.errors import b_row_norms
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.registry import STRATEGIES, PickContext, factorize, parse_factorization
from dpmf.plan.accounting import calibrate
from dpmf.plan.plan import PrivatePlan, build_strategy
from dpmf.plan.schemes import SCHEMES, auto_scheme, get_scheme
from dpmf.workloads.schedules import Schedule
from dpmf.workloads.workload import from_schedule

__all__ = [
    "PICK_SCHEMES",
    "PickEntry",
    "PickResult",
    "candidate_specs",
    "default_jobs",
    "participation_for_scheme",
    "pick",
]

#: ``auto`` and every scheme that accounts matrix mechanisms
PICK_SCHEMES = ("auto",) + tuple(name for name, cls in SCHEMES.items() if cls.matrix_mechanism)


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
        plan: the candidate's calibrated ``PrivatePlan`` (its strategy built once, σ and
            ``privacy`` set): train it as it is, nothing is factorized or calibrated again.
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
    plan: PrivatePlan | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """JSON-ready dict of the numbers (the plan is not included)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}


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
            "recommendation": rec.to_dict(),
            "ranking": [e.to_dict() for e in self.ranking],
            "skipped": [{"factorization": f, "reason": r} for f, r in self.skipped],
            "seconds": self.seconds,
        }


def candidate_specs(schedule: Schedule, n: int, max_bands: int, *, optimized: bool, dense_max_steps: int):
    """The candidate factorization specs (each registered strategy's ``candidates``), without
    duplicates, in registry order."""
    has_decay = schedule.name != "constant" and schedule.beta != 1.0
    grid = sorted({p for p in (2**i for i in range(1, 31)) if p <= max_bands} | {max_bands})
    grid = tuple(p for p in grid if 2 <= p <= n)
    ctx = PickContext(n, has_decay, grid, max_bands, optimized, dense_max_steps)
    specs: list[str] = []
    for entry in STRATEGIES.values():
        specs += [s for s in entry.candidates(ctx) if s not in specs]
    return specs


def _checked_scheme(scheme: str, accountant: str | None, run0):
    """The chosen ``Scheme`` (None for ``auto``), with its preconditions on the run and on the
    accountant checked.

    Raises:
        ValueError: a randomized accountant, or one the scheme cannot use, or a run the scheme
            refuses.
    """
    deterministic = tuple(n for n, cls in ACCOUNTANTS.items() if not cls.randomized)
    if accountant is not None and accountant not in deterministic:
        raise ValueError(
            f"accountant={accountant!r} is invalid: must be one of {', '.join(deterministic)} "
            "(a deterministic accountant the candidate's scheme supports; the Monte Carlo settings "
            "are samples/seed/confidence)"
        )
    chosen = None if scheme == "auto" else get_scheme(scheme)
    if chosen is not None:
        chosen.check_strategy(run0)  # the scheme's own preconditions on N, B, n (one epoch, bins)
        if accountant is not None:
            chosen.check_accountant(accountant)  # e.g. pld cannot measure balls-in-bins
    return chosen


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
    jobs: int = 1,
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
        jobs: worker processes for the candidates and calibrations, ≥ 1 (1: in this process;
            ``default_jobs()``: one per available core). The result is the same for every value.

    Returns:
        ``PickResult``.

    Raises:
        ValueError/TypeError: any invalid argument, named, before any work (also a run that no
            candidate can be accounted for).
    """
    t0 = time.perf_counter()
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule={schedule!r} is invalid: must be a dpmf.workloads.Schedule")
    run0 = PrivatePlan(dataset_size, batch_size, steps=steps, schedule=schedule)
    N, B, n = run0.dataset_size, run0.batch_size, run0.steps
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=False)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    max_bands = check_int("max_bands", max_bands, minimum=1)
    scheme = check_choice("scheme", scheme, PICK_SCHEMES)
    metric = check_choice("metric", metric, ("mean_se", "max_se"))
    dense_max_steps = check_int("dense_max_steps", dense_max_steps, minimum=1, maximum=DENSE_MAX_STEPS)
    samples, seed, confidence = check_monte_carlo(samples, seed, confidence)
    jobs = check_int("jobs", jobs, minimum=1)
    chosen = _checked_scheme(scheme, accountant, run0)

    workload = from_schedule(schedule, n)
    specs = candidate_specs(schedule, n, max_bands, optimized=optimized, dense_max_steps=dense_max_steps)
    calibration = (epsilon, delta, accountant, samples, seed, confidence)
    pool = _executor(jobs, len(specs))
    bar = tqdm(
        total=len(specs), desc="pick", unit="strategy", disable=None if progress is None else not progress
    )
    try:
        outcomes = _run_candidates(pool, workload, specs, chosen, run0, calibration, bar)
    finally:  # on an error, drop the queued tasks instead of running them
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    entries = [outcomes[spec] for spec in specs if not isinstance(outcomes[spec], str)]  # spec order
    skipped = [(spec, outcomes[spec]) for spec in specs if isinstance(outcomes[spec], str)]
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


def participation_for_scheme(scheme: str, steps_per_epoch: int, steps: int) -> Participation:
    """The participation an optimized strategy is optimized for under ``scheme``
    (``Scheme.participation``: fixed_epochs(b, ⌈n/b⌉) for ``fixed_order`` with more than one
    epoch, single participation otherwise).

    Raises:
        ValueError: an unknown scheme, b or n < 1.
    """
    b = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    n = check_int("steps", steps, minimum=1)
    return get_scheme(scheme).participation(n, b)


def _plan(workload, spec: str, chosen, run0: PrivatePlan) -> PrivatePlan:
    """The candidate's plan: its scheme (``auto_scheme`` or the chosen one, DP-SGD under the
    chosen scheme's counterpart), its strategy built for that scheme's participation."""
    name, param = parse_factorization(spec)
    entry = STRATEGIES[name]
    bands = entry.bands_of(param)
    if name == "identity":
        sch = auto_scheme(None, None, run0) if chosen is None else chosen.dpsgd_counterpart()
        f = factorize(workload, "identity")
    else:
        sch = auto_scheme(entry, bands, run0) if chosen is None else chosen
        reason = sch.refuse_candidate(entry, bands, run0)
        if reason is not None:
            raise _Skip(reason)
        f = build_strategy(workload, spec, sch, run0.steps_per_epoch)
    return PrivatePlan(
        run0.dataset_size, run0.batch_size, steps=run0.steps, scheme=sch, strategy=f, schedule=run0.schedule
    )


def default_jobs() -> int:
    """The number of cores this process may run on (``--jobs`` of ``dpmf pick``), ≥ 1."""
    if hasattr(os, "process_cpu_count"):  # Python ≥ 3.13
        count = os.process_cpu_count()
    elif hasattr(os, "sched_getaffinity"):
        count = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - platforms without affinity
        count = os.cpu_count()
    return max(1, int(count or 1))


class _InProcess(Executor):
    """An executor that runs each task when it is submitted (``jobs=1``)."""

    def submit(self, fn, /, *args, **kwargs):
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # handed to the caller by future.result(); Ctrl-C stops at once
            future.set_exception(exc)
        return future


def _limit_blas_threads(threads: int) -> None:
    """Worker initializer: at most ``threads`` BLAS threads (no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - optional
        return
    threadpool_limits(limits=threads, user_api="blas")


def _executor(jobs: int, tasks: int) -> Executor:
    """``jobs`` worker processes (at most one per task), or this process for ``jobs=1``.

    Workers are forked on Linux (no re-import of the toolkit) and spawned elsewhere; each may use
    its share of the cores for BLAS."""
    workers = min(jobs, tasks)
    if workers <= 1:
        return _InProcess()
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    threads = max(1, default_jobs() // workers)
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context(method),
        initializer=_limit_blas_threads,
        initargs=(threads,),
    )
    pool.submit(int).result()  # start the workers now, before the progress bar's thread exists
    return pool


@dataclass(frozen=True, eq=False)
class _Built:
    """A candidate's plan, built and evaluated (without σ)."""

    plan: PrivatePlan
    key: object
    max_se: float
    mean_se: float
    seconds: float


def _build_candidate(workload, spec: str, chosen, run0: PrivatePlan) -> _Built:
    """Task: the candidate's plan and its errors at σ = 1. Raises _Skip or ValueError when the
    candidate cannot be built or accounted."""
    t0 = time.perf_counter()
    plan = _plan(workload, spec, chosen, run0)
    s = plan.sensitivity
    rows = b_row_norms(plan.strategy)
    max_se = s * float(np.max(rows))
    mean_se = s * float(np.sqrt(np.mean(rows**2)))
    return _Built(plan, plan.scheme.event_key(plan), max_se, mean_se, time.perf_counter() - t0)


def _calibrate_candidate(plan: PrivatePlan, epsilon, delta, accountant, samples, seed, confidence):
    """Task: σ for the plan's event (shared by the plans with its event key); returns
    (noise_multiplier, epsilon, delta, accountant, guarantee, seconds, the PrivacyResult)."""
    t0 = time.perf_counter()
    name = accountant if accountant in plan.scheme.accountants else None  # else its default
    if get_accountant(plan.scheme.check_accountant(name)).randomized:
        kw = dict(samples=samples, seed=seed, confidence=confidence, progress=False)
    else:
        kw = dict(accountant=name)
    res = calibrate(plan, epsilon=epsilon, delta=delta, **kw)
    return (
        res.noise_multiplier,
        res.epsilon,
        res.delta,
        res.accountant,
        res.guarantee,
        time.perf_counter() - t0,
        res,
    )


def _cost_order(specs: list[str]) -> list[str]:
    """The optimized strategies first (they take longest), then the rest, each in spec order."""
    slow = [s for s in specs if STRATEGIES[parse_factorization(s)[0]].optimized]
    return slow + [s for s in specs if s not in slow]


def _run_candidates(pool: Executor, workload, specs, chosen, run0, calibration, bar) -> dict:
    """Build every candidate and calibrate every distinct event on ``pool``; returns
    spec → ``PickEntry``, or the reason it was skipped."""
    builds = {
        pool.submit(_build_candidate, workload, spec, chosen, run0): spec for spec in _cost_order(specs)
    }
    pending = set(builds)
    outcomes: dict = {}
    built: dict[str, _Built] = {}
    sigma: dict = {}  # event key → future of _calibrate_candidate
    owner: dict = {}  # event key → the spec whose plan was calibrated
    waiting: dict[str, object] = {}  # built spec → its event key, until its σ is known
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            spec = builds.get(future)
            if spec is None:
                continue  # a calibration: its candidates are finished below
            try:
                b = future.result()
            except (_Skip, ValueError) as exc:  # infeasible/unsolved, or a scheme precondition
                outcomes[spec] = str(exc)
                bar.update(1)
                continue
            built[spec] = b
            key = ("candidate", spec) if b.key is None else ("event", b.key)
            if key not in sigma:
                sigma[key] = pool.submit(_calibrate_candidate, b.plan, *calibration)
                owner[key] = spec
                pending.add(sigma[key])
            waiting[spec] = key
        for spec, key in list(waiting.items()):
            if sigma[key].done():
                outcomes[spec] = _entry(built[spec], sigma[key], owner[key] == spec)
                del waiting[spec]
                bar.update(1)
    return outcomes


def _entry(b: _Built, calibrated: Future, owns: bool):
    """The candidate's ``PickEntry`` at its calibrated σ, or why it was skipped (an accountant
    that cannot measure it)."""
    try:
        sigma, eps, delta, accountant, guarantee, seconds, res = calibrated.result()
    except ValueError as exc:
        return str(exc)
    plan = b.plan
    # plans of one event key share σ and ε; the result names each plan's own strategy
    privacy = dataclasses.replace(res, sensitivity=plan.sensitivity, factorization=plan.label)
    calibrated_plan = plan.with_noise(sigma, privacy=privacy)
    return PickEntry(
        factorization=plan.label,
        scheme=plan.scheme.name,
        noise_multiplier=sigma,
        sensitivity=plan.sensitivity,
        max_se=b.max_se,
        mean_se=b.mean_se,
        noise_max_se=sigma * b.max_se,
        noise_mean_se=sigma * b.mean_se,
        epsilon=eps,
        delta=delta,
        accountant=accountant,
        guarantee=guarantee,
        bands=plan.bands,
        seconds=b.seconds + (seconds if owns else 0.0),
        plan=calibrated_plan,
    )
