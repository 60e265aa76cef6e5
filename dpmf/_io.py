"""Atomic file output: write to a temporary file in the same folder, then rename.

A reader never sees a half-written file, and an interrupted run leaves the previous version.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["atomic_write_text", "atomic_write_csv", "atomic_write_json", "atomic_savefig", "atomic_path"]


class atomic_path:
    """Context manager yielding a temporary path next to ``path``; on success it replaces
    ``path`` atomically (``os.replace``), on error it is removed."""

    def __init__(self, path, suffix: str | None = None):
        self.path = Path(path)
        self.suffix = suffix if suffix is not None else self.path.suffix

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=self.suffix)
        os.close(fd)
        self.tmp = Path(tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)
        return False


def atomic_write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_csv(path, header: Sequence[str], rows: Iterable[Sequence]) -> Path:
    """Write a CSV with ``header`` and ``rows`` atomically; return the path."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return Path(path)


def atomic_write_json(path, obj) -> Path:
    """Write ``obj`` as indented JSON atomically; return the path."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_savefig(fig, path, **kwargs) -> Path:
    """Save a matplotlib figure atomically (format from ``path``'s suffix); return the path."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", **kwargs)
    return Path(path)
