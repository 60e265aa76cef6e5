"""`dpmf curves` and `dpmf colormap`: outputs, values, and the exit status on bad input."""

import csv
import subprocess
import sys

import numpy as np
import pytest

from dpmf.cli import main
from dpmf.mechanisms import Participation, evaluate, factorize
from dpmf.mechanisms.sweeps import CURVE_COLUMNS
from dpmf.workloads import Schedule, from_schedule


def read_csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_curves_writes_csv_and_png(tmp_path):
    rc = main(
        [
            "curves",
            "--schedule",
            "exponential",
            "--beta",
            "0.1",
            "--n",
            "16,64",
            "--factorizations",
            "sqrt_prefix,lr_aware,bisr:4",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = read_csv(tmp_path / "curves.csv")
    assert tuple(rows[0].keys()) == CURVE_COLUMNS
    assert len(rows) == 6
    by = {(int(r["n"]), r["factorization"], r["bands"]): r for r in rows}
    r = by[(64, "lr_aware", "")]
    assert round(float(r["max_se"]), 4) == 1.5630 and round(float(r["mean_se"]), 4) == 1.4146
    assert round(float(r["lower_bound"]), 4) == 0.9282 and r["sensitivity_exact"] == "True"
    e = evaluate(factorize(from_schedule(Schedule("exponential", 0.1), 16), "bisr:4"))
    assert float(by[(16, "bisr", "4")]["mean_se"]) == pytest.approx(e.mean_se, rel=1e-12)
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_curves_min_sep(tmp_path):
    rc = main(
        [
            "curves",
            "--schedule",
            "linear",
            "--beta",
            "0.2",
            "--n",
            "64",
            "--participation",
            "min_sep",
            "--min-sep",
            "16",
            "--max-participations",
            "4",
            "--factorizations",
            "bsr:8",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    (row,) = read_csv(tmp_path / "curves.csv")
    part = Participation.separated(16, 4)
    e = evaluate(factorize(from_schedule(Schedule("linear", 0.2), 64), "bsr:8"), part)
    assert float(row["sensitivity"]) == pytest.approx(e.sensitivity, rel=1e-12)
    assert float(row["lower_bound"]) == pytest.approx(e.lower_bound, rel=1e-12)
    assert row["participation"] == "min_sep" and row["min_sep"] == "16" and row["max_participations"] == "4"


def test_colormap(tmp_path):
    rc = main(
        [
            "colormap",
            "--numerator",
            "lr_aware",
            "--denominator",
            "sqrt_prefix",
            "--metric",
            "max_se",
            "--schedule",
            "exponential",
            "--n",
            "16,64",
            "--beta",
            "0.01,0.5",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = read_csv(tmp_path / "colormap.csv")
    assert [k for k in rows[0]][:3] == ["n", "beta", "gain"] and len(rows) == 4
    for r in rows:
        w = from_schedule(Schedule("exponential", float(r["beta"])), int(r["n"]))
        ratio = evaluate(factorize(w, "lr_aware")).max_se / evaluate(factorize(w, "sqrt_prefix")).max_se
        assert float(r["gain"]) == pytest.approx(ratio, rel=1e-12)
    assert (tmp_path / "colormap.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv",
    [
        ["curves", "--schedule", "exponential", "--beta", "1.5", "--n", "16", "--factorizations", "identity"],
        ["curves", "--schedule", "exponential", "--beta", "nan", "--n", "16", "--factorizations", "identity"],
        ["curves", "--schedule", "nope", "--n", "16", "--factorizations", "identity"],
        ["curves", "--schedule", "linear", "--n", "0", "--factorizations", "identity"],
        ["curves", "--schedule", "linear", "--n", "16,x", "--factorizations", "identity"],
        ["curves", "--schedule", "linear", "--n", "16", "--factorizations", "bisr:0"],
        ["curves", "--schedule", "linear", "--n", "16", "--factorizations", "magic"],
        [
            "curves",
            "--schedule",
            "linear",
            "--n",
            "16",
            "--factorizations",
            "bsr:4",
            "--participation",
            "min_sep",
        ],
        [
            "curves",
            "--schedule",
            "linear",
            "--n",
            "16",
            "--factorizations",
            "bsr:4",
            "--participation",
            "min_sep",
            "--min-sep",
            "0",
            "--max-participations",
            "2",
        ],
        [
            "colormap",
            "--numerator",
            "lr_aware",
            "--denominator",
            "sqrt_prefix",
            "--metric",
            "max_se",
            "--schedule",
            "exponential",
            "--n",
            "16",
            "--beta",
            "0",
        ],
    ],
)
def test_bad_input_exits_2(argv, tmp_path, capsys):
    assert main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]
    assert not (tmp_path / "o").exists()  # nothing written


def test_console_entry_point(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpmf",
            "curves",
            "--schedule",
            "cosine",
            "--n",
            "8",
            "--factorizations",
            "sqrt",
            "--out",
            str(tmp_path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote" in out.stdout
    assert np.isfinite(float(read_csv(tmp_path / "curves.csv")[0]["max_se"]))


def test_curves_without_lower_bound_leaves_the_column_empty(tmp_path, capsys):
    args = ["curves", "--schedule", "exponential", "--n", "64", "--factorizations", "lr_aware"]
    rc = main([*args, "--out", str(tmp_path), "--no-progress", "--no-lower-bound"])
    assert rc == 0
    (row,) = read_csv(tmp_path / "curves.csv")
    assert row["lower_bound"] == ""
    assert round(float(row["mean_se"]), 4) == 1.4146
    assert "0.9282" not in capsys.readouterr().out
