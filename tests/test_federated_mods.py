"""``RecordDPTrainer`` in a user's own ClientApp: its reply equals dpmf's private local run
(the same steps for the same key), ε equals ``dpmf epsilon``'s computation, the context state
guard, and B > N refused."""

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402

from dpmf import seeds  # noqa: E402
from dpmf.federated.grid import server_identity  # noqa: E402
from dpmf.federated.local import PrivateLocalRun, record_privacy  # noqa: E402
from dpmf.federated.models import build_model, get_weights  # noqa: E402
from dpmf.federated.mods import EPSILON_KEY, RecordDPTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 1, 1, 6)).astype(np.float32), rng.integers(0, 2, size=n).astype(np.int64)


def _msg(weights):
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in weights.items()}),
                          "config": ConfigRecord({"local-steps": 2, "server-round": 1})})  # fmt: skip
    with server_identity():  # a message as a ServerApp builds it
        msg = Message(content, 1, "train", group_id="1")
    msg.metadata.__dict__["_message_id"] = "m1"
    return msg


def test_the_reply_is_the_private_local_run_and_epsilon_is_dpmf_epsilons():
    x, y = _data()
    kw = dict(noise_multiplier=1.5, clip_norm=1.0, batch_size=8, delta=1e-5)
    trainer = RecordDPTrainer(x, y, build_model((1, 1, 6), 2, hidden=8, seed=0), rounds=3, local_steps=2,
                              seed=5, **kw)  # fmt: skip
    ref = PrivateLocalRun(x, y, build_model((1, 1, 6), 2, hidden=8, seed=0), steps=6, lr=0.1,
                          seed=seeds.child_key(5, "fl-record", 0), **kw)  # fmt: skip
    w0 = get_weights(build_model((1, 1, 6), 2, hidden=8, seed=1))
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    reply = trainer.train(_msg(w0), ctx)
    want, _ = ref.train_round(w0, 2)
    for k, v in want.items():
        np.testing.assert_array_equal(reply.content["arrays"][k].numpy(), v)
    eps = record_privacy(1.5, dataset_size=40, batch_size=8, steps=6, delta=1e-5).epsilon
    assert reply.content["metrics"][EPSILON_KEY] == eps and reply.content["metrics"]["num-examples"] == 1
    assert int(ctx.state["dpmf-record"]["steps-taken"]) == 2
    fresh = RecordDPTrainer(x, y, build_model((1, 1, 6), 2, hidden=8, seed=0), rounds=3, local_steps=2, **kw)
    with pytest.raises(RuntimeError, match="replaying its noise"):
        fresh.train(_msg(w0), ctx)  # the node's run took 2 steps elsewhere


def test_a_batch_above_the_records_is_refused():
    x, y = _data(10)
    with pytest.raises(ValueError, match="batch_size"):
        RecordDPTrainer(x, y, build_model((1, 1, 6), 2, hidden=8, seed=0), noise_multiplier=1.0,
                        clip_norm=1.0, batch_size=11, rounds=1, local_steps=1)  # fmt: skip
