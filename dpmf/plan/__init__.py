"""One private run = one plan: batch-sampling schemes as objects, ``PrivatePlan``, its
accounting (``accounting``: on a plan; ``api``: the entry points that also take keywords and
build the plan), and ``pick`` (which builds one plan per candidate strategy).

Numpy only: the torch noise stream is built lazily by ``PrivatePlan.noise``.
"""

from dpmf.plan.api import (
    account,
    account_segments,
    calibrate,
    default_accountant,
    max_batch_size,
    max_steps,
)
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
    "account_segments",
    "build_strategy",
    "calibrate",
    "default_accountant",
    "get_scheme",
    "leading_block",
    "max_batch_size",
    "max_steps",
    "register_scheme",
    "scheme_names",
    "steps_per_epoch",
]
