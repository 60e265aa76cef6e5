"""The ``dpmf`` command: a thin layer over the library's functions.

Each sub-command is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args)``. Flags are
validated first; bad input exits with status 2 and a one-line reason on stderr
(the project's command-line contract, ``docs/architecture.md``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


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


_COMMANDS: list = []


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``dpmf`` parser with every command, or with the command ``only`` alone (its flags'
    choices import parts of the library: building one command's keeps start-up short)."""
    parser = argparse.ArgumentParser(
        prog="dpmf",
        description="Differentially private training with correlated noise (matrix factorization).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add, run in _COMMANDS:
        if only is None or name == only:
            p = add(sub)
            p.set_defaults(_run=run)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command named by ``argv`` (its first word, when it is one), else None."""
    names = {name for name, _, _ in _COMMANDS}
    return argv[0] if argv and argv[0] in names else None


class _ConsoleHandler(logging.Handler):
    """The library's log records as the command's own output: INFO on stdout, WARNING and above
    on stderr, the message alone. The stream is looked up at each record, so redirections made
    after the handler was installed (tests, notebooks) are honoured."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except _StdoutError:  # the command ends with one line, not a logging traceback
            raise
        except Exception:  # pragma: no cover - logging must not raise
            self.handleError(record)


def _configure_logging() -> None:
    """Install the console handler on the ``dpmf`` logger once (the library installs none)."""
    logger = logging.getLogger("dpmf")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        handler = _ConsoleHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def run() -> None:
    """The ``dpmf`` command: ``main()``, then exit with its status.

    After a stop by SIGINT/SIGTERM (130/143) ``results.json`` and the checkpoint are already on
    disk (atomic writes), so the process leaves without the interpreter's teardown, where a C++
    worker thread interrupted mid-operation can abort it (SIGABRT) and hide the exit status.
    """
    code = main()
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the ``dpmf`` command ``argv`` (default ``sys.argv[1:]``); return the exit status.

    0 success; 2 bad input (one line on stderr, before any work); 1 a failure while working:
    a file that could not be written (disk full, …), a standard output that cannot be written
    (``> /dev/full``, a closed pipe), a numerical failure; 130/143 ``dpmf train`` stopped by
    SIGINT/SIGTERM. Never a traceback for these.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command_of(argv))
    args = parser.parse_args(argv)
    _configure_logging()
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)  # a failed write to it is told apart from other files'
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # a full or closed standard output fails here, not at exit
        return status
    except _StdoutError as exc:
        _silence(stdout)
        _error(args, f"cannot write to standard output ({exc.strerror or exc})")
        return 1
    except (UsageError, ValueError, TypeError, FileNotFoundError) as exc:
        _error(args, exc)
        return 2
    except OSError as exc:  # a file that could not be written (dpmf._io.WriteError: one line)
        _error(args, exc)
        return 1
    finally:
        sys.stdout = stdout


def _dispatch(args) -> int:
    """Check ``--out`` (before any work), then run the command under its Monte Carlo limit."""
    out = getattr(args, "out", None)
    if out is not None:  # every command that writes files: refuse a bad folder before any work
        from dpmf._io import check_out_dir

        check_out_dir(out, name="--out")
    limit = getattr(args, "max_samples", None)
    if limit is None:
        return int(args._run(args) or 0)
    from dpmf.accountants.montecarlo import sample_limit

    with sample_limit(limit):
        return int(args._run(args) or 0)


def _error(args, message) -> None:
    """One line on stderr: ``dpmf COMMAND: error: message`` (stderr itself may be gone)."""
    try:
        print(f"dpmf {args.command}: error: {message}", file=sys.stderr)
        sys.stderr.flush()
    except OSError:
        pass


class _StdoutError(OSError):
    """Standard output could not be written (a full device, a closed pipe)."""


class _Stdout:
    """``sys.stdout`` during a command: the same stream, whose write errors become
    ``_StdoutError``."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _StdoutError(exc.errno, exc.strerror or str(exc)) from None

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as exc:
            raise _StdoutError(exc.errno, exc.strerror or str(exc)) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _silence(stream) -> None:
    """Point a broken standard output at the null device, so that the interpreter's last flush
    of what is left in its buffer does not fail again (a file without a descriptor: nothing)."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):  # not a real file (tests, notebooks)
        pass


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


def _add_figure_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="png", choices=("png", "pdf", "svg"), help="figure format")
    p.add_argument("--dpi", type=int, default=150, help="figure resolution of a PNG (default 150)")


