"""Empirical privacy auditing: ε lower bounds from canaries.

* ``estimators``: ε lower bounds and attack statistics from in/out canary scores (numpy/scipy).
* ``mechanism``: the mechanism-level audit of a plan (no model): canary sums through the
  strategy's noise, the likelihood-ratio score, many independent trials (numpy).
* ``canaries``: canaries in training (torch): white-box gradient canaries injected into the
  clipped sum, black-box mislabeled input canaries.
* ``runner``: ``dpmf audit``: a training run with canaries → scores → bound, ``audit.json``.
* ``private_audit``: white-box canaries in a ``make_private`` run (one process or torchrun).
* ``federated``: canaries in ``dpmf fl``: canary clients (client mode, any mean strategy),
  canary records in a client's run (record mode) and in the server's DP-SGD (aggregator mode).
"""

from dpmf.audit.estimators import (
    Bonferroni,
    Explicit,
    Split,
    attack_auroc,
    epsilon_clopper_pearson,
    epsilon_from_gdp,
    epsilon_one_run,
    epsilon_one_run_fdp,
    tpr_at_given_fpr,
)

__all__ = [
    "Bonferroni",
    "Explicit",
    "Split",
    "attack_auroc",
    "epsilon_clopper_pearson",
    "epsilon_from_gdp",
    "epsilon_one_run",
    "epsilon_one_run_fdp",
    "tpr_at_given_fpr",
]
