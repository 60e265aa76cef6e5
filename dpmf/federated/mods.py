"""Record-level DP in a user's own Flower ClientApp: ``RecordDPTrainer``.

Flower's ``LocalDpMod`` adds noise to a client's *update* after its training (a mod sees only
messages). Record-level DP (one record of the client's data) needs per-example clipping and
noise *inside* every local step, which a mod cannot reach; so dpmf's building block is the
train handler itself: a ``RecordDPTrainer`` owns the client's private run for the whole
federation (``dpmf.federated.local.PrivateLocalRun``: R·L steps of DP-SGD, DP-Adam or DP-Muon,
any batch-sampling scheme and noise strategy, accounted as ``dpmf epsilon`` does, PLD on a
1e-3 grid: ``local.record_privacy``) and answers Flower train messages:

    trainer = RecordDPTrainer(x, y, model, noise_multiplier=1.1, clip_norm=1.0, batch_size=32,
                              rounds=50, local_steps=5)
    app = ClientApp()

    @app.train()
    def train(msg, context):
        return trainer.train(msg, context)

Each reply carries the client's arrays (ArrayRecord ``arrays``) and a MetricRecord with weight
1 (a record count is a statistic of the protected data) and ``dp-record-epsilon`` /
``dp-record-delta``: (ε, δ) of the whole run for the unit *one record of this client*. The
steps taken are kept in ``context.state`` (``dpmf-record``); a node whose private run is not in
this process (a fresh process) is refused rather than restarted, since a restart would replay
the noise. The noise key is secret (drawn from the operating system) unless a seed is given.

Evaluation: the trainer answers train messages only, and ε covers only what they carry. An
``evaluate`` handler that scores the global model on the same ``x, y`` releases the accuracy and
loss of the protected records with no noise (and Flower's strategies ask every node for it by
default, ``fraction_evaluate=1.0``): evaluate on records the trainer never sees, on the server
(``Strategy.start(..., evaluate_fn=...)``), or set ``fraction_evaluate=0``.
"""

from __future__ import annotations

import numpy as np

from dpmf import seeds
from dpmf._validation import check_int

__all__ = ["RecordDPTrainer", "EPSILON_KEY", "DELTA_KEY"]

EPSILON_KEY = "dp-record-epsilon"
DELTA_KEY = "dp-record-delta"


class RecordDPTrainer:
    """A client's private local training across all rounds, as a Flower train handler.

    Args:
        x, y: the client's records, (N, C, H, W) or (N, d) float32 and (N,) int64.
        model: the client's torch model (its weights are replaced by the global ones each round).
        noise_multiplier: σ > 0; clip_norm: per-example clip norm ζ > 0.
        batch_size: expected batch size B in [1, N].
        rounds, local_steps: R and L; the run has n = R·L private steps.
        delta: δ of the reported ε.
        optimizer: ``dp-sgd`` (default), ``dp-adam``, ``dp-muon``, …; lr: its learning rate.
        scheme, factorization, accountant: as ``dpmf epsilon``.
        seed: None (default): a secret key; an int: the key itself (reproducible).

    Raises:
        ValueError/TypeError: invalid settings (before any training), e.g. B > N.
    """

    def __init__(
        self,
        x,
        y,
        model,
        *,
        noise_multiplier: float,
        clip_norm: float,
        batch_size: int,
        rounds: int,
        local_steps: int,
        delta: float = 1e-5,
        optimizer: str = "dp-sgd",
        lr: float = 0.1,
        scheme: str | None = None,
        factorization: str = "identity",
        accountant: str | None = None,
        seed: int | None = None,
    ):
        from dpmf.federated.local import PrivateLocalRun
        from dpmf.plan.schemes import Poisson

        n = int(np.asarray(y).shape[0])
        check_int("batch_size", batch_size, minimum=1, maximum=n)
        self.local_steps = check_int("local_steps", local_steps, minimum=1)
        check_int("rounds", rounds, minimum=1)
        policy = seeds.SeedPolicy.of(seed)  # secret unless given; never stored or shown
        self.run = PrivateLocalRun(
            np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64), model,
            noise_multiplier=noise_multiplier, clip_norm=clip_norm, batch_size=batch_size,
            steps=rounds * self.local_steps, delta=delta, scheme=scheme or Poisson.name,
            factorization=factorization, accountant=accountant, optimizer=optimizer, lr=lr,
            seed=seeds.child_key(policy.key, "fl-record", 0),
        )  # fmt: skip
        self.delta = float(delta)

    @property
    def privacy(self):
        """The run's ``PrivacyResult``: ε of R·L steps for one record of this client."""
        return self.run.privacy

    def train(self, msg, context):
        """Answer a Flower train message: L private steps from the global arrays.

        Raises:
            RuntimeError: the private run's steps in ``context.state`` differ from this process's
                (its noise cannot be continued without replaying it), or the run is used up.
        """
        from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

        state = context.state.config_records.get("dpmf-record")
        taken = int(state["steps-taken"]) if state is not None else 0
        if taken != self.run.steps_taken:
            raise RuntimeError(
                f"the private run took {taken} steps in another process and {self.run.steps_taken} here: "
                "it cannot continue without replaying its noise (keep one process per node)"
            )
        arrays = next(iter(msg.content.array_records.values()))
        cfg = msg.content.config_records.get("config")
        mu = float(cfg.get("proximal-mu", 0.0)) if cfg is not None else 0.0
        steps = int(cfg.get("local-steps", self.local_steps)) if cfg is not None else self.local_steps
        new, _ = self.run.train_round({k: a.numpy() for k, a in arrays.items()}, steps, mu)
        context.state["dpmf-record"] = ConfigRecord({"steps-taken": self.run.steps_taken})
        metrics = MetricRecord(
            {"num-examples": 1, EPSILON_KEY: float(self.privacy.epsilon), DELTA_KEY: self.delta}
        )
        content = RecordDict(
            {"arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in new.items()}), "metrics": metrics}
        )
        return Message(content=content, reply_to=msg)
