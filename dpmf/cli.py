"""The ``dpmf`` command: a thin layer over the library's functions.

Each sub-command is a pair ``_add_<name>(subparsers)`` / ``_run_<name>(args)``. Flags are
validated first; bad input exits with status 2 and a one-line reason on stderr
(the command-line contract of DESIGN.md).
"""

from __future__ import annotations

import argparse
import sys

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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
