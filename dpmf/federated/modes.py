"""The privacy modes of a federated run as objects: each one owns its rules, in one registry.

A mode says what is noised, where, and what its ε protects. Each mode is one ``PrivacyMode``
subclass registered under its name (``register_privacy_mode``); ``FLConfig``, the server and
the ClientApp of ``dpmf.federated.run``, the Flower app (``dpmf.federated.app``), the settings
checks, the privacy budget, ``dpmf fl --privacy`` and the Flower run config all take the mode
from ``PRIVACY_MODES`` and call it; none of them names a mode. A mode owns:

* **its settings** (``options``: the ``FLConfig`` fields it reads, with their ``dpmf fl`` flag,
  run-config key and help); those in ``exclusive`` are refused by the other modes unless they
  keep the field's default (``refuse_foreign``); its own checks of a configuration
  (``check_config``) and of the loaded data (``check_data``);
* **its server part** (``server``: a ``ServerPart`` for one run): the ledger entries it
  accounts, which clients train in a round (``select``), what it does to the replies before
  the strategy aggregates them (``privatize``), to the aggregate after (``after_aggregate``),
  a round without replies (``no_replies``), and ε after r rounds for the privacy budget
  (``epsilons_after``, ``steps_per_round``);
* **its client part** (``client``: a ``ClientPart``): one participant's local training of a
  round (``train``: the new weights, the weight of the reply, the loss sent) and the ledger
  entries accounted on the clients;
* **its ledger entry** (``entry``): ε with its unit (``protects``: what it protects) and the
  note on the threat model.

==============  ==============================  ===============================================
mode            unit (``protects``)             noise
==============  ==============================  ===============================================
``aggregator``  aggregator-dataset records      server DP-SGD on its aggregator dataset after
                                                each aggregation, σ per step from the
                                                participants' scores
``record``      records of client k             each client's local training is one private
                                                run (dpmf's private step) to its (ε_k, δ)
``client``      client                          each update clipped to ζ_c, one Gaussian noise
                                                vector on their mean (correlated across rounds
                                                by a strategy, clients sampled or not)
==============  ==============================  ===============================================

Adding a mode is one subclass with ``@register_privacy_mode`` (docs/architecture.md,
"Extending"); a mode that needs a setting no ``FLConfig`` field holds adds that
field too.

Module level imports numpy and the ledger only (``FLConfig`` validates without torch or
Flower); the parts import torch and Flower when a run builds them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import numpy as np

from dpmf import seeds
from dpmf._validation import check_choice, check_int, check_real
from dpmf.federated._registry import PRIVACY_MODES as _REGISTRY
from dpmf.federated.hooks import AuditHooks
from dpmf.federated.ledger import PrivacyEntry

__all__ = [
    "PRIVACY_MODES",
    "ClientPart",
    "LocalSGDClients",
    "Option",
    "PrivacyMode",
    "ServerPart",
    "get_privacy_mode",
    "privacy_modes",
    "register_privacy_mode",
]


class Option(NamedTuple):
    """A setting of one mode: its ``dpmf fl`` flag (the run-config key is the flag without
    ``--``), the ``FLConfig`` field, its type and its help (a string, or a function giving it)."""

    flag: str
    field: str
    kind: type
    help: object

    @property
    def key(self) -> str:
        return self.flag.lstrip("-")


# ----------------------------------------------------------------------------- the parts


class ServerPart:
    """A mode's part on the server for one run (``PrivacyMode.server``); by default it changes
    nothing in a round. ``entries``: the ``PrivacyEntry`` list it accounts.

    Args:
        mode: its ``PrivacyMode``.
        server: the run's server (``dpmf.federated.run._Server``: ``config``, ``data``,
            ``idx``, ``sigmas``, ``dim``, ``new_model()``).
        key: the run's key (secret; child keys only, never shown).
        audit: a white-box audit's ``dpmf.federated.hooks.AuditHooks`` (None: none).
    """

    def __init__(self, mode: PrivacyMode, server, key: int):
        self.mode, self.server, self.config = mode, server, server.config
        self.audit = getattr(server, "audit", None) or AuditHooks()  # dpmf.federated.hooks
        self.entries: list[PrivacyEntry] = []

    def select(self, msgs, grid) -> tuple[list, int]:
        """This round's train messages and the number of replies expected (default: every
        participant)."""
        return list(msgs), len(self.server.idx)

    def privatize(self, replies, arrays, server_round: int):
        """The replies as the strategy aggregates them (default: unchanged)."""
        return replies

    def no_replies(self, arrays) -> dict:
        """The model of a round in which no client trained (default: refused)."""
        raise RuntimeError(f"privacy={self.mode.name!r}: a round without replies has no model")

    def after_aggregate(self, weights: dict) -> dict:
        """The model after the strategy's aggregation (default: unchanged)."""
        return weights

    def epsilons_after(self, rounds: int) -> list[float]:
        """ε of each ledger entry after the first ``rounds`` rounds (``dpmf.federated.budget``).

        Raises:
            ValueError: the mode has no accounting of a prefix of its run.
        """
        raise ValueError(
            f"max_epsilon is invalid with privacy={self.mode.name!r}: the mode accounts no prefix of its run"
        )

    def steps_per_round(self, entries: int) -> list[int]:
        """The private releases per round of each of ``entries`` ledger entries (default 1)."""
        return [1] * entries