def _check_figure_flags(args) -> None:
    if not 10 <= args.dpi <= 2400:
        raise UsageError(f"--dpi={args.dpi} is invalid: must be an integer in [10, 2400]")


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


_COMMANDS.append(("curves", _add_curves, _run_curves))


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


_COMMANDS.append(("colormap", _add_colormap, _run_colormap))


# --- train --------------------------------------------------------------------------------


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


def _accountants(poisson: bool = False) -> tuple[str, ...]:
    """The registered accountant names (``dpmf.accountants.registry``); ``poisson``: those of
    Poisson-subsampled Gaussian events."""
    from dpmf.accountants.events import PoissonGaussianEvent
    from dpmf.accountants.registry import ACCOUNTANTS, accountants_for

    return accountants_for(PoissonGaussianEvent) if poisson else tuple(ACCOUNTANTS)


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
        "--distributed-mode",
        str,
        "with --distributed: sharded (default; each parameter's noise and update on one owner "
        "rank)|replicated|rank0",
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


_COMMANDS.append(("train", _add_train, _run_train))


# --------------------------------------------------------------------------------------------
# dpmf epsilon / dpmf calibrate: privacy accounting of a training run


def _add_max_samples_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="refuse a Monte Carlo query needing more samples per direction (default 1e9)",
    )


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
    from dpmf.plan import account

    sigma = check_real("noise_multiplier", args.noise_multiplier, low=0.0, low_inclusive=False)
    plan, mc = _accounting_plan(args)
    result = account(plan, sigma, delta=args.delta, **mc)
    _print_result(result, args.json)
    return 0


_COMMANDS.append(("epsilon", _add_epsilon, _run_epsilon))


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


_COMMANDS.append(("calibrate", _add_calibrate, _run_calibrate))


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


_COMMANDS.append(("pick", _add_pick, _run_pick))


# --------------------------------------------------------------------------------------------
# dpmf fl: compliance-aware federated learning on Flower (the optional extra `fl`)

_FL_FLAGS = (
    # (flag, FLConfig field, type, help); defaults are FLConfig's
    ("--data-file", "data_file", str, "the MedMNIST .npz (pneumoniamnist[_S].npz, breastmnist[_S].npz, ...)"),
    ("--partition", "partition", str, "iid|dirichlet|shards (default iid)"),
    ("--alpha", "alpha", float, "Dirichlet concentration α > 0 (default 0.5)"),
    ("--shards", "shards", int, "label shards per client (default 2)"),
    ("--aggregator-fraction", "aggregator_fraction", float, "share of the stand-ins held out for the server"),
    ("--local-steps", "local_steps", int, "local steps per round L (default 5)"),
    ("--local-batch-size", "local_batch_size", int, "local (expected) batch size (default 16)"),
    ("--local-lr", "local_lr", float, "local learning rate (default 0.1)"),
    ("--clip-norm", "clip_norm", float, "per-example clip norm ζ (record and aggregator modes; default 1)"),
    ("--proximal-mu", "proximal_mu", float, "FedProx μ (default 0.01)"),
    ("--fedopt-eta", "fedopt_eta", float, "FedAdam/FedYogi server learning rate (default Flower's)"),
    ("--hidden", "hidden", int, "hidden width of the MLP (default 32)"),
    ("--delta", "delta", float, "δ of every ε (default 1e-5)"),
    (
        "--accountant",
        "accountant",
        str,
        lambda: (
            f"{'|'.join(_accountants(poisson=True))} (default pld). Cost per accounting (record "
            "mode: one per distinct σ and sampling rate, in background processes while the clients "
            "train), 250 steps at sampling rate 0.62: pld 0.1-0.5 s (a 1e-3 grid; 16 distinct clients "
            "add about nothing to the run), prv 4-14 s (30x pld; 16 distinct clients on 2 cores: "
            "0.5-2 min, the run waits for them), rdp 0.1 s with ε 13-30 %% larger"
        ),
    ),
    ("--max-epsilon", "max_epsilon", float, "privacy budget: stop before the round whose ε would exceed it"),
    ("--eval-fraction", "eval_fraction", float, "share of each client's records held out for evaluation"),
)


def _fl_flags() -> tuple:
    """``dpmf fl``'s settings flags: the common ones, then every registered privacy mode's
    options (``dpmf.federated.modes``), as (flag, FLConfig field, type, help)."""
    from dpmf.federated.modes import PRIVACY_MODES

    return _FL_FLAGS + tuple(tuple(o) for mode in PRIVACY_MODES.values() for o in mode.options)


