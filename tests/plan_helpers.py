"""Shorthands of the tests: a run's plan and its privacy event from (scheme, N, B, n, strategy)."""

from dpmf.plan import PrivatePlan


def check_run(scheme, dataset_size, batch_size, steps, factorization=None):
    """The run's plan (C = I without a factorization)."""
    strategy = "identity" if factorization is None else factorization
    return PrivatePlan(dataset_size, batch_size, steps=steps, scheme=scheme, strategy=strategy)


def build_event(plan, sigma):
    """The plan's privacy event at σ and its sensitivity."""
    return plan.event(sigma), {"sensitivity": plan.sensitivity}
