"""Per-epoch metrics of a run: a CSV table and a PNG of the curves (both written atomically)."""

from __future__ import annotations

import csv

from dpmf._io import atomic_savefig, atomic_write_csv

__all__ = ["METRIC_COLUMNS", "write_metrics_csv", "read_metrics_csv", "plot_training_curves"]

METRIC_COLUMNS = (
    "epoch",
    "step",
    "test_loss",
    "test_accuracy",
    "epsilon",
    "delta",
    "lr",
    "empty_batches",
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
