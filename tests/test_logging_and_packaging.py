"""Packaging and logging: cvxpy is a test extra, dpmf imports and works without it and installs no
log handlers, library messages go through logging (and can be silenced), and the GPU check script
says there is no GPU."""

import logging
import math
import os

import pytest
from cli_helpers import SINGLE

from dpmf import cli
from dpmf.accountants.events import GaussianEvent
from dpmf.accountants.library import PLDAccountant

# --- cvxpy is optional ------------------------------------------------------------------


def test_cvxpy_is_a_test_extra_not_a_dependency():
    import pathlib

    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("cvxpy") for d in meta["dependencies"])
    assert any(d.startswith("cvxpy") for d in meta["optional-dependencies"]["test"])


def test_dpmf_imports_and_works_without_cvxpy_and_installs_no_log_handlers():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['cvxpy'] = None\n"  # importing cvxpy now raises ImportError
        "import dpmf.cli, dpmf.mechanisms, dpmf.accountants, dpmf.plots\n"
        "from dpmf.mechanisms import factorize, evaluate\n"
        "from dpmf.mechanisms.dense_cvxpy import dense_cvxpy\n"
        "from dpmf.workloads import prefix_sum\n"
        "print(round(evaluate(factorize(prefix_sum(8), 'sqrt_prefix')).max_se, 6))\n"
        "try:\n"
        "    dense_cvxpy(prefix_sum(4))\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
        "import logging\n"
        "names = [n for n in logging.root.manager.loggerDict if n.startswith('dpmf')]\n"
        "print(len(names), sum(len(logging.getLogger(n).handlers) for n in names + ['dpmf']))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    r = [math.comb(2 * j, j) / 4**j for j in range(8)]
    assert float(lines[0]) == pytest.approx(sum(x * x for x in r), abs=1e-6)  # MaxSE = Σ r_j²
    assert lines[1].startswith("ImportError: dense_cvxpy needs cvxpy") and "pip install cvxpy" in lines[1]
    loggers, handlers = map(int, lines[2].split())
    assert loggers >= 2 and handlers == 0  # module loggers exist; the library configures none


# --- library messages through logging ---------------------------------------------------


def test_library_messages_go_through_logging_and_can_be_silenced(caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="dpmf"):
        meas = PLDAccountant().epsilon(GaussianEvent(1e-300), 1e-5)
    assert meas.epsilon == math.inf
    rec = [r for r in caplog.records if r.name == "dpmf.accountants.library"]
    assert rec and rec[0].levelno == logging.WARNING and "noise is negligible" in rec[0].getMessage()
    argv = ["epsilon", *SINGLE, "--noise-multiplier", "1e-300", "--delta", "1e-5"]
    assert cli.main(argv) == 0
    assert "privacy: analytic Gaussian" in capsys.readouterr().err  # the CLI prints it
    lib = logging.getLogger("dpmf")
    before = lib.level
    lib.setLevel(logging.ERROR)
    try:
        assert cli.main(argv) == 0
        assert "privacy:" not in capsys.readouterr().err  # and the user can silence it
    finally:
        lib.setLevel(before)


# --- the GPU check script ---------------------------------------------------------------


def test_gpu_check_says_there_is_no_gpu_and_exits_3(tmp_path):
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs scripts/gpu_check.sh itself (about 5 minutes)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path), DPMF_PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", os.path.join(root, "scripts", "gpu_check.sh")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    report = (tmp_path / "gpu_check.txt").read_text()
    assert "no CUDA device is usable by torch here" in report
    assert "status: skipped (no CUDA device)" in report and report in done.stdout