class ClientPart:
    """A mode's part on the clients for one run (``PrivacyMode.client``). ``entries``: the
    ``PrivacyEntry`` list accounted on the clients (the ServerApp builds the part for them).

    Args:
        mode: its ``PrivacyMode``; config: the ``FLConfig``; data: the ``FederatedData``.
        idx: the participants' client indices; sigmas: their σ_k; ids: their client ids.
        key: the run's key (secret; child keys only, never shown).
    """

    def __init__(self, mode: PrivacyMode, config, data, idx, sigmas, ids, key: int, audit=None):
        self.audit = audit or AuditHooks()  # dpmf.federated.hooks
        self.mode, self.config, self.data = mode, config, data
        self.idx, self.sigmas, self.ids, self._key = list(idx), sigmas, list(ids), key
        self.entries: list[PrivacyEntry] = []

    def new_model(self):
        from dpmf.federated.models import build_model

        c, d = self.config, self.data
        return build_model(d.input_shape, d.num_classes, hidden=c.hidden, seed=c.public_seed)

    def start(self, jobs) -> None:
        """A round's trainings ``(j, weights, steps, proximal_mu)``, announced before ``train`` is
        called for each (``record`` steps some participants in worker processes meanwhile);
        default: nothing."""

    def close(self) -> None:
        """The run is over (or failed): release what the part holds; default: nothing."""

    def complete_entries(self) -> list[PrivacyEntry]:
        """``entries``, complete: a part whose accountings run in the background while its
        clients train (``record``) waits for them here. The run asks for them before the first
        round when a privacy budget needs them, else after the last."""
        return self.entries

    def train(self, j: int, weights: dict, steps: int, proximal_mu: float, server_round: int):
        """Participant j's training of one round from the global ``weights``.

        Returns:
            (new weights, the reply's weight in the aggregation, the training loss sent).
        """
        raise NotImplementedError


