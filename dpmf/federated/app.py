"""dpmf's compliance-aware federated run as a Flower app: module-level ``app`` (ServerApp) and
``clientapp`` (ClientApp) for ``flwr run`` (components ``dpmf.federated.app:app`` and
``dpmf.federated.app:clientapp``; ``examples/flower/pyproject.toml``).

The run config (``[tool.flwr.app.config]``, or ``flwr run --run-config``) holds the settings of
``dpmf fl`` under the names of its flags (``config_keys``): ``dataset``, ``clients``,
``rounds``, ``strategy``, ``privacy``, ``noise-map``, ``sigma-min``, ``sigma-max``,
``local-steps``, ``client-factorization``, ``max-epsilon``, ``seed`` (−1: a secret key), … The
ServerApp and the ClientApp build the same ``FLConfig`` from it and run what ``dpmf fl`` runs
(``dpmf.federated.run``): the same strategies, noise, ledger and hence the same ε. The ledger
is logged and kept in the ServerApp's ``context.state`` (``dpmf-ledger``: ε, δ, unit per entry).

Keys: with ``seed`` ≥ 0 every noise key derives from it as in ``dpmf fl --seeds`` (the run is
reproducible: same weights and ε). With ``seed = -1`` (default) the server draws its secret key
(client-level and aggregator noise) and each client process draws its own for its record-level
noise; no key leaves the process that drew it.

The mode (``privacy``) is taken from the registry (``dpmf.federated.modes``): the ServerApp
builds its server part and its client part's ledger entries, the ClientApp its client part.

Client state: a mode whose clients keep private state (``keeps_client_state``; ``record``
mode's private run: sampler position, noise stream) keeps it in the client's process for the
whole run, and the number of private steps taken is kept in
``context.state`` (``dpmf-record``). A node whose process lost the run (a simulation engine
that moved it to another worker) is refused with an error rather than restarted, since
restarting would replay its noise. ``aggregator`` and ``client`` modes keep no client state.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from dpmf import seeds
from dpmf.federated.compliance import NoiseMap, example_profiles
from dpmf.federated.ledger import format_entry
from dpmf.federated.runconfig import _MAP_KEYS, parse_run_config_value, run_config_keys

__all__ = ["app", "clientapp", "config_from_run_config", "config_keys"]

_LOG = logging.getLogger("dpmf.federated.app")


def config_keys() -> tuple[str, ...]:
    """The run-config keys understood (besides ``noise-map``, ``sigma-min``, ``sigma-max``,
    ``seed``): the common ones and every registered privacy mode's options."""
    return tuple(run_config_keys())


def config_from_run_config(run_config) -> object:
    """The ``FLConfig`` of a Flower run config (the keys of ``config_keys``; ``seed`` −1 or
    absent: a secret key; ``max-epsilon``/``client-noise-multiplier`` 0: none).

    Every value is parsed strictly for its key's type (``parse_run_config_value``): "false" is
    not True, 2.9 rounds are not 2, NaN is no seed.

    Raises:
        ValueError: an unknown key (with the allowed ones), a value of the wrong type or not
            finite (naming the key), or an invalid value (``FLConfig``).
    """
    from dpmf.federated.run import FLConfig

    cfg, keys = dict(run_config), run_config_keys()
    unknown = sorted(set(cfg) - set(keys) - set(_MAP_KEYS) - {"seed", "results-file"})
    if unknown:
        raise ValueError(
            f"run config keys {unknown} are invalid: allowed are {sorted([*keys, *_MAP_KEYS, 'seed'])}"
        )
    kw = {}
    for key, (field, kind) in keys.items():
        if key in cfg and cfg[key] != "":
            kw[field] = parse_run_config_value(key, cfg[key], kind)
    for field in ("max_epsilon", "client_noise_multiplier", "fedopt_eta"):
        if kw.get(field) == 0:
            kw.pop(field)
    seed = parse_run_config_value("seed", cfg.get("seed", -1), int)
    kw["seed"] = None if seed < 0 else seed
    kw["noise_map"] = NoiseMap(
        parse_run_config_value("noise-map", cfg.get("noise-map", "linear"), str),
        parse_run_config_value("sigma-min", cfg.get("sigma-min", 0.8), float),
        parse_run_config_value("sigma-max", cfg.get("sigma-max", 2.0), float),
    )
    return FLConfig(**kw)


_CACHE: dict = {}


def _setup(config):
    """The run's data and participants (cached per process and configuration)."""
    from dpmf.federated.data import load_federated
    from dpmf.federated.run import participants

    key = repr(config.to_dict())
    if key not in _CACHE:
        comp = example_profiles(config.num_clients)
        idx, sigmas = participants(config, comp)
        data = load_federated(
            config.dataset, config.num_clients, data_file=config.data_file, partition_scheme=config.partition,
            alpha=config.alpha, shards=config.shards, seed=config.public_seed,
            aggregator_fraction=config.aggregator_fraction,
        )  # fmt: skip
        if config.eval_fraction > 0:
            from dpmf.federated.evaluation import split_held_out

            data = split_held_out(data, config.eval_fraction, config.public_seed)
        _CACHE[key] = (comp.select(config.num_clients), idx, sigmas, data)
    return _CACHE[key]


