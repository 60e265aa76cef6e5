"""A compliance-aware federated run on Flower: configuration, ClientApp, ServerApp, results.

The privacy mode (``FLConfig.privacy``) is an object of the registry ``dpmf.federated.modes``:
its server part (``ServerPart``) and client part (``ClientPart``) do what differs between modes
(steps 2, 3 and 5 below, and the ledger); this module only runs the rounds. One round
(r = 1..R), for the P participating clients (all clients, or only the compliant ones for the
compliant-only baseline), with the built-in modes:

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

import time
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

import numpy as np

from dpmf import seeds
from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.events import PoissonGaussianEvent
from dpmf.accountants.registry import accountants_for
from dpmf.federated.compliance import ComplianceSet, NoiseMap, example_profiles, uniform_control
from dpmf.federated.data import DATASETS, PARTITIONS, FederatedData, load_federated
from dpmf.federated.ledger import PrivacyEntry, format_entry
from dpmf.federated.modes import PRIVACY_MODES, get_privacy_mode, privacy_modes
from dpmf.federated.strategies import STRATEGIES, make_strategy
from dpmf.plan.schemes import Poisson

__all__ = ["ALLOCATIONS", "BACKENDS", "FLConfig", "FLResult", "run_federated", "participants", "start_ahead"]

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
        privacy: a registered privacy mode (``dpmf.federated.modes``): ``aggregator``,
            ``record``, ``client``, …
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
        self._check_run()
        self._check_training()
        self._check_mode()

    def _check_run(self) -> None:
        """The data, the federation, the strategy, δ, the accountant and the seeds."""
        check_choice("dataset", self.dataset, DATASETS)
        check_int("num_clients", self.num_clients, minimum=2)
        check_int("rounds", self.rounds, minimum=1)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("privacy", self.privacy, privacy_modes())
        check_choice("allocation", self.allocation, ALLOCATIONS)
        if not isinstance(self.noise_map, NoiseMap):
            raise TypeError(f"noise_map={self.noise_map!r} is invalid: must be a NoiseMap")
        check_choice("partition", self.partition, PARTITIONS)
        check_real("delta", self.delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        if self.accountant is not None:
            check_choice("accountant", self.accountant, accountants_for(PoissonGaussianEvent))
        seeds.check_seed(self.seed)
        check_int("replica", self.replica, minimum=0)
        check_real("eval_fraction", self.eval_fraction, low=0.0, high=0.5)

    def _check_training(self) -> None:
        """The sizes, steps and rates of the local and server training; the budget."""
        for name in ("local_steps", "local_batch_size", "server_steps", "server_batch_size", "hidden"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("local_lr", "clip_norm", "server_lr", "client_clip"):
            check_real(name, getattr(self, name), low=0.0, low_inclusive=False)
        check_real("proximal_mu", self.proximal_mu, low=0.0)
        if self.fedopt_eta is not None:
            check_real("fedopt_eta", self.fedopt_eta, low=0.0, low_inclusive=False)
        if self.max_epsilon is not None:
            check_real("max_epsilon", self.max_epsilon, low=0.0, low_inclusive=False)
            if not self.server_noise:
                raise ValueError("max_epsilon is invalid with server_noise=False: that run has ε = ∞")

    def _check_mode(self) -> None:
        """Client sampling's names, then the privacy mode's rules (``dpmf.federated.modes``): the
        other modes refuse their own settings, the mode checks its own."""
        from dpmf.federated.sampling import CLIENT_SAMPLINGS

        check_choice("client_sampling", self.client_sampling, CLIENT_SAMPLINGS)
        mode = get_privacy_mode(self.privacy)
        for name, other in PRIVACY_MODES.items():
            if name != self.privacy:
                other().refuse_foreign(self)
        if self.client_sampling == "all" and self.clients_per_round is not None:
            raise ValueError(
                "clients_per_round is invalid with client_sampling='all': every client trains every round; "
                "add --client-sampling poisson or fixed"
            )
        mode.check_config(self)

    @property
    def mode(self):
        """The ``PrivacyMode`` of ``privacy`` (``dpmf.federated.modes``)."""
        return get_privacy_mode(self.privacy)

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
    """The server side of one run: strategy, the privacy mode's server part, evaluation, ledger.

    ``part`` is the mode's ``ServerPart`` (``dpmf.federated.modes``); the ledger starts with its
    entries (the client part's are appended by ``_client_app``; by ``_serve_locally`` after the
    last round, or before the first under a privacy budget).
    """

    def __init__(
        self,
        config: FLConfig,
        data: FederatedData,
        comp: ComplianceSet,
        idx,
        sigmas,
        log,
        key: int,
        audit=None,
    ):
        from dpmf.federated.models import get_weights

        self.config, self.data, self.log = config, data, log
        self.audit = audit  # a white-box audit's hooks (dpmf.federated.hooks), or None
        self.ids = [comp.profiles[i].client_id for i in idx]
        self.idx, self.sigmas = list(idx), np.asarray(sigmas, dtype=np.float64)
        self.model = self.new_model()
        self.initial = get_weights(self.model)
        self.dim = int(sum(v.size for v in self.initial.values()))
        self.rounds = config.rounds  # fewer when a privacy budget binds (``dpmf.federated.budget``)
        self.strategy = make_strategy(
            config.strategy, len(self.idx), proximal_mu=config.proximal_mu, server_lr=config.fedopt_eta
        )
        self.part = config.mode.server(self, key)
        self.ledger: list[PrivacyEntry] = list(self.part.entries)

    def new_model(self):
        """A fresh model of the run (the public initial weights)."""
        from dpmf.federated.models import build_model

        c, d = self.config, self.data
        return build_model(d.input_shape, d.num_classes, hidden=c.hidden, seed=c.public_seed)

    def _evaluate(self, weights) -> tuple[float, float]:
        from dpmf.federated.models import evaluate, set_weights

        set_weights(self.model, weights)
        return evaluate(self.model, self.data.test_x, self.data.test_y)

    def serve(self, grid) -> list[dict]:
        """The R rounds (steps 1–6 of the module docstring) over ``grid``; per-round metrics."""
        weights = self.initial
        acc, loss = self._evaluate(weights)
        rows = [{"round": 0, "test_accuracy": acc, "test_loss": loss, "train_loss": float("nan")}]
        arrays = _record(weights)
        for r in range(1, self.rounds + 1):
            weights, train_loss = self._round(r, arrays, grid)
            arrays = _record(weights)
            acc, loss = self._evaluate(weights)
            row = {"round": r, "test_accuracy": acc, "test_loss": loss, "train_loss": train_loss}
            if self.config.eval_fraction > 0:
                row.update(self._federated_evaluation(r, arrays, grid))
            rows.append(row)
        return rows

    def _round(self, r: int, arrays, grid) -> tuple[dict, float]:
        """Round r from the global ``arrays``: the new weights and the clients' mean loss."""
        from flwr.app import ConfigRecord

        local = ConfigRecord({"local-steps": self.config.local_steps})
        msgs = self.strategy.configure_train(r, arrays, local, grid)
        msgs, expected = self.part.select(msgs, grid)
        replies = []
        if msgs:
            replies = sorted(grid.send_and_receive(msgs), key=lambda m: m.metadata.src_node_id)
        errors = [m for m in replies if m.has_error()]
        if errors:
            raise RuntimeError(f"round {r}: a ClientApp failed: {errors[0].error.reason}")
        if len(replies) != expected:
            raise RuntimeError(f"round {r}: {len(replies)} replies from {expected} participants")
        if not replies:  # e.g. a Poisson round without clients
            return self.part.after_aggregate(self.part.no_replies(arrays)), float("nan")
        train_loss = float(np.mean([float(m.content["metrics"]["train-loss"]) for m in replies]))
        agg, _ = self.strategy.aggregate_train(r, self.part.privatize(replies, arrays, r))
        if agg is None:
            raise RuntimeError(f"round {r}: the strategy returned no model")
        return self.part.after_aggregate({k: a.numpy() for k, a in agg.items()}), train_loss

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