def _privacy_help() -> str:
    from dpmf.federated.modes import PRIVACY_MODES

    modes = "; ".join(f"{name}: {mode.summary}" for name, mode in PRIVACY_MODES.items())
    return f"{'|'.join(PRIVACY_MODES)} (default aggregator). {modes}"


def _add_fl(sub):
    p = sub.add_parser(
        "fl",
        help="compliance-aware federated learning on Flower (needs the extra fl)",
        description="Federated training on Flower with compliance-dependent noise; every ε is "
        "reported with what it protects (aggregator-dataset records, records of client k, client).",
    )
    p.add_argument(
        "--dataset",
        default="breast-cancer",
        help="breast-cancer|fashion-mnist-2|pneumoniamnist|breastmnist|medmnist",
    )
    p.add_argument("--clients", type=int, default=16, help="number of clients K (default 16)")
    p.add_argument("--rounds", type=int, default=50, help="rounds R (default 50)")
    p.add_argument("--strategy", default="fedavg", help="fedavg|fedmedian|fedprox|fedadam|fedyogi")
    p.add_argument("--privacy", default="aggregator", help=_privacy_help())
    p.add_argument(
        "--compliance", default=None, help="YAML of the clients' compliance profiles (default: example)"
    )
    p.add_argument(
        "--criteria-weights",
        default=None,
        help="weights of the five criteria, e.g. hipaa=0.3,gdpr=0.3,nist=0.2,iso=0.1,hl7_fhir=0.1 "
        "(default: the file's, else equal)",
    )
    p.add_argument("--compliant-only", action="store_true", help="train with the compliant clients only")
    p.add_argument(
        "--allocation", default="weighted", help="weighted (σ_k from scores) | uniform (equal mean)"
    )
    p.add_argument("--noise-map", default="linear", help="linear|exponential|table (score -> σ)")
    p.add_argument("--sigma-min", type=float, default=0.8, help="σ at score 1 (default 0.8)")
    p.add_argument("--sigma-max", type=float, default=2.0, help="σ at score 0 (default 2.0)")
    p.add_argument("--noise-table", default=None, help="for --noise-map table: 0:2.0,0.5:1.2,0.8:0.8")
    p.add_argument(
        "--seeds",
        default=None,
        help="reproducible seeds, a range 0-4 or a list 0,1,2 (their noise is predictable to whoever "
        "knows them); default: secret keys",
    )
    p.add_argument(
        "--replicas", type=int, default=None, help="replicas with secret keys, numbered 0..N-1 (default 1)"
    )
    p.add_argument("--backend", default="local", help="local (in-process, deterministic) | ray")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1; with 1, record mode steps its clients in one process "
        "per usable core, the same results)",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run's files in --out (its ledger is lost)",
    )
    for flag, _, kind, text in _fl_flags():
        p.add_argument(flag, type=kind, default=None, help=text() if callable(text) else text)
    return p


def _noise_table(text: str) -> tuple:
    rows = []
    for item in _csv_list(text, name="--noise-table"):
        t, _, s = item.partition(":")
        try:
            rows.append((float(t), float(s)))
        except ValueError:
            raise UsageError(
                f"--noise-table {text!r} is invalid: give threshold:sigma pairs, e.g. 0:2,0.8:0.8"
            ) from None
    return tuple(rows)


def _criteria_weights(text: str) -> dict:
    out = {}
    for item in _csv_list(text, name="--criteria-weights"):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UsageError(
                f"--criteria-weights {text!r} is invalid: give name=weight pairs, e.g. hipaa=0.3"
            ) from None
    return out


