"""``dpmf fl`` refusals and warnings (before any folder or training), MedMNIST file checks, the
experiment grid on a data file, and record mode's parallel accountings (bit-equal to serial)."""

import numpy as np
import pytest

pytest.importorskip("flwr")

from dpmf.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST = ["--clients", "4", "--rounds", "2", "--sigma-min", "2", "--sigma-max", "4", "--local-steps", "1"]


def _medmnist(path, n=(60, 20, 30), size=28, labels=2, channels=None, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, k in zip(("train", "val", "test"), n, strict=True):
        y = rng.integers(0, labels, size=(k, 1))
        shape = (k, size, size) if channels is None else (k, size, size, channels)
        arrays[f"{split}_images"] = rng.integers(0, 255, size=shape).astype(np.uint8)
        arrays[f"{split}_labels"] = y.astype(np.uint8)
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--alpha", "0.3"], "alpha is invalid with partition='iid'"),
        (["--shards", "3", "--partition", "dirichlet"], "shards is invalid with partition='dirichlet'"),
        (["--fedopt-eta", "0.1"], "fedopt_eta is invalid with strategy='fedavg'"),
        (["--strategy", "fedadam", "--proximal-mu", "0.1"], "proximal_mu is invalid with strategy='fedadam'"),
        (["--privacy", "record", "--local-batch-size", "200"], "local_batch_size=200 is invalid in record"),
    ],
)
def test_conflicting_options_exit_2_in_one_line_before_any_folder(tmp_path, capsys, extra, match):
    out = tmp_path / "never"
    assert main(["fl", *FAST, *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err
    assert not out.exists()


def test_the_options_are_accepted_where_they_apply(tmp_path, capsys):
    from dpmf.federated.checks import flag_conflicts

    flag_conflicts({"alpha"}, partition="dirichlet", strategy="fedavg")
    flag_conflicts({"fedopt_eta"}, partition="iid", strategy="fedyogi")
    flag_conflicts({"proximal_mu"}, partition="iid", strategy="fedprox")


def test_one_record_per_client_and_a_one_client_federation_are_warned(tmp_path, capsys):
    from dpmf.federated.checks import check_data
    from dpmf.federated.run import FLConfig

    notes = check_data(FLConfig(num_clients=400), [1] * 390 + [2] * 10, list(range(400)))
    assert len(notes) == 1 and "390 of 400 clients hold a single record" in notes[0]
    assert main(["fl", *FAST, "--privacy", "client", "--compliant-only", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "warning: only one client trains" in out and "client-level noise" in out


def test_a_file_that_is_not_npz_is_named_with_the_expected_format(tmp_path):
    from dpmf.federated.data import load_federated

    bad = tmp_path / "scans.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"scans\.csv.*not a numpy \.npz file; expected a \.npz archive"):
        load_federated("medmnist", 4, data_file=str(bad))
    one = tmp_path / "one.npy"
    np.save(one, np.zeros(3))
    with pytest.raises(ValueError, match=r"one\.npy.*a single \.npy array"):
        load_federated("medmnist", 4, data_file=str(one))


def test_pneumoniamnist_refuses_a_file_of_another_kind_and_names_it(tmp_path):
    from dpmf.federated.data import load_federated

    rgb = tmp_path / "mine.npz"
    _medmnist(rgb, channels=3)
    with pytest.raises(ValueError, match=r"mine\.npz.*dataset='pneumoniamnist'.*shape \(60, 28, 28, 3\)"):
        load_federated("pneumoniamnist", 4, data_file=str(rgb))
    many = tmp_path / "many.npz"
    _medmnist(many, labels=5)
    with pytest.raises(ValueError, match=r"many\.npz.*classes \[0, 1, 2, 3, 4\]"):
        load_federated("breastmnist", 4, data_file=str(many))
    ok = tmp_path / "ok.npz"
    _medmnist(ok, size=64)
    assert load_federated("pneumoniamnist", 4, data_file=str(ok)).input_shape == (1, 64, 64)


def test_the_experiment_grid_runs_on_a_medmnist_file(tmp_path):
    from dpmf.federated.experiment import compliance_grid
    from dpmf.federated.run import FLConfig

    path = tmp_path / "tiny.npz"
    _medmnist(path, n=(40, 16, 20))
    rows = compliance_grid(
        ["medmnist"], ["fedavg"], rounds=1, seeds=[0], num_clients=4, experiments=(1,),
        allocations=("weighted",), base=FLConfig(data_file=str(path), server_batch_size=4, local_steps=1),
    )  # fmt: skip
    assert len(rows) == 1 and rows[0]["dataset"] == "medmnist"
    # 20 test images: the accuracy is a multiple of 1/20
    assert abs(rows[0]["final_accuracy"] * 20 - round(rows[0]["final_accuracy"] * 20)) < 1e-9


def test_parallel_record_accountings_equal_the_serial_ones_bit_for_bit(monkeypatch):
    from dpmf.federated import local
    from dpmf.federated.prefetch import prefetch_record_privacy

    settings = [(s, 20, 4, 6, 1e-5, "poisson", "identity", None) for s in (2.0, 3.0, 2.0, 4.0)]
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    assert prefetch_record_privacy(settings, workers=2) == 3  # the repeated σ is accounted once
    parallel = [local.RECORD_CACHE[s].epsilon for s in settings]
    serial = [local._record_privacy(*s).epsilon for s in settings]
    assert parallel == serial and parallel[0] == parallel[2] and parallel[0] > parallel[1] > parallel[3]
    assert prefetch_record_privacy(settings) == 0  # all cached


# -- dpmf fl: --seeds with a huge range is refused before it is expanded ------------------------------
# parse_seeds refuses a huge range with a ValueError naming the seeds instead of building the whole
# list: `dpmf fl --seeds 0-1000000000` was killed by the OOM killer (rc 137) instead of exiting 2 with
# a one-line error. Run here in a subprocess under a 4 GB address-space limit with 10¹² seeds
# (MemoryError at once if the list is built).
@pytest.mark.torch
def test_a_huge_seed_range_is_refused_with_a_value_error():
    import subprocess
    import sys

    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from dpmf.federated.report import parse_seeds\n"
        "try:\n    parse_seeds('0-1000000000000')\n"
        "except ValueError as e:\n    print('ValueError', e)\n"
        "except BaseException as e:\n    print(type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("ValueError") and "seeds" in out.stdout, out.stdout + out.stderr[-300:]
