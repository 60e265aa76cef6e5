"""Flags that would be ignored are refused in one line naming the flag, its value and the fix;
no command creates its --out before its input is validated; a standard output that cannot be
written ends with status 1 and one line, never a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpmf.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--dataset", "digits", "--model", "mlp", "--epochs", "1", "--batch-size", "256"]
TRAIN += ["--noise-multiplier", "1", "--no-progress"]
RUN = ["--dataset-size", "400", "--batch-size", "10", "--steps", "40", "--delta", "1e-5"]


def _refused(argv, capsys, *needles):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# --- 7. ignored combinations are refused --------------------------------------------------------


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--distributed-mode", "replicated"], ["--distributed-mode=replicated", "without --distributed"]),
        (["--doppler-a", "1,-0.5"], ["--doppler-a=1,-0.5", "--filter doppler"]),
        (["--filter", "disk", "--doppler-b", "0.2"], ["--doppler-b=0.2", "--filter doppler"]),
        (["--disk-kappa", "0.5"], ["--disk-kappa=0.5", "--filter disk"]),
        (["--filter", "doppler", "--disk-gamma", "0.3"], ["--disk-gamma=0.3", "--filter disk"]),
    ],
)
def test_train_flags_that_would_be_ignored_are_refused(extra, needles, tmp_path, capsys):
    out = tmp_path / "run"
    _refused([*TRAIN, *extra, "--out", str(out)], capsys, *needles, "would be ignored")
    assert not out.exists()


def test_doppler_flags_with_the_doppler_filter_are_accepted(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TRAIN, "--filter", "doppler", "--doppler-a", "1,-0.5", "--out", str(out)]) == 0
    import json

    assert json.loads((out / "results.json").read_text())["config"]["doppler_a"] == [1.0, -0.5]


def test_an_empty_filter_coefficient_is_refused_by_argparse(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, "--filter", "doppler", "--doppler-a", "1,,-0.5", "--out", str(tmp_path / "r")])
    assert exit_.value.code == 2
    assert "item 2 of 3 is empty" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["epsilon", "calibrate"])
@pytest.mark.parametrize("accountant", ["pld", "rdp", "prv"])
def test_samples_with_a_library_accountant_is_refused(command, accountant, capsys):
    target = ["--noise-multiplier", "1"] if command == "epsilon" else ["--epsilon", "3"]
    argv = [command, "--scheme", "poisson", "--accountant", accountant, "--samples", "1000", *target, *RUN]
    _refused(argv, capsys, "--samples=1000", accountant, "drop --samples")


def test_colormap_constant_schedule_with_a_beta_grid_is_refused(tmp_path, capsys):
    out = tmp_path / "cm"
    argv = ["colormap", "--numerator", "lr_aware", "--denominator", "sqrt_prefix", "--metric", "max_se"]
    argv += ["--schedule", "constant", "--n", "8,16", "--beta", "0.1,0.5", "--out", str(out), "--no-progress"]
    _refused(argv, capsys, "--beta='0.1,0.5'", "--schedule constant", "decaying")
    assert not out.exists()


@pytest.mark.parametrize(
    "flags", [["--factorizations", "sqrt_prefix,,identity"], ["--factorizations", "identity,"]]
)
def test_an_empty_item_in_a_list_is_refused(flags, tmp_path, capsys):
    out = tmp_path / "cv"
    argv = ["curves", "--schedule", "constant", "--n", "8", *flags, "--out", str(out), "--no-progress"]
    _refused(argv, capsys, "--factorizations=", "is empty", "remove the extra comma")
    assert not out.exists()


def test_a_bad_number_in_a_list_names_the_flag_and_the_item(tmp_path, capsys):
    argv = ["curves", "--schedule", "constant", "--n", "8,x", "--factorizations", "identity"]
    _refused([*argv, "--out", str(tmp_path / "cv")], capsys, "--n='8,x'", "'x' is not an integer")


@pytest.mark.parametrize("seeds", ["0,,2", "0,1,"])
def test_an_empty_seed_in_fl_is_refused(seeds, tmp_path, capsys):
    pytest.importorskip("flwr")
    out = tmp_path / "fl"
    _refused(
        ["fl", "--clients", "4", "--rounds", "1", "--seeds", seeds, "--out", str(out)],
        capsys,
        f"seeds={seeds!r}",
        "0,1,2",
    )
    assert not out.exists()


# --- 8. no command creates its --out before validating its input ---------------------------------


def test_fl_refusing_its_data_file_leaves_no_folder(tmp_path, capsys):
    pytest.importorskip("flwr")
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")
    out = tmp_path / "fl"
    argv = ["fl", "--dataset", "pneumoniamnist", "--data-file", str(bad), "--clients", "4", "--rounds", "1"]
    _refused([*argv, "--out", str(out)], capsys, "data_file=", "is invalid: not a")
    assert not out.exists()


def test_train_refusing_its_input_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "run"
    _refused([*TRAIN, "--batch-size", "100000", "--out", str(out)], capsys, "batch")
    assert not out.exists()


# --- 9. a standard output that cannot be written -------------------------------------------------

EPSILON = [sys.executable, "-m", "dpmf", "epsilon", "--scheme", "poisson", "--noise-multiplier", "1", *RUN]


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_standard_output_is_one_line_and_status_1():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(EPSILON, stdout=full, stderr=subprocess.PIPE, env=_env(), timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err and "Exception ignored" not in err
    assert "dpmf epsilon: error: cannot write to standard output" in err and "No space left" in err


def test_closed_pipe_is_one_line_and_status_1():
    proc = subprocess.Popen(EPSILON, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()  # as `| head -0` does, before the command writes
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err and "Exception ignored" not in err
    assert "cannot write to standard output" in err


def test_fl_into_a_folder_holding_a_ledger_is_refused_without_overwrite(tmp_path, capsys):
    # a second run would replace the first's privacy ledger (the record of a released model)
    pytest.importorskip("flwr")
    out = tmp_path / "fl"
    out.mkdir()
    (out / "ledger.json").write_text("{}")
    argv = ["fl", "--dataset", "breast-cancer", "--clients", "4", "--rounds", "1", "--out", str(out)]
    _refused(argv, capsys, "holds an earlier federated run (ledger.json)", "--overwrite")
    assert (out / "ledger.json").read_text() == "{}"