class LocalSGDClients(ClientPart):
    """Plain local SGD (no noise on the clients). The reply weighs N_k and carries the loss
    when the mode shares the clients' statistics (``PrivacyMode.shares_statistics``), else 1
    and NaN (a record count or a loss is a non-private statistic of the protected data)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._models: dict = {}

    def train(self, j, weights, steps, proximal_mu, server_round):
        from dpmf.federated.models import get_weights, local_sgd, set_weights

        i, c = self.idx[j], self.config
        if j not in self._models:
            self._models[j] = self.new_model()
        model = self._models[j]
        set_weights(model, weights)
        rng = np.random.default_rng([c.public_seed, 3, i, server_round])
        loss = local_sgd(
            model, self.data.client_x[i], self.data.client_y[i], steps=steps, batch_size=c.local_batch_size,
            lr=c.local_lr, proximal_mu=proximal_mu, rng=rng,
        )  # fmt: skip
        if not self.mode.shares_statistics:
            return get_weights(model), 1, float("nan")
        return get_weights(model), int(self.data.client_y[i].shape[0]), float(loss)


# ----------------------------------------------------------------------------- the mode


class PrivacyMode:
    """One federated privacy mode (see the module docstring for what it owns).

    Class attributes:
        name: its ``--privacy`` name; summary: one line for ``dpmf fl --help``.
        protects: the unit of its ε (``PrivacyEntry.protects``; ``{k}`` is a client id).
        note: one sentence on the threat model (the ledger's).
        options: its settings (``Option``: flags and run-config keys).
        exclusive: the fields another mode refuses unless at their default; ``exclusive_role``
            what they set, for the refusal.
        shares_statistics: the clients send their example counts and losses (plain clients).
        keeps_client_state: a client keeps private state between rounds (refused on Ray; the
            Flower app checks that a node stays in its process).
        one_client_note: added to the warning of a one-client federation.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    protects: ClassVar[str] = ""
    note: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    exclusive: ClassVar[tuple[str, ...]] = ()
    exclusive_role: ClassVar[str] = ""
    shares_statistics: ClassVar[bool] = False
    keeps_client_state: ClassVar[bool] = False
    one_client_note: ClassVar[str] = ""

    # -- the configuration ---------------------------------------------------------------
    def refuse_foreign(self, config) -> None:
        """Refuse a configuration of another mode that sets this mode's options.

        Raises:
            ValueError: one of ``exclusive`` differs from its ``FLConfig`` default.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        names = list(self.exclusive)
        if any(getattr(config, n) != defaults[n] for n in names):
            verb = "are" if len(names) > 1 else "is"
            raise ValueError(
                f"{'/'.join(names)} {verb} invalid with privacy={config.privacy!r}: "
                f"{'they set' if len(names) > 1 else 'it sets'} {self.exclusive_role}"
            )

    def check_config(self, config) -> None:
        """This mode's checks of an ``FLConfig`` (after the generic ones; default: none).

        Raises:
            ValueError: a setting this mode cannot run.
        """

    def check_data(self, config, smallest: int) -> None:
        """This mode's check of the loaded partition (``smallest``: the fewest records of a
        participant; default: none).

        Raises:
            ValueError: the data cannot run this mode.
        """

    # -- the run -------------------------------------------------------------------------
    def server(self, server, key: int) -> ServerPart:
        """This mode's server part of one run (default: no server-side mechanism)."""
        return ServerPart(self, server, key)

    def client(self, config, data, idx, sigmas, ids, key: int, audit=None) -> ClientPart:
        """This mode's client part of one run (default: plain local SGD); ``audit``: a white-box
        audit's ``AuditHooks``."""
        return LocalSGDClients(self, config, data, idx, sigmas, ids, key, audit=audit)

    def start_ahead(self, config, data, idx, sigmas) -> None:
        """Start the background work of a run before it is built, from its settings alone
        (``dpmf.federated.run.start_ahead``; default: none). The run must ask for the same work
        and find it started: what is started here never changes a result.

        Raises:
            ValueError/TypeError: settings this mode refuses (the run refuses them too).
        """

    def entry(self, config, *, subject: str, epsilon: float, accountant: str, guarantee: str,
              noise_multiplier: float, steps: int, dataset_size: int, client: str = "",
              note: str | None = None) -> PrivacyEntry:  # fmt: skip
        """This mode's ledger entry: ε with its unit (``protects``, client ``client``), at the
        run's δ, with the mode's note (or ``note``)."""
        return PrivacyEntry(
            self.name, self.protects.format(k=client), subject, float(epsilon), config.delta, accountant,
            guarantee, float(noise_multiplier), int(steps), int(dataset_size),
            self.note if note is None else note,
        )  # fmt: skip


#: name → ``PrivacyMode`` class, in registration order (stored in ``_registry``, which the
#: ledger reads).
PRIVACY_MODES: dict[str, type[PrivacyMode]] = _REGISTRY