_CLIENT_KEY = seeds.SeedPolicy.of(None)  # this process's secret key (record mode, seed = -1)
_INNER: dict = {}  # configuration → the ClientApp of ``dpmf.federated.run`` (this process's)
_TAKEN: dict = {}  # configuration → node → private steps taken in this process (record mode)


def _log(text: str) -> None:
    _LOG.warning(text)


def _wait_for_nodes(grid, count: int, seconds: float = 30.0) -> None:
    """Wait until the federation has ``count`` nodes (one per participant).

    Raises:
        RuntimeError: another number after ``seconds`` (the simulation's num-supernodes differs),
            naming the fix.
    """
    import time

    end = time.monotonic() + seconds
    while True:
        have = len(list(grid.get_node_ids()))
        if have == count or time.monotonic() > end:
            break
        time.sleep(0.5)
    if have != count:
        raise RuntimeError(
            f"the federation has {have} nodes and the run {count} participants: run "
            f"flwr run <app> --federation-config 'num-supernodes={count}'"
        )


# ---------------------------------------------------------------------------- ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The rounds of ``dpmf fl`` over Flower's grid; the ledger in ``context.state``."""
    from dpmf.federated.checks import check_data
    from dpmf.federated.run import _budget, _client_app, _ledger_notes, _Server

    config = config_from_run_config(context.run_config)
    comp, idx, sigmas, data = _setup(config)
    _wait_for_nodes(grid, len(idx))
    for note in check_data(config, data.client_sizes(), idx):
        _log(f"warning: {note}")
    policy = seeds.SeedPolicy.of(config.seed)  # secret unless given; never stored or shown
    if policy.notice:
        _log(policy.notice)
    if config.eval_fraction > 0:
        from dpmf.federated.evaluation import EVAL_NOTE

        _log(f"notice: {EVAL_NOTE}")
    server = _Server(config, data, comp, idx, sigmas, _log, policy.key)
    # the ledger entries of the mode's client part (record: the clients' (ε_k, δ), from public
    # facts σ_k, N_k, B, steps); the clients train in their own processes
    _client_app(config, data, idx, sigmas, server.ids, server, policy.key)
    stopped = _budget(config, server)
    rows = server.serve(grid)
    _ledger_notes(config, server.ledger, policy)  # held-out evaluation, a given seed
    for e in server.ledger:
        _log(f"privacy: {format_entry(e)}")
    _log(f"test accuracy after round {rows[-1]['round']}: {100 * rows[-1]['test_accuracy']:.2f} %")
    context.state["dpmf-ledger"] = ConfigRecord(
        {
            "epsilon": [float(e.epsilon) for e in server.ledger],
            "delta": [float(e.delta) for e in server.ledger],
            "protects": [e.protects for e in server.ledger],
            "lines": [format_entry(e) for e in server.ledger],
            "notes": [e.note for e in server.ledger],
            "test-accuracy": [float(r["test_accuracy"]) for r in rows],
            "stopped": stopped,
        }
    )
    path = context.run_config.get("results-file", "")
    if path:  # ``dpmf fl --backend ray`` reads the run back from here (no secret in it)
        from dpmf._io import atomic_write_json

        atomic_write_json(
            path, {"rows": rows, "ledger": [e.to_dict() for e in server.ledger], "stopped": stopped}
        )


# ---------------------------------------------------------------------------- ClientApp
clientapp = ClientApp()


def _inner(config, comp, idx, sigmas, data):
    from dpmf.federated.run import _client_app

    key = seeds.SeedPolicy.of(config.seed).key if config.seed is not None else _CLIENT_KEY.key
    inner_key = repr(config.to_dict())
    if inner_key not in _INNER:
        _INNER[inner_key] = _client_app(
            config, data, idx, sigmas, [p.client_id for p in comp.profiles], SimpleNamespace(ledger=[]), key
        )
    return inner_key, _INNER[inner_key]


@clientapp.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Node ``partition-id`` evaluates the global model on its held-out records."""
    config = config_from_run_config(context.run_config)
    _, inner = _inner(config, *_setup(config))
    return inner(msg, context)


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    """Node ``partition-id`` trains participant ``partition-id`` as in ``dpmf fl``."""
    config = config_from_run_config(context.run_config)
    comp, idx, sigmas, data = _setup(config)
    if int(context.node_config["num-partitions"]) != len(idx):
        raise ValueError(
            f"the federation has {context.node_config['num-partitions']} nodes and the run {len(idx)} "
            "participants: set the simulation's num-supernodes to the number of participants"
        )
    inner_key, inner = _inner(config, comp, idx, sigmas, data)
    if not config.mode.keeps_client_state:
        return inner(msg, context)
    # the mode's clients keep private state (record: sampler, noise stream) in this process
    state = context.state.config_records.get("dpmf-record")
    taken = int(state["steps-taken"]) if state is not None else 0
    seen = _TAKEN.setdefault(inner_key, {})
    j = int(context.node_config["partition-id"])
    if taken != seen.get(j, 0):
        raise RuntimeError(
            f"node {j}: its private run took {taken} steps in another process; this process cannot "
            f"continue it without replaying noise (run {config.privacy} mode with one process per node)"
        )
    reply = inner(msg, context)
    seen[j] = taken + int(msg.content["config"]["local-steps"])
    context.state["dpmf-record"] = ConfigRecord({"steps-taken": seen[j]})
    return reply
