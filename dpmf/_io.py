"""Atomic file output: write to a temporary file in the same folder, then rename.

A reader never sees a half-written file, and an interrupted run leaves the previous version.
A shareable file gets the permissions a plain ``open(path, "w")`` would give it (0666 masked by
the process umask). A file holding secrets (``private=True``: checkpoints, with the noise seed)
stays 0600 from the moment it is created: the temporary file is created 0600 (``O_CREAT |
O_EXCL``, mode 0o600) and renamed as it is, so no other user can read it at any moment.
A failed write (disk full, quota, I/O error) raises ``WriteError``: one line naming the file
and the cause; the temporary file is removed and the previous version kept.
``check_out_dir`` tells, before any work, whether a folder can receive the files.
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
    "WriteError",
    "PRIVATE_MODE",
]

PRIVATE_MODE = 0o600


class WriteError(OSError):
    """A file could not be written (disk full, quota, I/O error, permissions): ``str()`` is one
    line naming the file and the cause; ``errno`` is the underlying one."""

    def __init__(self, path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or type(cause).__name__)
        self.path = str(path)
        self.cause = cause

    def __str__(self) -> str:
        reason = self.cause.strerror or str(self.cause) or type(self.cause).__name__
        return f"could not write {self.path!r} ({reason}); the previous version of the file, if any, is kept"


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
    ``path`` atomically (``os.replace``), on error it is removed.

    Args:
        path: the final file.
        suffix: the temporary file's suffix (default: ``path``'s).
        private: keep the file 0600 (it holds secrets); otherwise it gets the umask's mode.

    Raises:
        WriteError: an ``OSError`` while creating, writing or renaming (one line with the file).
    """

    def __init__(self, path, suffix: str | None = None, *, private: bool = False):
        self.path = Path(path)
        self.suffix = suffix if suffix is not None else self.path.suffix
        self.private = bool(private)

    def __enter__(self) -> Path:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # mkstemp opens with O_CREAT | O_EXCL and mode 0o600: private from the first byte
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=self.suffix)
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        if self.private:
            os.fchmod(fd, PRIVATE_MODE)  # whatever the platform's mkstemp did
        os.close(fd)
        self.tmp = Path(tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                if not self.private:
                    os.chmod(self.tmp, file_mode())  # mkstemp made it 0600
                os.replace(self.tmp, self.path)
                return False
            except OSError as err:
                self.tmp.unlink(missing_ok=True)
                raise WriteError(self.path, err) from None
        self.tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(self.path, exc) from None
        return False


def atomic_write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_csv(path, header: Sequence[str], rows: Iterable[Sequence], *, private: bool = False) -> Path:
    """Write a CSV with ``header`` and ``rows`` atomically (0600 when ``private``); return the path."""
    with atomic_path(path, private=private) as tmp, open(tmp, "w", newline="") as fh:
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