def register_privacy_mode(cls: type[PrivacyMode]) -> type[PrivacyMode]:
    """Add a ``PrivacyMode`` subclass to ``PRIVACY_MODES`` under ``cls.name`` (a decorator).

    Raises:
        TypeError: not a ``PrivacyMode`` subclass.
        ValueError: no name, a name already registered, or no unit (``protects``).
    """
    if not (isinstance(cls, type) and issubclass(cls, PrivacyMode)):
        raise TypeError(f"cls={cls!r} is invalid: must be a PrivacyMode subclass")
    if not cls.name or cls.name in PRIVACY_MODES:
        raise ValueError(f"name={cls.name!r} is invalid: must be non-empty and not yet registered")
    if not cls.protects:
        raise ValueError(f"protects={cls.protects!r} is invalid: a mode's ε needs its unit")
    PRIVACY_MODES[cls.name] = cls
    return cls


def privacy_modes() -> tuple[str, ...]:
    """The registered mode names, in registration order."""
    return tuple(PRIVACY_MODES)


def get_privacy_mode(name: str) -> PrivacyMode:
    """The mode registered as ``name``.

    Raises:
        ValueError: an unknown name (with the registered ones).
    """
    check_choice("privacy", name, privacy_modes())
    return PRIVACY_MODES[name]()


# ----------------------------------------------------------------------------- aggregator


class _AggregatorServer(ServerPart):
    """DP-SGD on the aggregator dataset after each aggregation, ``server_steps`` steps per
    participant at its σ_k (``local.AggregatorDPSGD``)."""

    def __init__(self, mode, server, key):
        from dpmf.federated import local

        super().__init__(mode, server, key)
        config, data = self.config, server.data
        self.round_sigmas = np.repeat(server.sigmas, config.server_steps)
        self.steps_per_round_ = int(self.round_sigmas.size)
        steps = np.tile(self.round_sigmas, config.rounds)
        n_agg = int(data.aggregator_y.shape[0])
        if config.server_batch_size > n_agg:
            raise ValueError(
                f"server_batch_size={config.server_batch_size} is invalid: the aggregator dataset has "
                f"{n_agg} records"
            )
        x, y = self.audit.private_records("aggregator", 0, data.aggregator_x, data.aggregator_y)
        self.dp = local.AggregatorDPSGD(
            x, y, server.new_model(),
            sigmas=steps if config.server_noise else np.zeros_like(steps), clip_norm=config.clip_norm,
            batch_size=config.server_batch_size, lr=config.server_lr,
            seed=seeds.child_key(key, "fl-aggregator"),
        )  # fmt: skip
        self.audit.private_run("aggregator", 0, self.dp)
        if config.server_noise:
            pr = self._privacy(steps)
            eps, acc, guar = pr.epsilon, pr.accountant, pr.guarantee
        else:
            eps, acc, guar = math.inf, "none", "upper_bound"
        self.entries = [
            mode.entry(
                config,
                subject=f"aggregator dataset (N={n_agg})",
                epsilon=eps,
                accountant=acc,
                guarantee=guar,
                noise_multiplier=float(steps.min()) if config.server_noise else 0.0,
                steps=int(steps.size),
                dataset_size=n_agg,
            )
        ]

    def _privacy(self, steps):
        from dpmf.federated import local

        c = self.config
        return local.aggregator_privacy(
            steps, sampling_rate=self.dp.sampling_rate, delta=c.delta, accountant=c.accountant or "pld"
        )

    def after_aggregate(self, weights):
        return self.dp.run(weights, self.steps_per_round_)

    def epsilons_after(self, rounds):
        if rounds == 0:
            return [0.0]
        return [self._privacy(np.tile(self.round_sigmas, rounds)).epsilon]

    def steps_per_round(self, entries):
        return [self.steps_per_round_] * entries


