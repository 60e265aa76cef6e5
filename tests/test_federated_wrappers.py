"""``CorrelatedClientDP`` with Flower's own classes: its aggregate is FedAvg's aggregate of the
clipped updates plus the plan's noise for a fixed key, ε against dp-accounting, refusals, and
Flower's own ``Strategy.start`` loop."""

import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from flower_helpers import SHAPES, P  # noqa: E402
from flower_helpers import client_app as _app  # noqa: E402
from flower_helpers import fedavg as _strategy  # noqa: E402
from flower_helpers import updates as _updates  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import strategy as fs  # noqa: E402

from dpmf import seeds  # noqa: E402
from dpmf.federated.grid import LocalGrid, server_identity  # noqa: E402
from dpmf.federated.local import ClientLevelNoise  # noqa: E402
from dpmf.federated.wrappers import DELTA_KEY, EPSILON_KEY, CorrelatedClientDP  # noqa: E402

R, SIGMA, ZETA = 4, 1.5, 0.5


def test_aggregate_is_fedavg_of_clipped_updates_plus_the_plans_noise():
    dp = CorrelatedClientDP(_strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=ZETA,
                            factorization="bisr:2", seed=7)  # fmt: skip
    grid = LocalGrid(_app(), P)
    w0 = {k: np.zeros(s, dtype=np.float32) for k, s in SHAPES.items()}
    ref_noise = ClientLevelNoise(P, R, noise_multiplier=SIGMA, clip_norm=ZETA, delta=1e-5,
                                 factorization="bisr:2", dim=9,
                                 seed=seeds.child_key(7, "fl-client-noise"))  # fmt: skip
    w = w0
    with server_identity():
        for r in (1, 2):
            arrays = ArrayRecord({k: Array(v) for k, v in w.items()})
            msgs = dp.configure_train(r, arrays, ConfigRecord({}), grid)
            agg, metrics = dp.aggregate_train(r, grid.send_and_receive(msgs))
            clipped = [{k: u[k] * min(1.0, ZETA / math.sqrt(sum(float(np.sum(x * x)) for x in u.values())))
                        for k in u} for u in _updates(r)]  # fmt: skip
            z = ref_noise.next() / P
            off = 0
            for k in ("w", "b"):  # the model's flattening order
                n = int(np.prod(SHAPES[k]))
                want = w[k] + np.mean([c[k] for c in clipped], axis=0) + z[off : off + n].reshape(SHAPES[k])
                off += n
                np.testing.assert_allclose(agg[k].numpy(), want, atol=2e-6)  # equal weights, not 10/20/30
            w = {k: a.numpy() for k, a in agg.items()}
            assert metrics[EPSILON_KEY] == dp.privacy.epsilon and metrics[DELTA_KEY] == 1e-5
    assert dp.privacy.epsilon == ref_noise.privacy.epsilon


def test_identity_epsilon_is_r_gaussians_by_dp_accounting():
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    dp = CorrelatedClientDP(_strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=ZETA)
    dp._build(9)
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(SIGMA), R)
    assert dp.privacy.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)


@pytest.mark.parametrize("cls", [fs.FedMedian, fs.FedTrimmedAvg])
def test_a_median_or_trimmed_mean_is_refused_with_the_reason(cls):
    with pytest.raises(ValueError, match="sensitivity of a mean"):
        CorrelatedClientDP(cls(), num_clients=P, rounds=R, noise_multiplier=1.0, clip_norm=1.0)


def test_runs_in_flowers_own_loop_with_fedadam_and_reports_epsilon():
    inner = fs.FedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P)
    dp = CorrelatedClientDP(
        inner, num_clients=P, rounds=2, noise_multiplier=SIGMA, clip_norm=ZETA, factorization="bsr:2"
    )  # fmt: skip  (a secret key)
    grid = LocalGrid(_app(), P)
    with server_identity():
        result = dp.start(grid, ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in SHAPES.items()}),
                          num_rounds=2)  # fmt: skip
    eps = {r: m[EPSILON_KEY] for r, m in result.train_metrics_clientapp.items()}
    assert set(eps) == {1, 2} and eps[1] == eps[2] == dp.privacy.epsilon > 0
    assert "seed" not in repr(dp) and str(dp._policy.key) not in repr(dp)


