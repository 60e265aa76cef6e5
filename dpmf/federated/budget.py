"""A privacy budget for a federated run: stop before the round that would exceed ``max_epsilon``.

The run's noise is planned for R rounds and its ledger holds the ε of all R. With a budget
ε_max, when the largest ε of the ledger exceeds it, the run trains only the first r* rounds,

    r* = max { r ≤ R : ε(r) ≤ ε_max },   ε(r) = the largest ε of the ledger after r rounds,

found by bisection (ε(r) is non-decreasing in r: the releases of r rounds are a prefix of
those of r + 1), and its ledger holds ε(r*) with the reason. A budget that binds costs
⌈log₂ R⌉ accountings per entry; one that does not, none.

ε after r rounds is the privacy mode's (``dpmf.federated.modes``, ``ServerPart.epsilons_after``),
each the exact accounting of the released prefix; for the built-in modes:

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

__all__ = ["BudgetStop", "plan_budget"]


class BudgetStop:
    """Where a budgeted run stops: ``rounds`` (r*), ``epsilon`` (ε(r*) per ledger entry),
    ``next_epsilon`` (the largest ε after r* + 1 rounds) and ``reason`` (one sentence)."""

    def __init__(self, rounds: int, epsilon: list, next_epsilon: float, reason: str):
        self.rounds, self.epsilon, self.next_epsilon, self.reason = rounds, epsilon, next_epsilon, reason


def plan_budget(config, ledger, epsilons_after) -> BudgetStop | None:
    """Where the run stops under ``config.max_epsilon`` (None: no budget, or it does not bind).

    Args:
        config: the ``FLConfig`` (``max_epsilon``, ``rounds``).
        ledger: the ``PrivacyEntry`` list of the whole planned run (R rounds).
        epsilons_after: r ↦ ε of each ledger entry after r rounds (the privacy mode's
            ``ServerPart.epsilons_after``; it raises ValueError when the mode accounts no prefix).

    Raises:
        ValueError: the budget is exceeded by the first round already, or the mode's prefix is
            not accounted (see the module docstring).
    """
    cap = config.max_epsilon
    if cap is None or max(e.epsilon for e in ledger) <= cap:
        return None
    eps = epsilons_after
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
