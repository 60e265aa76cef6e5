"""Privacy accounting: the (ε, δ) of a training run with DP-SGD or a matrix mechanism.

Events (what happened) are in ``events``; accountants (how private it was) in ``library``
(PLD, RDP, PRV), ``montecarlo`` (balls-in-bins, certified) and ``allocation``; each accountant
is a specification object of the registry ``ACCOUNTANTS`` (``registry``); the one generic
calibrator is in ``calibration``. This layer knows nothing of plans: the entry points
``account``, ``calibrate``, ``max_steps`` and ``max_batch_size`` take a ``dpmf.PrivatePlan``
(or keywords that build one) and live above it (``dpmf.account``, ``dpmf.plan.api``).
"""

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
from dpmf.accountants.registry import (
    ACCOUNTANTS,
    PLD,
    PRV,
    RDP,
    AccountantSpec,
    AllocationPLD,
    MonteCarlo,
    accountant_names,
    accountants_for,
    get_accountant,
    make_accountant,
    register_accountant,
)
from dpmf.accountants.result import GUARANTEES, Measurement, PrivacyResult

__all__ = [
    "ACCOUNTANTS",
    "AccountantSpec",
    "AllocationPLD",
    "MonteCarlo",
    "PLD",
    "PRV",
    "RDP",
    "accountant_names",
    "accountants_for",
    "get_accountant",
    "make_accountant",
    "register_accountant",
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
    "certified_delta",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "kl_bernoulli",
    "sample_privacy_losses",
    "samples_needed",
    "to_dp_event",
]
