"""``dpmf fl --backend ray``: the run as the Flower app ``dpmf.federated.app`` under ``flwr run``
on Flower's simulation engine (Ray) — Flower 1.42's way to simulate (its Python entry point
``flwr.simulation.run_simulation`` is deprecated).

A temporary app folder holds a ``pyproject.toml`` with the run's config
(``runconfig.run_config_from_config``); ``flwr run --federation-config num-supernodes=P``
executes it on one simulated SuperNode per participant
with ``HOME``, ``FLWR_HOME`` and Ray's files in a temporary folder and the local SuperLink on two
free loopback ports (``local_superlink_env``), so the SuperLink it starts (127.0.0.1 only) is this
run's own even when another one (a ``flwr run`` of the user's, which Flower leaves running) holds
Flower's default ports. When the run is over, or fails, or times out, every process started for
it (the SuperLink, its SuperExec, the simulation and Ray) is ended by its process group
(``stop_processes``: they all carry that ``FLWR_HOME``). The ServerApp writes the per-round
metrics and the ledger to a results file in that folder (no key is in it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["local_superlink_env", "run_app", "stop_processes"]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (bound together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_superlink_env(home: str) -> dict[str, str]:
    """The environment that gives ``flwr run`` a local SuperLink of its own: ``HOME``,
    ``FLWR_HOME`` (``home/.flwr``: its configuration, database, log and apps) and ``RAY_TMPDIR``
    under ``home``, and two free loopback ports for the SuperLink's APIs (Flower's defaults,
    39091 and 39093, would join a SuperLink already running there)."""
    api, control = _free_ports(2)
    return {
        "HOME": home,
        "FLWR_HOME": str(Path(home) / ".flwr"),
        "RAY_TMPDIR": str(Path(home) / "ray"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(api),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control),
    }


def _marked(needle: bytes) -> list[int]:
    """The processes whose environment holds ``needle`` (a ``NAME=value`` entry)."""
    pids = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(pid))
    return pids


def stop_processes(home: str, grace: float = 5.0) -> list[int]:
    """End every process started under ``local_superlink_env(home)`` (its ``FLWR_HOME`` is in
    their environment: ``flwr run``, the SuperLink, its SuperExec, the simulation, Ray): SIGTERM
    to their process groups, SIGKILL to what is left after ``grace`` seconds.

    Returns:
        the process ids found (empty: none was running).
    """
    needle = f"FLWR_HOME={Path(home) / '.flwr'}".encode()
    own = os.getpgid(0)
    found: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _marked(needle)
        if not pids:
            break
        found.extend(p for p in pids if p not in found)
        for pid in pids:
            try:
                group = os.getpgid(pid)
                if group != own:  # their own groups (Flower detaches the SuperLink and SuperExec)
                    os.killpg(group, sig)
                else:
                    os.kill(pid, sig)
            except OSError:  # already gone
                pass
        end = time.monotonic() + grace
        while time.monotonic() < end and _marked(needle):
            time.sleep(0.1)
    return found


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
        env = {**os.environ, **local_superlink_env(tmp),
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
               "PATH": os.pathsep.join([str(flwr.parent), os.environ.get("PATH", "")])}  # fmt: skip
        try:
            out = subprocess.run(
                [str(flwr), "run", str(app_dir), "--federation-config", f"num-supernodes={int(num_nodes)}",
                 "--stream"], env=env, capture_output=True, text=True,
                timeout=timeout, cwd=tmp, start_new_session=True,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"flwr run failed: it did not end within {timeout:g} s") from None
        finally:
            stop_processes(tmp)
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
