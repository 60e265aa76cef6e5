"""``dpmf curves``: MaxSE, MeanSE and sensitivity of factorizations of the learning-rate
workload against the number of steps n (``curves.csv`` and a figure).
"""

from __future__ import annotations

from pathlib import Path

from dpmf.cli._common import (
    _add_figure_flags,
    _add_participation_flags,
    _check_figure_flags,
    _csv_list,
    _participation,
)


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
    _add_figure_flags(p)
    p.add_argument(
        "--no-lower-bound",
        action="store_true",
        help="skip the nuclear-norm lower bound (the lower_bound column is then left empty)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _run_curves(args) -> int:
    from dpmf._io import atomic_write_csv
    from dpmf.mechanisms.sweeps import CURVE_COLUMNS, error_curves
    from dpmf.plots import plot_curves
    from dpmf.workloads import Schedule

    _check_figure_flags(args)
    schedule = Schedule(args.schedule, args.beta, args.gamma)
    ns = _csv_list(args.n, int, name="--n")
    facts = _csv_list(args.factorizations, name="--factorizations")
    participation = _participation(args)
    rows = error_curves(
        schedule,
        ns,
        facts,
        participation,
        progress=not args.no_progress,
        with_lower_bound=not args.no_lower_bound,
    )
    out = Path(args.out)
    csv_path = atomic_write_csv(out / "curves.csv", CURVE_COLUMNS, [r.as_tuple() for r in rows])
    fig_path = plot_curves(rows, out / f"curves.{args.format}", dpi=args.dpi)
    _print_curves(rows)
    print(f"wrote {csv_path} and {fig_path}")
    return 0


def _print_curves(rows) -> None:
    head = f"{'n':>6} {'factorization':<20} {'sens':>9} {'MaxSE':>9} {'MeanSE':>9} {'bound':>9}"
    print(head)
    for r in rows:
        label = r.factorization if r.bands is None else f"{r.factorization}:{r.bands}"
        flag = "" if r.sensitivity_exact else " (sens upper bound)"
        bound = "" if r.lower_bound is None else f"{r.lower_bound:.4f}"
        print(
            f"{r.n:>6} {label:<20} {r.sensitivity:>9.4f} {r.max_se:>9.4f} {r.mean_se:>9.4f} {bound:>9}{flag}"
        )


COMMANDS = [("curves", _add_curves, _run_curves)]
