"""Figures: error curves, gain colormaps (matplotlib; headless machines use its Agg backend).

Every figure has labelled axes with units, a legend and a title, and is written atomically,
as PNG (at ``dpi`` dots per inch), PDF or SVG after the file name's suffix (``FORMATS``).
Log axes spanning less than a decade get plain-number ticks (1.2, 1.4, …) instead of the
sparse or scientific labels matplotlib gives them by default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from dpmf._io import atomic_savefig
from dpmf._validation import check_choice, check_int

__all__ = [
    "FORMATS",
    "plot_curves",
    "plot_gain",
    "figure_curves",
    "figure_gain",
    "log_ticks",
    "lower_bound_label",
]

FORMATS = ("png", "pdf", "svg")
_MANTISSA_STEPS = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01)


def _check_output(path, dpi) -> tuple[Path, int]:
    path = Path(path)
    check_choice("format", path.suffix.lstrip(".").lower(), FORMATS)
    return path, check_int("dpi", dpi, minimum=10, maximum=2400)


def log_ticks(lo: float, hi: float, *, most: int = 7) -> list[float]:
    """Tick positions m·10^k in [lo, hi] for a log axis spanning less than a decade.

    The mantissa step is the coarsest of 1, 0.5, 0.2, …, 0.01 that gives at least three ticks
    with no gap wider than 40 % of the axis (in log scale); ticks closer than 1/(most + 1) of the
    axis to a rounder one are then dropped. [] when lo ≤ 0 or hi < lo.
    """
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        return []
    span = math.log10(hi / lo)
    if span == 0:
        return [float(f"{lo:.6g}")]
    k0, k1 = math.floor(math.log10(lo)), math.floor(math.log10(hi))
    ticks: list[float] = []
    for step in _MANTISSA_STEPS:
        ticks = []
        for k in range(k0, k1 + 1):
            for m in np.arange(1.0, 10.0 - 1e-9, step):
                v = float(f"{m * 10.0**k:.6g}")
                if lo * (1 - 1e-12) <= v <= hi * (1 + 1e-12):
                    ticks.append(v)
        if len(ticks) >= 3:
            gaps = np.diff(np.log10([lo, *ticks, hi]))
            if gaps.max() <= 0.4 * span:
                break
    # thin, keeping the roundest numbers first (1, 2, 3 before 1.5 before 1.2 …)
    gap = span / (most + 1) * (1 - 1e-9)
    kept: list[float] = []
    for v in sorted(ticks, key=_roundness):
        if all(abs(math.log10(v / u)) >= gap for u in kept):
            kept.append(v)
    return sorted(kept)


def _roundness(v: float) -> int:
    """0 for m·10^k with integer m, 1 for a multiple of 0.5·10^k, … (index in the steps)."""
    m = v / 10.0 ** math.floor(math.log10(v))
    for rank, step in enumerate(_MANTISSA_STEPS):
        q = m / step
        if abs(q - round(q)) < 1e-6:
            return rank
    return len(_MANTISSA_STEPS)


def _readable_log_y(ax, values) -> None:
    """Plain-number ticks on a log y axis whose data span less than a decade."""
    vals = np.asarray([v for v in values if v > 0 and math.isfinite(v)])
    if vals.size == 0:
        return
    lo, hi = float(vals.min()), float(vals.max())
    if hi / lo >= 10.0:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        return
    pad = (hi / lo) ** 0.05 if hi > lo else 1.1
    ax.set_ylim(lo / pad, hi * pad)
    ticks = log_ticks(lo / pad, hi * pad)
    if ticks:
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _steps_x(ax, ns) -> None:
    """Log-2 x axis labelled with the n values themselves (at most 10 labels)."""
    ns = sorted(set(int(n) for n in ns))
    ax.set_xscale("log", base=2)
    stride = max(1, math.ceil(len(ns) / 10))
    ax.xaxis.set_major_locator(FixedLocator(ns[::stride]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _label(row) -> str:
    return row.factorization if row.bands is None else f"{row.factorization}:{row.bands}"


def plot_curves(rows: Sequence, path, *, title: str | None = None, dpi: int = 150) -> Path:
    """Write ``figure_curves(rows)`` to ``path`` atomically; return the path.

    Args:
        path: ends in .png, .pdf or .svg (the format).
        dpi: resolution of a PNG, in [10, 2400] (default 150).

    Raises:
        ValueError: no rows, an unknown suffix or a dpi out of range (before drawing).
    """
    path, dpi = _check_output(path, dpi)
    fig = figure_curves(rows, title=title)
    out = atomic_savefig(fig, path, dpi=dpi)
    plt.close(fig)
    return out


def lower_bound_label(participation: str) -> str:
    """The legend entry of the rigorous lower bound (``dpmf.mechanisms.bounds.lower_bound``)."""
    if participation == "single":
        return "lower bound ‖A‖*/n (nuclear norm; any factorization)"
    return "lower bound ‖A‖*/√(n·b*) (nuclear norm; any factorization)"


def figure_curves(rows: Sequence, *, title: str | None = None):
    """Three panels against n (log x): MaxSE and MeanSE (log y) with the nuclear-norm lower
    bound dashed, and the sensitivity sens(C); one line per factorization.
    ``rows`` are ``dpmf.mechanisms.sweeps.CurveRow``. Returns the Figure.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("rows is invalid: nothing to plot")
    labels = list(dict.fromkeys(_label(r) for r in rows))
    ns = [r.n for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
    lb_label = lower_bound_label(rows[0].participation)
    for ax, metric, name in zip(axes[:2], ("max_se", "mean_se"), ("MaxSE", "MeanSE"), strict=True):
        for label in labels:
            pts = sorted((r.n, getattr(r, metric)) for r in rows if _label(r) == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        lb = sorted({(r.n, r.lower_bound) for r in rows if r.lower_bound is not None})
        if lb:  # none with --no-lower-bound
            ax.plot([p[0] for p in lb], [p[1] for p in lb], "k--", label=lb_label)
        _steps_x(ax, ns)
        ax.set_yscale("log")
        _readable_log_y(ax, [getattr(r, metric) for r in rows] + [p[1] for p in lb])
        ax.set_xlabel("n (steps)")
        ax.set_ylabel(f"{name} (units of σ·ζ)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    for label in labels:
        pts = sorted((r.n, r.sensitivity) for r in rows if _label(r) == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
    _steps_x(ax, ns)
    ax.set_xlabel("n (steps)")
    ax.set_ylabel("sens(C) (units of ζ)")
    title_sens = "sensitivity"
    if any(not r.sensitivity_exact for r in rows):
        title_sens += " (some are upper bounds)"
    ax.set_title(title_sens)
    ax.grid(True, which="both", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=min(len(names), 5), fontsize=8)
    r0 = rows[0]
    part = (
        r0.participation
        if r0.participation == "single"
        else (f"{r0.participation} b={r0.min_sep} k={r0.max_participations}")
    )
    fig.suptitle(title or f"{r0.schedule} schedule, β={r0.beta:g}, {part} participation")
    return fig


def plot_gain(grid, path, *, title: str | None = None, dpi: int = 150) -> Path:
    """Write ``figure_gain(grid)`` to ``path`` atomically; return the path.

    Args:
        path: ends in .png, .pdf or .svg (the format).
        dpi: resolution of a PNG, in [10, 2400] (default 150).

    Raises:
        ValueError: an unknown suffix or a dpi out of range (before drawing).
    """
    path, dpi = _check_output(path, dpi)
    fig = figure_gain(grid, title=title)
    out = atomic_savefig(fig, path, dpi=dpi)
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
