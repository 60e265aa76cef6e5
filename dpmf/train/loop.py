"""The private training loop: sample → privatize → optimizer step, with epochs, metrics and
atomic checkpoints that resume bit-for-bit.

Each step t (0-based, T = epochs·steps_per_epoch in all):

1. the learning rate of every parameter group is set to its base rate η_g times χ_t;
2. ``DPStep.take``, the one step body of every loop in dpmf: the sampler gives the step's
   example indices (possibly none), drawn through the step's ``DrawnBatches``, which then
   accepts at step t only those indices, once; the ``Privatizer`` writes
   g̃_t = (Σ clip_ζ(g_i) + σζ·sens·(C⁻¹Z)_t)/B̄ into ``p.grad`` (with a ``lookahead``, e.g.
   DiSK's, g_i is the per-example combination of gradients at the points it names, clipped as
   one vector); the optimizer steps (post-processing);
3. if a weight became NaN/inf the step is undone and an error names it.

After every epoch: test loss and accuracy, ε spent so far, one CSV row, the PNG of the curves,
and a checkpoint (model, optimizer, sampler, noise stream, global RNG states, metrics: the run
state of ``dpmf.train.state``, the format ``make_private`` writes too) written atomically.
``resume=True`` continues from it and reaches the same final weights as an
uninterrupted run (everything random is either checkpointed or a function of (seed, step)).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dpmf._validation import check_int, check_real, check_vector
from dpmf.optim.clipping import trainable_parameters
from dpmf.optim.model_guard import check_state_unchanged, state_versions
from dpmf.train.data import Dataset
from dpmf.train.metrics import StepLog, batch_loss, plot_training_curves, write_metrics_csv
from dpmf.train.shards import remove_shards
from dpmf.train.state import (
    check_run_state,
    read_run_state,
    restore_run_state,
    run_state,
    set_rng_state,
    write_run_state,
)

__all__ = [
    "critical_section",
    "deliver_stop",
    "CHECKPOINT",
    "METRICS",
    "CURVES",
    "Trainer",
    "TrainOutcome",
    "evaluate",
    "NonFiniteWeightsError",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.csv"
CURVES = "curves.png"


class NonFiniteWeightsError(FloatingPointError):
    """An optimizer step produced NaN/inf weights; the step was undone."""


class _Deferred(threading.local):
    depth = 0
    pending: BaseException | None = None


_DEFERRED = _Deferred()


def deliver_stop(exc: BaseException) -> None:
    """Raise ``exc`` (a ``KeyboardInterrupt`` from a signal handler) now, or, inside a
    ``critical_section``, when it ends: a stop never falls between a checkpoint written and the
    epoch counted."""
    if _DEFERRED.depth:
        if _DEFERRED.pending is None:
            _DEFERRED.pending = exc
        return
    raise exc


@contextmanager
def critical_section():
    """Defer the stops handed to ``deliver_stop`` (the CLI's SIGINT/SIGTERM handlers) to the end
    of the block; a stop that arrived in it is raised when the block completes."""
    _DEFERRED.depth += 1
    try:
        yield
    except BaseException:
        if _DEFERRED.depth == 1:
            _DEFERRED.pending = None  # the block's own error is the one reported
        raise
    finally:
        _DEFERRED.depth -= 1
    if _DEFERRED.depth == 0 and _DEFERRED.pending is not None:
        exc, _DEFERRED.pending = _DEFERRED.pending, None
        raise exc


@dataclass
class TrainOutcome:
    """What a finished (or resumed-and-finished) run returns.

    Attributes:
        metrics: one dict per epoch (``METRIC_COLUMNS``).
        steps: steps taken (= the accountant's steps).
        empty_batches: how many of them had no example (noise-only updates).
        resumed_from_epoch: 0 for a fresh run, else the epoch of the checkpoint used.
    """

    metrics: list[dict] = field(default_factory=list)
    steps: int = 0
    empty_batches: int = 0
    resumed_from_epoch: int = 0


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, device
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y), in eval mode, no gradients.

    Returns:
        (loss, accuracy), accuracy in [0, 1].
    """
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, x.shape[0], batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        out = model(xb)
        total_loss += float(F.cross_entropy(out.float(), yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train(was_training)
    n = max(int(x.shape[0]), 1)
    return total_loss / n, correct / n


class Trainer:
    """Runs the private loop over prepared parts (``dpmf.train.run.train`` builds them from a
    ``TrainConfig``).

    Args:
        model: on ``device``.
        data: the in-memory ``Dataset`` (CPU tensors; batches are moved to ``device``).
        step: the run's ``dpmf.step.DPStep`` (``dpmf.step.build``): its sampler covers
            ``epochs·steps_per_epoch`` steps (in a run over several processes its batches are
            this rank's slices of each global batch), its privatizer (clip → sum → noise →
            divide) the same steps; each step of the loop is ``DPStep.take``.
        optimizer: any ``torch.optim.Optimizer`` over the trainable parameters, freshly built:
            each group's ``lr`` is taken as its base rate η_g. A DP optimizer is bound to the
            step here (``DPStep.bind``: it reads each step's fresh-noise std).
        lr_multipliers: χ, shape (T,), step t uses η_g·χ_t in group g.
        epochs: E ≥ 1.
        out_dir: folder for the checkpoint, metrics CSV and curves PNG.
        device: torch device of the model.
        run_identity: a dict that must match for a checkpoint to be resumed (the config).
        epsilon_at: ``epsilon_at(steps)`` → ε spent after that many steps (None: not reported
            per epoch; the final ε is ``final_epsilon``).
        final_epsilon: the run's ε, computed before training.
        delta: δ.
        eval_batch_size: test batch size.
        progress: show a tqdm bar on stderr.
        secrets: ``{"seed": key, "given": bool}``: the noise key the checkpoint must keep to
            resume but no other file may hold, saved under ``"secret"``.
        lookahead: an object whose ``points(model)`` gives each step's evaluation plan
            (``dpmf.optim.disk.DiskLookahead`` for the DiSK filter), called once per step
            before the gradients; its ``state_dict`` is checkpointed. None: gradients at θ_t.
        log_every: K ≥ 1: every K steps, the batch's training loss, clipped fraction and
            learning rate go to ``steps.csv`` (and TensorBoard where installed; see
            ``dpmf.train.metrics.StepLog``; not private). None: per-epoch metrics only.
        collectives: the ``dpmf.distributed.Collectives`` of a run over several processes
            (then the step's privatizer is a ``DistributedPrivatizer``): each rank handles its slice
            of every global batch, the checkpoint is one shard per rank and a manifest, and
            only rank 0 writes the metrics, curves and progress bar. None: one process.
        plan: the run's ``PrivatePlan.to_dict()``, kept in the checkpoint and compared on resume
            (None: neither).
        data_digest: ``dpmf.train.state.data_digest(data)``, kept and compared likewise.

    The checkpoint is ``dpmf.train.state``'s run state (the format ``make_private`` also writes).

    Raises:
        ValueError: inconsistent step counts or out-of-range numbers.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        data: Dataset,
        step,
        optimizer: torch.optim.Optimizer,
        lr_multipliers,
        epochs: int,
        out_dir: str,
        device,
        run_identity: dict,
        epsilon_at: Callable[[int], float] | None = None,
        final_epsilon: float | None = None,
        delta: float | None = None,
        eval_batch_size: int = 1024,
        progress: bool = True,
        title: str = "",
        lookahead=None,
        secrets: dict | None = None,
        log_every: int | None = None,
        collectives=None,
        plan: dict | None = None,
        data_digest: str | None = None,
    ):
        self.collectives = collectives
        self.writer = collectives is None or collectives.rank == 0
        self.model = model
        self.secrets = dict(secrets or {})
        self.log_every = None if log_every is None else check_int("log_every", log_every, minimum=1)
        self.step_log: StepLog | None = None
        self.lookahead = lookahead
        self.data = data
        self.step = step
        self.sampler = sampler = step.batches.sampler
        self.privatizer = step.privatizer
        self.optimizer = optimizer
        self.base_lrs = [
            check_real("lr", g["lr"], low=0.0, low_inclusive=False) for g in optimizer.param_groups
        ]
        self.epochs = check_int("epochs", epochs, minimum=1)
        self.total_steps = self.epochs * sampler.steps_per_epoch
        self.lr_multipliers = check_vector(
            "lr_multipliers", lr_multipliers, length=self.total_steps, positive=True
        )
        if sampler.steps != self.total_steps:
            raise ValueError(
                f"sampler.steps={sampler.steps} is invalid: the run has {self.total_steps} steps"
            )
        step.bind(optimizer)
        self.out_dir = out_dir
        self.device = torch.device(device)
        self.run_identity = dict(run_identity)
        self.plan = plan
        self.data_digest = data_digest
        self.epsilon_at = epsilon_at
        self.final_epsilon = final_epsilon
        self.delta = delta
        self.eval_batch_size = check_int("eval_batch_size", eval_batch_size, minimum=1)
        self.progress = bool(progress) and self.writer
        self.title = title
        self.outcome = TrainOutcome()

    # -- paths ------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.out_dir, CHECKPOINT)

    # -- checkpoint -------------------------------------------------------------------------
    def _state(self, epoch: int) -> dict:
        return run_state(
            door="train",
            plan=self.plan,
            privatizer=self.privatizer,
            model=self.model,
            optimizer=self.optimizer,
            key=self.secrets.get("seed"),
            given=self.secrets.get("given", False),
            run_identity=self.run_identity,
            data=self.data_digest,
            epoch=epoch,
            metrics=self.outcome.metrics,
            empty_batches=self.outcome.empty_batches,
            lookahead=self.lookahead,
        )

    def _restore(self, state: dict) -> int:
        where = f"checkpoint {self.checkpoint_path!r}"
        check_run_state(
            state,
            where,
            door="train",
            plan=self.plan,
            run_identity=self.run_identity,
            data=self.data_digest,
            model=self.model,
        )
        if self.lookahead is not None and state.get("lookahead") is None:
            raise ValueError(f"{where} has no lookahead state")
        restore_run_state(
            state,
            model=self.model,
            optimizer=self.optimizer,
            sampler=self.sampler,
            privatizer=self.privatizer,
            where=where,
        )
        if self.lookahead is not None:
            self.lookahead.load_state_dict(state["lookahead"])
        set_rng_state(state["rng"])
        self.outcome.metrics = list(state["metrics"])
        self.outcome.empty_batches = int(state["empty_batches"])
        return int(state["epoch"])

    # -- one step -----------------------------------------------------------------------------
    def _step(self, t: int) -> int:
        chi = float(self.lr_multipliers[t])
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * chi
        lr = self.base_lrs[0] * chi
        points = None if self.lookahead is None else self.lookahead.points(self.model)
        batch = {}

        def rows(idx):  # this rank's slice of the global batch in a distributed run
            ids = torch.from_numpy(idx)
            batch["x"] = self.data.train_x[ids].to(self.device, non_blocking=True)
            batch["y"] = self.data.train_y[ids].to(self.device, non_blocking=True)
            return batch["x"], batch["y"], idx

        def log(info):
            if self.step_log is not None and self.step_log.due(t + 1):  # weights still θ_t here
                x, y = batch["x"], batch["y"]
                before = state_versions(self.model)
                loss = batch_loss(self.model, x, y)
                check_state_unchanged(self.model, before, "the logged loss's forward pass", t)
                epoch = t // self.sampler.steps_per_epoch + 1
                self.step_log.record(t + 1, epoch, loss, info.clipped_fraction, lr)

        params = [p for _, p in trainable_parameters(self.model)]
        before = [p.detach().clone() for p in params]
        info = self.step.take(self.optimizer, rows, points=points, before_update=log)
        if not all(bool(torch.isfinite(p).all()) for p in params):
            with torch.no_grad():
                for p, b in zip(params, before, strict=True):
                    p.copy_(b)
            raise NonFiniteWeightsError(
                f"the optimizer step at step {t} (epoch {t // self.sampler.steps_per_epoch + 1}) made "
                f"weights NaN/inf (lr={lr:g}); the step was undone. Lower the learning rate."
            )
        return int(info.batch_size)  # the global batch's size (summed over the ranks)

    # -- the run ------------------------------------------------------------------------------
    def run(
        self,
        *,
        resume: bool = False,
        on_epoch_end: Sequence[Callable[[int, dict], None]] = (),
    ) -> TrainOutcome:
        """Train for the remaining epochs.

        Args:
            resume: continue from ``out_dir/checkpoint.pt`` if it exists (a fresh start
                otherwise). Without it, an existing checkpoint is refused.
            on_epoch_end: callables ``f(epoch, row)`` run after each epoch's checkpoint.

        Returns:
            ``TrainOutcome``.

        Raises:
            ValueError: a checkpoint exists and ``resume`` is False, or it belongs to another run.
            NonFiniteGradientError, NonFiniteWeightsError: numerical failure at a named step.
        """
        from tqdm import tqdm

        os.makedirs(self.out_dir, exist_ok=True)
        start_epoch = 0
        if os.path.exists(self.checkpoint_path):
            if not resume:
                raise ValueError(
                    f"out_dir={self.out_dir!r} is invalid: it holds a checkpoint of an earlier run; "
                    "pass --resume to continue it or choose another --out"
                )
            state = read_run_state(self.checkpoint_path)
            start_epoch = self._restore(state)
            if self.outcome.metrics and self.writer:  # the files agree with the checkpoint
                write_metrics_csv(os.path.join(self.out_dir, METRICS), self.outcome.metrics)
            self.outcome.resumed_from_epoch = start_epoch
        if self.collectives is not None:
            self.privatizer.verify()  # seed, step and weights agree on every rank
        if self.log_every is not None and self.writer:
            self.step_log = StepLog(self.out_dir, self.log_every, start_step=self.sampler.step)
        self.model.train()
        spe = self.sampler.steps_per_epoch
        bar = tqdm(
            total=self.total_steps,
            initial=start_epoch * spe,
            disable=not self.progress,
            file=sys.stderr,
            unit="step",
            dynamic_ncols=True,
        )
        try:
            for epoch in range(start_epoch, self.epochs):
                began = time.perf_counter()
                for t in range(epoch * spe, (epoch + 1) * spe):
                    if self._step(t) == 0:
                        self.outcome.empty_batches += 1
                    bar.update(1)
                row = self._end_epoch(epoch + 1, time.perf_counter() - began)
                bar.set_postfix(acc=f"{row['test_accuracy']:.4f}", eps=_fmt_eps(row["epsilon"]))
                for callback in on_epoch_end:
                    callback(epoch + 1, row)
        finally:
            bar.close()
            if self.step_log is not None:
                self.step_log.close()
        self.outcome.steps = self.sampler.step
        return self.outcome

    def _end_epoch(self, epoch: int, seconds: float) -> dict:
        loss, acc = evaluate(
            self.model,
            self.data.test_x,
            self.data.test_y,
            batch_size=self.eval_batch_size,
            device=self.device,
        )
        steps = self.sampler.step
        if steps == self.total_steps and self.final_epsilon is not None:
            eps = self.final_epsilon
        elif self.epsilon_at is not None:
            eps = float(self.epsilon_at(steps))
        else:
            eps = None
        row = {
            "epoch": epoch,
            "step": steps,
            "test_loss": loss,
            "test_accuracy": acc,
            "epsilon": eps,
            "delta": self.delta,
            "lr": self.base_lrs[0] * float(self.lr_multipliers[steps - 1]),
            "seconds": round(seconds, 3),
        }
        if self.step_log is not None:  # steps.csv is trimmed to the checkpoint on resume
            self.step_log.flush()
        # the checkpoint before metrics.csv: after a kill between the writes, metrics.csv is never
        # ahead of it; the epoch counts (outcome.metrics, hence results.json) only once its
        # checkpoint is on disk, so a failed write (disk full) leaves every file at the last one
        state = self._state(epoch)
        state["metrics"].append(row)
        with critical_section():  # a SIGTERM here stops after the epoch is counted
            write_run_state(self.checkpoint_path, state, self.privatizer, self.collectives)
            if self.collectives is None:
                remove_shards(self.checkpoint_path)  # those of a distributed run this one resumed
            self.outcome.metrics.append(row)
        if not self.writer:
            return row
        write_metrics_csv(os.path.join(self.out_dir, METRICS), self.outcome.metrics)
        plot_training_curves(os.path.join(self.out_dir, CURVES), self.outcome.metrics, title=self.title)
        return row


def _fmt_eps(eps) -> str:
    return "-" if eps is None else f"{eps:.3g}"
