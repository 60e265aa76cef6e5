"""A privacy budget for a federated run: stop before the round that would exceed ``max_epsilon``.

The run's noise is planned for R rounds and its ledger holds the ε of all R. With a budget
ε_max, when the largest ε of the ledger exceeds it, the run trains only the first r* rounds,

    r* = max { r ≤ R : ε(r) ≤ ε_max },   ε(r) = the largest ε of the ledger after r rounds,

found by bisection (ε(r) is non-decreasing in r: the releases of r rounds are a prefix of
those of r + 1), and its ledger holds ε(r*) with the reason. A budget that binds costs
⌈log₂ R⌉ accountings per entry; one that does not, none.

ε after r rounds, per mode (each the exact accounting of the released prefix):

* ``aggregator``: the heterogeneous composition of the first r rounds' server steps
  (``local.aggregator_privacy``);
* ``record``: client k's r·L Poisson-sampled steps with independent noise
  (``local.record_privacy``); a correlated local strategy or another scheme is refused (the
  prefix of a correlated stream planned for R·L steps is not the stream planned for r·L);
* ``client``: r rounds of N(0, σ_c²ζ²) on the sum (``local.ClientLevelNoise`` for r rounds);
  correlated client noise is refused for the same reason.

Raises ``ValueError`` before any training when even the first round exceeds the budget.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

__all__ = ["BudgetStop", "plan_budget"]


class BudgetStop:
    """Where a budgeted run stops: ``rounds`` (r*), ``epsilon`` (ε(r*) per ledger entry),
    ``next_epsilon`` (the largest ε after r* + 1 rounds) and ``reason`` (one sentence)."""

    def __init__(self, rounds: int, epsilon: list, next_epsilon: float, reason: str):
        self.rounds, self.epsilon, self.next_epsilon, self.reason = rounds, epsilon, next_epsilon, reason


def _epsilons_after(
    config, ledger, *, sigmas=(), sizes=(), steps_per_round_sigmas=(), sampling_rate=1.0, num_clients=1
):
    from dpmf.federated import local
    from dpmf.plan.schemes import Poisson

    mode = config.privacy
    if mode == "record" and (config.local_factorization != "identity" or config.local_scheme != Poisson.name):
        raise ValueError(
            "max_epsilon is invalid with a correlated local strategy or a scheme other than poisson in "
            "record mode: the ε of a prefix of that run is not accounted; drop --max-epsilon or use "
            "--local-factorization identity --local-scheme poisson"
        )
    if mode == "client" and config.client_factorization != "identity":
        raise ValueError(
            "max_epsilon is invalid with correlated client noise: the ε of a prefix of a stream planned for "
            "R rounds is not accounted; drop --max-epsilon or choose --rounds within the budget"
        )

    def eps(r: int) -> list[float]:
        if r == 0:
            return [0.0] * len(ledger)
        if mode == "aggregator":
            steps = np.tile(steps_per_round_sigmas, r)
            pr = local.aggregator_privacy(
                steps, sampling_rate=sampling_rate, delta=config.delta, accountant=config.accountant or "pld"
            )
            return [pr.epsilon]
        if mode == "record":
            return [
                local.record_privacy(
                    float(s), dataset_size=int(n), batch_size=config.local_batch_size,
                    steps=r * config.local_steps, delta=config.delta, accountant=config.accountant,
                ).epsilon
                for s, n in zip(sigmas, sizes, strict=True)
            ]  # fmt: skip
        sigma_c = ledger[0].noise_multiplier
        noise = local.ClientLevelNoise(  # its privacy only: the stream of dim 1 is never drawn
            num_clients, r, noise_multiplier=sigma_c, clip_norm=1.0, delta=config.delta,
            accountant=config.accountant, dim=1, seed=0,
        )  # fmt: skip
        return [noise.privacy.epsilon]

    return eps


def plan_budget(config, ledger, **facts) -> BudgetStop | None:
    """Where the run stops under ``config.max_epsilon`` (None: no budget, or it does not bind).

    Args:
        config: the ``FLConfig`` (``max_epsilon``, ``rounds``, the mode's settings).
        ledger: the ``PrivacyEntry`` list of the whole planned run (R rounds).
        facts: ``sigmas``, ``sizes`` (record mode: each entry's σ_k and N_k),
            ``steps_per_round_sigmas`` and ``sampling_rate`` (aggregator mode: one round's
            server σ_t and the Poisson rate), ``num_clients`` (client mode: P).

    Raises:
        ValueError: the budget is exceeded by the first round already, or the mode's prefix is
            not accounted (see the module docstring).
    """
    cap = config.max_epsilon
    if cap is None or max(e.epsilon for e in ledger) <= cap:
        return None
    eps = _epsilons_after(config, ledger, **facts)
    lo, hi, hi_eps = 0, config.rounds, max(e.epsilon for e in ledger)
    lo_eps = [0.0] * len(ledger)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        e = eps(mid)
        if max(e) <= cap:
            lo, lo_eps = mid, e
        else:
            hi, hi_eps = mid, max(e)
    if lo == 0:
        raise ValueError(
            f"max_epsilon={cap:g} is invalid for this run: one round already gives ε = {hi_eps:.4g} "
            f"({ledger[0].protects}); raise max_epsilon or the noise"
        )
    reason = (
        f"stopped before round {lo + 1} of {config.rounds}: it would bring ε to {hi_eps:.4g} > "
        f"max_epsilon = {cap:g}; ε after round {lo} is {max(lo_eps):.4g}"
    )
    return BudgetStop(lo, lo_eps, hi_eps, reason)


def apply(ledger, stop: BudgetStop, steps_per_round) -> list:
    """The ledger of the stopped run: ε(r*) and the steps of r* rounds, the reason in each note."""
    return [
        replace(e, epsilon=float(eps), steps=int(stop.rounds * steps_per_round[i]),
                note=(e.note + "; " if e.note else "") + stop.reason)
        for i, (e, eps) in enumerate(zip(ledger, stop.epsilon, strict=True))
    ]  # fmt: skip