@register_privacy_mode
class AggregatorMode(PrivacyMode):
    """Server-side DP-SGD on a small aggregator dataset; the clients train in the clear."""

    name = "aggregator"
    summary = "server DP-SGD on its aggregator dataset after each aggregation; ε of that dataset's records"
    protects = "aggregator-dataset records"
    note = (
        "protects only the server's aggregator dataset against the released models; the "
        "clients' updates reach a semi-honest aggregator unprotected (client-level DP needs "
        "secure aggregation)"
    )
    options = (
        Option("--server-steps", "server_steps", int,
               "aggregator mode: server DP-SGD steps per participant per round"),
        Option("--server-batch-size", "server_batch_size", int,
               "aggregator mode: expected server batch (default 16)"),
        Option("--server-lr", "server_lr", float, "aggregator mode: server DP-SGD step size (default 0.1)"),
    )  # fmt: skip
    shares_statistics = True

    def refuse_foreign(self, config):
        if not config.server_noise:
            raise ValueError("server_noise=False is invalid: only aggregator mode has server noise")

    def server(self, server, key):
        return _AggregatorServer(self, server, key)


# ----------------------------------------------------------------------------- record


def _optimizer_choices() -> str:
    from dpmf.optim.registry import optimizer_names

    return "|".join(optimizer_names())


class _RecordServer(ServerPart):
    """Nothing on the server (the clients' runs are private); the budget's prefix accounting."""

    def epsilons_after(self, rounds):
        from dpmf.federated import local
        from dpmf.plan.schemes import Poisson

        c = self.config
        if c.local_factorization != "identity" or c.local_scheme != Poisson.name:
            raise ValueError(
                "max_epsilon is invalid with a correlated local strategy or a scheme other than poisson in "
                "record mode: the ε of a prefix of that run is not accounted; drop --max-epsilon or use "
                "--local-factorization identity --local-scheme poisson"
            )
        sizes = [int(self.server.data.client_y[i].shape[0]) for i in self.server.idx]
        if rounds == 0:
            return [0.0] * len(sizes)
        return [
            local.record_privacy(
                float(s), dataset_size=n, batch_size=c.local_batch_size, steps=rounds * c.local_steps,
                delta=c.delta, accountant=c.accountant,
            ).epsilon
            for s, n in zip(self.server.sigmas, sizes, strict=True)
        ]  # fmt: skip

    def steps_per_round(self, entries):
        return [self.config.local_steps] * entries


def _record_settings(config, data, idx, sigmas) -> list:
    """``record_privacy``'s arguments for each participant j (its σ_j and N_k)."""
    return [
        (float(sigmas[j]), int(data.client_y[i].shape[0]), config.local_batch_size,
         config.rounds * config.local_steps, config.delta, config.local_scheme,
         config.local_factorization, config.accountant)
        for j, i in enumerate(idx)
    ]  # fmt: skip