def _run_fl(args) -> int:
    from dpmf._validation import check_int
    from dpmf.federated.report import parse_seeds

    threads = _fl_preflight(args)
    noise_map = _fl_noise_map(args)
    if args.seeds is not None and args.replicas is not None:
        raise UsageError(
            "--seeds and --replicas are exclusive: give seeds (reproducible) or replicas (secret keys)"
        )
    seeds = None if args.seeds is None else parse_seeds(args.seeds)
    replicas = 1 if args.replicas is None else check_int("replicas", args.replicas, minimum=1)
    weights = None
    if args.criteria_weights is not None:
        from dpmf.federated.compliance import check_weights

        weights = check_weights(_criteria_weights(args.criteria_weights))
    _fl_files(args)
    config = _fl_config(args, noise_map)
    compliance = _fl_compliance(args, weights, config.num_clients)
    from dpmf.federated.run import start_ahead

    # the first run's background work (record mode: its accountings) runs while torch loads
    start_ahead(config.replace(seed=None if seeds is None else seeds[0], replica=0), compliance,
                backend=args.backend)  # fmt: skip
    import torch

    torch.set_num_threads(threads)
    from dpmf.federated.report import run_seeds, summarize

    try:
        results = run_seeds(
            config, seeds, replicas=replicas, out_dir=args.out, compliance=compliance, backend=args.backend
        )
    except (ImportError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    print(summarize(results))
    print(f"wrote {args.out}/{{metrics.csv, ledger.json, summary.csv}}")
    return 0


def _fl_preflight(args) -> int:
    """The backend's name and the thread count (returned) of ``dpmf fl``."""
    from dpmf._validation import check_choice, check_int

    check_choice("backend", args.backend, ("local", "ray"))
    return check_int("threads", args.threads, minimum=1)


def _fl_noise_map(args):
    """The score → σ map of ``--noise-map``/``--sigma-min``/``--sigma-max``/``--noise-table``."""
    from dpmf.federated.compliance import NoiseMap

    if args.noise_map == "table":
        if args.noise_table is None:
            raise UsageError("--noise-map table needs --noise-table (e.g. 0:2.0,0.5:1.2,0.8:0.8)")
        return NoiseMap("table", table=_noise_table(args.noise_table))
    if args.noise_table is not None:
        raise UsageError("--noise-table needs --noise-map table")
    return NoiseMap(args.noise_map, args.sigma_min, args.sigma_max)


def _fl_files(args) -> None:
    """The input files exist, Flower is installed, and ``--out`` holds no earlier ledger (unless
    ``--overwrite``)."""
    if args.compliance is not None and not os.path.isfile(args.compliance):
        raise UsageError(f"--compliance {args.compliance!r} is invalid: no such file")
    if args.data_file is not None and not os.path.isfile(args.data_file):
        raise UsageError(f"--data-file {args.data_file!r} is invalid: no such file")
    import importlib.util

    # found, not imported (the run imports it; a module set to None in sys.modules is absent)
    if sys.modules.get("flwr", ...) is None or importlib.util.find_spec("flwr") is None:
        raise UsageError("Flower is not installed: pip install 'dpmf[fl]' (flwr==1.42.0, Python >= 3.11)")
    if not args.overwrite and os.path.exists(os.path.join(args.out, "ledger.json")):
        raise UsageError(
            f"--out {args.out!r} is invalid: it holds an earlier federated run (ledger.json), whose "
            "privacy ledger would be lost; choose another folder, or pass --overwrite"
        )


def _fl_config(args, noise_map):
    """The ``FLConfig`` of the flags (the settings flags given override its defaults; options that
    the partition or strategy ignores are refused first)."""
    from dpmf.federated.checks import flag_conflicts
    from dpmf.federated.run import FLConfig

    overrides = {
        field: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, field, _, _ in _fl_flags()
    }
    flag_conflicts(
        [k for k, v in overrides.items() if v is not None],
        partition=overrides["partition"] or "iid",
        strategy=args.strategy,
    )
    return FLConfig(
        dataset=args.dataset,
        num_clients=args.clients,
        rounds=args.rounds,
        strategy=args.strategy,
        privacy=args.privacy,
        compliant_only=args.compliant_only,
        allocation=args.allocation,
        noise_map=noise_map,
        **{k: v for k, v in overrides.items() if v is not None},
    )


def _fl_compliance(args, weights, num_clients: int):
    """The clients' profiles: ``--compliance``'s file, the example's with ``--criteria-weights``,
    or None (the example)."""
    if args.compliance is not None:
        from dpmf.federated.compliance import load_profiles

        return load_profiles(args.compliance, weights=weights)
    if weights is None:
        return None
    from dpmf.federated.compliance import ComplianceSet, example_profiles

    ex = example_profiles(num_clients)
    return ComplianceSet(ex.profiles, weights, ex.compliant_threshold, source="example")


_COMMANDS.append(("fl", _add_fl, _run_fl))


# --------------------------------------------------------------------------------------------
# dpmf audit: a training run with canaries and an empirical ε lower bound (dpmf.audit)


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


_COMMANDS.append(("audit", _add_audit, _run_audit))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
