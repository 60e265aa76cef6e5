"""Federated evaluation on held-out splits of the clients' records.

With ``FLConfig.eval_fraction`` = f > 0, each client's partition is split once (a seeded
permutation of the public seed): ⌈f·N_k⌉ records are held out for evaluation (at least one
record stays for training), and every round, after the aggregation, each participant
evaluates the global model on its held-out records (Flower's ``configure_evaluate`` /
``aggregate_evaluate``: the mean weighted by the held-out counts). The round's
``federated_accuracy`` and ``federated_loss`` appear beside the central ``test_accuracy``.

Privacy: the held-out records never enter training, so no ε of the ledger covers them; the
evaluation metrics are non-private statistics of those records. It is opt-in: with the default
``eval_fraction = 0`` no evaluation message is sent and a client asked to evaluate refuses
(``EVALUATION_OFF``: it never evaluates on its training records, whose statistics would leak
outside their ε); with f > 0 the run logs ``EVAL_NOTE`` once and every ledger entry's note
carries it (``dpmf fl``, the Flower app and ``dpmf fl --backend ray`` alike). In ``record`` mode
N_k (and ε_k) is that of the training part.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

__all__ = ["split_held_out", "EVAL_NOTE", "EVALUATION_OFF"]

EVAL_NOTE = (
    "federated evaluation releases each participant's accuracy and loss on its held-out records "
    "every round: statistics of records that no ε here covers"
)
EVALUATION_OFF = (
    "federated evaluation is off in this run (eval_fraction = 0): a client evaluates on held-out "
    "records only, never on the records it trains on; set eval_fraction > 0 (dpmf fl "
    "--eval-fraction, run config eval-fraction)"
)


def split_held_out(data, fraction: float, seed: int):
    """``data`` with each client's records split into training and held-out parts.

    Returns:
        a ``FederatedData`` whose ``client_x``/``client_y`` are the training parts and whose
        ``eval_x``/``eval_y`` are the held-out parts (⌈fraction·N_k⌉ records, at most N_k − 1).

    Raises:
        ValueError: a client with a single record (nothing to hold out).
    """
    xs, ys, ex, ey = [], [], [], []
    for k, (x, y) in enumerate(zip(data.client_x, data.client_y, strict=True)):
        n = int(y.shape[0])
        if n < 2:
            raise ValueError(
                f"eval_fraction={fraction} is invalid: client {k} holds {n} record(s), none to hold out; "
                "use fewer clients or eval_fraction=0"
            )
        m = min(n - 1, max(1, math.ceil(fraction * n)))
        perm = np.random.default_rng([seed, 17, k]).permutation(n)
        ev, tr = np.sort(perm[:m]), np.sort(perm[m:])
        xs.append(x[tr])
        ys.append(y[tr])
        ex.append(x[ev])
        ey.append(y[ev])
    return replace(data, client_x=tuple(xs), client_y=tuple(ys), eval_x=tuple(ex), eval_y=tuple(ey))
