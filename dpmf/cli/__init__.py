"""The ``dpmf`` command: a thin layer over the library's functions.

One module per command (``curves``, ``colormap``, ``train``, ``epsilon`` with ``calibrate``,
``pick``, ``fl``, ``audit``; helpers of several in ``_common``), each listing its commands in
``COMMANDS`` as (name, ``_add_<name>(subparsers)``, ``_run_<name>(args)``); this module builds
the parser from them and runs a command. Flags are validated first; bad input exits with status 2 and a
one-line reason on stderr (the project's command-line contract, ``docs/architecture.md``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dpmf.cli import audit, colormap, curves, epsilon, fl, pick, train
from dpmf.cli._common import UsageError

__all__ = ["main", "build_parser"]

# (name, add(subparsers) -> parser, run(args) -> status), in the order of ``dpmf --help``
_COMMANDS: list = [
    *curves.COMMANDS,
    *colormap.COMMANDS,
    *train.COMMANDS,
    *epsilon.COMMANDS,
    *pick.COMMANDS,
    *fl.COMMANDS,
    *audit.COMMANDS,
]


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

    After a stop by SIGINT/SIGTERM (130/143), and after any run started by torchrun (its gloo
    or NCCL worker threads), ``results.json`` and the checkpoint are already on disk (atomic
    writes), so the process leaves without the interpreter's teardown, where a C++ worker thread
    can abort it (SIGABRT: "terminate called without an active exception") and hide the exit
    status from torchrun.
    """
    code = main()
    if code in (130, 143) or "TORCHELASTIC_RUN_ID" in os.environ:
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
