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

    schedule = Schedule(args.schedule, args.beta, args.gamma)
    ns = _csv_list(args.n, int)
    facts = _csv_list(args.factorizations)
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
        bound = "" if r.lower_bound is None else f"{r.lower_bound:.4f}"
        print(
            f"{r.n:>6} {label:<20} {r.sensitivity:>9.4f} {r.max_se:>9.4f} {r.mean_se:>9.4f} {bound:>9}{flag}"
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


# --- train --------------------------------------------------------------------------------


def real_list(text: str) -> tuple[float, ...]:
    """A comma-separated list of reals, e.g. ``1,-0.9`` (filter coefficients)."""
    return tuple(_csv_list(text, float))


_TRAIN_FLAGS = (
    # (flag, type, help); defaults are None so that only the flags given override the config
    ("--dataset", str, "fashion-mnist|cifar10|digits (default fashion-mnist; digits when absent)"),
    ("--data-dir", str, "folder with the data set's files (must exist when given)"),
    ("--model", str, "cnn|cnn3|mlp|wrn16-4 (default cnn)"),
    ("--optimizer", str, "dp-sgd|dp-adam|dp-muon|dp-muon-s|dp-muon-bc (default dp-sgd)"),
    (
        "--factorization",
        str,
        "strategy, e.g. identity, bisr:16, bsr:8, lr_aware, bsr_opt:32, blt:4, dense (default "
        "identity), or auto: the recommendation of dpmf pick for this run (sets the scheme too)",
    ),
    (
        "--scheme",
        str,
        "poisson|cyclic_poisson|balls_in_bins|epoch_balls_in_bins|fixed_order|single_release"
        " (with --factorization auto: poisson or auto let pick choose)",
    ),
    ("--max-bands", int, "with --factorization auto: at most this many bands or BLT buffers (default 64)"),
    ("--epochs", int, "epochs E (the run has E·ceil(N/B) steps)"),
    ("--batch-size", int, "expected (logical) batch size B"),
    ("--delta", float, "δ (default 1e-5)"),
    ("--clip-norm", float, "per-example clip norm ζ (default 1)"),
    ("--lr", float, "base learning rate η (default per optimizer)"),
    ("--momentum", float, "heavy-ball momentum of DP-SGD and of DP-Muon's 1-D parameters"),
    ("--muon-beta", float, "DP-Muon's EMA momentum β of the matrix updates (default 0.95)"),
    ("--vector-lr", float, "DP-Muon's learning rate of the 1-D parameters (default --lr)"),
    ("--weight-decay", float, "weight decay (default 0)"),
    ("--filter", str, "temporal filter before the optimizer: none|doppler|disk (default none)"),
    ("--doppler-a", real_list, "DOPPLER feedback coefficients a0,a1,... (default 1,-0.9)"),
    ("--doppler-b", real_list, "DOPPLER feed-forward coefficients b0,b1,... (default 0.1)"),
    ("--disk-kappa", float, "DiSK Kalman gain κ in (0, 1] (default 0.7)"),
    ("--disk-gamma", float, "DiSK extrapolation length γ > 0 (default 0.5; (1-κ)/κ: one pass)"),
    (
        "--schedule",
        str,
        "learning-rate schedule χ: constant|exponential|linear|cosine|polynomial|inverse_power",
    ),
    ("--beta", float, "final learning-rate multiplier β in (0, 1]"),
    ("--gamma", float, "power γ of polynomial/inverse_power"),
    ("--seed", int, "seed of the weights, batches and noise (keep it secret for a released model)"),
    ("--device", str, "auto|cpu|cuda (default auto: CUDA when available)"),
    ("--micro-batch-size", int, "per-example gradients held at once (gradient accumulation)"),
    ("--accountant", str, "pld|rdp|prv|monte_carlo (default: the scheme's)"),
    ("--samples", int, "Monte Carlo samples for the balls-in-bins schemes"),
    ("--eval-batch-size", int, "test batch size"),
)


def _add_train(sub):
    p = sub.add_parser(
        "train",
        help="train a model with DP and correlated noise (metrics CSV, curves PNG, checkpoints)",
        description="Private training: per-example clipping, correlated noise of a factorization, "
        "a DP optimizer; the run's (ε, δ) is computed before the first step.",
    )
    p.add_argument(
        "--config", default=None, help="YAML or JSON file of TrainConfig fields; flags override it"
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=float, default=None, help="target ε (σ is calibrated)")
    budget.add_argument("--noise-multiplier", type=float, default=None, help="σ (ε is computed)")
    for flag, kind, text in _TRAIN_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--no-epsilon-each-epoch", action="store_true", help="account ε only for the whole run")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _train_config(args):
    from dpmf.train.config import TrainConfig

    if args.config is not None:
        try:
            base = TrainConfig.from_file(args.config)
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None
    else:
        base = TrainConfig()
    names = ["epsilon", "noise_multiplier"]
    names += [f.lstrip("-").replace("-", "_") for f, _, _ in _TRAIN_FLAGS]
    overrides = {k: getattr(args, k) for k in names}
    if args.no_epsilon_each_epoch:
        overrides["epsilon_each_epoch"] = False
    return base.replace(**overrides)


def _run_train(args) -> int:
    config = _train_config(args)
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads={args.threads} is invalid: must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    from dpmf.train.run import train

    try:
        train(config, args.out, resume=args.resume, progress=not args.no_progress)
    except FloatingPointError as exc:  # NaN/inf at a named step; the weights stayed finite
        print(f"dpmf train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"dpmf train: interrupted; the last completed epoch is in {args.out}/checkpoint.pt "
            "(continue with --resume)",
            file=sys.stderr,
        )
        return 130
    return 0


_COMMANDS.append((_add_train, _run_train))


# --------------------------------------------------------------------------------------------
# dpmf epsilon / dpmf calibrate: privacy accounting of a training run


def _add_accounting_flags(p: argparse.ArgumentParser, target: str) -> None:
    from dpmf.accountants import ACCOUNTANTS, SCHEMES
    from dpmf.workloads import SCHEDULES

    p.add_argument("--scheme", required=True, choices=SCHEMES, help="batch-sampling scheme")
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
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed (default 0)")
    p.add_argument("--confidence", type=float, default=0.99, help="Monte Carlo confidence (default 0.99)")
    p.add_argument("--min-sep", type=int, default=None, help="cyclic_poisson groups b' (default: bands of C)")
    p.add_argument("--no-progress", action="store_true", help="no Monte Carlo progress bar")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _accounting_run(args) -> dict:
    """Validate every flag (no work), then build the strategy; the keyword arguments of
    ``account``/``calibrate``."""
    from dpmf._validation import check_int, check_real
    from dpmf.accountants.api import _check_accountant, _check_mc
    from dpmf.accountants.schemes import check_run
    from dpmf.mechanisms import parse_factorization

    N = check_int("dataset_size", args.dataset_size, minimum=1)
    B = check_int("batch_size", args.batch_size, minimum=1)
    if args.steps is not None:
        steps = check_int("steps", args.steps, minimum=1)
    else:
        steps = check_int("epochs", args.epochs, minimum=1) * (-(-N // B)) if B <= N else 1
    check_run(args.scheme, N, B, steps, None, args.min_sep)
    check_real("delta", args.delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    _check_accountant(args.accountant, args.scheme)
    _check_mc(args.samples, args.seed, args.confidence)
    spec = None
    if args.factorization is not None:
        name, _ = parse_factorization(args.factorization)
        spec = None if name == "identity" else args.factorization
    if spec is not None and args.scheme in ("poisson", "epoch_balls_in_bins"):
        raise UsageError(f"--factorization {spec} is invalid with --scheme {args.scheme} (DP-SGD only)")
    schedule = _schedule_from_args(args)
    factorization = None
    if spec is not None:
        from dpmf.pick import build_strategy
        from dpmf.workloads import from_schedule, prefix_sum

        workload = prefix_sum(steps) if schedule is None else from_schedule(schedule, steps)
        # optimized strategies are optimized for the participation of the scheme, as in pick/train
        factorization = build_strategy(workload, spec, args.scheme, -(-N // B))
    return dict(
        dataset_size=N,
        batch_size=B,
        steps=steps,
        factorization=factorization,
        accountant=args.accountant,
        samples=args.samples,
        seed=args.seed,
        confidence=args.confidence,
        min_sep=args.min_sep,
        progress=False if args.no_progress else None,
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
    from dpmf.accountants import account

    sigma = check_real("noise_multiplier", args.noise_multiplier, low=0.0, low_inclusive=False)
    kwargs = _accounting_run(args)
    result = account(args.scheme, noise_multiplier=sigma, delta=args.delta, **kwargs)
    _print_result(result, args.json)
    return 0


_COMMANDS.append((_add_epsilon, _run_epsilon))


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
    from dpmf.accountants import calibrate

    epsilon = check_real("epsilon", args.epsilon, low=0.0, low_inclusive=False)
    kwargs = _accounting_run(args)
    if kwargs["confidence"] is None:
        kwargs["confidence"] = 0.99
    result = calibrate(args.scheme, epsilon=epsilon, delta=args.delta, **kwargs)
    _print_result(result, args.json)
    return 0


_COMMANDS.append((_add_calibrate, _run_calibrate))


# --------------------------------------------------------------------------------------------
# dpmf pick: which factorization, how many bands and how much noise for a privacy budget


def _add_pick(sub):
    from dpmf.pick import PICK_SCHEMES
    from dpmf.workloads import SCHEDULES

    p = sub.add_parser(
        "pick",
        help="rank strategies by σ × error for a privacy budget and recommend one",
        description=(
            "Calibrate the noise multiplier of every candidate strategy to (ε, δ) under its "
            "batch-sampling scheme and rank them by the noise on the trained model, σ·MaxSE "
            "and σ·MeanSE (units: clip norm per expected batch)."
        ),
    )
    p.add_argument("--dataset-size", type=int, required=True, help="N, number of examples")
    p.add_argument("--batch-size", type=int, required=True, help="B (expected) batch size, 1..N")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=int, help="steps = epochs × ceil(N/B)")
    length.add_argument("--steps", type=int, help="number of steps n")
    p.add_argument("--epsilon", type=float, required=True, help="target ε > 0")
    p.add_argument("--delta", type=float, required=True, help="δ in (0, 1)")
    p.add_argument("--schedule", required=True, choices=SCHEDULES, help="learning-rate schedule")
    p.add_argument("--beta", type=float, default=None, help="final multiplier β in (0, 1]")
    p.add_argument("--gamma", type=float, default=None, help="power γ of polynomial/inverse_power")
    p.add_argument("--max-bands", type=int, default=64, help="memory budget: bands or BLT buffers")
    p.add_argument("--scheme", choices=PICK_SCHEMES, default="auto", help="batch sampling (default auto)")
    p.add_argument("--metric", choices=("mean_se", "max_se"), default="mean_se", help="rank by")
    p.add_argument("--no-optimized", action="store_true", help="skip bisr_opt/bsr_opt/blt/dense")
    p.add_argument("--dense-max-steps", type=int, default=1024, help="dense only when n ≤ this")
    p.add_argument("--accountant", choices=("pld", "rdp", "prv"), default=None)
    p.add_argument("--samples", type=int, default=None, help="Monte Carlo samples (balls_in_bins)")
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    p.add_argument("--confidence", type=float, default=0.99, help="Monte Carlo confidence")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _run_pick(args) -> int:
    import json

    from dpmf._validation import check_int
    from dpmf.pick import pick

    N = check_int("dataset_size", args.dataset_size, minimum=1)
    B = check_int("batch_size", args.batch_size, minimum=1)
    if args.steps is not None:
        steps = check_int("steps", args.steps, minimum=1)
    else:
        steps = check_int("epochs", args.epochs, minimum=1) * (-(-N // B))
    schedule = _schedule_from_args(args)
    result = pick(
        dataset_size=N,
        batch_size=B,
        steps=steps,
        epsilon=args.epsilon,
        delta=args.delta,
        schedule=schedule,
        max_bands=args.max_bands,
        scheme=args.scheme,
        metric=args.metric,
        optimized=not args.no_optimized,
        dense_max_steps=args.dense_max_steps,
        accountant=args.accountant,
        samples=args.samples,
        seed=args.seed,
        confidence=args.confidence,
        progress=False if args.no_progress else None,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    _print_pick(result)
    return 0


def _print_pick(result) -> None:
    print(
        f"N={result.dataset_size} B={result.batch_size} steps={result.steps} "
        f"target ε={result.target_epsilon:g} δ={result.delta:g} schedule={result.schedule} "
        f"β={result.beta:g}; ranked by σ×{result.metric}"
    )
    head = (
        f"{'#':>3} {'factorization':<14} {'scheme':<15} {'sigma':>8} {'sens':>8} {'MaxSE':>9} "
        f"{'MeanSE':>9} {'σ·MaxSE':>9} {'σ·MeanSE':>9} {'ε':>7} {'guarantee':<11}"
    )
    print(head)
    for i, e in enumerate(result.ranking, 1):
        print(
            f"{i:>3} {e.factorization:<14} {e.scheme:<15} {e.noise_multiplier:>8.4f} "
            f"{e.sensitivity:>8.4f} {e.max_se:>9.4f} {e.mean_se:>9.4f} {e.noise_max_se:>9.4f} "
            f"{e.noise_mean_se:>9.4f} {e.epsilon:>7.4f} {e.guarantee:<11}"
        )
    for spec, reason in result.skipped:
        print(f"    skipped {spec}: {reason}")
    r = result.recommendation
    print(
        f"recommendation: {r.factorization} under {r.scheme} with noise_multiplier "
        f"{r.noise_multiplier:.6g} (ε={r.epsilon:.4g} at δ={r.delta:g}, {r.accountant}, "
        f"{r.guarantee}); {result.seconds:.1f} s"
    )


_COMMANDS.append((_add_pick, _run_pick))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