class _RecordClients(ClientPart):
    """Each participant's local training over the whole run is one private run of R·L steps
    (``local.PrivateLocalRun``), kept between rounds; one ledger entry per participant. When the
    run announces its rounds (``start``: the local grid does) and one torch thread leaves cores
    free, the participants are stepped in forked worker processes too (``parallel.ForkedRuns``;
    the same results bit for bit)."""

    def __init__(self, *args, **kwargs):
        from dpmf.federated import local
        from dpmf.federated.prefetch import start_record_privacy, usable_cores

        super().__init__(*args, **kwargs)
        config, data, sigmas = self.config, self.data, self.sigmas
        self.runs = {}
        self._forked = None  # parallel.ForkedRuns once started; False: every run steps here
        self._retired: set = set()  # participants whose worker has ended
        self._done: dict = {}  # participant → its round trained ahead here (or its failure)
        for j, i in enumerate(self.idx):
            x, y = self.audit.private_records("record", j, data.client_x[i], data.client_y[i])
            self.runs[j] = local.PrivateLocalRun(
                x, y, self.new_model(), noise_multiplier=float(sigmas[j]), clip_norm=config.clip_norm,
                batch_size=config.local_batch_size,  # ≤ N_k: checked by ``check_data``
                steps=config.rounds * config.local_steps, delta=config.delta, scheme=config.local_scheme,
                factorization=config.local_factorization, accountant=config.accountant,
                optimizer=config.local_optimizer, lr=config.local_lr,
                seed=seeds.child_key(self._key, "fl-record", i),
            )  # fmt: skip
            self.audit.private_run("record", j, self.runs[j])
        # every run built (its settings checked): one accounting per distinct setting, in
        # background processes while the clients train (``complete_entries`` waits for them);
        # on every core when a privacy budget needs them before the first round (those that
        # ``RecordMode.start_ahead`` started are not started again)
        start_record_privacy(
            _record_settings(config, data, self.idx, sigmas),
            workers=None if config.max_epsilon is None else usable_cores(),
        )

    def complete_entries(self):
        """One entry per participant: its run's (ε_k, δ) (awaited from the background)."""
        if len(self.entries) < len(self.runs):
            self.entries[:] = [self._entry(j) for j in range(len(self.runs))]
        return self.entries

    def _entry(self, j):
        pr, i = self.runs[j].privacy, self.idx[j]
        return self.mode.entry(
            self.config,
            subject=self.ids[j],
            client=self.ids[j],
            epsilon=pr.epsilon,
            accountant=pr.accountant,
            guarantee=pr.guarantee,
            noise_multiplier=float(self.sigmas[j]),
            steps=pr.steps,
            dataset_size=int(self.data.client_y[i].shape[0]),
        )

    def start(self, jobs):
        from dpmf.federated.parallel import ServingForkedRuns, parallel_workers

        if self._forked is None:
            workers = 1 if self._retired else parallel_workers(len(self.runs))
            # one participant fewer here: this process also serves the rounds meanwhile
            self._forked = ServingForkedRuns(self.runs, workers) if workers > 1 else False
        if self._forked:
            jobs = list(jobs)
            self._forked.submit(jobs)
            self._train_here(jobs)

    def _train_here(self, jobs) -> None:
        """This process's participants of the round, trained now while the workers train theirs
        (``train`` hands out each reply when the grid asks, in node order). A round depends only
        on its participant's own run and job, so the order of the runs changes no bit; the first
        failure is kept and raised by ``train`` for its participant (the later ones then train
        when asked, as they would have)."""
        self._done = {}
        for j, weights, steps, mu in jobs:
            if j in self._retired or self._forked.is_remote(j):
                continue
            try:
                self._done[j] = self.runs[j].train_round(weights, steps, mu)[0]
            except Exception as err:  # noqa: BLE001 - raised by ``train`` for participant j
                self._done[j] = err
                return

    def train(self, j, weights, steps, proximal_mu, server_round):
        if j in self._retired:
            raise RuntimeError(f"participant {j}'s private run ended with its worker process")
        if self._forked and self._forked.is_remote(j):
            return self._forked.result(j), 1, float("nan")
        done = self._done.pop(j, None)
        if isinstance(done, Exception):
            raise done
        new = self.runs[j].train_round(weights, steps, proximal_mu)[0] if done is None else done
        return new, 1, float("nan")

    def close(self):
        if self._forked:
            self._retired = {j for j in self.runs if self._forked.is_remote(j)}
            self._forked.close()
        self._forked = False
        self._done = {}


@register_privacy_mode
class RecordMode(PrivacyMode):
    """Each client trains with dpmf's private step to its own (ε_k, δ)."""

    name = "record"
    summary = "each client trains with dpmf's private step to its (ε_k, δ); ε of each client's records"
    protects = "records of client {k}"
    note = (
        "protects one record of this client against everyone who sees its updates, the server "
        "included; the server's aggregation and optimizer are post-processing"
    )
    options = (
        Option("--local-optimizer", "local_optimizer", str, lambda: f"record mode: {_optimizer_choices()}"),
        Option("--local-factorization", "local_factorization", str,
               "record mode: strategy of the local noise"),
        Option("--local-scheme", "local_scheme", str, "record mode: batch-sampling scheme (default poisson)"),
    )  # fmt: skip
    exclusive = ("local_optimizer", "local_factorization", "local_scheme")
    exclusive_role = "record mode's private local step"
    keeps_client_state = True

    def check_config(self, config):
        from dpmf.optim.registry import optimizer_names

        check_choice("local_optimizer", config.local_optimizer, optimizer_names())

    def check_data(self, config, smallest):
        if config.local_batch_size > smallest:
            raise ValueError(
                f"local_batch_size={config.local_batch_size} is invalid in record mode: a participant holds "
                f"only {smallest} records and its Poisson sampling rate B/N_k must be <= 1; give "
                f"--local-batch-size <= {smallest} or fewer clients"
            )

    def server(self, server, key):
        return _RecordServer(self, server, key)

    def client(self, config, data, idx, sigmas, ids, key, audit=None):
        return _RecordClients(self, config, data, idx, sigmas, ids, key, audit=audit)

    def start_ahead(self, config, data, idx, sigmas):
        # the accountings, e.g. while the caller imports torch (``_RecordClients`` finds them
        # started: ``record_privacy``'s results are a function of these arguments alone)
        from dpmf.federated.prefetch import start_record_privacy, usable_cores

        start_record_privacy(
            _record_settings(config, data, idx, sigmas),
            workers=None if config.max_epsilon is None else usable_cores(),
        )