def test_a_non_finite_client_update_is_refused_not_passed_unclipped():
    # min(1, ζ/nan) is 1: without the check a NaN update's finite coordinates would go through
    # unclipped (and the model would become NaN)
    from dpmf.federated.clip import update_scale

    assert update_scale(5.0, ZETA, 1) == pytest.approx(ZETA / 5.0) and update_scale(0.0, ZETA, 1) == 1.0
    for bad in (math.nan, math.inf):
        with pytest.raises(RuntimeError, match="round 3: a client update is not finite"):
            update_scale(bad, ZETA, 3)

    dp = CorrelatedClientDP(_strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=ZETA,
                            seed=7)  # fmt: skip
    app = ClientApp()

    @app.train()
    def train(msg, context):
        w = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        w["w"] = w["w"] + np.float32(np.nan) * (int(context.node_config["partition-id"]) == 0)
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in w.items()}),
                              "metrics": MetricRecord({"num-examples": 10})})  # fmt: skip
        return Message(content=content, reply_to=msg)

    grid = LocalGrid(app, P)
    arrays = ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})
    with server_identity():
        msgs = dp.configure_train(1, arrays, ConfigRecord({}), grid)
        with pytest.raises(RuntimeError, match="round 1: a client update is not finite"):
            dp.aggregate_train(1, grid.send_and_receive(msgs))


def _reply_app(reply):
    """A ClientApp whose client j answers ``reply(j, w)`` → (arrays, metrics)."""
    app = ClientApp()

    @app.train()
    def train(msg, context):
        j = int(context.node_config["partition-id"])
        arrays, metrics = reply(j, {k: a.numpy() for k, a in msg.content["arrays"].items()})
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                              "metrics": MetricRecord(metrics)})  # fmt: skip
        return Message(content=content, reply_to=msg)

    return app


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda w: {"w": w["w"]}, r"missing arrays \['b'\]"),
        (lambda w: {**w, "x": np.zeros(2, np.float32)}, r"extra arrays \['x'\]"),
        (lambda w: {"w": w["w"].reshape(3, 2), "b": w["b"]}, r"shapes 'w' \(3, 2\) instead of \(2, 3\)"),
    ],
)
def test_a_reply_with_other_arrays_is_refused_naming_its_node_before_any_noise(change, what):
    dp = CorrelatedClientDP(
        _strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=ZETA, seed=7
    )
    app = _reply_app(lambda j, w: (change(w) if j == 1 else w, {"num-examples": 10}))
    grid = LocalGrid(app, P)
    node = sorted(grid.get_node_ids())[1]  # partition 1
    arrays = ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})
    with server_identity():
        msgs = dp.configure_train(1, arrays, ConfigRecord({}), grid)
        with pytest.raises(
            ValueError, match=rf"round 1: the reply of node {node} is invalid: .*{what}"
        ) as err:
            dp.aggregate_train(1, grid.send_and_receive(msgs))
    assert "\n" not in str(err.value)
    assert dp._noise is None and dp._round == 0  # refused before the round's noise was drawn


def test_client_metrics_are_not_passed_to_the_strategys_metrics_aggregation():
    # a custom train_metrics_aggr_fn sees what the wrapped strategy would release: only the weight
    seen = []

    def aggr(contents, weight_key):
        seen.extend(dict(next(iter(c.metric_records.values()))) for c in contents)
        return MetricRecord({})

    inner = fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P,
                      train_metrics_aggr_fn=aggr)  # fmt: skip
    dp = CorrelatedClientDP(inner, num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=ZETA, seed=7)
    app = _reply_app(lambda j, w: (w, {"num-examples": 10 * (j + 1), "train-loss": 1.5 * j, "acc": 0.5}))
    arrays = ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})
    grid = LocalGrid(app, P)
    with server_identity():
        _, metrics = dp.aggregate_train(
            1, grid.send_and_receive(dp.configure_train(1, arrays, ConfigRecord({}), grid))
        )
    assert seen == [{"num-examples": 1}] * P
    assert set(metrics) == {EPSILON_KEY, DELTA_KEY, "dp-client-clip-norm"}


