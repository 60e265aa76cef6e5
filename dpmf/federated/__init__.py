"""Compliance-aware federated learning on Flower (the optional extra ``fl``: ``flwr==1.42.0``).

Institutions (clients) train one model with Flower's Message API (``ServerApp``/``ClientApp``)
and Flower's own strategies (FedAvg, FedMedian, FedProx, FedAdam, FedYogi). Each client's
public compliance profile (HIPAA, GDPR, NIST, ISO, HL7/FHIR scores; ``compliance``) sets its
noise multiplier. Privacy modes are objects in a registry (``modes``: ``PRIVACY_MODES``,
``register_privacy_mode``), each with the unit its ε protects (``ledger``); three are built in:

* ``aggregator`` — server-side DP-SGD on a small aggregator dataset after each aggregation,
  per-step noise from the participants' scores; ε of the aggregator dataset's records;
* ``record`` — each client trains with dpmf's private step to its own (ε_k, δ); ε of client
  k's records;
* ``client`` — clipped client updates, one Gaussian noise on their mean (optionally correlated
  across rounds); ε of a whole client.

Modules: ``compliance``, ``ledger`` and ``modes`` (numpy only at import), ``data`` (MedMNIST files, stand-ins,
partitions), ``models`` (torch), ``local`` (the one seam to dpmf's private-step machinery),
``strategies``, ``grid`` (in-process Flower Grid), ``run`` (``FLConfig``, ``run_federated``),
``report`` (several seeds, files and summary tables) and ``experiment`` (the grid of
Experiments 1/4 × weighted/uniform noise); ``checks`` (contradictory settings), ``prefetch``
(record-mode accountings in parallel), ``budget`` (``max_epsilon``), ``sampling`` (client
sampling per round), ``evaluation`` (held-out federated evaluation). Building blocks for a
user's own Flower app: ``wrappers.CorrelatedClientDP`` (a strategy wrapper: client-level DP with
noise correlated across rounds, fixed or adaptive clipping — ``adaptive.AdaptiveClipping``),
``mods.RecordDPTrainer`` (record-level DP as a train handler) and
``weighted.ComplianceWeighted`` (compliance-weighted noise over either); the whole run as a
Flower app: ``app`` (``app``, ``clientapp``; ``flwr run``). Import
``run``/``grid``/``strategies``/``report``/``experiment``/``wrappers``/``mods``/``weighted``/``app``
only with Flower installed.
"""

from dpmf.federated.compliance import (
    CRITERIA,
    ComplianceProfile,
    ComplianceSet,
    NoiseMap,
    example_profiles,
    load_profiles,
    uniform_control,
)
from dpmf.federated.ledger import VACUOUS_EPSILON, PrivacyEntry, format_entry
from dpmf.federated.modes import PRIVACY_MODES, PrivacyMode, privacy_modes, register_privacy_mode

__all__ = [
    "CRITERIA",
    "PRIVACY_MODES",
    "VACUOUS_EPSILON",
    "ComplianceProfile",
    "ComplianceSet",
    "NoiseMap",
    "PrivacyEntry",
    "PrivacyMode",
    "example_profiles",
    "format_entry",
    "load_profiles",
    "privacy_modes",
    "register_privacy_mode",
    "uniform_control",
]
