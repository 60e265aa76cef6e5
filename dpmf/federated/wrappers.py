"""A Flower strategy wrapper for client-level DP with noise correlated across rounds.

``CorrelatedClientDP(strategy, ...)`` wraps any Flower strategy whose aggregate is a mean of the
clients' arrays (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad) the way Flower's
``DifferentialPrivacyServerSideFixedClipping`` wraps one, with dpmf's noise instead of fresh
noise each round. Round r, for the P clients that every round trains (all of them: the
accounting is for full participation):

1. ``configure_train`` is the wrapped strategy's; the wrapper keeps the global arrays w;
2. ``aggregate_train`` clips each reply's update w_k − w to norm ζ (fixed clipping), gives
   every reply the weight 1, adds the round's noise ν_r = (σ·ζ·sens(C)·(C⁻¹Z)_r)/P to every
   reply — the noise on the sum of the clipped updates, divided by P, so the equal-weight mean
   is w + (1/P)·Σ_k clip(w_k − w) + ν_r — and hands the replies to the wrapped strategy's
   ``aggregate_train`` (its server optimizer acts on the noisy mean: post-processing);
3. the returned metrics carry ``dp-client-epsilon`` and ``dp-client-delta``: the (ε, δ) of the
   whole run (all R rounds) for the unit *a whole client* (add or remove one client's data),
   with the accountant in the log line, and ``dp-client-clip-norm``, the round's ζ.

Client metrics are not released: they are not privatized. Each reply's MetricRecord is replaced
by the wrapped strategy's weighting key alone (``weighted_by_key`` = 1) before it aggregates,
so a client's training loss or record count never reaches the returned metrics (its mean would
be a statistic of the clients' data outside the reported ε).

Federated evaluation is off unless ``evaluate_on_clients=True``. A client's evaluation reply is
a statistic of its own data (its accuracy, loss and example count on its records) with no noise,
and the wrapped strategy's ``aggregate_evaluate`` releases their example-weighted mean, which
Flower logs and keeps in ``Result.evaluate_metrics_clientapp``: outside the reported ε. Flower's
own DP wrappers (``DifferentialPrivacyServerSideFixedClipping``, ``…ClientSideFixedClipping``
and the adaptive ones, in ``flwr.serverapp.strategy`` as in ``flwr.server.strategy``) hand
``configure_evaluate`` and ``aggregate_evaluate`` to the wrapped strategy unchanged, so with
Flower's default ``fraction_evaluate=1.0`` every round releases that mean; this wrapper does not:

* by default ``configure_evaluate`` sends no evaluation message (no client computes anything;
  a warning says so once when the wrapped strategy would have evaluated) and
  ``aggregate_evaluate`` drops any replies it is given and returns None (a warning once);
* with ``evaluate_on_clients=True`` both go to the wrapped strategy, a warning says once that
  those metrics are not covered by (ε, δ), and so does the note of every ``ledger`` entry.

Evaluation on the server's own held-out data (``Strategy.start(..., evaluate_fn=...)``) reads no
client's data and is unaffected.

Every reply's update is flattened, and gets its noise coordinates, in the key order of the
global ArrayRecord the server sent in ``configure_train`` (not the reply's own order: an
ArrayRecord is a mapping); a reply whose arrays have other names or shapes is refused with a
ValueError naming its node, before any noise is drawn.

Adaptive clipping (``adaptive=AdaptiveClipping(...)``, ``dpmf.federated.adaptive``; Andrew et
al., NeurIPS 2021): ``clip_norm`` is the initial norm C_1; round r clips to C_r, releases the
count of unclipped updates with noise N(0, σ_b²) and sets C_{r+1} = C_r·exp(−η(b̄_r − γ)); the
updates' noise uses z_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) > σ at the round's ζ = C_r, so that the
round's two Gaussian releases together have the privacy of noise multiplier σ, and the reported
ε is the run's ε at σ (for any factorization: every client in every round, the correlated
stream on the normalized sums Σ_k clip(Δ_k)/C_r with C_r fixed by earlier releases — the
adaptive streaming setting of the matrix mechanism, Denisov et al., NeurIPS 2022).

The noise is ``dpmf.federated.local.ClientLevelNoise``: with ``factorization="identity"`` it is
Flower's DP-FedAvg noise N(0, σ²ζ²) on the sum each round; with a strategy (``bisr:4``,
``blt:2``, banded ``bsr:4``, …) it is the DP-FTRL / BLT stream correlated across rounds (Kairouz
et al., ICML 2021; Dvijotham et al., FOCS 2024), accounted as every client participating once
per round, R rounds. Its key is secret (operating-system entropy, never written) unless a seed
is given (``dpmf.seeds``).

A coordinate-wise median (FedMedian), trimmed mean, Krum/Bulyan or q-FedAvg is refused: the
noise is calibrated to the sensitivity of a mean (one client moves the mean of clipped updates
by at most ζ/P), and those aggregates have another sensitivity.

The server sees each clipped update before the noise: as in Flower's server-side wrapper, this
protects clients against whoever sees the aggregate (the released models), not against the
server itself (that needs secure aggregation).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np

from dpmf import seeds
from dpmf._validation import check_int, check_real
from dpmf.federated.adaptive import AdaptiveClipping, adjusted_noise_multiplier, geometric_update
from dpmf.federated.clip import update_scale
from dpmf.federated.ledger import PrivacyEntry
from dpmf.federated.replies import keep_weight_only, reply_updates

__all__ = ["AdaptiveClipping", "CorrelatedClientDP", "EPSILON_KEY", "DELTA_KEY", "CLIP_NORM_KEY",
           "CLIENT_EVALUATION_NOTE"]  # fmt: skip

EPSILON_KEY = "dp-client-epsilon"
DELTA_KEY = "dp-client-delta"
CLIP_NORM_KEY = "dp-client-clip-norm"
CLIENT_EVALUATION_NOTE = (
    "federated evaluation on the clients (evaluate_on_clients=True) releases each round's mean of "
    "the clients' evaluation metrics on their own data: statistics not covered by this (ε, δ)"
)
_EVALUATION_OFF = (
    "federated evaluation on the clients is off: their accuracy and loss on their own data carry no "
    "noise and are outside the reported ε, so no evaluation message is sent; pass "
    "evaluate_on_clients=True to run it anyway, or evaluate on server-side data (evaluate_fn)"
)
_DROPPED = (
    "%d client evaluation replies dropped: their metrics are statistics of the clients' own data "
    "outside the reported ε; pass evaluate_on_clients=True to aggregate them anyway"
)
_NOT_A_MEAN = ("FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan", "QFedAvg", "FedXgbBagging",
               "FedXgbCyclic")  # fmt: skip

try:  # the base class when Flower is installed
    from flwr.serverapp.strategy import Strategy as _Base
except ImportError:  # pragma: no cover - the module needs Flower to run
    _Base = object


class CorrelatedClientDP(_Base):
    """Client-level DP for any mean-aggregating Flower strategy, noise correlated across rounds.

    Args:
        strategy: a ``flwr.serverapp.strategy`` object aggregating a (weighted) mean: FedAvg
            or a subclass other than those in the module docstring.
        num_clients: P, the clients that train in every round (the strategy must sample all).
        rounds: R, the rounds the noise and the accounting are planned for.
        noise_multiplier: σ > 0 (Flower's convention: N(0, σ²ζ²) on the sum per round with
            ``identity``; the same ε for any factorization).
        clip_norm: ζ > 0, the bound on each client's update norm (with ``adaptive``: its
            initial value C_1; the paper recommends 0.1).
        delta: δ in (0, 1) of the reported ε.
        factorization: ``identity`` or a dpmf strategy spec (``bisr:4``, ``blt:2``, …).
        accountant: ``pld`` (default), ``rdp`` or ``prv``.
        seed: None (default): a secret key; an int: the key itself (reproducible, the noise
            predictable to whoever knows it).
        adaptive: None (fixed clipping) or an ``AdaptiveClipping`` (target_clipped_quantile,
            clip_norm_lr, clipped_count_stddev — default P/20).
        evaluate_on_clients: False (default): no federated evaluation on the clients (none is
            sent, replies given to ``aggregate_evaluate`` are dropped); True: the wrapped
            strategy's federated evaluation, whose metrics no ε covers (a warning once, and the
            note of the ``ledger`` entries).

    Client metrics are not released: they are not privatized (``aggregate_train`` keeps only
    the strategy's weighting key of each reply; the returned metrics are the wrapper's own;
    evaluation metrics only with ``evaluate_on_clients=True``). Flower's DP wrappers pass
    federated evaluation through to the wrapped strategy; this one refuses it by default
    (module docstring).

    Raises:
        TypeError: not a Flower strategy, or ``evaluate_on_clients`` not a bool.
        ValueError: a strategy whose aggregate is not a mean, or a parameter out of range
            (with ``adaptive``: σ ≥ 2σ_b, where the count alone would spend the budget); in
            ``aggregate_train``, a reply whose arrays' names or shapes differ from the global
            model's (naming its node).
    """

    def __init__(
        self,
        strategy,
        *,
        num_clients: int,
        rounds: int,
        noise_multiplier: float,
        clip_norm: float,
        delta: float = 1e-5,
        factorization: str = "identity",
        accountant: str | None = None,
        seed: int | None = None,
        adaptive: AdaptiveClipping | None = None,
        evaluate_on_clients: bool = False,
    ):
        from flwr.serverapp.strategy import FedAvg, Strategy

        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy={strategy!r} is invalid: must be a flwr.serverapp.strategy.Strategy")
        name = type(strategy).__name__
        if not isinstance(strategy, FedAvg) or any(
            type(strategy).__name__ == n or any(c.__name__ == n for c in type(strategy).__mro__)
            for n in _NOT_A_MEAN
        ):
            raise ValueError(
                f"strategy={name} is invalid: client-level noise is calibrated to the sensitivity of a "
                "mean (ζ/P), and this aggregate (median, trimmed mean, Krum, …) has no such bound; wrap "
                "FedAvg, FedProx, FedAvgM, FedAdam, FedYogi or FedAdagrad"
            )
        super().__init__()
        self.strategy = strategy
        self.num_clients = check_int("num_clients", num_clients, minimum=1)
        self.rounds = check_int("rounds", rounds, minimum=1)
        self.noise_multiplier = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
        self.clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_inclusive=False)
        self.delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        self.factorization = factorization
        self.accountant = accountant
        if adaptive is not None and not isinstance(adaptive, AdaptiveClipping):
            raise TypeError(
                f"adaptive={adaptive!r} is invalid: must be None (fixed clipping) or a "
                "dpmf.federated.adaptive.AdaptiveClipping"
            )
        self.adaptive = adaptive
        if not isinstance(evaluate_on_clients, bool):
            raise TypeError(f"evaluate_on_clients={evaluate_on_clients!r} is invalid: must be True or False")
        self.evaluate_on_clients = evaluate_on_clients
        self._warned: set[str] = set()  # the evaluation warnings already logged (once each)
        if evaluate_on_clients:
            self._warn_once("evaluate", "%s", CLIENT_EVALUATION_NOTE)
        self.stream_noise_multiplier = self.noise_multiplier  # z_Δ: the updates' noise multiplier
        if adaptive is not None:
            self.clipped_count_stddev = adaptive.count_stddev(self.num_clients)
            self.stream_noise_multiplier = adjusted_noise_multiplier(
                self.noise_multiplier, self.clipped_count_stddev
            )
        self.current_clip_norm = self.clip_norm  # C_r (constant with fixed clipping)
        self._policy = seeds.SeedPolicy.of(seed)  # secret unless given; never stored or shown
        if self._policy.notice:
            logging.getLogger(__name__).warning(self._policy.notice)
        self._noise = None  # built at the first round, when the model's size is known
        self._privacy = None
        self._base: dict[int, dict] = {}
        self._round = 0

    # -- the privacy of the run -----------------------------------------------------------
    def _build(self, dim: int):
        from dpmf.federated.local import ClientLevelNoise

        self._noise = ClientLevelNoise(
            self.num_clients,
            self.rounds,
            noise_multiplier=self.stream_noise_multiplier,
            clip_norm=self.clip_norm,
            delta=self.delta,
            factorization=self.factorization,
            accountant=self.accountant,
            dim=dim,
            seed=seeds.child_key(self._policy.key, "fl-client-noise"),
        )
        self._privacy = self._noise.privacy
        if self.adaptive is not None:
            # the updates (z_Δ) and the counts (2σ_b) together: the run at σ (module docstring)
            self._count_rng = seeds.generator(self._policy.key, "fl-clip-count")
            self._privacy = self._noise.plan.account(
                self.noise_multiplier / math.sqrt(self.rounds), delta=self.delta,
                accountant=self.accountant, progress=False,
            )  # fmt: skip

    @property
    def privacy(self):
        """The run's ``PrivacyResult`` (ε of R rounds for a whole client); None before round 1."""
        return self._privacy

    @property
    def ledger(self) -> list[PrivacyEntry]:
        """The run's ledger: one ``PrivacyEntry`` (mode ``client``: ε of a whole client over the R
        rounds) whose note names what it does not cover (federated evaluation on the clients
        when ``evaluate_on_clients``); empty before round 1."""
        if self._privacy is None:
            return []
        subject = f"each of the {self.num_clients} clients"
        return [self._ledger_entry(subject, self._privacy, self.noise_multiplier)]

    def _ledger_entry(self, subject: str, pr, sigma: float) -> PrivacyEntry:
        from dpmf.federated.modes import PRIVACY_MODES

        note = PRIVACY_MODES["client"].note
        if self.evaluate_on_clients:
            note += "; " + CLIENT_EVALUATION_NOTE
        return PrivacyEntry("client", "client", subject, float(pr.epsilon), self.delta, pr.accountant,
                            pr.guarantee, float(sigma), self.rounds, self.num_clients, note)  # fmt: skip

    def _warn_once(self, what: str, text: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logging.getLogger(__name__).warning(text, *args)

    def summary(self) -> None:
        self.strategy.summary()

    def __repr__(self) -> str:
        clip = f"ζ={self.clip_norm:g}"
        if self.adaptive is not None:
            a = self.adaptive
            clip = (f"adaptive ζ₁={self.clip_norm:g} γ={a.target_clipped_quantile:g} "
                    f"η={a.clip_norm_lr:g} σ_b={self.clipped_count_stddev:g}")  # fmt: skip
        return (
            f"CorrelatedClientDP({type(self.strategy).__name__}, σ={self.noise_multiplier:g}, "
            f"{clip}, {self.factorization}, {self.num_clients} clients × {self.rounds} rounds)"
        )

    def _client_clip(self, msg, clip: float) -> float:
        """The clip norm of the reply ``msg`` in a round whose norm is ``clip`` (the same for every
        client here; ``dpmf.federated.weighted`` scales it per client)."""
        return clip

    # -- Flower's Strategy interface --------------------------------------------------------
    def configure_train(self, server_round: int, arrays, config, grid) -> Iterable:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if len(messages) != self.num_clients:
            raise RuntimeError(
                f"round {server_round}: the strategy sampled {len(messages)} clients, the accounting is for "
                f"all {self.num_clients} in every round; set fraction_train=1 and min_train_nodes"
            )
        if server_round > self.rounds:
            raise RuntimeError(
                f"round {server_round} exceeds rounds={self.rounds}: the noise and ε were planned "
                "for that many"
            )
        self._base[server_round] = {k: a.numpy().astype(np.float64) for k, a in arrays.items()}
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable):
        from flwr.app import Array, ArrayRecord, MetricRecord

        replies = list(replies)
        base = self._base.pop(server_round)
        if any(m.has_error() for m in replies) or len(replies) != self.num_clients:
            raise RuntimeError(
                f"round {server_round}: {len(replies)} replies "
                f"({sum(m.has_error() for m in replies)} errors) "
                f"from {self.num_clients} clients; the round's noise is for all of them"
            )
        key = self.strategy.arrayrecord_key
        # every update in the global model's key order, every reply checked before any noise
        updates = [reply_updates(msg, key, base, server_round) for msg in replies]
        if self._noise is None:
            self._build(int(sum(v.size for v in base.values())))
        self._round += 1
        clip = self.current_clip_norm
        noise = self._noise.next() / len(replies)  # σ·ζ_1·sens·(C⁻¹Z)_r (z_Δ when adaptive)
        if clip != self.clip_norm:  # adaptive: the noise at this round's ζ = C_r
            noise = noise * (clip / self.clip_norm)
        unclipped = 0
        for msg, upd in zip(replies, updates, strict=True):
            norm = math.sqrt(sum(float(np.sum(u * u)) for u in upd.values()))
            own = self._client_clip(msg, clip)
            scale = update_scale(norm, own, server_round)
            unclipped += int(norm <= own)
            out, off = {}, 0
            for k, u in upd.items():  # the order of ``base``: noise coordinate i, same entry for all
                z = noise[off : off + u.size].reshape(u.shape)
                off += u.size
                out[k] = Array(np.asarray(base[k] + scale * u + z, dtype=np.float32))
            msg.content[key] = ArrayRecord(out)
            keep_weight_only(msg, self.strategy.weighted_by_key)  # client metrics are not released
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        metrics = MetricRecord({} if metrics is None else dict(metrics))
        metrics[EPSILON_KEY] = float(self._privacy.epsilon)
        metrics[DELTA_KEY] = float(self.delta)
        metrics[CLIP_NORM_KEY] = float(clip)
        if self.adaptive is not None:  # the noisy count of unclipped updates moves ζ (Algorithm 1)
            # released: the centred count Σ_k (b_k − ½) + N(0, σ_b²) (sensitivity ½); b̄ adds back ½
            centred = unclipped - len(replies) / 2 + self._count_rng.normal(0.0, self.clipped_count_stddev)
            noisy = centred / self.num_clients + 0.5
            self.current_clip_norm = geometric_update(
                clip, noisy, self.adaptive.target_clipped_quantile, self.adaptive.clip_norm_lr
            )
        logging.getLogger(__name__).info(
            "round %d: client-level DP, ε = %.4g at δ = %g for a whole client over %d rounds (%s)",
            server_round, self._privacy.epsilon, self.delta, self.rounds, self._privacy.accountant,
        )  # fmt: skip
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays, config, grid):
        """The wrapped strategy's evaluation messages with ``evaluate_on_clients``; else none."""
        if self.evaluate_on_clients:
            return self.strategy.configure_evaluate(server_round, arrays, config, grid)
        if getattr(self.strategy, "fraction_evaluate", 0.0):
            self._warn_once("off", "%s", _EVALUATION_OFF)
        return []

    def aggregate_evaluate(self, server_round: int, replies):
        """The wrapped strategy's aggregate of the evaluation replies with
        ``evaluate_on_clients``; else None (the replies are dropped)."""
        if self.evaluate_on_clients:
            return self.strategy.aggregate_evaluate(server_round, replies)
        dropped = len(list(replies))
        if dropped:
            self._warn_once("dropped", _DROPPED, dropped)
        return None
