"""Privacy accounting: the (ε, δ) of a training run with DP-SGD or a matrix mechanism.

Events (what happened) are in ``events``; accountants (how private it was) in ``library``
(PLD, RDP, PRV) and ``montecarlo`` (balls-in-bins, certified); the batch-sampling schemes of a
training run in ``schemes``; the entry points ``account``, ``calibrate``, ``max_steps`` and
``max_batch_size`` in ``api``.
"""

from dpmf.accountants.api import (
    ACCOUNTANTS,
    account,
    account_segments,
    calibrate,
    default_accountant,
    max_batch_size,
    max_steps,
)
from dpmf.accountants.events import (
    ComposedEvent,
    GaussianEvent,
    MixtureGaussianEvent,
    PoissonGaussianEvent,
)
from dpmf.accountants.gaussian import gaussian_delta, gaussian_epsilon, gaussian_mu
from dpmf.accountants.library import PLDAccountant, PRVAccountant, RDPAccountant
from dpmf.accountants.montecarlo import (
    MonteCarloAccountant,
    PrivacyLossSample,
    certified_delta,
    kl_bernoulli,
    sample_privacy_losses,
    samples_needed,
)
from dpmf.accountants.result import GUARANTEES, Measurement, PrivacyResult
from dpmf.accountants.schemes import (
    MONTE_CARLO_SCHEMES,
    SCHEMES,
    Run,
    bin_gram,
    build_event,
    check_run,
)

__all__ = [
    "ACCOUNTANTS",
    "GUARANTEES",
    "MONTE_CARLO_SCHEMES",
    "SCHEMES",
    "ComposedEvent",
    "GaussianEvent",
    "Measurement",
    "MixtureGaussianEvent",
    "MonteCarloAccountant",
    "PLDAccountant",
    "PRVAccountant",
    "PoissonGaussianEvent",
    "PrivacyLossSample",
    "PrivacyResult",
    "RDPAccountant",
    "Run",
    "account",
    "account_segments",
    "bin_gram",
    "build_event",
    "calibrate",
    "certified_delta",
    "check_run",
    "default_accountant",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "kl_bernoulli",
    "max_batch_size",
    "max_steps",
    "sample_privacy_losses",
    "samples_needed",
]
