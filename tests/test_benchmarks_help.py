"""Every benchmark script imports only names that exist and answers ``--help`` (exit 0, a usage
line) without running its benchmark (all scripts in one subprocess, each run as ``__main__``)."""

import ast
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
# helper modules (``_harness.py``) are imported by the scripts, not run
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_dpmf_name_a_benchmark_imports_exists(script):
    """``from dpmf.x import a, b`` anywhere in the script (inside functions too) names
    attributes that exist."""
    missing = []
    for node in ast.walk(ast.parse(script.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "dpmf"
        ):
            module = importlib.import_module(node.module)
            for alias in node.names:
                name = alias.name
                if not hasattr(module, name):
                    try:
                        importlib.import_module(f"{node.module}.{name}")
                    except ImportError:
                        missing.append(f"{node.module}.{name} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dpmf":
                    importlib.import_module(alias.name)
    assert missing == []


# One subprocess runs every script as ``__main__`` with ``--help`` in turn (torch is loaded once,
# not once per script) and reports each exit code and what it printed.
_DRIVER = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    out = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        code, _ = 1, out.write(f"{type(exc).__name__}: {exc}")
    print(json.dumps({"script": path, "code": code, "output": out.getvalue()[:3000]}), flush=True)
"""


@pytest.fixture(scope="module")
def help_runs():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(BENCH), *map(str, SCRIPTS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    runs = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            runs[row["script"]] = row
    return runs, proc


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_benchmark_answers_help(script, help_runs):
    runs, proc = help_runs
    assert str(script) in runs, proc.stderr[-2000:]
    row = runs[str(script)]
    assert row["code"] == 0, row["output"]
    assert row["output"].lstrip().startswith("usage:"), row["output"][:500]
