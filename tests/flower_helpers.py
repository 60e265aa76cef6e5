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


# client j's evaluation reply: accuracy and loss on its own records, and their count
EVAL_ACCURACY = (0.91, 0.62, 0.35)
EVAL_LOSS = (0.2, 0.9, 1.7)
EVAL_EXAMPLES = (10, 30, 60)


def evaluating_client_app(evaluated: list):
    """``client_app()`` whose client j also answers evaluation messages with its accuracy, loss and
    example count (``EVAL_*[j]``); ``evaluated`` gets the partition id of every client that
    evaluated."""
    app = client_app()

    @app.evaluate()
    def evaluate(msg, context):
        j = int(context.node_config["partition-id"])
        evaluated.append(j)
        metrics = MetricRecord(
            {"num-examples": EVAL_EXAMPLES[j], "eval-acc": EVAL_ACCURACY[j], "eval-loss": EVAL_LOSS[j]}
        )
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app
