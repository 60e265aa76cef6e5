"""``dpmf colormap``: the gain of one factorization over another on an n × β grid
(``colormap.csv`` and a figure).
"""

from __future__ import annotations

from pathlib import Path

from dpmf.cli._common import (
    UsageError,
    _add_figure_flags,
    _add_participation_flags,
    _check_figure_flags,
    _csv_list,
    _participation,
)


def _add_colormap(sub):
    p = sub.add_parser(
        "colormap",
        help="gain of one factorization over another on an n × β grid (CSV + PNG)",
        description="Ratio metric(numerator)/metric(denominator) on a grid of n and β.",
    )
    p.add_argument("--numerator", required=True, help="factorization, e.g. lr_aware")
    p.add_argument("--denominator", required=True, help="factorization, e.g. sqrt_prefix")
    p.add_argument("--metric", required=True, choices=("max_se", "mean_se"))
    p.add_argument("--schedule", required=True)
    p.add_argument("--gamma", type=float, default=None)
    p.add_argument("--n", required=True, help="steps, comma-separated")
    p.add_argument("--beta", required=True, help="β values, comma-separated, each in (0, 1]")
    _add_participation_flags(p)
    p.add_argument("--out", required=True, help="output folder")
    _add_figure_flags(p)
    p.add_argument("--no-progress", action="store_true")
    return p


# the first three columns are the original file's, so that its readers keep working
COLORMAP_COLUMNS = (
    "n",
    "beta",
    "gain",
    "metric",
    "schedule",
    "gamma",
    "numerator",
    "denominator",
    "numerator_error",
    "denominator_error",
    "participation",
    "min_sep",
    "max_participations",
)


def _run_colormap(args) -> int:
    from dpmf._io import atomic_write_csv
    from dpmf.mechanisms.sweeps import gain_grid
    from dpmf.plots import plot_gain

    _check_figure_flags(args)
    ns, betas = _csv_list(args.n, int, name="--n"), _csv_list(args.beta, float, name="--beta")
    if args.schedule == "constant" and any(b != 1.0 for b in betas):
        raise UsageError(
            f"--beta={args.beta!r} is invalid with --schedule constant: the constant schedule has "
            "β = 1, so every row of the grid would be the same; choose a decaying --schedule "
            "(e.g. exponential) or pass --beta 1"
        )
    grid = gain_grid(
        args.numerator,
        args.denominator,
        args.metric,
        args.schedule,
        ns,
        betas,
        gamma=args.gamma,
        participation=_participation(args),
        progress=not args.no_progress,
    )
    out = Path(args.out)
    part = grid.participation
    rows = [
        (
            int(n),
            float(b),
            float(grid.gain[i, j]),
            grid.metric,
            grid.schedule,
            "" if args.gamma is None else args.gamma,
            grid.numerator,
            grid.denominator,
            float(grid.numerator_error[i, j]),
            float(grid.denominator_error[i, j]),
            part.kind,
            "" if part.kind == "single" else part.min_sep,
            "" if part.kind == "single" else part.max_participations,
        )
        for i, b in enumerate(grid.betas)
        for j, n in enumerate(grid.ns)
    ]
    csv_path = atomic_write_csv(out / "colormap.csv", COLORMAP_COLUMNS, rows)
    png_path = plot_gain(grid, out / f"colormap.{args.format}", dpi=args.dpi)
    better = int((grid.gain < 1).sum())
    print(
        f"{args.numerator} better than {args.denominator} ({args.metric}) "
        f"in {better} of {grid.gain.size} cells"
    )
    print(f"wrote {csv_path} and {png_path}")
    return 0


COMMANDS = [("colormap", _add_colormap, _run_colormap)]
