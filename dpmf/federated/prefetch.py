"""Record mode's per-client accountings, computed once per distinct setting and in parallel.

Each client of a ``record`` run is one private run of n = R·L steps on its N_k records at its
own σ_k; its (ε_k, δ) is ``dpmf.federated.local.record_privacy`` — the ``dpmf epsilon``
computation, whose PLD discretization (dp-accounting) dominated a run's start-up. Clients whose
settings coincide (same σ, N, B, steps, scheme, strategy, δ, accountant: e.g. under the
``uniform`` allocation) share one accounting (the cache of ``record_privacy``), and under the
PLD accountant so do clients with the same privacy event and δ (same σ, sampling rate B/N_k and
steps; ``local.PLD_CACHE``); the distinct accountings run in worker processes (``fork``), each
the very same computation, so every ε is bit-for-bit the sequential one.

Two ways: ``prefetch_record_privacy`` waits for the results (at most the usable CPU cores);
``start_record_privacy`` returns at once and leaves the accountings running in the background
(on the cores the caller does not use: one fewer than usable, at least one) while the caller
trains; ``record_privacy`` then waits for a setting's result when it is first asked for.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

__all__ = ["cancel_pending", "prefetch_record_privacy", "start_record_privacy", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on (``sched_getaffinity``; else ``cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _one(args):
    from dpmf.federated.local import _record_privacy

    return _record_privacy(*args)


def _measure(key):
    from dpmf.federated.local import pld_measurement

    return pld_measurement(*key)


_HEAVY = ("prv",)  # accountants whose accountings outlast the training: every core for them


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class _Group:
    """One accounting and the settings it answers: a PLD measurement of one (event, δ) shared by
    every setting with that event (each gets its own ``PrivacyResult`` here), or one setting's
    whole ``record_privacy`` computation."""

    def __init__(self, fn, arg):
        self.fn, self.arg, self.members = fn, arg, []  # members: (setting, (plan, σ) or None)

    def finish(self, value) -> dict:
        """setting → PrivacyResult, from the job's value (filling ``PLD_CACHE`` for a measurement)."""
        from dpmf.federated import local
        from dpmf.plan.accounting import privacy_result

        if self.fn is _one:
            return {s: value for s, _ in self.members}
        local.PLD_CACHE[self.arg] = value
        return {s: privacy_result(plan, sigma, value) for s, (plan, sigma) in self.members}


def _groups(settings) -> list:
    """The accountings the settings not yet cached or started need (``_Group``s, in order of
    first appearance); settings whose PLD measurement is cached are answered at once.

    Raises:
        ValueError/TypeError: an invalid setting (the plan's and the accountant's checks).
    """
    from dpmf.federated import local
    from dpmf.plan.accounting import privacy_result

    groups: dict = {}
    for s in dict.fromkeys(tuple(s) for s in settings):
        if s in local.RECORD_CACHE or s in local.RECORD_PENDING:
            continue
        found = local.record_pld_event(*s)
        if found is None:
            groups.setdefault(("setting", s), _Group(_one, s)).members.append((s, None))
            continue
        plan, sigma, key = found
        if key in local.PLD_CACHE:
            local.RECORD_CACHE[s] = privacy_result(plan, sigma, local.PLD_CACHE[key])
            continue
        groups.setdefault(("pld", key), _Group(_measure, key)).members.append((s, (plan, sigma)))
    return list(groups.values())


def prefetch_record_privacy(settings, *, workers: int | None = None) -> int:
    """Account every distinct setting not yet cached, in parallel; fill ``record_privacy``'s cache.

    Settings with the same PLD event and δ (same σ, sampling rate and steps) share one
    measurement.

    Args:
        settings: tuples ``(noise_multiplier, dataset_size, batch_size, steps, delta, scheme,
            factorization, accountant)`` — the positional arguments of ``record_privacy``.
        workers: processes (None: ``min(accountings, usable_cores())``); 1 computes in this
            process.

    Returns:
        the number of accountings computed (0 when all were cached).

    Raises:
        ValueError/TypeError: an invalid setting (from the accountant), before any training.
    """
    from dpmf.federated import local

    groups = _groups(settings)
    if not groups:
        return 0
    n = min(len(groups), usable_cores() if workers is None else max(1, int(workers)))
    if n > 1 and _can_fork():
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
            values = list(pool.map(_apply, [(g.fn, g.arg) for g in groups]))
    else:
        values = [_call(g) for g in groups]
    for g, v in zip(groups, values, strict=True):
        local.RECORD_CACHE.update(g.finish(v))
    return len(groups)


def _call(group):
    return group.fn(group.arg)


def _apply(job):
    fn, arg = job
    return fn(arg)


class _Waiting:
    """``record_privacy``'s wait for one setting of a background accounting."""

    def __init__(self, future, group: _Group, setting):
        self.future, self.group, self.setting = future, group, setting

    def __call__(self):
        return self.group.finish(self.future.result())[self.setting]

    def cancel(self) -> None:
        self.future.cancel()


def start_record_privacy(settings, *, workers: int | None = None) -> int:
    """Start the accountings of the settings not yet cached or started, in the background.

    One accounting per distinct PLD event and δ (as ``prefetch_record_privacy``), in ``workers``
    forked processes (None: one fewer than the usable cores, at least one — the clients train on
    the others —, or every usable core for PRV accountings; at most one per accounting);
    ``record_privacy`` waits for a setting's result when it is first asked for.
    Where processes cannot be forked, or ``workers=0``, they are computed here, before returning.

    Args:
        settings: as ``prefetch_record_privacy``.
        workers: background processes; 0 computes in this process.

    Returns:
        the number of accountings started (0 when all were cached or started).

    Raises:
        ValueError/TypeError: an invalid setting, before anything is started.
    """
    from dpmf.federated import local

    groups = _groups(settings)
    if not groups:
        return 0
    if workers is None:  # the clients train meanwhile, on the other cores; PRV (seconds per
        # accounting, tens of times PLD's) takes every core
        heavy = any(s[7] in _HEAVY for g in groups for s, _ in g.members)
        n = usable_cores() if heavy else max(1, usable_cores() - 1)
    else:
        n = max(0, int(workers))
    n = min(n, len(groups))
    if n == 0 or not _can_fork():
        for g in groups:
            local.RECORD_CACHE.update(g.finish(_call(g)))
        return len(groups)
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
    try:
        for g in groups:
            future = pool.submit(g.fn, g.arg)
            for s, _ in g.members:
                local.RECORD_PENDING[s] = _Waiting(future, g, s)
    finally:
        pool.shutdown(wait=False)  # the submitted accountings still complete
    return len(groups)


def cancel_pending() -> None:
    """Drop the background accountings not yet asked for (those not started are cancelled)."""
    from dpmf.federated import local

    for waiting in local.RECORD_PENDING.values():
        waiting.cancel()
    local.RECORD_PENDING.clear()