# ----------------------------------------------------------------------------- client


class _ClientServer(ServerPart):
    """Each update clipped to ζ_c and one Gaussian noise vector on the mean of the replies
    (``local.ClientLevelNoise``; ``sampling.SampledClientNoise`` with client sampling)."""

    def __init__(self, mode, server, key):
        from dpmf.federated import local

        super().__init__(mode, server, key)
        config, P, R = self.config, len(server.idx), self.config.rounds
        sigma_c = config.client_noise_multiplier
        self.sigma_c = float(server.sigmas.max()) if sigma_c is None else float(sigma_c)
        self.sampled = config.client_sampling != "all"
        common = dict(
            noise_multiplier=self.sigma_c, clip_norm=config.client_clip, delta=config.delta,
            factorization=config.client_factorization, accountant=config.accountant, dim=server.dim,
        )  # fmt: skip
        note = mode.note
        if self.sampled:
            from dpmf.federated.sampling import SampledClientNoise

            self.noise = SampledClientNoise(
                config.client_sampling, P, config.clients_per_round, R,
                seed=seeds.child_key(key, "fl-client-sampling"), **common,
            )  # fmt: skip
            note += (
                f"; {config.client_sampling} client sampling, {config.clients_per_round} of {P} clients "
                "per round (expected), amplification accounted"
            )
        else:
            self.noise = local.ClientLevelNoise(P, R, seed=seeds.child_key(key, "fl-client-noise"), **common)
            self.audit.client_noise(self.noise)
        pr = self.noise.privacy
        self.entries = [
            mode.entry(
                config,
                subject=f"each of the {P} participating clients",
                epsilon=pr.epsilon,
                accountant=pr.accountant,
                guarantee=pr.guarantee,
                noise_multiplier=self.sigma_c,
                steps=R,
                dataset_size=P,
                note=note,
            )
        ]

    def select(self, msgs, grid):
        if not self.sampled:
            return super().select(msgs, grid)
        nodes = sorted(grid.get_node_ids())  # this round's clients (``dpmf.federated.sampling``)
        keep = {nodes[j] for j in self.noise.participants()}
        return [m for m in msgs if m.metadata.dst_node_id in keep], len(keep)

    def no_replies(self, arrays):
        """A Poisson round without clients: w + ν/K̄ (nothing to aggregate)."""
        nu = self.noise.next() / self.noise.divisor
        weights, off = {}, 0
        for k, a in arrays.items():
            w = a.numpy().astype(np.float64)
            weights[k] = np.asarray(w + nu[off : off + w.size].reshape(w.shape), dtype=np.float32)
            off += w.size
        return weights

    def privatize(self, replies, arrays, server_round):
        """Clip each update w_k − w to ζ_c, give it weight 1 and add the round's noise on the
        sum / K (K̄ when clients are sampled) to every reply, so that their mean is
        w + (1/K)·Σ_k clip(w_k − w) + ν_r/K."""
        from flwr.app import Array, ArrayRecord

        from dpmf.federated.clip import update_scale
        from dpmf.federated.replies import reply_updates

        base = {k: a.numpy().astype(np.float64) for k, a in arrays.items()}
        divisor = getattr(self.noise, "divisor", len(replies))  # K̄ when clients are sampled
        grow = len(replies) / divisor  # the mean of the replies is then Σ/K̄ (1.0 without sampling)
        # every update in the global model's key order, every reply checked before any noise
        updates = [reply_updates(msg, None, base, server_round) for msg in replies]
        noise = self.noise.next()
        canaries = self.audit.client_updates(server_round)  # a white-box audit's, else None
        if canaries is not None:
            noise = noise + canaries
        noise = noise / divisor
        for msg, upd in zip(replies, updates, strict=True):
            rec_key = next(iter(msg.content.array_records.keys()))
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
        self.audit.client_round(server_round, arrays, replies)
        return replies

    def epsilons_after(self, rounds):
        from dpmf.federated import local

        c = self.config
        if c.client_factorization != "identity":
            raise ValueError(
                "max_epsilon is invalid with correlated client noise: the ε of a prefix of a stream planned "
                "for R rounds is not accounted; drop --max-epsilon or choose --rounds within the budget"
            )
        if rounds == 0:
            return [0.0]
        noise = local.ClientLevelNoise(  # its privacy only: the stream of dim 1 is never drawn
            len(self.server.idx), rounds, noise_multiplier=self.sigma_c, clip_norm=1.0, delta=c.delta,
            accountant=c.accountant, dim=1, seed=0,
        )  # fmt: skip
        return [noise.privacy.epsilon]


