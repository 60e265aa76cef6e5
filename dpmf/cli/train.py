"""``dpmf train``: private training (its flags over a ``TrainConfig``, the checks of flags that
would be ignored, the run under SIGINT/SIGTERM handlers that stop it cleanly). ``dpmf audit``
takes its flags and checks from here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from dpmf.cli._common import UsageError, _accountants, _csv_list


def real_list(text: str) -> tuple[float, ...]:
    """A comma-separated list of reals, e.g. ``1,-0.9`` (filter coefficients).

    Raises:
        argparse.ArgumentTypeError: an empty item or one that is not a number (argparse
            reports it in one line with the flag).
    """
    try:
        return tuple(_csv_list(text, float, name="value"))
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _optimizer_choices() -> str:
    """The registered optimizer names, "a|b|c" (``dpmf.optim.registry``)."""
    from dpmf.optim.registry import optimizer_names

    return "|".join(optimizer_names())


_TRAIN_FLAGS = (
    # (flag, type, help); defaults are None so that only the flags given override the config
    ("--dataset", str, "fashion-mnist|cifar10|digits (default fashion-mnist; digits when absent)"),
    ("--data-dir", str, "folder with the data set's files (must exist when given)"),
    ("--model", str, "cnn|cnn3|mlp|wrn16-4 (default cnn)"),
    ("--optimizer", str, lambda: f"{_optimizer_choices()} (default dp-sgd)"),
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
    ("--seed", int, "seed of weights, batches, noise (default: a secret key; a seed makes it predictable)"),
    ("--device", str, "auto|cpu|cuda (default auto: CUDA when available)"),
    ("--micro-batch-size", int, "per-example gradients held at once (gradient accumulation)"),
    (
        "--clipping",
        str,
        "per-example clipping: auto|vmap|ghost|bk (default auto: ghost norms with book-keeping "
        "where every layer allows it, else torch.func vmap)",
    ),
    ("--accountant", str, lambda: f"{'|'.join(_accountants())} (default: the scheme's)"),
    ("--samples", int, "Monte Carlo samples for the balls-in-bins schemes"),
    ("--eval-batch-size", int, "test batch size"),
    (
        "--log-every",
        int,
        "every K steps: training loss, clipped fraction, lr to steps.csv (and TensorBoard if installed)",
    ),
    (
        "--noise-keys",
        str,
        "chunked|stream: raw noise keyed by step, parameter and chunk (default: the noise of a "
        "--distributed run at any number of processes) or by step (checkpoints of earlier runs)",
    ),
    (
        "--noise-generator",
        str,
        "device|torch-mt19937|torch-philox-cuda|numpy-philox: what makes the raw normals (default: "
        "torch's generator on the training device; numpy-philox: the numbers of earlier versions)",
    ),
    (
        "--distributed-mode",
        str,
        "with --distributed: sharded (default; each parameter's noise and update on one owner "
        "rank)|replicated|rank0|fsdp (= --fsdp)",
    ),
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
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (needs one)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the files of an earlier run in OUT (without it, such a folder is refused)",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=float, default=None, help="target ε (σ is calibrated)")
    budget.add_argument("--noise-multiplier", type=float, default=None, help="σ (ε is computed)")
    for flag, kind, text in _TRAIN_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=text() if callable(text) else text)
    p.add_argument("--no-epsilon-each-epoch", action="store_true", help="account ε only for the whole run")
    p.add_argument("--threads", type=int, default=None, help="threads of torch and of the BLAS/OpenMP pools")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="one of W processes started by torchrun --nproc-per-node W -m dpmf train ... "
        "(gloo on CPU, NCCL on GPUs); the same noise and ε as one process",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="with --distributed: shard the model with fully_shard (FSDP2): each rank holds 1/W of "
        "the weights, gradients, optimizer and noise state (--distributed-mode fsdp)",
    )
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
    if args.fsdp:
        if args.distributed_mode is not None:
            raise UsageError(
                f"--fsdp and --distributed-mode={args.distributed_mode} are invalid together: --fsdp is "
                "--distributed-mode fsdp; pass one"
            )
        overrides["distributed_mode"] = "fsdp"
    return base.replace(**overrides)


# flags that act only with another one: (flag, attribute, applies(args, config), what it needs)
_TRAIN_REQUIRES = (
    ("--distributed-mode", "distributed_mode", lambda a, c: a.distributed, "--distributed"),
    ("--doppler-a", "doppler_a", lambda a, c: c.filter == "doppler", "--filter doppler"),
    ("--doppler-b", "doppler_b", lambda a, c: c.filter == "doppler", "--filter doppler"),
    ("--disk-kappa", "disk_kappa", lambda a, c: c.filter == "disk", "--filter disk"),
    ("--disk-gamma", "disk_gamma", lambda a, c: c.filter == "disk", "--filter disk"),
)


def _check_train_flags(args, config) -> None:
    """Refuse flags that would be ignored, a torchrun start without ``--distributed`` and a bad
    ``--threads``, before any work."""
    for flag, attr, applies, needs in _TRAIN_REQUIRES:
        value = getattr(args, attr)
        if value is not None and not applies(args, config):
            shown = ",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else value
            raise UsageError(
                f"{flag}={shown} is invalid without {needs}: it would be ignored; add {needs} or drop {flag}"
            )
    if args.fsdp and not args.distributed:
        raise UsageError("--fsdp is invalid without --distributed: it would be ignored; add --distributed")
    world = os.environ.get("WORLD_SIZE", "1")
    if not args.distributed and world.isdigit() and int(world) > 1:
        raise UsageError(
            f"WORLD_SIZE={world} is set (started by torchrun?) but --distributed is not: each process "
            "would train its own copy into the same --out; add --distributed"
        )
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads={args.threads} is invalid: must be >= 1")
    if args.resume and args.overwrite:
        raise UsageError(
            "--resume and --overwrite are invalid together: --resume continues the run in --out, "
            "--overwrite replaces it; pass one"
        )


class _Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, Slurm, Kubernetes, torchrun), raised in the main thread as Ctrl-C's
    ``KeyboardInterrupt`` is: the run stops the same way (``results.json`` says ``interrupted``)."""

    signal_name = "SIGTERM"


