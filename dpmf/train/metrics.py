"""Metrics of a run: per epoch, a CSV table and a PNG of the curves (both written atomically);
per step, optionally, ``steps.csv`` and TensorBoard event files (``StepLog``).

Privacy of the per-step figures. The training loss and the fraction of clipped examples are
computed from the private batches without noise: they are not covered by the run's (ε, δ)
guarantee. Keep ``steps.csv`` and the TensorBoard folder private, like the seed and the
checkpoint (the per-epoch test metrics use the public test split only).
"""

from __future__ import annotations

import csv
import logging
import math
import os

from dpmf._io import atomic_savefig, atomic_write_csv
from dpmf._validation import check_int

__all__ = [
    "METRIC_COLUMNS",
    "STEP_COLUMNS",
    "STEPS",
    "TENSORBOARD",
    "StepLog",
    "batch_loss",
    "write_metrics_csv",
    "read_metrics_csv",
    "plot_training_curves",
]

logger = logging.getLogger(__name__)

METRIC_COLUMNS = (
    "epoch",
    "step",
    "test_loss",
    "test_accuracy",
    "epsilon",
    "delta",
    "lr",
    "seconds",
)


def write_metrics_csv(path: str, rows: list[dict]) -> None:
    """Write ``rows`` (dicts with ``METRIC_COLUMNS``) as CSV, atomically."""
    atomic_write_csv(path, METRIC_COLUMNS, [[_fmt(row.get(k)) for k in METRIC_COLUMNS] for row in rows])


def read_metrics_csv(path: str) -> list[dict]:
    """Read a metrics CSV back (values as strings)."""
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return v


def plot_training_curves(path: str, rows: list[dict], *, title: str = "") -> None:
    """PNG with test accuracy, test loss and ε against the epoch (written atomically).

    Uses matplotlib's object interface (no pyplot global state, no display needed).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = [int(r["epoch"]) for r in rows]
    fig = Figure(figsize=(11, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    panels = [
        ("test_accuracy", "test accuracy", lambda v: 100.0 * v, "%"),
        ("test_loss", "test loss (cross-entropy)", lambda v: v, ""),
        ("epsilon", "ε spent", lambda v: v, ""),
    ]
    for k, (key, label, tf, unit) in enumerate(panels):
        ax = fig.add_subplot(1, 3, k + 1)
        pts = [
            (e, tf(float(r[key]))) for e, r in zip(epochs, rows, strict=True) if r.get(key) not in (None, "")
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"{label} ({unit})" if unit else label)
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    atomic_savefig(fig, path, dpi=110)


STEPS = "steps.csv"
TENSORBOARD = "tensorboard"
STEP_COLUMNS = ("step", "epoch", "train_loss", "clipped_fraction", "lr")


class StepLog:
    """Per-step figures every ``every`` steps: ``steps.csv`` and TensorBoard scalars.

    Each recorded step t (1-based: the steps done) has the mean cross-entropy of its batch at
    the weights before the update (evaluated in eval mode, without gradients, so no random
    state is consumed and the trajectory is the same with or without logging; empty for an
    empty batch), the fraction of its examples whose gradient norm exceeded ζ, and the
    learning rate η·χ_t of the first parameter group. **Not private**: see the module notes.

    ``steps.csv`` is rewritten atomically by ``flush`` (after each epoch, before the
    checkpoint), so after a resume it is trimmed to the checkpoint's step and continues from
    there. TensorBoard events go to ``out_dir/tensorboard`` through
    ``torch.utils.tensorboard.SummaryWriter`` (tags ``train/loss``, ``train/clipped_fraction``,
    ``train/lr``; ``purge_step`` drops events an interrupted run wrote past the checkpoint)
    when the ``tensorboard`` package is installed; otherwise a notice is logged once and only
    the CSV is written. Both are private: ``steps.csv`` is 0600 and the TensorBoard folder 0700,
    whatever the umask.

    Args:
        out_dir: the run's folder.
        every: K ≥ 1, record the steps t with t % K == 0.
        start_step: the steps already done (the checkpoint's step when resuming, else 0).
        tensorboard: also write TensorBoard events where available.

    Raises:
        ValueError: K < 1 or start_step < 0.
    """

    def __init__(self, out_dir: str, every: int, *, start_step: int = 0, tensorboard: bool = True):
        self.every = check_int("every", every, minimum=1)
        start_step = check_int("start_step", start_step, minimum=0)
        self.path = os.path.join(out_dir, STEPS)
        self.rows: list[list] = []
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path, encoding="utf-8", newline="") as f:
                self.rows = [
                    [r[k] for k in STEP_COLUMNS] for r in csv.DictReader(f) if int(r["step"]) <= start_step
                ]
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.info(
                    "notice: tensorboard is not installed: per-step figures go to %s only "
                    "(pip install tensorboard for event files)",
                    STEPS,
                )
            else:
                board = os.path.join(out_dir, TENSORBOARD)
                os.makedirs(board, mode=0o700, exist_ok=True)
                os.chmod(board, 0o700)  # the events hold non-private figures
                self.writer = SummaryWriter(log_dir=board, purge_step=start_step + 1)

    def due(self, steps_done: int) -> bool:
        """Whether the step that brings the count to ``steps_done`` is recorded."""
        return steps_done % self.every == 0

    def record(self, steps_done: int, epoch: int, loss: float | None, clipped_fraction: float, lr: float):
        """Add one row (``loss`` None or NaN for an empty batch)."""
        has_loss = loss is not None and math.isfinite(loss)
        self.rows.append(
            [
                steps_done,
                epoch,
                repr(float(loss)) if has_loss else "",
                repr(float(clipped_fraction)),
                repr(lr),
            ]
        )
        if self.writer is not None:
            if has_loss:
                self.writer.add_scalar("train/loss", float(loss), steps_done)
            self.writer.add_scalar("train/clipped_fraction", float(clipped_fraction), steps_done)
            self.writer.add_scalar("train/lr", float(lr), steps_done)

    def flush(self) -> None:
        """Write ``steps.csv`` (atomically) and flush the TensorBoard events."""
        atomic_write_csv(self.path, STEP_COLUMNS, self.rows, private=True)  # not private figures
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def batch_loss(model, x, y) -> float | None:
    """Mean cross-entropy of ``model`` on one batch, in eval mode and without gradients (no
    random state is used); None for an empty batch."""
    import torch
    import torch.nn.functional as F

    if x.shape[0] == 0:
        return None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(F.cross_entropy(model(x).float(), y))
    finally:
        model.train(was_training)
