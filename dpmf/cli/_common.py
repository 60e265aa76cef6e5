"""Helpers of several ``dpmf`` commands: the one-line usage error (``UsageError``, exit status 2),
comma-separated lists, the participation and figure flags of ``curves`` and ``colormap``, the
registered accountants' names (``train``, ``pick``, ``fl``), the Monte Carlo sample limit and the
learning-rate schedule flags of ``epsilon``, ``calibrate`` and ``pick``.
"""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """Bad command-line input: reported in one line, exit status 2."""


def _csv_list(text: str, convert=str, *, name: str = "list") -> list:
    """The items of a comma-separated list, each converted; ``name`` is the flag in messages.

    Raises:
        UsageError: an empty list, an empty item (``a,,b`` or a trailing comma: nothing is
            dropped silently) or an item ``convert`` refuses.
    """
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise UsageError(f"{name}={text!r} is invalid: expected a comma-separated list, e.g. a,b")
    empty = [i for i, t in enumerate(items, 1) if not t]
    if empty:
        raise UsageError(
            f"{name}={text!r} is invalid: item {empty[0]} of {len(items)} is empty; remove the extra comma"
        )
    kind = {int: "an integer", float: "a number"}.get(convert, "a valid value")
    out = []
    for t in items:
        try:
            out.append(convert(t))
        except ValueError:
            raise UsageError(f"{name}={text!r} is invalid: {t!r} is not {kind}; correct that item") from None
    return out


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


def _add_figure_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="png", choices=("png", "pdf", "svg"), help="figure format")
    p.add_argument("--dpi", type=int, default=150, help="figure resolution of a PNG (default 150)")


def _check_figure_flags(args) -> None:
    if not 10 <= args.dpi <= 2400:
        raise UsageError(f"--dpi={args.dpi} is invalid: must be an integer in [10, 2400]")


def _accountants(poisson: bool = False) -> tuple[str, ...]:
    """The registered accountant names (``dpmf.accountants.registry``); ``poisson``: those of
    Poisson-subsampled Gaussian events."""
    from dpmf.accountants.events import PoissonGaussianEvent
    from dpmf.accountants.registry import ACCOUNTANTS, accountants_for

    return accountants_for(PoissonGaussianEvent) if poisson else tuple(ACCOUNTANTS)


def _add_max_samples_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="refuse a Monte Carlo query needing more samples per direction (default 1e9)",
    )


def _schedule_from_args(args):
    """The ``Schedule`` of --schedule/--beta/--gamma (None without --schedule): a decaying
    schedule needs --beta, the constant one takes none but 1.

    Raises:
        UsageError: --beta/--gamma without --schedule, or a β that does not fit the schedule.
    """
    from dpmf.workloads import Schedule

    if args.schedule is None:
        if args.beta is not None or args.gamma is not None:
            raise UsageError("--beta/--gamma need --schedule")
        return None
    if args.schedule == "constant" and args.beta is not None and args.beta != 1.0:
        raise UsageError("--beta is invalid with --schedule constant (β = 1)")
    if args.schedule != "constant" and args.beta is None:
        raise UsageError(f"--schedule {args.schedule} needs --beta (final multiplier in (0, 1])")
    return Schedule(args.schedule, 1.0 if args.beta is None else args.beta, args.gamma)
