"""The ``dpmf`` command: a thin layer over the library's functions.

Each sub-command is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args)``. Flags are
validated first; bad input exits with status 2 and a one-line reason on stderr
(the command-line contract of DESIGN.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


class UsageError(ValueError):
    """Bad command-line input: reported in one line, exit status 2."""


def _csv_list(text: str, convert=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"expected a comma-separated list, got {text!r}")
    try:
        return [convert(t) for t in items]
    except ValueError:
        raise UsageError(f"invalid value in list {text!r}") from None


_COMMANDS: list = []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpmf",
        description="Differentially private training with correlated noise (matrix factorization).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add, run in _COMMANDS:
        p = add(sub)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (UsageError, ValueError, TypeError) as exc:
        print(f"dpmf {args.command}: error: {exc}", file=sys.stderr)
        return 2


# --- curves -------------------------------------------------------------------------------


def _add_participation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--participation", default="single", choices=("single", "min_sep", "fixed_epochs"))
    p.add_argument("--min-sep", type=int, default=None, metavar="b", help="min separation b (steps)")
    p.add_argument("--max-participations", type=int, default=None, metavar="k", help="max participations k")


def _participation(args):
    from dpmf.mechanisms import Participation

    if args.participation == "single":
        if args.min_sep is not None or args.max_participations is not None:
            raise UsageError("--min-sep/--max-participations need --participation min_sep or fixed_epochs")
        return Participation.single()
    if args.min_sep is None or args.max_participations is None:
        raise UsageError(f"--participation {args.participation} needs --min-sep and --max-participations")
    return Participation(args.participation, args.min_sep, args.max_participations)


def _add_curves(sub):
    p = sub.add_parser(
        "curves",
        help="MaxSE/MeanSE/sensitivity of factorizations against n (CSV + PNG)",
        description="Error curves of factorizations of the learning-rate workload A_χ.",
    )
    p.add_argument(
        "--schedule", required=True, help="constant|exponential|linear|cosine|polynomial|inverse_power"
    )
    p.add_argument("--beta", type=float, default=0.1, help="final learning-rate multiplier β in (0, 1]")
    p.add_argument("--gamma", type=float, default=None, help="power γ of polynomial/inverse_power")
    p.add_argument("--n", required=True, help="steps, comma-separated (e.g. 16,64,256)")
    _add_participation_flags(p)
    p.add_argument(
        "--factorizations", required=True, help="comma-separated, e.g. sqrt_prefix,lr_aware,bisr:16"
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _run_curves(args) -> int:
    from dpmf._io import atomic_write_csv
    from dpmf.mechanisms.sweeps import CURVE_COLUMNS, error_curves
    from dpmf.plots import plot_curves
    from dpmf.workloads import Schedule

    schedule = Schedule(args.schedule, args.beta, args.gamma)
    ns = _csv_list(args.n, int)
    facts = _csv_list(args.factorizations)
    participation = _participation(args)
    rows = error_curves(schedule, ns, facts, participation, progress=not args.no_progress)
    out = Path(args.out)
    csv_path = atomic_write_csv(out / "curves.csv", CURVE_COLUMNS, [r.as_tuple() for r in rows])
    png_path = plot_curves(rows, out / "curves.png")
    _print_curves(rows)
    print(f"wrote {csv_path} and {png_path}")
    return 0


def _print_curves(rows) -> None:
    head = f"{'n':>6} {'factorization':<20} {'sens':>9} {'MaxSE':>9} {'MeanSE':>9} {'bound':>9}"
    print(head)
    for r in rows:
        label = r.factorization if r.bands is None else f"{r.factorization}:{r.bands}"
        flag = "" if r.sensitivity_exact else " (sens upper bound)"
        print(
            f"{r.n:>6} {label:<20} {r.sensitivity:>9.4f} {r.max_se:>9.4f} {r.mean_se:>9.4f} "
            f"{r.lower_bound:>9.4f}{flag}"
        )


_COMMANDS.append((_add_curves, _run_curves))


# --- colormap -----------------------------------------------------------------------------


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
    p.add_argument("--no-progress", action="store_true")
    return p


def _run_colormap(args) -> int:
    from dpmf._io import atomic_write_csv
    from dpmf.mechanisms.sweeps import gain_grid
    from dpmf.plots import plot_gain

    grid = gain_grid(
        args.numerator,
        args.denominator,
        args.metric,
        args.schedule,
        _csv_list(args.n, int),
        _csv_list(args.beta, float),
        gamma=args.gamma,
        participation=_participation(args),
        progress=not args.no_progress,
    )
    out = Path(args.out)
    rows = [
        (int(n), float(b), float(grid.gain[i, j]))
        for i, b in enumerate(grid.betas)
        for j, n in enumerate(grid.ns)
    ]
    csv_path = atomic_write_csv(out / "colormap.csv", ("n", "beta", "gain"), rows)
    png_path = plot_gain(grid, out / "colormap.png")
    better = int((grid.gain < 1).sum())
    print(
        f"{args.numerator} better than {args.denominator} ({args.metric}) "
        f"in {better} of {grid.gain.size} cells"
    )
    print(f"wrote {csv_path} and {png_path}")
    return 0


_COMMANDS.append((_add_colormap, _run_colormap))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