def _record(weights):
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({k: Array(np.asarray(v)) for k, v in weights.items()})


def _client_app(config: FLConfig, data: FederatedData, idx, sigmas, ids, server, key: int):
    """The ClientApp; node i trains participant i's partition through the privacy mode's client
    part (``dpmf.federated.modes``; built once, so a mode's clients keep their state between
    rounds), whose ledger entries are appended to ``server.ledger``."""
    part = config.mode.client(config, data, idx, sigmas, ids, key)
    server.ledger.extend(part.complete_entries())
    return _client_app_of(part, data, idx)


def _train_args(msg, context, shared: dict | None = None) -> tuple:
    """(participant j, global weights, local steps, proximal μ, server round) of a train message.

    ``shared``: id of an ``ArrayRecord`` → its decoded weights, for the messages of one push
    that carry the same record (a strategy sends one global model to all): decoded once, then a
    copy for each message."""
    j = int(context.node_config["partition-id"])
    record = msg.content["arrays"]
    if shared is None:
        weights = {k: a.numpy() for k, a in record.items()}
    else:
        if id(record) not in shared:
            shared[id(record)] = {k: a.numpy() for k, a in record.items()}
        weights = {k: a.copy() for k, a in shared[id(record)].items()}
    cfg = msg.content["config"]
    return j, weights, int(cfg["local-steps"]), float(cfg.get("proximal-mu", 0.0)), int(cfg["server-round"])


