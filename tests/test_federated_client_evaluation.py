"""Federated evaluation on the clients' own data is outside every ε: dpmf's client-level wrappers
send none and drop any evaluation replies by default (Flower's default ``fraction_evaluate=1.0``
included), release the wrapped strategy's evaluation only with ``evaluate_on_clients=True`` (a
warning once, the ledger's note), and ``dpmf fl``'s ClientApp evaluates on held-out records only,
opted in by ``eval_fraction`` with a notice once and the ledger's note."""

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flower_helpers import SHAPES, P, evaluating_client_app  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord  # noqa: E402
from flwr.serverapp import strategy as fs  # noqa: E402

from dpmf.federated.compliance import example_profiles  # noqa: E402
from dpmf.federated.grid import LocalGrid, server_identity  # noqa: E402
from dpmf.federated.weighted import ComplianceWeighted  # noqa: E402
from dpmf.federated.wrappers import CLIENT_EVALUATION_NOTE, CorrelatedClientDP  # noqa: E402

R = 2
WRAPPERS = ("correlated", "compliance-weighted")


def _inner():
    # Flower's defaults for evaluation: fraction_evaluate=1.0, every node asked every round
    return fs.FedAvg(fraction_train=1.0, min_train_nodes=P, min_available_nodes=P)


def _wrap(kind, inner, grid, **kw):
    if kind == "correlated":
        return CorrelatedClientDP(inner, num_clients=P, rounds=R, noise_multiplier=1.0, clip_norm=0.5, seed=1,
                                  **kw)  # fmt: skip
    nodes = sorted(grid.get_node_ids())
    rule = ComplianceWeighted(example_profiles(P))
    node_clients = dict(zip(nodes, rule.compliance.client_ids, strict=True))
    return rule.client_dp(inner, node_clients=node_clients, rounds=R, clip_norm=0.5, seed=1, **kw)


def _arrays():
    return ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})


def _evaluation_replies():
    """The clients' evaluation replies to Flower's own ``configure_evaluate`` (Messages whose
    MetricRecord the clients built), as a leak would aggregate them."""
    grid = LocalGrid(evaluating_client_app([]), P)
    with server_identity():
        return list(grid.send_and_receive(_inner().configure_evaluate(1, _arrays(), ConfigRecord({}), grid)))


def _leaked(replies) -> dict[str, float]:
    """The example-weighted means of the replies' accuracy and loss, by hand from the replies."""
    recs = [next(iter(m.content.metric_records.values())) for m in replies]
    n = np.array([float(r["num-examples"]) for r in recs])
    return {k: float(np.dot(n, [float(r[k]) for r in recs]) / n.sum()) for k in ("eval-acc", "eval-loss")}


def _released(result) -> list[float]:
    """Every number the server's run released (training and evaluation metrics of every round)."""
    out = []
    for history in (result.train_metrics_clientapp, result.evaluate_metrics_clientapp):
        for rec in history.values():
            for v in rec.values():
                out.extend(np.ravel(v).astype(float).tolist())
    return out


