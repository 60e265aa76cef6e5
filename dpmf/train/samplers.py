"""Batch samplers for training: the samplers of ``dpmf.plan.samplers`` and ``make_sampler``.

A run's sampler comes from its plan (``PrivatePlan.sampler(seed)``), so that the sampler and the
accounting cannot disagree; ``make_sampler`` builds one by scheme name for code that has no plan.
"""

from __future__ import annotations

from dpmf.plan.samplers import (
    BallsInBinsSampler,
    BatchSampler,
    CyclicPoissonSampler,
    EpochBallsInBinsSampler,
    PoissonSampler,
    ShuffledFixedSampler,
    steps_per_epoch,
)
from dpmf.plan.schemes import SCHEMES, CyclicPoisson, get_scheme

__all__ = [
    "SCHEMES",
    "BatchSampler",
    "PoissonSampler",
    "CyclicPoissonSampler",
    "BallsInBinsSampler",
    "EpochBallsInBinsSampler",
    "ShuffledFixedSampler",
    "make_sampler",
    "steps_per_epoch",
]


class _Run:
    """The few facts of a run a scheme's sampler needs."""

    def __init__(self, dataset_size: int, batch_size: int, steps: int):
        self.dataset_size, self.batch_size, self.steps = dataset_size, batch_size, steps
        self.steps_per_epoch = steps_per_epoch(dataset_size, batch_size)
        self.factorization = None


def make_sampler(
    scheme: str,
    dataset_size: int,
    batch_size: int,
    steps: int,
    *,
    seed: int = 0,
    groups: int | None = None,
) -> BatchSampler:
    """The sampler of a batch-sampling ``scheme`` (its ``Scheme.sampler``).

    Args:
        scheme: a registered scheme name.
        dataset_size, batch_size, steps, seed: as ``BatchSampler``.
        groups: b' for ``cyclic_poisson``: the strategy's bands p (or a min_sep ≥ p);
            default 1 (plain Poisson sampling). Prefer ``PrivatePlan.sampler``, which takes the
            groups from the plan's strategy.

    Raises:
        ValueError: unknown scheme, a batch larger than the data set, bad groups, or groups for
            a scheme that has none.
    """
    sch = get_scheme(scheme)
    if groups is not None or isinstance(sch, CyclicPoisson):
        sch = get_scheme(scheme, min_sep=1 if groups is None else groups)
    return sch.sampler(_Run(dataset_size, batch_size, steps), seed)