def _announce(part, decoded: dict):
    """The local grid's ``prepare``: a push's train messages decoded once (kept in ``decoded``,
    id of the message → (message, its ``_train_args``)) and announced to the client part."""

    from flwr.app import MessageType

    def prepare(pairs) -> None:
        decoded.clear()
        shared: dict = {}
        for m, c in pairs:
            if m.metadata.message_type == MessageType.TRAIN:
                decoded[id(m)] = (m, _train_args(m, c, shared))
        if decoded:
            part.start([args[:4] for _, args in decoded.values()])

    return prepare


def _client_app_of(part, data: FederatedData, idx, decoded: dict | None = None):
    """The ClientApp training and evaluating through the client part ``part``; a train message
    already decoded by ``_announce`` (the same object, in ``decoded``) is not decoded again."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()
    decoded = {} if decoded is None else decoded

    @app.train()
    def train(msg: Message, context) -> Message:
        known = decoded.pop(id(msg), None)
        j, weights, steps, mu, r = (
            known[1] if known is not None and known[0] is msg else _train_args(msg, context)
        )
        new, weight, loss = part.train(j, weights, steps, mu, r)
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in new.items()}),
                "metrics": MetricRecord({"num-examples": weight, "train-loss": float(loss)}),
            }
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate_held_out(msg: Message, context) -> Message:
        from dpmf.federated.evaluation import EVALUATION_OFF
        from dpmf.federated.models import evaluate, set_weights

        if not data.eval_y:  # a client evaluates on held-out records only, never on its training data
            raise RuntimeError(EVALUATION_OFF)
        j = int(context.node_config["partition-id"])
        i = idx[j]
        model = part.new_model()
        set_weights(model, {k: a.numpy() for k, a in msg.content["arrays"].items()})
        acc, loss = evaluate(model, data.eval_x[i], data.eval_y[i])
        n = int(data.eval_y[i].shape[0])
        metrics = MetricRecord({"num-examples": n, "eval-accuracy": float(acc), "eval-loss": float(loss)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _budget(config: FLConfig, server: _Server) -> str:
    """Apply ``config.max_epsilon`` (``dpmf.federated.budget``) before any training: set the
    rounds to run and the ledger of the stopped run; the reason, or "" when it does not bind.
    ε after r rounds is the mode's (``ServerPart.epsilons_after``)."""
    from dpmf.federated import budget

    if config.max_epsilon is None:
        return ""
    stop = budget.plan_budget(config, server.ledger, server.part.epsilons_after)
    if stop is None:
        return ""
    server.rounds = stop.rounds
    server.ledger[:] = budget.apply(server.ledger, stop, server.part.steps_per_round(len(server.ledger)))
    server.log(f"privacy budget: {stop.reason}")
    return stop.reason


def _check_audit(audit, backend: str) -> None:
    """An audit's hooks are ``AuditHooks`` and run with the local backend only."""
    if audit is None:
        return
    from dpmf.federated.hooks import AuditHooks

    if not isinstance(audit, AuditHooks):
        raise TypeError(f"audit={audit!r} is invalid: must be a dpmf.federated.hooks.AuditHooks")
    if backend != "local":
        raise ValueError(f"backend={backend!r} is invalid with an audit: audits run with backend='local'")


