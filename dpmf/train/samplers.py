"""Batch samplers for training: the samplers of ``dpmf.plan.samplers``.

A run's sampler comes from its plan only (``PrivatePlan.sampler(seed)``, built with the rest of
the step by ``PrivatePlan.private_step``), so that the sampler and the accounting cannot
disagree.
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
from dpmf.plan.schemes import SCHEMES

__all__ = [
    "SCHEMES",
    "BatchSampler",
    "PoissonSampler",
    "CyclicPoissonSampler",
    "BallsInBinsSampler",
    "EpochBallsInBinsSampler",
    "ShuffledFixedSampler",
    "steps_per_epoch",
]
