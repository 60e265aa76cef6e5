"""``dpmf epsilon`` and ``dpmf calibrate``: the privacy accounting of a training run, ε at δ for a
noise multiplier or the smallest noise multiplier for a target (ε, δ); the two commands share
their flags, their plan and their table.
"""

from __future__ import annotations

import argparse

from dpmf.cli._common import UsageError, _add_max_samples_flag, _schedule_from_args


def _add_accounting_flags(p: argparse.ArgumentParser, target: str) -> None:
    from dpmf.accountants import ACCOUNTANTS
    from dpmf.plan import scheme_names
    from dpmf.workloads import SCHEDULES

    p.add_argument("--scheme", required=True, choices=scheme_names(), help="batch-sampling scheme")
    if target == "noise":
        p.add_argument("--noise-multiplier", type=float, required=True, help="noise multiplier σ > 0")
    else:
        p.add_argument("--epsilon", type=float, required=True, help="target ε > 0")
    p.add_argument("--dataset-size", type=int, required=True, help="N, number of examples")
    p.add_argument("--batch-size", type=int, required=True, help="B (expected) batch size, 1..N")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=int, help="steps = epochs × ceil(N/B)")
    length.add_argument("--steps", type=int, help="number of steps n")
    p.add_argument("--delta", type=float, required=True, help="δ in (0, 1)")
    p.add_argument(
        "--factorization",
        default=None,
        help="strategy, e.g. bisr:16, bsr:16, sqrt_prefix (default: identity = DP-SGD)",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="learning-rate schedule of the workload (default: prefix sum)",
    )
    p.add_argument("--beta", type=float, default=None, help="final learning-rate multiplier β in (0, 1]")
    p.add_argument("--gamma", type=float, default=None, help="power γ of polynomial/inverse_power")
    p.add_argument(
        "--accountant",
        choices=ACCOUNTANTS,
        default=None,
        help="default: pld, or monte_carlo for the balls-in-bins schemes",
    )
    p.add_argument("--samples", type=int, default=None, help="Monte Carlo samples per direction")
    _add_max_samples_flag(p)
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed (default 0)")
    p.add_argument("--confidence", type=float, default=0.99, help="Monte Carlo confidence (default 0.99)")
    p.add_argument("--min-sep", type=int, default=None, help="cyclic_poisson groups b' (default: bands of C)")
    p.add_argument("--no-progress", action="store_true", help="no Monte Carlo progress bar")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _accounting_plan(args):
    """Validate every flag, then build the run's ``PrivatePlan`` (the strategy is built for the
    scheme's participation, as in pick and train); returns (plan, the accountant's keywords)."""
    from dpmf._validation import check_int
    from dpmf.accountants.calibration import check_delta, check_monte_carlo
    from dpmf.accountants.registry import get_accountant
    from dpmf.mechanisms import parse_factorization
    from dpmf.plan import PrivatePlan, get_scheme

    N = check_int("dataset_size", args.dataset_size, minimum=1)
    B = check_int("batch_size", args.batch_size, minimum=1)
    length = {"steps": args.steps} if args.steps is not None else {"epochs": args.epochs}
    check_delta(args.delta)
    scheme = get_scheme(args.scheme, min_sep=args.min_sep)
    accountant = scheme.check_accountant(args.accountant)
    check_monte_carlo(args.samples, args.seed, args.confidence)
    if not get_accountant(accountant).randomized and args.samples is not None:
        raise UsageError(
            f"--samples={args.samples} is invalid with the {accountant} accountant: samples are "
            "drawn by the monte_carlo accountant only; drop --samples or pass --accountant monte_carlo"
        )
    spec = "identity" if args.factorization is None else args.factorization
    parse_factorization(spec)
    schedule = _schedule_from_args(args)
    plan = PrivatePlan(N, B, **length, scheme=scheme, strategy=spec, schedule=schedule)
    mc = dict(
        accountant=args.accountant,
        samples=args.samples,
        seed=args.seed,
        confidence=args.confidence,
        progress=False if args.no_progress else None,
    )
    return plan, mc


def _print_result(result, as_json: bool) -> None:
    import json
    import math

    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    rows = [
        ("scheme", result.scheme),
        ("factorization", result.factorization),
        ("noise_multiplier", f"{result.noise_multiplier:.6g}"),
        ("epsilon", "inf" if math.isinf(result.epsilon) else f"{result.epsilon:.6g}"),
        ("delta", f"{result.delta:.3g}"),
        ("accountant", result.accountant),
        ("guarantee", result.guarantee),
        ("steps", str(result.steps)),
        ("sensitivity", f"{result.sensitivity:.6g}"),
    ]
    if result.sampling_rate is not None:
        rows.append(("sampling_rate", f"{result.sampling_rate:.6g}"))
    for name in ("confidence", "samples", "seed", "epsilon_estimate", "delta_estimate"):
        value = getattr(result, name)
        if value is not None:
            rows.append((name, f"{value:.6g}" if isinstance(value, float) else str(value)))
    for key, value in result.details.items():
        rows.append((key, f"{value:.6g}" if isinstance(value, float) else str(value)))
    rows.append(("method", result.method))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _add_epsilon(sub):
    p = sub.add_parser(
        "epsilon",
        help="ε of a training run for a noise multiplier",
        description="Privacy (ε at δ) of a training run under a batch-sampling scheme.",
    )
    _add_accounting_flags(p, "noise")
    return p


def _run_epsilon(args) -> int:
    from dpmf._validation import check_real
    from dpmf.plan import account

    sigma = check_real("noise_multiplier", args.noise_multiplier, low=0.0, low_inclusive=False)
    plan, mc = _accounting_plan(args)
    result = account(plan, sigma, delta=args.delta, **mc)
    _print_result(result, args.json)
    return 0


def _add_calibrate(sub):
    p = sub.add_parser(
        "calibrate",
        help="smallest noise multiplier for a target (ε, δ)",
        description="Smallest noise multiplier σ meeting a target (ε, δ) (conservative).",
    )
    _add_accounting_flags(p, "epsilon")
    return p


def _run_calibrate(args) -> int:
    from dpmf._validation import check_real
    from dpmf.plan import calibrate

    epsilon = check_real("epsilon", args.epsilon, low=0.0, low_inclusive=False)
    plan, mc = _accounting_plan(args)
    result = calibrate(plan, epsilon=epsilon, delta=args.delta, **mc)
    _print_result(result, args.json)
    return 0


COMMANDS = [
    ("epsilon", _add_epsilon, _run_epsilon),
    ("calibrate", _add_calibrate, _run_calibrate),
]
