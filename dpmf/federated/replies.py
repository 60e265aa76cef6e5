"""Client replies as the client-level noise needs them: every update in the global model's key
order (``reply_updates``) and only the weighting metric (``keep_weight_only``).

One rule for ``dpmf fl --privacy client`` and ``CorrelatedClientDP``. The noise ν of a round is
one flat vector over the model; coordinate i must fall on the same entry of the same array in
every reply, or the mean of the replies averages different slices of ν and its noise is smaller
than the plan's (an ArrayRecord is a mapping: a client may list its arrays in any order). So
every reply is flattened in the order of the global arrays the server sent, and a reply with
other keys or shapes is refused before any noise is drawn.
"""

from __future__ import annotations

import numpy as np

__all__ = ["keep_weight_only", "reply_updates"]


def _who(msg) -> str:
    try:
        return f"node {int(msg.metadata.src_node_id)}"
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - a reply always has one
        return "a client"


def reply_updates(msg, record_key: str | None, base: dict, server_round: int) -> dict[str, np.ndarray]:
    """The update w_k − w of reply ``msg`` (float64), keyed and ordered as ``base``.

    Args:
        msg: a Flower reply ``Message``.
        record_key: the name of its ArrayRecord (None: its only one).
        base: the global arrays w sent in that round (name → float64 array), in their order.
        server_round: the round (for the message).

    Raises:
        ValueError: the reply has no such ArrayRecord, or its arrays' names or shapes differ from
            the global model's (one line naming the node and what differs).
    """
    records = msg.content.array_records
    if record_key is None:
        record_key = next(iter(records), None)
    if record_key not in records:
        raise ValueError(
            f"round {server_round}: the reply of {_who(msg)} is invalid: it has no ArrayRecord "
            f"{record_key!r} (it has {list(records)}); a client must return the global model's arrays"
        )
    got = {k: a.numpy() for k, a in records[record_key].items()}
    missing = [k for k in base if k not in got]
    extra = [k for k in got if k not in base]
    shapes = [
        f"{k!r} {tuple(got[k].shape)} instead of {tuple(base[k].shape)}"
        for k in base
        if k in got and tuple(got[k].shape) != tuple(base[k].shape)
    ]
    if missing or extra or shapes:
        what = "; ".join(
            s
            for s in (
                f"missing arrays {missing}" if missing else "",
                f"extra arrays {extra}" if extra else "",
                f"shapes {', '.join(shapes)}" if shapes else "",
            )
            if s
        )
        raise ValueError(
            f"round {server_round}: the reply of {_who(msg)} is invalid: its arrays differ from the global "
            f"model's ({what}); a client must return every array of the global model with its shape"
        )
    return {k: np.asarray(got[k], dtype=np.float64) - w for k, w in base.items()}


def keep_weight_only(msg, weight_key: str) -> None:
    """Replace every MetricRecord of reply ``msg`` by one holding only ``weight_key`` = 1.

    The clients' other metrics (a training loss, a record count) are statistics of their data
    that no noise covers: a strategy would release their mean outside the reported ε, so they
    are dropped here before the strategy aggregates.
    """
    from flwr.app import MetricRecord

    names = list(msg.content.metric_records) or ["metrics"]
    for name in names:
        msg.content[name] = MetricRecord({weight_key: 1})
