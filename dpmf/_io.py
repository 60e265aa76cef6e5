"""Atomic file output: write to a temporary file in the same folder, then rename.

A reader never sees a half-written file, and an interrupted run leaves the previous version.
The file gets the permissions a plain ``open(path, "w")`` would give it (0666 masked by the
process umask), not the 0600 of the temporary file. ``check_out_dir`` tells, before any work,
whether a folder can receive the files.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "atomic_write_text",
    "atomic_write_csv",
    "atomic_write_json",
    "atomic_savefig",
    "atomic_path",
    "check_out_dir",
    "file_mode",
]

_UMASK_LOCK = threading.Lock()


def file_mode() -> int:
    """The mode a new file gets from ``open()``: 0o666 without the bits of the process umask."""
    with _UMASK_LOCK:  # reading the umask means setting it; restored at once
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def check_out_dir(path, *, name: str = "out") -> Path:
    """Check that ``path`` is (or can be made) a writable folder, before any work is done.

    The nearest existing ancestor of ``path`` (``path`` itself when it exists) must be a folder
    in which a file can be created: this is tried (a temporary file, removed at once), so
    permissions, read-only file systems and pseudo file systems are all caught, for root too.
    The folder itself is not created.

    Args:
        path: the output folder.
        name: the parameter's name in the message (``out`` for ``--out``).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``path`` is a file, lies under a file, or is in a place that cannot be
            written (permissions or a read-only file system).
    """
    out = Path(path)
    if str(path) == "":
        raise ValueError(f"{name}='' is invalid: must name a folder")
    probe = out
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: creating through it would fail
            raise ValueError(f"{name}={str(path)!r} is invalid: {str(probe)!r} is a broken link")
        parent = probe.parent
        if parent == probe:
            break
        probe = parent
    if not probe.is_dir():
        where = "is a file" if probe == out else f"lies under the file {str(probe)!r}"
        raise ValueError(f"{name}={str(path)!r} is invalid: it {where}; choose a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".dpmf-write-test.")
    except OSError as exc:
        where = "" if probe == out else f" (its nearest existing folder {str(probe)!r})"
        reason = exc.strerror or type(exc).__name__
        raise ValueError(
            f"{name}={str(path)!r} is invalid: cannot write in the folder{where} ({reason}); "
            "choose another folder"
        ) from None
    os.close(fd)
    os.unlink(tmp)
    return out


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
            os.chmod(self.tmp, file_mode())  # mkstemp made it 0600
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