def run_federated(
    config: FLConfig,
    *,
    compliance: ComplianceSet | None = None,
    backend: str = "local",
    data: FederatedData | None = None,
    log=print,
    audit=None,
) -> FLResult:
    """Run one seed of a compliance-aware federated experiment on Flower.

    Args:
        config: the run.
        compliance: the clients' profiles; None: ``example_profiles(num_clients)`` (announced
            through ``log``).
        backend: ``local`` (the ServerApp and ClientApps in this process through
            ``LocalGrid``; deterministic) or ``ray`` (Flower's simulation engine; needs Ray,
            and refuses a mode whose clients keep private state between rounds, ``record``).
        data: already loaded data (else loaded from the config).
        log: where notices and the ledger lines go.
        audit: a white-box audit's ``dpmf.federated.hooks.AuditHooks`` (``dpmf.audit.federated``);
            None: none. Only with ``backend='local'``.

    Returns:
        ``FLResult``.

    Raises:
        ImportError: Flower (or Ray for ``backend='ray'``) is not installed.
        ValueError: invalid settings, before any training.
    """
    _check_backend(config, backend)
    _check_audit(audit, backend)
    began = time.perf_counter()
    if compliance is None:
        compliance = example_profiles(config.num_clients)
    if compliance.source == "example":
        log(
            f"notice: no compliance file given: using the bundled example profile ({config.num_clients} "
            f"clients, {int(compliance.compliant().sum())} compliant)"
        )
    idx, sigmas = participants(config, compliance)
    data = _prepare_data(config, data, idx, log)
    comp = compliance.select(config.num_clients)
    policy = seeds.SeedPolicy.of(config.seed)  # secret unless given; never stored or shown
    if policy.notice:
        log(policy.notice)
    if config.eval_fraction > 0:
        from dpmf.federated.evaluation import EVAL_NOTE

        log(f"notice: {EVAL_NOTE}")
    if backend == "ray":  # the Flower app under ``flwr run`` on the simulation engine
        from dpmf.federated.flwr_run import run_app

        if compliance.source != "example":
            raise ValueError(
                "backend='ray' is invalid with a compliance file: the Flower app runs the bundled example "
                "profiles; use backend='local'"
            )
        rows, ledger, stopped = run_app(config, len(idx), log=log)
        server = SimpleNamespace(ledger=ledger, ids=[comp.profiles[i].client_id for i in idx], sigmas=sigmas)
    else:
        server = _Server(config, data, comp, idx, sigmas, log, policy.key, audit)
        rows, stopped = _serve_locally(config, data, idx, sigmas, server, policy.key)
    _finish_ledger(config, server.ledger, policy, log)
    return FLResult(
        config,
        rows,
        list(server.ledger),
        list(server.ids),
        {cid: float(s) for cid, s in zip(server.ids, server.sigmas, strict=True)},
        _data_info(data),
        time.perf_counter() - began,
        stopped,
    )


def _data_info(data: FederatedData) -> dict:
    """What ``FLResult.data`` says of the run's data: its name, source and split sizes."""
    return {
        "name": data.name,
        "source": data.source,
        "client_sizes": data.client_sizes(),
        "aggregator": int(data.aggregator_y.shape[0]),
        "test": int(data.test_y.shape[0]),
    }


def start_ahead(config: FLConfig, compliance: ComplianceSet | None = None, *, backend: str = "local") -> None:
    """Start the background work of ``run_federated(config, compliance=…, backend=…)`` now
    (``PrivacyMode.start_ahead``; record mode: its accountings), so that it runs while the
    caller goes on (``dpmf fl`` imports torch meanwhile: nothing here imports it). The run finds
    the work started and waits for it; it still makes every check and refusal itself.

    Settings the run would refuse start nothing here (the run then refuses them with its own
    message), nor does a backend other than ``local``; Flower is not imported here (the run
    checks that it is installed).
    """
    if backend != "local":
        return
    try:
        compliance = example_profiles(config.num_clients) if compliance is None else compliance
        idx, sigmas = participants(config, compliance)
        data = _prepare_data(config, None, idx, lambda *_: None)
        config.mode.start_ahead(config, data, idx, sigmas)
    except (ImportError, OSError, ValueError, TypeError):
        return  # refused by the run itself, with its message (nothing was started)


