"""``dpmf audit``: the run of ``dpmf train`` with the same flags plus canaries, and an empirical ε
lower bound against the claimed ε (``dpmf.audit``).
"""

from __future__ import annotations

import argparse

from dpmf.cli._common import UsageError
from dpmf.cli.train import _add_train, _check_train_flags, _train_config


def _add_audit(sub):
    # the flags of ``dpmf train`` (its parser as a parent), then the audit's own
    holder = argparse.ArgumentParser(add_help=False).add_subparsers()
    train = _add_train(holder)
    p = sub.add_parser(
        "audit",
        parents=[train],
        conflict_handler="resolve",
        help="audit a training run: canaries in/out, an ε lower bound against the claimed ε",
        description="The run of `dpmf train` with the same flags, plus M canaries each included with "
        "probability 1/2; prints the claimed (ε, δ), the ε lower bound at its confidence and the "
        "AUROC, and writes OUT/audit.json and OUT/audit.png.",
    )
    p.add_argument("--canaries", type=int, default=1000, help="number of canaries M (default 1000)")
    p.add_argument(
        "--canary", default="white-box", help="white-box (gradient canaries) | input (mislabeled examples)"
    )
    p.add_argument(
        "--method",
        default="one-run",
        help="one-run | one-run-fdp | clopper-pearson | gdp (default one-run; the last two assume "
        "independent trials)",
    )
    p.add_argument("--significance", type=float, default=0.05, help="α: the bound holds with confidence 1-α")
    return p


def _run_audit(args) -> int:
    if args.resume or args.distributed:
        flag = "--resume" if args.resume else "--distributed"
        raise UsageError(
            f"{flag} is invalid for dpmf audit: an audit is one uninterrupted process; drop {flag}"
        )
    from dpmf.audit.runner import check_audit_args, check_audit_out, run_audit

    check_audit_args(args.canaries, args.canary, args.method, args.significance)
    config = _train_config(args)
    _check_train_flags(args, config)
    try:
        check_audit_out(args.out, overwrite=args.overwrite)
    except ValueError as exc:
        raise UsageError(str(exc).replace("out_dir=", "--out ", 1)) from None
    if args.threads is not None:
        from dpmf.optim.threads import limit_threads

        limit_threads(args.threads)
    run_audit(
        config,
        args.out,
        canaries=args.canaries,
        kind=args.canary,
        method=args.method,
        significance=args.significance,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    return 0


COMMANDS = [("audit", _add_audit, _run_audit)]
