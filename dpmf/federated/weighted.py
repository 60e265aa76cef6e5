"""Compliance-weighted noise as a wrapper over dpmf's two Flower building blocks.

The compliance rule (``dpmf.federated.compliance``): client k's score s_k (the weighted mean of
its five criterion scores) gives σ_k = noise_map(s_k), non-increasing in s_k (less compliant →
more noise); the ``uniform`` allocation gives every client the mean σ instead (the control
arm). ``ComplianceWeighted`` applies that rule to either block:

* **record level** — ``record_trainer(client_id, x, y, model, ...)``: the client's
  ``RecordDPTrainer`` (``dpmf.federated.mods``) at σ_k; its ε is for one record of that client,
  as ``dpmf fl --privacy record``.
* **client level** — ``client_dp(strategy, node_clients=..., ...)``: a ``CorrelatedClientDP``
  (``dpmf.federated.wrappers``) whose noise is that of the smallest σ of the participants,
  σ_min, on the sum, and which clips client k's update to ζ_k = ζ·σ_min/σ_k ≤ ζ. One noise of
  standard deviation σ_min·ζ per round then protects client k with noise multiplier
  σ_min·ζ/ζ_k = σ_k: the per-client ("individualized") guarantee of scaled clip norms
  (Boenisch et al., "Have it your way: Individualized Privacy Assignment for DP-SGD", NeurIPS
  2023), ε_k = the run's ε at σ_k for a whole client k, with every client in every round (so
  with any factorization). The metrics carry ε_k per client (``dp-client-epsilon:<id>``) and
  the largest under ``dp-client-epsilon``. Updates of less compliant clients are shrunk more:
  the mean is biased towards the compliant ones. With the ``uniform`` allocation every ζ_k = ζ.

Example (a consortium's ServerApp; ``node_clients`` maps Flower node ids to profile ids)::

    from flwr.serverapp.strategy import FedAvg
    from dpmf.federated.compliance import NoiseMap, load_profiles
    from dpmf.federated.weighted import ComplianceWeighted

    cw = ComplianceWeighted(load_profiles("profiles.yaml"), NoiseMap("linear", 0.8, 2.0))
    cw.noise_multipliers()                          # {'hospital-01': 0.87, ...}: σ_k by the rule
    strategy = cw.client_dp(FedAvg(fraction_train=1.0), node_clients={101: "hospital-01", ...},
                            rounds=50, clip_norm=1.0, factorization="blt:2")
    strategy.privacy_of("hospital-01")              # ε of a whole hospital-01 over 50 rounds
    trainer = cw.record_trainer("hospital-01", x, y, model, clip_norm=1.0, batch_size=32,
                                rounds=50, local_steps=5)   # in that hospital's ClientApp
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from dpmf._validation import check_choice
from dpmf.federated.compliance import ComplianceSet, NoiseMap, uniform_control
from dpmf.federated.wrappers import EPSILON_KEY, CorrelatedClientDP

__all__ = ["ALLOCATIONS", "ComplianceWeighted", "ComplianceWeightedClientDP"]

ALLOCATIONS = ("weighted", "uniform")


@dataclass(frozen=True)
class ComplianceWeighted:
    """The compliance rule σ_k = noise_map(s_k), applied to a record-level trainer or a
    client-level strategy wrapper (module docstring).

    Attributes:
        compliance: the clients' profiles (``load_profiles`` or ``example_profiles``).
        noise_map: the score → σ map (default linear, σ(1) = 0.8, σ(0) = 2.0).
        allocation: ``weighted`` (σ_k from the scores) or ``uniform`` (every σ_k the mean).

    Raises:
        TypeError/ValueError: a setting of the wrong type or out of range.
    """

    compliance: ComplianceSet
    noise_map: NoiseMap = field(default_factory=NoiseMap)
    allocation: str = "weighted"

    def __post_init__(self):
        if not isinstance(self.compliance, ComplianceSet):
            raise TypeError(
                f"compliance={self.compliance!r} is invalid: must be a ComplianceSet (load_profiles)"
            )
        if not isinstance(self.noise_map, NoiseMap):
            raise TypeError(f"noise_map={self.noise_map!r} is invalid: must be a NoiseMap")
        check_choice("allocation", self.allocation, ALLOCATIONS)

    def noise_multipliers(self, client_ids=None) -> dict[str, float]:
        """σ_k of each client (all of the profiles, or ``client_ids`` in that order): the noise
        map of its score, or under ``uniform`` the mean of those σ_k.

        Raises:
            ValueError: an id without a profile.
        """
        ids = list(self.compliance.client_ids if client_ids is None else client_ids)
        known = self.compliance.client_ids
        unknown = [c for c in ids if c not in known]
        if unknown or not ids:
            raise ValueError(
                f"client_ids={ids!r} is invalid: {unknown or 'empty'}; give ids of the profiles "
                f"({list(known)})"
            )
        scores = self.compliance.scores()
        sig = self.noise_map(scores[[known.index(c) for c in ids]])
        if self.allocation == "uniform":
            sig = uniform_control(sig)
        return {c: float(s) for c, s in zip(ids, sig, strict=True)}

    def record_trainer(self, client_id: str, x, y, model, **kwargs):
        """``RecordDPTrainer(x, y, model, noise_multiplier=σ_k, **kwargs)`` for ``client_id``
        (σ_k under the allocation over all profiles).

        Raises:
            ValueError: an unknown id, ``noise_multiplier`` in ``kwargs``, or the trainer's own.
        """
        from dpmf.federated.mods import RecordDPTrainer

        if "noise_multiplier" in kwargs:
            raise ValueError("noise_multiplier is invalid here: it is set by the compliance rule; drop it")
        sigma = self.noise_multipliers()[self._known(client_id)]
        return RecordDPTrainer(x, y, model, noise_multiplier=sigma, **kwargs)

    def client_dp(self, strategy, *, node_clients: Mapping[int, str], **kwargs):
        """A ``ComplianceWeightedClientDP`` around ``strategy`` for the clients of
        ``node_clients`` (Flower node id → profile id; every one trains every round); the other
        keywords are ``CorrelatedClientDP``'s except ``num_clients`` and ``noise_multiplier``.

        Raises:
            ValueError: an unknown profile id, a repeated one, or a keyword set by the rule.
        """
        return ComplianceWeightedClientDP(strategy, self, node_clients=node_clients, **kwargs)

    def _known(self, client_id: str) -> str:
        if client_id not in self.compliance.client_ids:
            raise ValueError(
                f"client_id={client_id!r} is invalid: no such profile; use one of "
                f"{list(self.compliance.client_ids)}"
            )
        return client_id


class ComplianceWeightedClientDP(CorrelatedClientDP):
    """Client-level DP with one noise at σ_min and per-client clip norms ζ·σ_min/σ_k, so that
    client k is protected at σ_k (``dpmf.federated.weighted`` docstring).

    Args:
        strategy: as ``CorrelatedClientDP``.
        rule: the ``ComplianceWeighted`` that gives σ_k.
        node_clients: Flower node id → profile id of each participant (P = its length).
        kwargs: ``rounds``, ``clip_norm`` (ζ, the most compliant client's bound), ``delta``,
            ``factorization``, ``accountant``, ``seed``, ``evaluate_on_clients`` (default False:
            no federated evaluation on the clients, as ``CorrelatedClientDP``).

    Raises:
        ValueError: as ``CorrelatedClientDP``, an unknown or repeated profile id, ``adaptive``
            (not combined with per-client clip norms), or ``num_clients``/``noise_multiplier``.
    """

    def __init__(self, strategy, rule: ComplianceWeighted, *, node_clients: Mapping[int, str], **kwargs):
        if not isinstance(rule, ComplianceWeighted):
            raise TypeError(f"rule={rule!r} is invalid: must be a ComplianceWeighted")
        for key in ("num_clients", "noise_multiplier", "adaptive"):
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"{key} is invalid for a compliance-weighted wrapper: it is set by the participants and "
                    "their compliance (adaptive clipping is not combined with per-client clip norms); drop it"
                )
            kwargs.pop(key, None)
        if not isinstance(node_clients, Mapping) or not node_clients:
            raise TypeError(
                f"node_clients={node_clients!r} is invalid: must be a mapping node id → profile id"
            )
        ids = [str(c) for c in node_clients.values()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node_clients is invalid: profile ids repeat ({ids})")
        self.sigmas = rule.noise_multipliers(ids)  # σ_k over the participants
        self.node_clients = {int(n): str(c) for n, c in node_clients.items()}
        sigma_min = min(self.sigmas.values())
        super().__init__(strategy, num_clients=len(ids), noise_multiplier=sigma_min, **kwargs)
        self.clip_weights = {c: sigma_min / s for c, s in self.sigmas.items()}  # ζ_k / ζ ≤ 1
        self._per_client: dict[str, object] = {}

    def _client_clip(self, msg, clip: float) -> float:
        node = int(msg.metadata.src_node_id)
        if node not in self.node_clients:
            raise RuntimeError(
                f"a reply came from node {node}, which has no profile in node_clients; its clip norm "
                "(and so its privacy) is unknown"
            )
        return clip * self.clip_weights[self.node_clients[node]]

    def _build(self, dim: int):
        super()._build(dim)
        # client k: the same plan at σ_k (σ_k/√R per round on C·G, as ``ClientLevelNoise``)
        root = math.sqrt(self.rounds)
        acc = {}
        for c, s in self.sigmas.items():
            if s not in acc:
                acc[s] = self._noise.plan.account(s / root, delta=self.delta, accountant=self.accountant,
                                                  progress=False)  # fmt: skip
            self._per_client[c] = acc[s]

    def privacy_of(self, client_id: str):
        """The ``PrivacyResult`` of a whole ``client_id`` over the R rounds (None before round 1).

        Raises:
            ValueError: not a participant.
        """
        if client_id not in self.sigmas:
            raise ValueError(f"client_id={client_id!r} is invalid: participants are {list(self.sigmas)}")
        return self._per_client.get(client_id)

    @property
    def ledger(self):
        """One ``PrivacyEntry`` per participant: ε_k of a whole client k at σ_k over the R rounds
        (notes as ``CorrelatedClientDP.ledger``); empty before round 1."""
        return [self._ledger_entry(c, pr, self.sigmas[c]) for c, pr in self._per_client.items()]

    def aggregate_train(self, server_round: int, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        for c, pr in self._per_client.items():
            metrics[f"{EPSILON_KEY}:{c}"] = float(pr.epsilon)
        # the largest ε: the most compliant clients' (σ_min), which is ``privacy``
        metrics[EPSILON_KEY] = max(float(pr.epsilon) for pr in self._per_client.values())
        return arrays, metrics
