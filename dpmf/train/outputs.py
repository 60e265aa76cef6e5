"""The files of a run's folder: refusing a folder that holds another run, clearing it for
``overwrite``, and ``results.json`` saying how a stopped run ended."""

from __future__ import annotations

import json
import math
import os
import shutil
import time

from dpmf._io import WriteError, atomic_write_json
from dpmf.train.ledger import LEDGER_FILE, MODEL_FILE
from dpmf.train.loop import CHECKPOINT, CURVES, METRICS
from dpmf.train.metrics import STEPS, TENSORBOARD, write_metrics_csv
from dpmf.train.shards import remove_shards

__all__ = ["RESULTS", "check_out_state", "clear_run_files", "jsonable", "record_stop", "write_results"]

RESULTS = "results.json"


def check_out_state(out_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, a run that would lose or silently replace an earlier one in
    ``out_dir``.

    * ``resume`` and ``overwrite`` together contradict each other;
    * ``resume`` needs ``out_dir/checkpoint.pt`` (otherwise a new run would start and spend the
      privacy budget again);
    * without either, ``out_dir`` must not hold a checkpoint, nor a run's released outputs
      (``model.pt``, ``privacy.json``, ``metrics.csv``, or a ``results.json`` other than that of
      a run stopped before its first epoch).

    Raises:
        ValueError: one line naming ``out_dir``, what it holds and the fix.
    """
    checkpoint = os.path.join(out_dir, CHECKPOINT)
    if resume and overwrite:
        raise ValueError(
            "resume=True and overwrite=True (--resume, --overwrite) are invalid together: resume "
            f"continues the run in {out_dir!r}, overwrite replaces it; pass one"
        )
    if overwrite:
        return
    if resume:
        if not os.path.exists(checkpoint):
            raise ValueError(
                f"resume=True (--resume) is invalid: {out_dir!r} holds no {CHECKPOINT} (nothing to resume; "
                "resuming would start a new run and spend the privacy budget again); run without "
                "--resume to start one, or pass the folder of the run to continue"
            )
        return
    if os.path.exists(checkpoint):
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds a checkpoint of an earlier run; pass --resume "
            "to continue it, --overwrite to replace it, or choose another --out"
        )
    found = [
        name for name in (MODEL_FILE, LEDGER_FILE, METRICS) if os.path.exists(os.path.join(out_dir, name))
    ]
    if _results_of_a_run(os.path.join(out_dir, RESULTS)):
        found.insert(0, RESULTS)
    if found:
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds the outputs of an earlier run "
            f"({', '.join(found)}) and no checkpoint to resume; pass --overwrite to replace them "
            "or choose another --out"
        )


def _results_of_a_run(path: str) -> bool:
    """Whether ``results.json`` at ``path`` describes a run with outputs: any file but that of a
    run stopped (interrupted or failed) before its first epoch."""
    if not os.path.exists(path):
        return False
    try:
        with open(path) as fh:
            res = json.load(fh)
    except (OSError, ValueError):
        return True  # unreadable: not ours to replace silently
    return not (
        isinstance(res, dict)
        and res.get("status") in ("interrupted", "failed")
        and res.get("completed_epochs") == 0
    )


def clear_run_files(out_dir: str) -> None:
    """Remove an earlier run's files from ``out_dir`` (``overwrite=True``, after validation)."""
    remove_shards(os.path.join(out_dir, CHECKPOINT))
    for name in (CHECKPOINT, MODEL_FILE, LEDGER_FILE, METRICS, CURVES, STEPS, RESULTS):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    board = os.path.join(out_dir, TENSORBOARD)
    if os.path.isdir(board):
        shutil.rmtree(board)


def _stopped(header: dict, exc: BaseException, done: list, checkpoint: str, began: float) -> dict:
    """``header`` updated to say how the run stopped: ``interrupted`` (Ctrl-C, SIGTERM) or
    ``failed`` (with the error's one line), and the last checkpointed epoch and step."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    header.update(
        status="interrupted" if interrupted else "failed",
        error=None if interrupted else f"{type(exc).__name__}: {exc}",
        completed_epochs=len(done),
        checkpoint_step=int(done[-1]["step"]) if done else 0,
        checkpoint=CHECKPOINT if done and os.path.exists(checkpoint) else None,
        wall_seconds=round(time.perf_counter() - began, 2),
    )
    signal_name = getattr(exc, "signal_name", None)
    if signal_name is not None:
        header["signal"] = signal_name
    return header


def record_stop(out_dir: str, header: dict, exc: BaseException, done: list, checkpoint: str, began) -> None:
    """Write ``results.json`` (and ``metrics.csv``) of a run that stopped, agreeing with the last
    checkpoint written; a write that fails in turn (the disk still full) is left unreported, the
    first error being the one that matters."""
    _stopped(header, exc, done, checkpoint, began)
    try:
        if done:
            write_metrics_csv(os.path.join(out_dir, METRICS), done)
        write_results(out_dir, header)
    except WriteError:
        pass


def jsonable(obj):
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def write_results(out_dir: str, header: dict) -> None:
    """``out_dir/results.json`` (atomically; non-finite numbers as strings)."""
    atomic_write_json(os.path.join(out_dir, RESULTS), jsonable(header))