# -- federated: CorrelatedClientDP releases no client metric without noise -----------------------------
def _flower_app(reply):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg, context):
        j = int(context.node_config["partition-id"])
        w = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        arrays, metrics = reply(j, w)
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                              "metrics": MetricRecord(metrics)})  # fmt: skip
        return Message(content=content, reply_to=msg)

    return app


def _one_round(dp, app, clients):
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from dpmf.federated.grid import LocalGrid, server_identity

    grid = LocalGrid(app, clients)
    shapes = {"w": (2, 3), "b": (3,)}
    with server_identity():
        arrays = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in shapes.items()})
        return dp.aggregate_train(
            1, grid.send_and_receive(dp.configure_train(1, arrays, ConfigRecord({}), grid))
        )


def _fedavg(p):
    from flwr.serverapp import strategy as fs

    return fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=p, min_available_nodes=p)


# aggregate_train does not pass the clients' MetricRecords to the wrapped FedAvg, which would return
# their (weighted) mean next to dp-client-epsilon: a client statistic (here a training loss, one
# client's 1e6 sets it alone) released with no clipping or noise, outside the reported ε.
@pytest.mark.torch
def test_client_level_wrapper_does_not_release_the_clients_metrics_without_noise():
    pytest.importorskip("flwr")
    from dpmf.federated.wrappers import EPSILON_KEY, CorrelatedClientDP

    losses = [3.25, 7.5, 1e6]
    app = _flower_app(lambda j, w: (w, {"num-examples": 10, "train-loss": losses[j]}))
    dp = CorrelatedClientDP(_fedavg(3), num_clients=3, rounds=2, noise_multiplier=1.0, clip_norm=0.5)
    _, metrics = _one_round(dp, app, 3)
    assert EPSILON_KEY in metrics
    assert "train-loss" not in metrics, f"released without noise: train-loss={metrics['train-loss']}"


# The noise follows the global model's keys, not the order of each reply's own ArrayRecord keys
# (noise[off:off+size] in that order): a client that sends its arrays in another key order (its
# right: an ArrayRecord is a mapping) would get other noise coordinates on each array than the
# others, so the mean's noise would be an average of different slices: here 0.61× the norm of the
# plan's noise (less private than the ε reported).
@pytest.mark.torch
def test_client_level_noise_does_not_depend_on_a_replys_key_order():
    pytest.importorskip("flwr")
    import numpy as np

    from dpmf import seeds
    from dpmf.federated.local import ClientLevelNoise
    from dpmf.federated.wrappers import CorrelatedClientDP

    def reply(j, w):  # no update; client 0 lists its arrays in reverse order
        keys = list(w)[::-1] if j == 0 else list(w)
        return {k: w[k].copy() for k in keys}, {"num-examples": 10}

    dp = CorrelatedClientDP(_fedavg(3), num_clients=3, rounds=2, noise_multiplier=1.0, clip_norm=0.5, seed=7)
    agg, _ = _one_round(dp, _flower_app(reply), 3)
    ref = ClientLevelNoise(3, 2, noise_multiplier=1.0, clip_norm=0.5, delta=1e-5, factorization="identity",
                           dim=9, seed=seeds.child_key(7, "fl-client-noise"))  # fmt: skip
    want = ref.next() / 3
    got = np.concatenate([agg["w"].numpy().ravel(), agg["b"].numpy().ravel()])
    np.testing.assert_allclose(got, want, atol=1e-6)
