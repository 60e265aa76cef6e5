"""Record mode's per-client accountings, computed once per distinct setting and in parallel.

Each client of a ``record`` run is one private run of n = R·L steps on its N_k records at its
own σ_k; its (ε_k, δ) is ``dpmf.federated.local.record_privacy`` — the ``dpmf epsilon``
computation, whose PLD discretization (dp-accounting) dominates a run's start-up. Clients whose
settings coincide (same σ, N, B, steps, scheme, strategy, δ, accountant: e.g. under the
``uniform`` allocation) share one accounting (the cache of ``record_privacy``); the distinct
ones run in worker processes (``fork``), each the very same computation, so every ε is
bit-for-bit the sequential one.

Two ways: ``prefetch_record_privacy`` waits for the results (at most the usable CPU cores);
``start_record_privacy`` returns at once and leaves the accountings running in the background
(on the cores the caller does not use: one fewer than usable, at least one) while the caller
trains; ``record_privacy`` then waits for a setting's result when it is first asked for.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

__all__ = ["prefetch_record_privacy", "start_record_privacy", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may run on (``sched_getaffinity``; else ``cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _one(args):
    from dpmf.federated.local import _record_privacy

    return _record_privacy(*args)


def _todo(settings) -> list:
    from dpmf.federated import local

    return list(
        dict.fromkeys(
            tuple(s)
            for s in settings
            if tuple(s) not in local.RECORD_CACHE and tuple(s) not in local.RECORD_PENDING
        )
    )


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def prefetch_record_privacy(settings, *, workers: int | None = None) -> int:
    """Account every distinct setting not yet cached, in parallel; fill ``record_privacy``'s cache.

    Args:
        settings: tuples ``(noise_multiplier, dataset_size, batch_size, steps, delta, scheme,
            factorization, accountant)`` — the positional arguments of ``record_privacy``.
        workers: processes (None: ``min(distinct, usable_cores())``); 1 computes in this process.

    Returns:
        the number of accountings computed (0 when all were cached).

    Raises:
        ValueError/TypeError: an invalid setting (from the accountant), before any training.
    """
    from dpmf.federated import local

    todo = _todo(settings)
    if not todo:
        return 0
    n = min(len(todo), usable_cores() if workers is None else max(1, int(workers)))
    if n > 1 and _can_fork():
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_one, todo))
    else:
        results = [_one(s) for s in todo]
    for s, r in zip(todo, results, strict=True):
        local.RECORD_CACHE[s] = r
    return len(todo)


def start_record_privacy(settings, *, workers: int | None = None) -> int:
    """Start accounting every distinct setting not yet cached or started, in the background.

    The accountings run in ``workers`` forked processes (None: one fewer than the usable cores,
    at least one, at most one per setting) and fill ``record_privacy``'s cache when it asks for
    their setting (it waits then). Where processes cannot be forked, or ``workers=0``, they are
    computed here, before returning.

    Args:
        settings: as ``prefetch_record_privacy``.
        workers: background processes; 0 computes in this process.

    Returns:
        the number of accountings started (0 when all were cached or started).
    """
    from dpmf.federated import local

    todo = _todo(settings)
    if not todo:
        return 0
    n = max(1, usable_cores() - 1) if workers is None else max(0, int(workers))
    n = min(n, len(todo))
    if n == 0 or not _can_fork():
        for s in todo:
            local.RECORD_CACHE[s] = _one(s)
        return len(todo)
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
    try:
        for s in todo:
            local.RECORD_PENDING[s] = pool.submit(_one, s)
    finally:
        pool.shutdown(wait=False)  # the submitted accountings still complete
    return len(todo)


def cancel_pending() -> None:
    """Drop the background accountings not yet asked for (those not started are cancelled)."""
    from dpmf.federated import local

    for fut in local.RECORD_PENDING.values():
        if isinstance(fut, Future):
            fut.cancel()
    local.RECORD_PENDING.clear()