@register_privacy_mode
class ClientMode(PrivacyMode):
    """Clipped client updates and one Gaussian noise on their mean (client-level DP)."""

    name = "client"
    summary = "clipped updates and one Gaussian noise on their mean; ε of a whole client"
    protects = "client"
    note = (
        "protects each whole client (add or remove one client) against whoever sees the noisy "
        "aggregate; individual updates must stay hidden from the server (secure aggregation)"
    )
    options = (
        Option("--client-clip", "client_clip", float,
               "client mode: bound on each client's update norm (default 1)"),
        Option("--client-noise-multiplier", "client_noise_multiplier", float,
               "client mode: σ_c (default: largest σ_k)"),
        Option("--client-factorization", "client_factorization", str,
               "client mode: identity or a strategy, e.g. bisr:4"),
        Option("--client-sampling", "client_sampling", str,
               "client mode: all (default) | poisson | fixed (cyclic)"),
        Option("--clients-per-round", "clients_per_round", int,
               "client sampling: K per round (expected: poisson)"),
    )  # fmt: skip
    exclusive = ("client_factorization", "client_noise_multiplier")
    exclusive_role = "client mode's noise"
    one_client_note = " and client-level noise protects that one client's whole data"

    def refuse_foreign(self, config):
        super().refuse_foreign(config)
        if config.client_sampling != "all":
            raise ValueError(
                f"client_sampling={config.client_sampling!r} is invalid with privacy={config.privacy!r}: "
                "client sampling is accounted for client-level noise only; use privacy='client'"
            )

    def check_config(self, config):
        from dpmf.federated.strategies import MEAN_STRATEGIES

        if config.strategy not in MEAN_STRATEGIES:
            raise ValueError(
                f"strategy={config.strategy!r} is invalid with privacy='client': client-level noise is "
                "calibrated to the sensitivity of a mean, and a coordinate-wise median has another; "
                f"use one of {', '.join(MEAN_STRATEGIES)}"
            )
        if config.client_noise_multiplier is not None:
            check_real(
                "client_noise_multiplier", config.client_noise_multiplier, low=0.0, low_inclusive=False
            )
        if config.client_sampling == "all":
            return
        if config.clients_per_round is None:
            raise ValueError(
                f"client_sampling={config.client_sampling!r} needs clients_per_round (K >= 1, the "
                "expected number of clients per round)"
            )
        check_int("clients_per_round", config.clients_per_round, minimum=1, maximum=config.num_clients)
        if config.max_epsilon is not None:
            raise ValueError(
                "max_epsilon is invalid with client_sampling: the budget's prefix accounting is for "
                "full participation; drop one of them"
            )

    def server(self, server, key):
        return _ClientServer(self, server, key)
