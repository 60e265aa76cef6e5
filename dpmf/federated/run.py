"""A compliance-aware federated run on Flower: configuration, ClientApp, ServerApp, results.

One round (r = 1..R), for the P participating clients (all clients, or only the compliant ones
for the compliant-only baseline):

1. the strategy's ``configure_train`` sends the global weights to every participant;
2. each ClientApp trains locally — plain SGD (``aggregator``, ``client``) or dpmf's private step
   to its own (ε_k, δ) (``record``) — and replies with its weights;
3. ``client`` mode only: the server (standing for secure aggregation or a trusted aggregator)
   clips each update w_k − w to ζ, gives every client weight 1 and adds one Gaussian noise
   vector ν_r to every reply, so that the mean is w + (1/P)·Σ_k clip(w_k − w) + ν_r, with
   ν_r = the round's noise on the sum / P (``local.ClientLevelNoise``), before any server
   optimizer (FedAdam/FedYogi apply their update to the noisy mean);
4. the strategy's ``aggregate_train`` combines the replies (Flower's own arithmetic);
5. ``aggregator`` mode only: the server runs DP-SGD on its aggregator dataset, ``server_steps``
   steps per participant, each at that participant's noise multiplier σ_k;
6. the server evaluates the global model on the test split.

Client weights and metrics: ``aggregator`` mode weights clients by their example counts and
receives their training losses (the clients' data are not what this mode protects); ``record``
and ``client`` modes weight clients equally and send no training loss (``train_loss`` is NaN),
since a record count or a loss is a non-private statistic of the protected data.

Privacy note: every noise vector (the server's DP-SGD, each client's private run, the
client-level noise) is drawn from subkeys of the run's key (``dpmf.seeds``). By default
(``seed=None``) the key is fresh operating-system entropy, drawn for each run (each replica of
``dpmf fl``) and never written anywhere; results and ledgers record ``seed: null``. A given seed
is the key: the run is reproducible, its noise predictable to whoever knows the seed
(``dpmf.seeds.NOTICE`` is logged), and the ledger says so. The public randomness (initial
weights, data partition, local SGD order) comes from the seed when given, else from
``replica``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

import numpy as np

from dpmf import seeds
from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.events import PoissonGaussianEvent
from dpmf.accountants.registry import accountants_for
from dpmf.federated.clip import update_scale
from dpmf.federated.compliance import ComplianceSet, NoiseMap, example_profiles, uniform_control
from dpmf.federated.data import DATASETS, PARTITIONS, FederatedData, load_federated
from dpmf.federated.ledger import MODES, UNITS, PrivacyEntry, format_entry
from dpmf.federated.strategies import MEAN_STRATEGIES, STRATEGIES, make_strategy
from dpmf.plan.schemes import Poisson

__all__ = ["ALLOCATIONS", "BACKENDS", "FLConfig", "FLResult", "run_federated", "participants"]

BACKENDS = ("local", "ray")
ALLOCATIONS = ("weighted", "uniform")


@dataclass(frozen=True)
class FLConfig:
    """Everything a federated run needs (validated when built, before any data is read).

    Attributes:
        dataset, data_file, partition, alpha, shards, aggregator_fraction: the data
            (``dpmf.federated.data``).
        num_clients: K ≥ 2 (clients with a compliance profile; the first K profiles).
        rounds: R ≥ 1.
        strategy: one of ``STRATEGIES`` (Flower's classes).
        privacy: ``aggregator``, ``record`` or ``client``.
        compliant_only: train with the compliant clients only (the compliant-only baseline).
        allocation: ``weighted`` (σ_k from each client's score) or ``uniform`` (every client at
            the participants' mean σ: equal mean noise).
        noise_map: the score → σ map.
        local_steps: L local steps per round; ``local_batch_size`` B; ``local_lr`` η.
        local_optimizer, local_factorization, local_scheme: ``record`` mode's private step.
        clip_norm: per-example clip norm ζ of the private steps (record and aggregator modes).
        server_steps: ``aggregator`` mode: server DP-SGD steps per participant per round;
            ``server_batch_size`` the expected batch, ``server_lr`` its step size;
            ``server_noise=False`` runs them without noise (a non-private control, ε = ∞).
        client_clip: ``client`` mode's bound ζ_c on each client's update norm.
        client_noise_multiplier: σ_c of ``client`` mode; None: the largest σ_k of the
            participants (the noise the least compliant one needs; the mean under ``uniform``).
        client_factorization: ``identity`` (independent noise) or a strategy correlating the
            noise across rounds (``bisr:4``, ``blt:2``, …).
        proximal_mu: FedProx's μ; ``fedopt_eta``: FedAdam/FedYogi's η (None: Flower's default).
        hidden: width of the MLP's hidden layer.
        delta: δ of every reported ε; ``accountant``: ``pld`` (default), ``rdp`` or ``prv``.
        max_epsilon: a privacy budget: the run stops before the round whose ε (the ledger's
            largest) would exceed it, and the ledger holds the ε of the rounds run with the
            reason (``dpmf.federated.budget``); None: no budget.
        client_sampling: ``all`` (every participant every round), ``poisson`` or ``fixed``
            (``client`` mode; ``dpmf.federated.sampling``), with ``clients_per_round`` K (the
            expected number for Poisson); amplification by sampling is accounted.
        eval_fraction: f in [0, 0.5]: each client holds out ⌈f·N_k⌉ records and evaluates the
            global model on them every round (``dpmf.federated.evaluation``); 0: none.
        seed: None (default): a secret key for the noise and the private batches, drawn from
            the operating system (``dpmf.seeds``); an integer ≥ 0: the key itself (reproducible,
            the noise predictable to whoever knows it), which also seeds the weights, the
            partition and the local batches.
        replica: the replica's number r ≥ 0 (``dpmf fl --replicas``): seeds the public
            randomness (weights, partition, local SGD order) when ``seed`` is None.
    """

    dataset: str = "breast-cancer"
    data_file: str | None = None
    num_clients: int = 16
    rounds: int = 50
    strategy: str = "fedavg"
    privacy: str = "aggregator"
    compliant_only: bool = False
    allocation: str = "weighted"
    noise_map: NoiseMap = field(default_factory=NoiseMap)
    partition: str = "iid"
    alpha: float = 0.5
    shards: int = 2
    aggregator_fraction: float = 0.1
    local_steps: int = 5
    local_batch_size: int = 16
    local_lr: float = 0.1
    local_optimizer: str = "dp-sgd"
    local_factorization: str = "identity"
    local_scheme: str = Poisson.name
    clip_norm: float = 1.0
    server_steps: int = 1
    server_batch_size: int = 16
    server_lr: float = 0.1
    server_noise: bool = True
    client_clip: float = 1.0
    client_noise_multiplier: float | None = None
    client_factorization: str = "identity"
    proximal_mu: float = 0.01
    fedopt_eta: float | None = None
    hidden: int = 32
    delta: float = 1e-5
    accountant: str | None = None
    max_epsilon: float | None = None
    eval_fraction: float = 0.0
    client_sampling: str = "all"
    clients_per_round: int | None = None
    seed: int | None = None
    replica: int = 0

    def __post_init__(self):
        from dpmf.optim.registry import optimizer_names

        check_choice("dataset", self.dataset, DATASETS)
        check_int("num_clients", self.num_clients, minimum=2)
        check_int("rounds", self.rounds, minimum=1)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("privacy", self.privacy, MODES)
        check_choice("allocation", self.allocation, ALLOCATIONS)
        if not isinstance(self.noise_map, NoiseMap):
            raise TypeError(f"noise_map={self.noise_map!r} is invalid: must be a NoiseMap")
        check_choice("partition", self.partition, PARTITIONS)
        for name in ("local_steps", "local_batch_size", "server_steps", "server_batch_size", "hidden"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("local_lr", "clip_norm", "server_lr", "client_clip"):
            check_real(name, getattr(self, name), low=0.0, low_inclusive=False)
        check_real("proximal_mu", self.proximal_mu, low=0.0)
        if self.fedopt_eta is not None:
            check_real("fedopt_eta", self.fedopt_eta, low=0.0, low_inclusive=False)
        check_real("delta", self.delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        if self.accountant is not None:
            check_choice("accountant", self.accountant, accountants_for(PoissonGaussianEvent))
        seeds.check_seed(self.seed)
        check_int("replica", self.replica, minimum=0)
        check_choice("local_optimizer", self.local_optimizer, optimizer_names())
        if self.privacy == "client" and self.strategy not in MEAN_STRATEGIES:
            raise ValueError(
                f"strategy={self.strategy!r} is invalid with privacy='client': client-level noise is "
                "calibrated to the sensitivity of a mean, and a coordinate-wise median has another; "
                f"use one of {', '.join(MEAN_STRATEGIES)}"
            )
        if self.client_noise_multiplier is not None:
            check_real("client_noise_multiplier", self.client_noise_multiplier, low=0.0, low_inclusive=False)
        if self.privacy != "record" and (
            self.local_optimizer != "dp-sgd"
            or self.local_factorization != "identity"
            or self.local_scheme != Poisson.name
        ):
            raise ValueError(
                "local_optimizer/local_factorization/local_scheme are invalid with "
                f"privacy={self.privacy!r}: they set record mode's private local step"
            )
        if self.privacy != "client" and (
            self.client_factorization != "identity" or self.client_noise_multiplier is not None
        ):
            raise ValueError(
                f"client_factorization/client_noise_multiplier are invalid with privacy={self.privacy!r}: "
                "they set client mode's noise"
            )
        check_real("eval_fraction", self.eval_fraction, low=0.0, high=0.5)
        from dpmf.federated.sampling import CLIENT_SAMPLINGS

        check_choice("client_sampling", self.client_sampling, CLIENT_SAMPLINGS)
        if self.client_sampling != "all":
            if self.privacy != "client":
                raise ValueError(
                    f"client_sampling={self.client_sampling!r} is invalid with privacy={self.privacy!r}: "
                    "client sampling is accounted for client-level noise only; use privacy='client'"
                )
            if self.clients_per_round is None:
                raise ValueError(
                    f"client_sampling={self.client_sampling!r} needs clients_per_round (K >= 1, the "
                    "expected number of clients per round)"
                )
            check_int("clients_per_round", self.clients_per_round, minimum=1, maximum=self.num_clients)
            if self.max_epsilon is not None:
                raise ValueError(
                    "max_epsilon is invalid with client_sampling: the budget's prefix accounting is for "
                    "full participation; drop one of them"
                )
        elif self.clients_per_round is not None:
            raise ValueError(
                "clients_per_round is invalid with client_sampling='all': every client trains every round; "
                "add --client-sampling poisson or fixed"
            )
        if self.max_epsilon is not None:
            check_real("max_epsilon", self.max_epsilon, low=0.0, low_inclusive=False)
            if not self.server_noise:
                raise ValueError("max_epsilon is invalid with server_noise=False: that run has ε = ∞")
        if not self.server_noise and self.privacy != "aggregator":
            raise ValueError("server_noise=False is invalid: only aggregator mode has server noise")

    def replace(self, **changes) -> FLConfig:
        return replace(self, **changes)

    @property
    def public_seed(self) -> int:
        """The seed of the public randomness (weights, partition, local SGD order): the given
        seed (reduced to 63 bits by ``dpmf.seeds`` when larger), else the replica's number."""
        if self.seed is None:
            return self.replica
        return self.seed if self.seed < 2**63 else seeds.derive_int(self.seed, "fl-public", bits=63)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["noise_map"] = {"kind": self.noise_map.kind, "describe": self.noise_map.describe()}
        return out


@dataclass
class FLResult:
    """The outcome of one seed of ``run_federated``.

    Attributes:
        config: the run.
        metrics: one dict per round r = 0..R (r = 0: the initial model): ``round``,
            ``test_accuracy``, ``test_loss``, ``train_loss`` (the clients' mean, aggregator mode
            only; NaN otherwise).
        ledger: the ``PrivacyEntry`` list of the run.
        participants: the client ids that trained.
        sigmas: client id → σ_k (the allocation actually used).
        data: the run's data description.
        seconds: wall time.
        stopped: why the run stopped before ``config.rounds`` (the privacy budget), or "".
    """

    config: FLConfig
    metrics: list
    ledger: list
    participants: list
    sigmas: dict
    data: dict
    seconds: float = 0.0
    stopped: str = ""

    @property
    def final_accuracy(self) -> float:
        return float(self.metrics[-1]["test_accuracy"])


def participants(config: FLConfig, compliance: ComplianceSet) -> tuple[list[int], np.ndarray]:
    """The indices of the clients that train and their σ_k (after the allocation rule).

    Raises:
        ValueError: fewer profiles than clients, or no compliant client for the baseline.
    """
    comp = compliance.select(config.num_clients) if len(compliance) >= config.num_clients else None
    if comp is None:
        raise ValueError(
            f"num_clients={config.num_clients} is invalid: the compliance file {compliance.source!r} has "
            f"{len(compliance)} profiles"
        )
    scores = comp.scores()
    idx = list(range(config.num_clients))
    if config.compliant_only:
        idx = [i for i in idx if scores[i] >= comp.compliant_threshold]
        if len(idx) < 1:
            raise ValueError(
                f"compliant_only is invalid: no client reaches the threshold {comp.compliant_threshold:g}"
            )
    sig = config.noise_map(scores[idx])
    if config.allocation == "uniform":
        sig = uniform_control(sig)
    return idx, sig


def _flwr():
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ImportError(
            "dpmf.federated needs Flower: pip install 'dpmf[fl]' (flwr==1.42.0, Python >= 3.11)"
        ) from None


class _Server:
    """The server side of one run: strategy, privacy mechanism, evaluation, ledger."""

    def __init__(
        self, config: FLConfig, data: FederatedData, comp: ComplianceSet, idx, sigmas, log, key: int
    ):
        from dpmf.federated import local
        from dpmf.federated.models import build_model, get_weights

        self.config, self.data, self.log = config, data, log
        self.ids = [comp.profiles[i].client_id for i in idx]
        self.idx, self.sigmas = list(idx), np.asarray(sigmas, dtype=np.float64)
        self.model = build_model(
            data.input_shape, data.num_classes, hidden=config.hidden, seed=config.public_seed
        )
        self.initial = get_weights(self.model)
        self.dim = int(sum(v.size for v in self.initial.values()))
        P, R = len(self.idx), config.rounds
        self.rounds = R  # fewer when a privacy budget binds (``dpmf.federated.budget``)
        self.strategy = make_strategy(
            config.strategy, P, proximal_mu=config.proximal_mu, server_lr=config.fedopt_eta
        )
        self.ledger: list[PrivacyEntry] = []
        self.dp = self.client_noise = None
        self.sampled = config.client_sampling != "all"
        if config.privacy == "aggregator":
            per_round = np.repeat(self.sigmas, config.server_steps)
            steps = np.tile(per_round, R)
            n_agg = int(data.aggregator_y.shape[0])
            if config.server_batch_size > n_agg:
                raise ValueError(
                    f"server_batch_size={config.server_batch_size} is invalid: the aggregator dataset has "
                    f"{n_agg} records"
                )
            self.dp = local.AggregatorDPSGD(
                data.aggregator_x,
                data.aggregator_y,
                build_model(
                    data.input_shape, data.num_classes, hidden=config.hidden, seed=config.public_seed
                ),
                sigmas=steps if config.server_noise else np.zeros_like(steps),
                clip_norm=config.clip_norm,
                batch_size=config.server_batch_size,
                lr=config.server_lr,
                seed=seeds.child_key(key, "fl-aggregator"),
            )
            self.steps_per_round = per_round.size
            self.round_sigmas = per_round
            note = (
                "protects only the server's aggregator dataset against the released models; the "
                "clients' updates reach a semi-honest aggregator unprotected (client-level DP needs "
                "secure aggregation)"
            )
            if config.server_noise:
                pr = local.aggregator_privacy(
                    steps,
                    sampling_rate=self.dp.sampling_rate,
                    delta=config.delta,
                    accountant=config.accountant or "pld",
                )
                eps, acc, guar = pr.epsilon, pr.accountant, pr.guarantee
            else:
                eps, acc, guar = math.inf, "none", "upper_bound"
            self.ledger.append(
                PrivacyEntry(
                    "aggregator",
                    UNITS["aggregator"],
                    f"aggregator dataset (N={n_agg})",
                    eps,
                    config.delta,
                    acc,
                    guar,
                    float(steps.min()) if config.server_noise else 0.0,
                    int(steps.size),
                    n_agg,
                    note,
                )  # fmt: skip
            )
        elif config.privacy == "client":
            sigma_c = config.client_noise_multiplier
            if sigma_c is None:
                sigma_c = float(self.sigmas.max())
            if self.sampled:
                from dpmf.federated.sampling import SampledClientNoise

                self.client_noise = SampledClientNoise(
                    config.client_sampling, P, config.clients_per_round, R, noise_multiplier=sigma_c,
                    clip_norm=config.client_clip, delta=config.delta,
                    factorization=config.client_factorization, accountant=config.accountant, dim=self.dim,
                    seed=seeds.child_key(key, "fl-client-sampling"),
                )  # fmt: skip
            else:
                self.client_noise = local.ClientLevelNoise(
                    P,
                    R,
                    noise_multiplier=sigma_c,
                    clip_norm=config.client_clip,
                    delta=config.delta,
                    factorization=config.client_factorization,
                    accountant=config.accountant,
                    dim=self.dim,
                    seed=seeds.child_key(key, "fl-client-noise"),
                )
            pr = self.client_noise.privacy
            note = (
                "protects each whole client (add or remove one client) against whoever sees the noisy "
                "aggregate; individual updates must stay hidden from the server (secure aggregation)"
            )
            if self.sampled:
                note += (
                    f"; {config.client_sampling} client sampling, {config.clients_per_round} of {P} clients "
                    "per round (expected), amplification accounted"
                )
            self.ledger.append(
                PrivacyEntry(
                    "client",
                    UNITS["client"],
                    f"each of the {P} participating clients",
                    pr.epsilon,
                    config.delta,
                    pr.accountant,
                    pr.guarantee,
                    float(sigma_c),
                    R,
                    P,
                    note,
                )  # fmt: skip
            )
            self.sigma_c = float(sigma_c)

    # -- client mode: clipping and one noise vector on the mean -------------------------------
    def _privatize_replies(self, replies, arrays, server_round: int):
        from flwr.app import Array, ArrayRecord

        base = {k: a.numpy().astype(np.float64) for k, a in arrays.items()}
        divisor = getattr(self.client_noise, "divisor", len(replies))  # K̄ when clients are sampled
        grow = len(replies) / divisor  # the mean of the replies is then Σ/K̄ (1.0 without sampling)
        noise = self.client_noise.next() / divisor
        for msg in replies:
            rec_key = next(iter(msg.content.array_records.keys()))
            upd = {k: a.numpy().astype(np.float64) - base[k] for k, a in msg.content[rec_key].items()}
            norm = math.sqrt(sum(float(np.sum(u * u)) for u in upd.values()))
            scale = update_scale(norm, self.config.client_clip, server_round)
            out, off = {}, 0
            for k, u in upd.items():
                z = noise[off : off + u.size].reshape(u.shape)
                off += u.size
                out[k] = Array(np.asarray(base[k] + grow * scale * u + z, dtype=np.float32))
            msg.content[rec_key] = ArrayRecord(out)
            met_key = next(iter(msg.content.metric_records.keys()))
            msg.content[met_key]["num-examples"] = 1
        return replies

    def _evaluate(self, weights) -> tuple[float, float]:
        from dpmf.federated.models import evaluate, set_weights

        set_weights(self.model, weights)
        return evaluate(self.model, self.data.test_x, self.data.test_y)

    def serve(self, grid) -> list[dict]:
        """The R rounds (steps 1–6 of the module docstring) over ``grid``; per-round metrics."""
        from flwr.app import Array, ArrayRecord, ConfigRecord

        def record(w):
            return ArrayRecord({k: Array(np.asarray(v)) for k, v in w.items()})

        weights = self.initial
        acc, loss = self._evaluate(weights)
        rows = [{"round": 0, "test_accuracy": acc, "test_loss": loss, "train_loss": float("nan")}]
        arrays = record(weights)
        for r in range(1, self.rounds + 1):
            msgs = list(
                self.strategy.configure_train(
                    r, arrays, ConfigRecord({"local-steps": self.config.local_steps}), grid
                )
            )
            expected = len(self.idx)
            if self.sampled:  # this round's clients (``dpmf.federated.sampling``)
                nodes = sorted(grid.get_node_ids())
                keep = {nodes[j] for j in self.client_noise.participants()}
                msgs = [m for m in msgs if m.metadata.dst_node_id in keep]
                expected = len(keep)
            replies = []
            if msgs:
                replies = sorted(grid.send_and_receive(msgs), key=lambda m: m.metadata.src_node_id)
            errors = [m for m in replies if m.has_error()]
            if errors:
                raise RuntimeError(f"round {r}: a ClientApp failed: {errors[0].error.reason}")
            if len(replies) != expected:
                raise RuntimeError(f"round {r}: {len(replies)} replies from {expected} participants")
            train_loss = (
                float(np.mean([float(m.content["metrics"]["train-loss"]) for m in replies]))
                if replies
                else float("nan")
            )
            if not replies:  # a Poisson round without clients: w + ν/K̄ (nothing to aggregate)
                nu = self.client_noise.next() / self.client_noise.divisor
                weights, off = {}, 0
                for k, a in arrays.items():
                    w = a.numpy().astype(np.float64)
                    weights[k] = np.asarray(w + nu[off : off + w.size].reshape(w.shape), dtype=np.float32)
                    off += w.size
            else:
                if self.client_noise is not None:
                    replies = self._privatize_replies(replies, arrays, r)
                agg, _ = self.strategy.aggregate_train(r, replies)
                if agg is None:
                    raise RuntimeError(f"round {r}: the strategy returned no model")
                weights = {k: a.numpy() for k, a in agg.items()}
            if self.dp is not None:
                weights = self.dp.run(weights, self.steps_per_round)
            arrays = record(weights)
            acc, loss = self._evaluate(weights)
            row = {"round": r, "test_accuracy": acc, "test_loss": loss, "train_loss": train_loss}
            if self.config.eval_fraction > 0:
                row.update(self._federated_evaluation(r, arrays, grid))
            rows.append(row)
        return rows

    def _federated_evaluation(self, r, arrays, grid) -> dict:
        """Every participant evaluates the global model on its held-out records; the mean
        weighted by their counts (the strategy's ``aggregate_evaluate``)."""
        from flwr.app import ConfigRecord

        msgs = self.strategy.configure_evaluate(r, arrays, ConfigRecord({}), grid)
        replies = sorted(grid.send_and_receive(msgs), key=lambda m: m.metadata.src_node_id)
        errors = [m for m in replies if m.has_error()]
        if errors:
            raise RuntimeError(f"round {r}: a ClientApp failed to evaluate: {errors[0].error.reason}")
        agg = self.strategy.aggregate_evaluate(r, replies)
        return {"federated_accuracy": float(agg["eval-accuracy"]), "federated_loss": float(agg["eval-loss"])}


def _client_app(config: FLConfig, data: FederatedData, idx, sigmas, ids, server, key: int):
    """The ClientApp; node i trains participant i's partition. Record mode keeps each
    client's private run (sampler, noise stream) between rounds."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from dpmf.federated import local
    from dpmf.federated.models import build_model, get_weights, local_sgd, set_weights

    runs = {}
    if config.privacy == "record":
        from dpmf.federated.prefetch import prefetch_record_privacy

        prefetch_record_privacy(
            (float(sigmas[j]), int(data.client_y[i].shape[0]), config.local_batch_size,
             config.rounds * config.local_steps, config.delta, config.local_scheme,
             config.local_factorization, config.accountant)
            for j, i in enumerate(idx)
        )  # fmt: skip
        for j, i in enumerate(idx):
            x, y = data.client_x[i], data.client_y[i]
            b = config.local_batch_size  # ≤ N_k: checked by ``check_data``
            runs[j] = local.PrivateLocalRun(
                x,
                y,
                build_model(
                    data.input_shape, data.num_classes, hidden=config.hidden, seed=config.public_seed
                ),
                noise_multiplier=float(sigmas[j]),
                clip_norm=config.clip_norm,
                batch_size=b,
                steps=config.rounds * config.local_steps,
                delta=config.delta,
                scheme=config.local_scheme,
                factorization=config.local_factorization,
                accountant=config.accountant,
                optimizer=config.local_optimizer,
                lr=config.local_lr,
                seed=seeds.child_key(key, "fl-record", i),
            )
            pr = runs[j].privacy
            server.ledger.append(
                PrivacyEntry(
                    "record",
                    UNITS["record"].format(k=ids[j]),
                    ids[j],
                    pr.epsilon,
                    config.delta,
                    pr.accountant,
                    pr.guarantee,
                    float(sigmas[j]),
                    pr.steps,
                    int(y.shape[0]),
                    "protects one record of this client against everyone who sees its updates, the server "
                    "included; the server's aggregation and optimizer are post-processing",
                )  # fmt: skip
            )
    plain = {}
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        j = int(context.node_config["partition-id"])
        i = idx[j]
        weights = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        cfg = msg.content["config"]
        mu = float(cfg.get("proximal-mu", 0.0))
        steps = int(cfg["local-steps"])
        r = int(cfg["server-round"])
        if config.privacy == "record":
            new, _ = runs[j].train_round(weights, steps, mu)
            weight = 1
        else:
            if j not in plain:
                plain[j] = build_model(
                    data.input_shape, data.num_classes, hidden=config.hidden, seed=config.public_seed
                )
            model = plain[j]
            set_weights(model, weights)
            rng = np.random.default_rng([config.public_seed, 3, i, r])
            loss = local_sgd(
                model, data.client_x[i], data.client_y[i], steps=steps, batch_size=config.local_batch_size,
                lr=config.local_lr, proximal_mu=mu, rng=rng,
            )  # fmt: skip
            new = get_weights(model)
            weight = int(data.client_y[i].shape[0]) if config.privacy == "aggregator" else 1
        if config.privacy != "aggregator":  # a non-private statistic of the protected data: not sent
            loss = float("nan")
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in new.items()}),
                "metrics": MetricRecord({"num-examples": weight, "train-loss": float(loss)}),
            }
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate_held_out(msg: Message, context) -> Message:
        from dpmf.federated.models import evaluate

        j = int(context.node_config["partition-id"])
        i = idx[j]
        model = build_model(data.input_shape, data.num_classes, hidden=config.hidden, seed=config.public_seed)
        set_weights(model, {k: a.numpy() for k, a in msg.content["arrays"].items()})
        acc, loss = evaluate(model, data.eval_x[i], data.eval_y[i])
        n = int(data.eval_y[i].shape[0])
        metrics = MetricRecord({"num-examples": n, "eval-accuracy": float(acc), "eval-loss": float(loss)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _budget(config: FLConfig, server: _Server, data: FederatedData) -> str:
    """Apply ``config.max_epsilon`` (``dpmf.federated.budget``) before any training: set the
    rounds to run and the ledger of the stopped run; the reason, or "" when it does not bind."""
    from dpmf.federated import budget

    if config.max_epsilon is None:
        return ""
    facts, per = {}, [1] * len(server.ledger)
    if config.privacy == "aggregator":
        facts = {"steps_per_round_sigmas": server.round_sigmas, "sampling_rate": server.dp.sampling_rate}
        per = [server.steps_per_round]
    elif config.privacy == "record":
        facts = {"sigmas": server.sigmas, "sizes": [int(data.client_y[i].shape[0]) for i in server.idx]}
        per = [config.local_steps] * len(server.ledger)
    else:
        facts = {"num_clients": len(server.idx)}
    stop = budget.plan_budget(config, server.ledger, **facts)
    if stop is None:
        return ""
    server.rounds = stop.rounds
    server.ledger[:] = budget.apply(server.ledger, stop, per)
    server.log(f"privacy budget: {stop.reason}")
    return stop.reason


def run_federated(
    config: FLConfig,
    *,
    compliance: ComplianceSet | None = None,
    backend: str = "local",
    data: FederatedData | None = None,
    log=print,
) -> FLResult:
    """Run one seed of a compliance-aware federated experiment on Flower.

    Args:
        config: the run.
        compliance: the clients' profiles; None: ``example_profiles(num_clients)`` (announced
            through ``log``).
        backend: ``local`` (the ServerApp and ClientApps in this process through
            ``LocalGrid``; deterministic) or ``ray`` (Flower's simulation engine; needs Ray,
            and refuses ``record`` mode, whose clients keep private state between rounds).
        data: already loaded data (else loaded from the config).
        log: where notices and the ledger lines go.

    Returns:
        ``FLResult``.

    Raises:
        ImportError: Flower (or Ray for ``backend='ray'``) is not installed.
        ValueError: invalid settings, before any training.
    """
    check_choice("backend", backend, BACKENDS)
    _flwr()
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ImportError(
                "backend='ray' needs Ray: pip install 'flwr[simulation]==1.42.0' (or use the local backend)"
            ) from None
        if config.privacy == "record":
            raise ValueError(
                "backend='ray' is invalid with privacy='record': each client's private run keeps its "
                "sampler and noise stream between rounds, which Ray workers do not; use backend='local'"
            )
    began = time.perf_counter()
    if compliance is None:
        compliance = example_profiles(config.num_clients)
    if compliance.source == "example":
        log(
            f"notice: no compliance file given: using the bundled example profile ({config.num_clients} "
            f"clients, {int(compliance.compliant().sum())} compliant)"
        )
    idx, sigmas = participants(config, compliance)
    if data is None:
        data = load_federated(
            config.dataset,
            config.num_clients,
            data_file=config.data_file,
            partition_scheme=config.partition,
            alpha=config.alpha,
            shards=config.shards,
            seed=config.public_seed,
            aggregator_fraction=config.aggregator_fraction,
        )
    from dpmf.federated.checks import check_data

    if config.eval_fraction > 0 and not data.eval_y:
        from dpmf.federated.evaluation import split_held_out

        data = split_held_out(data, config.eval_fraction, config.public_seed)
    warnings = check_data(config, data.client_sizes(), idx)  # refusals before any training
    for note in data.notes:
        log(f"notice: {note}")
    for note in warnings:
        log(f"warning: {note}")
    comp = compliance.select(config.num_clients)
    policy = seeds.SeedPolicy.of(config.seed)  # secret unless given; never stored or shown
    if policy.notice:
        log(policy.notice)
    if backend == "ray":  # the Flower app under ``flwr run`` on the simulation engine
        from dpmf.federated.flwr_run import run_app

        if compliance.source != "example":
            raise ValueError(
                "backend='ray' is invalid with a compliance file: the Flower app runs the bundled example "
                "profiles; use backend='local'"
            )
        rows, ledger, stopped = run_app(config, len(idx), log=log)
        server = SimpleNamespace(ledger=ledger, ids=[comp.profiles[i].client_id for i in idx], sigmas=sigmas)
        out = {"rows": rows}
    else:
        server = _Server(config, data, comp, idx, sigmas, log, policy.key)
        app = _client_app(config, data, idx, sigmas, server.ids, server, policy.key)
        stopped = _budget(config, server, data)
        from flwr.app import Context, RecordDict
        from flwr.serverapp import Grid, ServerApp

        from dpmf.federated.grid import LocalGrid, server_identity

        out: dict = {}
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            out["rows"] = server.serve(grid)

        grid = LocalGrid(app, len(idx))
        with server_identity():
            server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    if config.eval_fraction > 0:
        from dpmf.federated.evaluation import EVAL_NOTE

        server.ledger[:] = [replace(e, note=e.note + "; " + EVAL_NOTE) for e in server.ledger]
    if not policy.is_secret:  # the guarantee holds only against whoever does not know the seed
        server.ledger[:] = [
            replace(e, note=e.note + "; the seed was given: only against whoever does not know it")
            for e in server.ledger
        ]
    for e in server.ledger:
        log(f"privacy: {format_entry(e)}")
    data_info = {
        "name": data.name,
        "source": data.source,
        "client_sizes": data.client_sizes(),
        "aggregator": int(data.aggregator_y.shape[0]),
        "test": int(data.test_y.shape[0]),
    }
    return FLResult(
        config,
        out["rows"],
        list(server.ledger),
        list(server.ids),
        {cid: float(s) for cid, s in zip(server.ids, server.sigmas, strict=True)},
        data_info,
        time.perf_counter() - began,
        stopped,
    )
