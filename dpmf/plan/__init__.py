"""One private run = one plan: batch-sampling schemes as objects, ``PrivatePlan``, its
accounting, and ``pick`` (which builds one plan per candidate strategy).

Numpy only: the torch noise stream is built lazily by ``PrivatePlan.noise``.
"""

from dpmf.plan.accounting import account, calibrate, max_batch_size, max_steps
from dpmf.plan.plan import PrivatePlan, build_strategy, leading_block, steps_per_epoch
from dpmf.plan.schemes import (
    SCHEMES,
    BallsInBins,
    CyclicPoisson,
    EpochBallsInBins,
    FixedOrder,
    Poisson,
    Scheme,
    SingleRelease,
    get_scheme,
    register_scheme,
    scheme_names,
)

__all__ = [
    "SCHEMES",
    "BallsInBins",
    "CyclicPoisson",
    "EpochBallsInBins",
    "FixedOrder",
    "Poisson",
    "PrivatePlan",
    "Scheme",
    "SingleRelease",
    "account",
    "build_strategy",
    "calibrate",
    "get_scheme",
    "leading_block",
    "max_batch_size",
    "max_steps",
    "register_scheme",
    "scheme_names",
    "steps_per_epoch",
]
