"""The privacy ledger of a federated run: every ε with what it protects.

An (ε, δ) is meaningless without its unit — the neighbouring relation it is a guarantee for. Each
privacy mode (``dpmf.federated.modes``, its registry) names its unit and makes its entries; the
built-in three protect different things:

==============  ==============================  ===============================================
mode            unit (``protects``)             what the guarantee says
==============  ==============================  ===============================================
``aggregator``  aggregator-dataset records      adding or removing one record of the server's
                                                aggregator dataset changes the released models
                                                by at most (ε, δ); the clients' updates reach
                                                a semi-honest aggregator in the clear and are
                                                not protected at all
``record``      records of client k             one record of client k's data, against everyone
                                                who sees client k's updates (the server
                                                included); one entry per client
``client``      client                          a whole client's data (add or remove one client),
                                                against everyone who sees the noisy aggregate;
                                                the server must not see individual updates
                                                (secure aggregation or a trusted aggregator)
==============  ==============================  ===============================================

ε above ``VACUOUS_EPSILON`` (10) is flagged: at that level the likelihood ratio between the
neighbouring worlds may reach e^10 ≈ 22 000, which offers no meaningful protection.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dpmf.federated._registry import PRIVACY_MODES

__all__ = ["VACUOUS_EPSILON", "PrivacyEntry", "format_entry"]

VACUOUS_EPSILON = 10.0


@dataclass(frozen=True)
class PrivacyEntry:
    """One (ε, δ) of a federated run and what it protects.

    Attributes:
        mode: the privacy mode's name (``dpmf.federated.modes.PRIVACY_MODES``).
        protects: the unit (the mode's ``protects``): ``aggregator-dataset records``,
            ``records of client <id>``, ``client``, ….
        subject: whose privacy it is (the aggregator dataset, a client id, every client).
        epsilon: ε ≥ 0, or ∞ for a run without noise.
        delta: δ.
        accountant, guarantee: as in ``dpmf.accountants.PrivacyResult``.
        noise_multiplier: the smallest σ of the mechanism (informational).
        steps: private releases composed.
        dataset_size: the number of protected units (records or clients).
        note: one sentence on the threat model.
    """

    mode: str
    protects: str
    subject: str
    epsilon: float
    delta: float
    accountant: str
    guarantee: str
    noise_multiplier: float
    steps: int
    dataset_size: int
    note: str = ""

    def __post_init__(self):
        if self.mode not in PRIVACY_MODES:
            raise ValueError(
                f"mode={self.mode!r} is invalid: must be a registered privacy mode, one of "
                f"{tuple(PRIVACY_MODES)} (dpmf.federated.modes)"
            )
        if not isinstance(self.protects, str) or not self.protects:
            raise ValueError(f"protects={self.protects!r} is invalid: must be the mode's unit (non-empty)")
        if math.isnan(self.epsilon) or self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon!r} is invalid: must be >= 0")

    @property
    def vacuous(self) -> bool:
        """ε > ``VACUOUS_EPSILON``: no meaningful protection."""
        return self.epsilon > VACUOUS_EPSILON

    def to_dict(self) -> dict:
        out = asdict(self)
        out["epsilon"] = "inf" if math.isinf(self.epsilon) else self.epsilon
        out["vacuous"] = self.vacuous
        return out


def format_entry(e: PrivacyEntry) -> str:
    """One line: ε with its unit, δ, the accountant, and the flag when vacuous."""
    eps = "inf" if math.isinf(e.epsilon) else f"{e.epsilon:.4g}"
    line = f"ε = {eps} at δ = {e.delta:g} for {e.protects} ({e.subject}; {e.accountant}, {e.guarantee})"
    if math.isinf(e.epsilon):
        return line + " — NOT PRIVATE: no noise was added"
    if e.vacuous:
        line += f" — VACUOUS: ε > {VACUOUS_EPSILON:g} offers no meaningful protection"
    return line
