"""``flwr run examples/flower`` on Flower's simulation engine (Ray), offline on the bundled
stand-in data, loopback only: it stops by itself and prints the ε ``dpmf fl`` gives with the same
settings. Skipped without Ray (the extra ``fl-sim``)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def _stop_our_superlink(home: Path) -> None:
    """End the local SuperLink that this test's ``flwr run`` started (found by its database path
    under the test's own HOME, ended by its pid)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and str(home) in cmd:
            os.kill(int(pid), signal.SIGTERM)


@pytest.mark.slow
def test_flwr_run_of_the_example_gives_dpmf_fls_epsilon(tmp_path):
    from dpmf.federated.app import config_from_run_config
    from dpmf.federated.ledger import format_entry
    from dpmf.federated.run import run_federated

    flwr = Path(sys.executable).with_name("flwr")
    env = {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(flwr.parent), os.environ.get("PATH", "")])}  # fmt: skip
    try:
        out = subprocess.run(
            [str(flwr), "run", str(ROOT / "examples" / "flower"), "--run-config", "rounds=1",
             "--federation-config", "num-supernodes=4", "--stream"],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
    finally:
        _stop_our_superlink(tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-2000:]
    got = re.findall(r"privacy: (ε = .*)", text)
    rc = {"clients": 4, "rounds": 1, "strategy": "fedavg", "privacy": "client", "local-steps": 2,
          "client-factorization": "bisr:4", "seed": 0}  # fmt: skip
    ref = run_federated(config_from_run_config(rc), log=lambda *_: None)
    assert got == [format_entry(e) for e in ref.ledger]


@pytest.mark.slow
def test_dpmf_fl_ray_backend_runs_the_app_and_equals_the_local_backend():
    from dpmf.federated.run import FLConfig, run_federated

    cfg = FLConfig(num_clients=4, rounds=1, privacy="client", local_steps=1, seed=3)
    ray = run_federated(cfg, backend="ray", log=lambda *_: None)
    local = run_federated(cfg, log=lambda *_: None)
    assert [e.epsilon for e in ray.ledger] == [e.epsilon for e in local.ledger]
    assert [m["test_accuracy"] for m in ray.metrics] == [m["test_accuracy"] for m in local.metrics]
    time.sleep(2)
    assert _superlinks("dpmf-flwr-") == []  # the run ended its own SuperLink


def _superlinks(marker: str) -> list[int]:
    pids = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = p.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and marker in cmd:
            pids.append(int(p.parent.name))
    return pids