def _check_backend(config: FLConfig, backend: str) -> None:
    """Flower installed; for ``ray``: Ray installed and a mode whose clients keep no state."""
    check_choice("backend", backend, BACKENDS)
    _flwr()
    if backend != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ImportError(
            "backend='ray' needs Ray: pip install 'flwr[simulation]==1.42.0' (or use the local backend)"
        ) from None
    if config.mode.keeps_client_state:
        raise ValueError(
            f"backend='ray' is invalid with privacy={config.privacy!r}: each client's private run keeps its "
            "sampler and noise stream between rounds, which Ray workers do not; use backend='local'"
        )


def _prepare_data(config: FLConfig, data: FederatedData | None, idx, log) -> FederatedData:
    """The run's data (loaded unless given, with its held-out split), checked against the run
    before any training; its notes and warnings logged."""
    from dpmf.federated.checks import check_data

    if data is None:
        data = load_federated(
            config.dataset, config.num_clients, data_file=config.data_file, partition_scheme=config.partition,
            alpha=config.alpha, shards=config.shards, seed=config.public_seed,
            aggregator_fraction=config.aggregator_fraction,
        )  # fmt: skip
    if config.eval_fraction > 0 and not data.eval_y:
        from dpmf.federated.evaluation import split_held_out

        data = split_held_out(data, config.eval_fraction, config.public_seed)
    warnings = check_data(config, data.client_sizes(), idx)  # refusals before any training
    for note in data.notes:
        log(f"notice: {note}")
    for note in warnings:
        log(f"warning: {note}")
    return data


def _serve_locally(config: FLConfig, data, idx, sigmas, server: _Server, key: int) -> tuple[list, str]:
    """The ServerApp and the ClientApps in this process (``LocalGrid``): the rows and the
    budget's reason."""
    from flwr.app import Context, RecordDict
    from flwr.serverapp import Grid, ServerApp

    from dpmf.federated.grid import LocalGrid, server_identity
    from dpmf.federated.prefetch import cancel_pending

    part = None
    try:
        # the audit's hooks reach the client part only in an audited run: a registered mode
        # whose ``client`` takes no ``audit`` runs as before (and cannot be audited)
        hooks = {} if server.audit is None else {"audit": server.audit}
        part = config.mode.client(config, data, idx, sigmas, server.ids, key, **hooks)
        decoded: dict = {}
        app = _client_app_of(part, data, idx, decoded)
        # the client part's entries (record: accounted in the background while the clients
        # train) are needed before the first round only by a privacy budget
        if config.max_epsilon is not None:
            server.ledger.extend(part.complete_entries())
        stopped = _budget(config, server)
        out: dict = {}
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            out["rows"] = server.serve(grid)

        grid = LocalGrid(app, len(idx), prepare=_announce(part, decoded))
        with server_identity():
            server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
        part.close()
        if config.max_epsilon is None:
            server.ledger.extend(part.complete_entries())
    except BaseException:
        if part is not None:
            part.close()
        cancel_pending()  # a failed run waits for no background accounting
        raise
    return out["rows"], stopped


_SEED_NOTE = "the seed was given: only against whoever does not know it"


def _ledger_notes(config: FLConfig, ledger: list, policy) -> None:
    """Add the notes every entry carries (held-out evaluation, a given seed) to ``ledger``, each
    once (a ledger read back from the Flower app already has them)."""
    from dpmf.federated.evaluation import EVAL_NOTE

    notes = [EVAL_NOTE] if config.eval_fraction > 0 else []
    if not policy.is_secret:  # the guarantee holds only against whoever does not know the seed
        notes.append(_SEED_NOTE)
    for note in notes:
        ledger[:] = [e if note in e.note else replace(e, note=e.note + "; " + note) for e in ledger]


def _finish_ledger(config: FLConfig, ledger: list, policy, log) -> None:
    """The notes every entry carries (``_ledger_notes``); each entry logged."""
    _ledger_notes(config, ledger, policy)
    for e in ledger:
        log(f"privacy: {format_entry(e)}")
