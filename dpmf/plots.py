"""Figures: error curves, gain colormaps (matplotlib; headless machines use its Agg backend).

Every figure has labelled axes with units, a legend and a title, and is written atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from dpmf._io import atomic_savefig

__all__ = ["plot_curves", "plot_gain", "figure_curves", "figure_gain"]


def _label(row) -> str:
    return row.factorization if row.bands is None else f"{row.factorization}:{row.bands}"


def plot_curves(rows: Sequence, path, *, title: str | None = None) -> Path:
    """Write ``figure_curves(rows)`` to ``path`` (PNG) atomically; return the path."""
    fig = figure_curves(rows, title=title)
    out = atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return out


def figure_curves(rows: Sequence, *, title: str | None = None):
    """Two panels (MaxSE, MeanSE) against n, log-log: one line per factorization and the lower
    bound dashed. ``rows`` are ``dpmf.mechanisms.sweeps.CurveRow``. Returns the Figure.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("rows is invalid: nothing to plot")
    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, metric, name in zip(axes, ("max_se", "mean_se"), ("MaxSE", "MeanSE"), strict=True):
        for label in labels:
            pts = sorted((r.n, getattr(r, metric)) for r in rows if _label(r) == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        lb = sorted({(r.n, r.lower_bound) for r in rows})
        ax.plot([p[0] for p in lb], [p[1] for p in lb], "k--", label="lower bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n (steps)")
        ax.set_ylabel(f"{name} (units of σ·ζ)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    r0 = rows[0]
    part = (
        r0.participation
        if r0.participation == "single"
        else (f"{r0.participation} b={r0.min_sep} k={r0.max_participations}")
    )
    fig.suptitle(title or f"{r0.schedule} schedule, β={r0.beta:g}, {part} participation")
    return fig


def plot_gain(grid, path, *, title: str | None = None) -> Path:
    """Write ``figure_gain(grid)`` to ``path`` (PNG) atomically; return the path."""
    fig = figure_gain(grid, title=title)
    out = atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return out


def figure_gain(grid, *, title: str | None = None, ax=None):
    """Heatmap of ``grid.gain`` (n on x, β on y) with a diverging colormap centred at 1: red where
    the numerator factorization is better (gain < 1), blue where worse, the level 1 drawn black.
    ``grid`` is a ``dpmf.mechanisms.sweeps.GainGrid``; draws into ``ax`` when given. Returns the
    Figure."""
    gain = np.asarray(grid.gain)
    lo, hi = float(gain.min()), float(gain.max())
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 1.0 - 1e-9), vmax=max(hi, 1.0 + 1e-9))
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    else:
        fig = ax.figure
    x = np.arange(len(grid.ns))
    y = np.arange(len(grid.betas))
    mesh = ax.pcolormesh(x, y, gain, cmap="RdBu", norm=norm, shading="nearest")
    if lo < 1.0 < hi:
        ax.contour(x, y, gain, levels=[1.0], colors="k", linewidths=1.0)
    ax.set_xticks(x, [str(n) for n in grid.ns], rotation=45)
    ax.set_yticks(y, [f"{b:g}" for b in grid.betas])
    ax.set_xlabel("n (steps)")
    ax.set_ylabel("β (final learning-rate multiplier)")
    cbar = fig.colorbar(mesh, ax=ax)
    metric = {"max_se": "MaxSE", "mean_se": "MeanSE"}[grid.metric]
    cbar.set_label(f"{metric}({grid.numerator}) / {metric}({grid.denominator})")
    ax.set_title(
        title
        or f"Gain of {grid.numerator} over {grid.denominator} ({metric}, {grid.schedule})\n"
        "red: numerator better (ratio < 1), blue: worse; black line: ratio = 1"
    )
    return fig
