"""``dpmf pick``: which factorization, how many bands and how much noise for a privacy budget
(every candidate calibrated to (ε, δ) and ranked by σ × error).
"""

from __future__ import annotations

from dpmf.cli._common import _accountants, _add_max_samples_flag, _schedule_from_args


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
    p.add_argument("--accountant", choices=_accountants(poisson=True), default=None)
    p.add_argument("--samples", type=int, default=None, help="Monte Carlo samples (balls_in_bins)")
    _add_max_samples_flag(p)
    p.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    p.add_argument("--confidence", type=float, default=0.99, help="Monte Carlo confidence")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="worker processes, >= 1 (default: one per core; 1: in process); same result for any",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _run_pick(args) -> int:
    import json

    from dpmf._validation import check_int
    from dpmf.pick import default_jobs, pick

    jobs = default_jobs() if args.jobs is None else check_int("jobs", args.jobs, minimum=1)
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
        jobs=jobs,
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


COMMANDS = [("pick", _add_pick, _run_pick)]
