"""Compliance-weighted noise over the two Flower building blocks: σ_k follows the compliance
rule (scores and map by hand), the client-level wrapper clips client k to ζ·σ_min/σ_k under one
noise at σ_min (its aggregate written out), ε of each compliance class against dp-accounting,
and the record-level trainer at σ_k."""

import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import strategy as fs  # noqa: E402

from dpmf import seeds  # noqa: E402
from dpmf.federated.compliance import NoiseMap, example_profiles  # noqa: E402
from dpmf.federated.grid import LocalGrid, server_identity  # noqa: E402
from dpmf.federated.local import ClientLevelNoise  # noqa: E402
from dpmf.federated.weighted import ComplianceWeighted  # noqa: E402
from dpmf.federated.wrappers import EPSILON_KEY  # noqa: E402

P, R, ZETA = 4, 3, 1.0
SHAPES = {"w": (2, 3), "b": (3,)}
# example_profiles(4): the scores are the means of the five criteria (equal weights)
SCORES = {"compliant-01": 4.73 / 5, "lower-01": 3.35 / 5, "lower-02": 2.85 / 5, "lower-03": 3.50 / 5}
SIGMAS = {c: 2.0 - 1.2 * s for c, s in SCORES.items()}  # linear map σ(1) = 0.8, σ(0) = 2.0


def _update(r, j):
    rng = np.random.default_rng([r, j])
    u = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    n = math.sqrt(sum(float(np.sum(v * v)) for v in u.values()))
    return {k: v * 5.0 / n for k, v in u.items()}  # norm 5: every update is clipped


def _app():
    app = ClientApp()

    @app.train()
    def train(msg, context):
        j, r = int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"])
        w = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        new = {k: (w[k] + _update(r, j)[k]).astype(np.float32) for k in w}
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                              "metrics": MetricRecord({"num-examples": 1})})  # fmt: skip
        return Message(content=content, reply_to=msg)

    return app


def _rule(allocation="weighted"):
    return ComplianceWeighted(example_profiles(P), NoiseMap("linear", 0.8, 2.0), allocation)


def test_noise_multipliers_follow_the_compliance_rule():
    got = _rule().noise_multipliers()
    assert list(got) == list(SIGMAS)
    for c, s in SIGMAS.items():
        assert got[c] == pytest.approx(s, rel=1e-12)
    uni = _rule("uniform").noise_multipliers()
    assert all(v == pytest.approx(np.mean(list(SIGMAS.values())), rel=1e-12) for v in uni.values())
    with pytest.raises(ValueError, match="allocation"):
        _rule("proportional")


def test_client_level_clips_each_client_to_its_weight_under_one_noise_and_reports_eps_per_class():
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    grid = LocalGrid(_app(), P)
    nodes = sorted(grid.get_node_ids())
    ids = list(SIGMAS)  # node i trains partition i = profile i
    inner = fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P)
    dp = _rule().client_dp(inner, node_clients=dict(zip(nodes, ids, strict=True)), rounds=R, clip_norm=ZETA,
                           factorization="bisr:2", seed=3)  # fmt: skip
    s_min = SIGMAS["compliant-01"]
    ref = ClientLevelNoise(P, R, noise_multiplier=s_min, clip_norm=ZETA, delta=1e-5, factorization="bisr:2",
                           dim=9, seed=seeds.child_key(3, "fl-client-noise"))  # fmt: skip
    w = {k: np.zeros(s, dtype=np.float32) for k, s in SHAPES.items()}
    with server_identity():
        arrays = ArrayRecord({k: Array(v) for k, v in w.items()})
        agg, metrics = dp.aggregate_train(
            1, grid.send_and_receive(dp.configure_train(1, arrays, ConfigRecord({}), grid))
        )
    z = ref.next() / P
    off = 0
    for k in ("w", "b"):
        n = int(np.prod(SHAPES[k]))
        # client j's update (norm 5) clipped to ζ·σ_min/σ_j
        mean = np.mean(
            [_update(1, j)[k] * (ZETA * s_min / SIGMAS[c]) / 5.0 for j, c in enumerate(ids)], axis=0
        )
        np.testing.assert_allclose(agg[k].numpy(), mean + z[off : off + n].reshape(SHAPES[k]), atol=2e-6)
        off += n
    for c, s in SIGMAS.items():  # ε of a whole client of each class: R Gaussians at σ_k
        acc = pld_privacy_accountant.PLDAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(s), R)
        assert dp.privacy_of(c).epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)
        assert metrics[f"{EPSILON_KEY}:{c}"] == dp.privacy_of(c).epsilon
    assert (
        metrics[EPSILON_KEY]
        == dp.privacy_of("compliant-01").epsilon
        == max(dp.privacy_of(c).epsilon for c in ids)
    )


def test_record_level_trainer_runs_at_the_clients_sigma_and_its_epsilon_is_dp_accountings():
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from dpmf.federated.models import build_model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 1, 1, 4)).astype(np.float32), rng.integers(0, 2, 20)
    tr = _rule().record_trainer("lower-02", x, y, build_model((1, 1, 4), 2, hidden=4), clip_norm=1.0,
                                batch_size=5, rounds=2, local_steps=2, seed=1)  # fmt: skip
    assert tr.privacy.noise_multiplier == pytest.approx(SIGMAS["lower-02"], rel=1e-12)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)  # record mode's grid
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(5 / 20, dp_accounting.GaussianDpEvent(SIGMAS["lower-02"])), 4
    )
    assert tr.privacy.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    with pytest.raises(ValueError, match="noise_multiplier is invalid here"):
        _rule().record_trainer("lower-02", x, y, None, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="client_id='nowhere' is invalid"):
        _rule().record_trainer("nowhere", x, y, None)


def test_client_level_refuses_settings_the_rule_owns():
    inner = fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P)
    for bad in ({"noise_multiplier": 1.0}, {"num_clients": 4}, {"adaptive": object()}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} is invalid for a compliance-weighted"):
            _rule().client_dp(inner, node_clients={1: "lower-01"}, rounds=R, clip_norm=ZETA, **bad)
    with pytest.raises(ValueError, match="profile ids repeat"):
        _rule().client_dp(inner, node_clients={1: "lower-01", 2: "lower-01"}, rounds=R, clip_norm=ZETA)


def test_client_level_does_not_release_the_clients_metrics():
    # the compliance-weighted wrapper aggregates through CorrelatedClientDP: a client's training
    # loss (not privatized) must not reach the metrics next to its ε
    app = ClientApp()

    @app.train()
    def train(msg, context):
        j = int(context.node_config["partition-id"])
        metrics = MetricRecord({"num-examples": 5, "train-loss": [1.0, 2.0, 3.0, 1e6][j]})
        content = RecordDict({"arrays": msg.content["arrays"], "metrics": metrics})
        return Message(content=content, reply_to=msg)

    grid = LocalGrid(app, P)
    nodes = sorted(grid.get_node_ids())
    inner = fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P)
    node_clients = dict(zip(nodes, SIGMAS, strict=True))
    dp = _rule().client_dp(inner, node_clients=node_clients, rounds=R, clip_norm=ZETA, seed=3)
    with server_identity():
        arrays = ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})
        _, metrics = dp.aggregate_train(
            1, grid.send_and_receive(dp.configure_train(1, arrays, ConfigRecord({}), grid))
        )
    assert "train-loss" not in metrics and "num-examples" not in metrics
    assert {k for k in metrics if not k.startswith(EPSILON_KEY)} == {"dp-client-delta", "dp-client-clip-norm"}
    assert metrics[EPSILON_KEY] == dp.privacy_of("compliant-01").epsilon
