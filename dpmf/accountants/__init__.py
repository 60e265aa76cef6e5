"""Privacy accounting: the (ε, δ) of a training run with DP-SGD or a matrix mechanism.

Events (what happened) are in ``events``; accountants (how private it was) in ``library``
(PLD, RDP, PRV) and ``montecarlo`` (balls-in-bins, certified); the one generic calibrator in
``calibration``; the entry points ``account``, ``calibrate``, ``max_steps`` and
``max_batch_size`` (on a ``dpmf.PrivatePlan``, or keyword conveniences that build one) in
``api``. The batch-sampling schemes are objects of ``dpmf.plan.schemes``.
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
from dpmf.accountants.library import PLDAccountant, PRVAccountant, RDPAccountant, to_dp_event
from dpmf.accountants.montecarlo import (
    MonteCarloAccountant,
    PrivacyLossSample,
    certified_delta,
    kl_bernoulli,
    sample_privacy_losses,
    samples_needed,
)
from dpmf.accountants.result import GUARANTEES, Measurement, PrivacyResult

__all__ = [
    "ACCOUNTANTS",
    "GUARANTEES",
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
    "account",
    "account_segments",
    "calibrate",
    "certified_delta",
    "default_accountant",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "kl_bernoulli",
    "max_batch_size",
    "max_steps",
    "sample_privacy_losses",
    "samples_needed",
    "to_dp_event",
]
