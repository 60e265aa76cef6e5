"""``flwr run examples/flower`` on Flower's simulation engine (Ray), offline on the bundled
stand-in data, loopback only: the README's lines, typed as a new user types them in a shell that
activates the virtual environment, end by themselves and print the ε and the test accuracy that
``dpmf fl`` gives with the same settings; every process they started is ended and nothing is left
behind. ``dpmf fl --backend ray`` runs the same app. Skipped without Ray (the extra ``fl-sim``)."""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import tomllib

pytest.importorskip("flwr")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)


def _readme_flower_lines() -> tuple[str, str]:
    """The README's activation line and its first ``flwr run examples/flower`` line (the quick
    check) from its Flower block, as written."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    block = next(b for b in blocks if "flwr run examples/flower" in b)
    lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
    activate = next((ln for ln in lines if ln.startswith(". .venv/bin/activate")), None)
    run = next(ln for ln in lines if ln.startswith("flwr run examples/flower"))
    assert activate is not None, "the README's Flower block must activate the environment first"
    assert lines.index(activate) < lines.index(run), "the README must activate the environment first"
    return activate, run


def _run_config(line: str) -> dict:
    """The example's run config with the ``--run-config`` overrides of ``line``."""
    example = tomllib.loads((ROOT / "examples" / "flower" / "pyproject.toml").read_text())
    rc = dict(example["tool"]["flwr"]["app"]["config"])
    args = shlex.split(line.split(" #")[0])
    if "--run-config" in args:
        for pair in args[args.index("--run-config") + 1].split():
            key, value = pair.split("=", 1)
            rc[key] = tomllib.loads(f"v = {value}")["v"]
    return rc


def _marked(home: str) -> list[int]:
    """Processes whose environment names this test's FLWR_HOME (started by its ``flwr run``)."""
    needle = f"FLWR_HOME={Path(home) / '.flwr'}".encode()
    pids = []
    for p in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in p.read_bytes().split(b"\0"):
                pids.append(int(p.parent.name))
        except OSError:
            continue
    return pids


def _fresh_shell_env(home: str) -> dict:
    """A new user's shell: no environment active (VIRTUAL_ENV unset, its bin not on PATH) and no
    PYTHONPATH; for isolation only, Flower's and Ray's files under ``home`` and the local
    SuperLink on free loopback ports instead of Flower's fixed 39091/39093 (another run there
    would be joined)."""
    from dpmf.federated.flwr_run import local_superlink_env

    bins = {str(VENV / "bin"), str(Path(sys.executable).parent)}
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p not in bins)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", **local_superlink_env(home)}


@pytest.mark.slow
def test_the_readmes_flwr_run_line_runs_in_the_activated_environment_and_prints_dpmf_fls_epsilon():
    from dpmf.federated.app import config_from_run_config
    from dpmf.federated.flwr_run import stop_processes
    from dpmf.federated.ledger import format_entry
    from dpmf.federated.run import run_federated

    if sys.prefix == sys.base_prefix:
        pytest.skip("the README's lines need the virtual environment the tests run in")
    activate, line = _readme_flower_lines()
    assert "num-supernodes=2" in line and "--stream" in line
    if VENV != ROOT / ".venv":  # the tests' environment, wherever it lives
        activate = activate.replace(".venv/bin/activate", shlex.quote(str(VENV / "bin" / "activate")))
    example_files = sorted(p.name for p in (ROOT / "examples" / "flower").iterdir())
    home = tempfile.mkdtemp(prefix="dpmf-readme-")  # short: Ray's socket paths must stay < 108 bytes
    began = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", f"{activate}\n{line}\n"], cwd=ROOT, env=_fresh_shell_env(home),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the README's flwr run did not end within 240 s; its output ends with:\n{out[-2000:]}")
    finally:
        stopped = stop_processes(home)  # the SuperLink Flower leaves running, and anything left
        left = _marked(home)
        shutil.rmtree(home, ignore_errors=True)
    seconds = time.monotonic() - began
    assert proc.returncode == 0, out[-2000:]
    assert left == [] and stopped  # the detached SuperLink was there, and is gone with the rest
    assert not Path(home).exists()
    assert sorted(p.name for p in (ROOT / "examples" / "flower").iterdir()) == example_files
    rc = _run_config(line)
    assert (rc["clients"], rc["rounds"]) == (2, 1)
    ref = run_federated(config_from_run_config(rc), log=lambda *_: None)
    assert re.findall(r"privacy: (ε = .*)", out) == [format_entry(e) for e in ref.ledger]
    acc = re.findall(r"test accuracy after round (\d+): ([\d.]+) %", out)
    assert acc == [("1", f"{100 * ref.metrics[-1]['test_accuracy']:.2f}")]
    assert seconds < 240


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
