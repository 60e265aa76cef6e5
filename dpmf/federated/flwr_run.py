"""``dpmf fl --backend ray``: the run as the Flower app ``dpmf.federated.app`` under ``flwr run``
on Flower's simulation engine (Ray) — Flower 1.42's way to simulate (its Python entry point
``flwr.simulation.run_simulation`` is deprecated).

A temporary app folder holds a ``pyproject.toml`` with the run's config
(``runconfig.run_config_from_config``); ``flwr run --federation-config num-supernodes=P``
executes it on one simulated SuperNode per participant
with ``HOME`` in a temporary folder, so the local SuperLink it starts (127.0.0.1 only) is this
run's own, and that SuperLink is ended (by its process id) when the run is over. The ServerApp
writes the per-round metrics and the ledger to a results file in that folder (no key is in it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["run_app"]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _stop_superlink(home: str) -> None:
    """End the local SuperLink whose files live under ``home`` (this run's own)."""
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and home in cmd:
            try:
                os.kill(int(pid), signal.SIGTERM)
            except OSError:
                pass


def run_app(config, num_nodes: int, *, timeout: float = 3600.0, log=print):
    """Run ``config`` through ``flwr run`` with ``num_nodes`` simulated SuperNodes.

    Returns:
        (rows, ledger, stopped): the per-round metrics, the ``PrivacyEntry`` list, the budget's
        reason or "".

    Raises:
        RuntimeError: ``flwr run`` failed (with the end of its output) or wrote no results.
    """
    from dpmf.federated.ledger import PrivacyEntry
    from dpmf.federated.runconfig import run_config_from_config

    rc = run_config_from_config(config)
    with tempfile.TemporaryDirectory(prefix="dpmf-flwr-") as tmp:
        app_dir = Path(tmp) / "app"
        app_dir.mkdir()
        results = Path(tmp) / "results.json"
        rc["results-file"] = str(results)
        lines = [
            "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
            "[project]", 'name = "dpmf-fl-run"', 'version = "1.0.0"', 'requires-python = ">=3.11"',
            "dependencies = []", "", "[tool.hatch.build.targets.wheel]", 'packages = ["."]', "",
            "[tool.flwr.app]", 'publisher = "dpmf"', "", "[tool.flwr.app.components]",
            'serverapp = "dpmf.federated.app:app"', 'clientapp = "dpmf.federated.app:clientapp"', "",
            "[tool.flwr.app.config]", *(f"{k} = {_toml_value(v)}" for k, v in rc.items()), "",
        ]  # fmt: skip
        (app_dir / "pyproject.toml").write_text("\n".join(lines))
        flwr = Path(sys.executable).with_name("flwr")
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds the dpmf package
        env = {**os.environ, "HOME": tmp,
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
               "PATH": os.pathsep.join([str(flwr.parent), os.environ.get("PATH", "")])}  # fmt: skip
        try:
            out = subprocess.run(
                [str(flwr), "run", str(app_dir), "--federation-config", f"num-supernodes={int(num_nodes)}",
                 "--stream"], env=env, capture_output=True, text=True,
                timeout=timeout, cwd=tmp,
            )  # fmt: skip
        finally:
            _stop_superlink(tmp)
        if out.returncode != 0 or not results.is_file():
            tail = (out.stdout + out.stderr)[-1500:]
            raise RuntimeError(f"flwr run failed (exit {out.returncode}); its output ends with:\n{tail}")
        got = json.loads(results.read_text())
    ledger = []
    for e in got["ledger"]:
        e = dict(e)
        e.pop("vacuous", None)
        e["epsilon"] = math.inf if e["epsilon"] == "inf" else float(e["epsilon"])
        ledger.append(PrivacyEntry(**e))
    return got["rows"], ledger, got["stopped"]