def _on_signal(signum, frame):
    """SIGINT/SIGTERM during ``dpmf train``: stop (``KeyboardInterrupt`` / ``_Terminated``) now,
    or right after a checkpoint being written is counted (``dpmf.train.loop.deliver_stop``)."""
    from dpmf.train.loop import deliver_stop

    deliver_stop(_Terminated() if signum == signal.SIGTERM else KeyboardInterrupt())


def _run_train(args) -> int:
    config = _train_config(args)
    _check_train_flags(args, config)
    if args.threads is not None:
        from dpmf.optim.threads import limit_threads

        limit_threads(args.threads)  # torch's pools and the BLAS/OpenMP ones
    import threading

    from dpmf.train.run import train

    main_thread = threading.current_thread() is threading.main_thread()  # signals: main thread only
    previous = {}
    for number in (signal.SIGINT, signal.SIGTERM) if main_thread else ():
        if signal.getsignal(number) is not signal.SIG_IGN:  # an ignored signal stays ignored
            previous[number] = signal.signal(number, _on_signal)
    try:
        train(
            config,
            args.out,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            distributed=args.distributed,
        )
        if args.distributed:
            from dpmf.distributed.launch import shutdown

            shutdown()
    except FloatingPointError as exc:  # NaN/inf at a named step; the weights stayed finite
        print(f"dpmf train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return _report_stop(args.out, exc)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0


def _report_stop(out: str, exc: KeyboardInterrupt) -> int:
    """One line on how ``dpmf train`` stopped (Ctrl-C or SIGTERM); 130 or 143 (128 + signal)."""
    if os.path.exists(os.path.join(out, "checkpoint.pt")):
        where = f"the last completed epoch is in {out}/checkpoint.pt (continue with --resume)"
    else:
        where = "no epoch was completed, so there is nothing to resume"
    how = "terminated (SIGTERM)" if isinstance(exc, _Terminated) else "interrupted"
    print(f"dpmf train: {how}; {where}", file=sys.stderr)
    return 143 if isinstance(exc, _Terminated) else 130


COMMANDS = [("train", _add_train, _run_train)]
