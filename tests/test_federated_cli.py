"""``dpmf fl``: every mode and strategy end to end, bad input, MedMNIST files, record-mode ε."""

import json
import sys
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from dpmf.cli import main  # noqa: E402
from dpmf.federated.strategies import STRATEGIES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST = ["--clients", "4", "--rounds", "3", "--sigma-min", "2", "--sigma-max", "4", "--local-steps", "2"]


def test_every_mode_and_strategy_runs_in_under_a_minute(tmp_path, capsys):
    began = time.perf_counter()
    for mode in ("aggregator", "record", "client"):
        for strategy in STRATEGIES:
            if mode == "client" and strategy == "fedmedian":
                continue
            out = tmp_path / f"{mode}-{strategy}"
            rc = main(["fl", *FAST, "--strategy", strategy, "--privacy", mode, "--out", str(out)])
            assert rc == 0, (mode, strategy)
            ledger = json.loads((out / "ledger.json").read_text())
            units = {e["protects"] for e in ledger["seeds"][0]["entries"]}
            want = {"aggregator": {"aggregator-dataset records"}, "client": {"client"}}.get(mode)
            if want is None:
                want = {f"records of client {c}" for c in ledger["participants"]}
            assert units == want
            rows = (out / "metrics.csv").read_text().strip().splitlines()
            assert len(rows) == 1 + 4  # header, rounds 0..3
            # no non-private statistic of the protected data reaches the server
            assert (rows[-1].split(",")[4] == "nan") == (mode != "aggregator")
    assert time.perf_counter() - began < 60
    text = capsys.readouterr().out
    assert "bundled example profile" in text and "for aggregator-dataset records" in text


def test_local_backend_is_deterministic_and_seeds_differ(tmp_path, capsys):
    args = ["fl", *FAST, "--strategy", "fedadam", "--privacy", "client", "--seeds", "0-1"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "metrics.csv").read_text()
    assert a == (tmp_path / "b" / "metrics.csv").read_text()
    lines = a.strip().splitlines()[1:]
    by_seed = {s: [r.split(",", 2)[2] for r in lines if r.startswith(f"{s},")] for s in "01"}
    assert by_seed["0"] != by_seed["1"]


def test_record_mode_epsilon_of_each_client_equals_dpmf_epsilon(tmp_path, capsys):
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    out = tmp_path / "rec"
    args = ["fl", *FAST, "--privacy", "record", "--local-batch-size", "8", "--out", str(out)]
    assert main(args) == 0
    ledger = json.loads((out / "ledger.json").read_text())
    sizes = ledger["data"]["client_sizes"]
    capsys.readouterr()
    for entry, n_k in zip(ledger["seeds"][0]["entries"], sizes, strict=True):
        sigma = ledger["noise_multipliers"][entry["subject"]]
        assert main(
            [
                "epsilon", "--scheme", "poisson", "--noise-multiplier", repr(sigma),
                "--dataset-size", str(n_k), "--batch-size", "8", "--steps", str(3 * 2),
                "--delta", "1e-5", "--json",
            ]
        ) == 0  # fmt: skip
        ref = json.loads(capsys.readouterr().out)
        # the same event on dp-accounting's 1e-3 grid: pessimistic, within 1e-4 of the 1e-4 grid
        assert ref["epsilon"] <= entry["epsilon"] <= ref["epsilon"] + 1e-4
        assert entry["steps"] == 6 and entry["dataset_size"] == n_k
        acc = PLDAccountant(value_discretization_interval=1e-3)
        acc.compose(dp_accounting.PoissonSampledDpEvent(8 / n_k, dp_accounting.GaussianDpEvent(sigma)), 6)
        assert entry["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)


def test_compliant_only_trains_the_compliant_clients_and_uniform_noise_is_equal(tmp_path, capsys):
    out = tmp_path / "c"
    assert (
        main(
            ["fl", *FAST, "--clients", "8", "--compliant-only", "--allocation", "uniform", "--out", str(out)]
        )
        == 0
    )
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["participants"] == ["compliant-01", "compliant-02"]
    assert len(set(ledger["noise_multipliers"].values())) == 1


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--strategy", "fedmedian", "--privacy", "client"], "sensitivity of a mean"),
        (["--privacy", "server"], "privacy='server' is invalid"),
        (["--seeds", "4-1"], "seeds='4-1' is invalid"),
        (["--noise-map", "table"], "needs --noise-table"),
        (["--sigma-min", "5"], "sigma_min=5.0 is invalid"),
        (["--compliance", "/nonexistent.yaml"], "no such file"),
        (["--backend", "spark"], "backend='spark' is invalid"),
        (["--local-optimizer", "dp-muon"], "record mode"),
        (["--criteria-weights", "hipa=1"], "unknown criteria ['hipa']"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, extra, match):
    assert main(["fl", *FAST, *extra, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err


def test_without_flower_or_ray_the_command_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["fl", *FAST, "--backend", "ray", "--out", str(tmp_path / "r")]) == 2
    assert "needs Ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "flwr", None)
    assert main(["fl", *FAST, "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pip install 'dpmf[fl]'" in err


def _write_medmnist(path, n=(60, 20, 30), size=28, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, k in zip(("train", "val", "test"), n, strict=True):
        y = rng.integers(0, 2, size=(k, 1))
        x = (rng.integers(0, 120, size=(k, size, size)) + 100 * y[:, :, None]).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = x, y.astype(np.uint8)
    np.savez(path, **arrays)


def test_an_official_medmnist_name_with_a_wrong_checksum_exits_2(tmp_path, capsys):
    path = tmp_path / "breastmnist.npz"
    _write_medmnist(path)
    rc = main(
        ["fl", *FAST, "--dataset", "breastmnist", "--data-file", str(path), "--out", str(tmp_path / "o")]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "750601b1f35ba3300ea97c75c52ff8f6" in err and "MD5" in err


def test_a_medmnist_format_file_with_another_name_loads_and_trains(tmp_path, capsys):
    from dpmf.federated.data import load_federated

    path = tmp_path / "my_scans_28.npz"
    _write_medmnist(path)
    d = load_federated("medmnist", 4, data_file=str(path))
    assert d.input_shape == (1, 28, 28) and sum(d.client_sizes()) == 60 and d.aggregator_y.size == 20
    assert d.notes and "without a checksum" in d.notes[0]
    assert float(d.test_x.min()) >= -1.0 and float(d.test_x.max()) <= 1.0
    out = tmp_path / "o"
    rc = main(["fl", *FAST, "--dataset", "medmnist", "--data-file", str(path), "--server-batch-size", "8",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    assert "without a checksum" in capsys.readouterr().out