def _warnings(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_with_flowers_default_fraction_evaluate_no_client_evaluation_metric_is_released(kind, caplog):
    replies = _evaluation_replies()
    leak = _leaked(replies)
    assert len(replies) == P and leak["eval-acc"] == pytest.approx(0.487)  # (9.1 + 18.6 + 21) / 100
    evaluated: list = []
    grid = LocalGrid(evaluating_client_app(evaluated), P)
    inner = _inner()
    assert inner.fraction_evaluate == 1.0
    dp = _wrap(kind, inner, grid)
    with caplog.at_level(logging.WARNING), server_identity():
        result = dp.start(grid, _arrays(), num_rounds=R)
    released = _released(result)
    assert released  # the training metrics (ε, δ, ζ) are there
    for value in leak.values():
        assert not any(np.isclose(x, value, rtol=0, atol=1e-9) for x in released)
    assert dict(result.evaluate_metrics_clientapp) == {}
    assert evaluated == []  # no client was asked to evaluate
    assert _warnings(caplog, "federated evaluation on the clients is off") == 1  # once for R rounds
    assert all(CLIENT_EVALUATION_NOTE not in e.note for e in dp.ledger) and dp.ledger


@pytest.mark.parametrize("kind", WRAPPERS)
def test_client_evaluation_replies_handed_to_the_wrapper_are_dropped_not_aggregated(kind, caplog):
    replies = _evaluation_replies()
    assert _inner().aggregate_evaluate(1, replies)["eval-acc"] == pytest.approx(_leaked(replies)["eval-acc"])
    dp = _wrap(kind, _inner(), LocalGrid(evaluating_client_app([]), P))
    with caplog.at_level(logging.WARNING):
        assert dp.aggregate_evaluate(1, replies) is None
        assert dp.aggregate_evaluate(2, replies) is None
        assert dp.aggregate_evaluate(3, []) is None
    assert _warnings(caplog, f"{P} client evaluation replies dropped") == 1


@pytest.mark.parametrize("kind", WRAPPERS)
def test_evaluate_on_clients_releases_the_metrics_with_one_warning_and_the_ledgers_note(kind, caplog):
    leak = _leaked(_evaluation_replies())
    evaluated: list = []
    grid = LocalGrid(evaluating_client_app(evaluated), P)
    with caplog.at_level(logging.WARNING):
        dp = _wrap(kind, _inner(), grid, evaluate_on_clients=True)
        assert dp.ledger == []  # nothing accounted before round 1
        with server_identity():
            result = dp.start(grid, _arrays(), num_rounds=R)
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]
    for rec in result.evaluate_metrics_clientapp.values():
        assert {k: rec[k] for k in leak} == pytest.approx(leak)
    assert sorted(evaluated) == sorted(list(range(P)) * R)
    assert _warnings(caplog, CLIENT_EVALUATION_NOTE) == 1
    assert _warnings(caplog, "is off") == 0 and _warnings(caplog, "dropped") == 0
    ledger = dp.ledger
    assert len(ledger) == (1 if kind == "correlated" else P)
    assert all(CLIENT_EVALUATION_NOTE in e.note and e.protects == "client" for e in ledger)
    assert max(e.epsilon for e in ledger) == result.train_metrics_clientapp[R]["dp-client-epsilon"]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_evaluate_on_clients_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=rf"^evaluate_on_clients={bad!r} is invalid: must be True or False$"):
        CorrelatedClientDP(_inner(), num_clients=P, rounds=R, noise_multiplier=1.0, clip_norm=0.5,
                           evaluate_on_clients=bad)  # fmt: skip


def test_dpmf_fls_client_app_refuses_to_evaluate_without_held_out_records():
    from dpmf.federated.data import load_federated
    from dpmf.federated.run import FLConfig, _client_app_of, participants
    from dpmf.federated.strategies import make_strategy

    config = FLConfig(num_clients=2, rounds=1, privacy="client", seed=0)
    idx, sigmas = participants(config, example_profiles(2))
    data = load_federated("breast-cancer", 2, seed=0)
    part = config.mode.client(config, data, idx, sigmas, ["a", "b"], 0)
    grid = LocalGrid(_client_app_of(part, data, idx), 2)
    arrays = ArrayRecord({k: Array(v) for k, v in part.new_model().state_dict().items()})
    with server_identity():
        msgs = make_strategy("fedavg", 2).configure_evaluate(1, arrays, ConfigRecord({}), grid)
        with pytest.raises(RuntimeError, match=r"^federated evaluation is off in this run") as err:
            grid.send_and_receive(msgs)
    assert "\n" not in str(err.value)


@pytest.mark.usefixtures("one_torch_thread")
def test_dpmf_fl_and_the_flower_app_log_the_evaluation_notice_once_and_mark_the_ledger():
    from flwr.app import Context, RecordDict

    from dpmf.federated.app import app, clientapp, config_from_run_config
    from dpmf.federated.evaluation import EVAL_NOTE
    from dpmf.federated.run import run_federated

    rc = {"clients": 2, "rounds": 2, "local-steps": 1, "privacy": "client", "eval-fraction": 0.25, "seed": 0}
    lines: list = []
    ref = run_federated(config_from_run_config(rc), log=lines.append)
    assert sum(EVAL_NOTE in line for line in lines) == 1
    assert ref.ledger and all(e.note.count(EVAL_NOTE) == 1 for e in ref.ledger)
    grid = LocalGrid(clientapp, 2, run_config=rc)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    with server_identity():
        app(grid, ctx)
    got = ctx.state.config_records["dpmf-ledger"]
    assert list(got["notes"]) == [e.note for e in ref.ledger]
    # without the opt-in nothing is evaluated on the clients and no ledger note claims it
    plain = run_federated(config_from_run_config({**rc, "eval-fraction": 0.0}), log=lines.append)
    assert "federated_accuracy" not in plain.metrics[-1]
    assert all(EVAL_NOTE not in e.note for e in plain.ledger)
