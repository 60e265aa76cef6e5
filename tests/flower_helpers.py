"""A three-client Flower federation for the strategy-wrapper tests: client j adds a fixed update
of norm 0.1, 1 or 5 to the weights it receives (no training), so every aggregate can be written
out by hand."""

import math

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import strategy as fs

P = 3  # clients
SHAPES = {"w": (2, 3), "b": (3,)}


def updates(r):
    """Client j's update in round r: norms 0.1, 1 and 5."""
    out = []
    for j, norm in enumerate((0.1, 1.0, 5.0)):
        rng = np.random.default_rng([r, j])
        u = {k: rng.normal(size=s) for k, s in SHAPES.items()}
        n = math.sqrt(sum(float(np.sum(v * v)) for v in u.values()))
        out.append({k: v * norm / n for k, v in u.items()})
    return out


def client_app():
    """The ClientApp whose client j (``partition-id``) replies w + updates(r)[j] with j+1 tens of examples."""
    app = ClientApp()

    @app.train()
    def train(msg, context):
        j = int(context.node_config["partition-id"])
        r = int(msg.content["config"]["server-round"])
        w = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        new = {k: (w[k] + updates(r)[j][k]).astype(np.float32) for k in w}
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                              "metrics": MetricRecord({"num-examples": 10 * (j + 1)})})  # fmt: skip
        return Message(content=content, reply_to=msg)

    return app


def fedavg():
    """FedAvg over all P clients, no evaluation."""
    return fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P)
