"""A run that is stopped, resumed or misused says so: corrupted checkpoints, another data set on
resume, files that agree after a stop, non-finite sensitivities, and flags that do not apply."""

import json
import os

import numpy as np
import pytest
import torch

from dpmf.cli import main
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.structured import ScaledToeplitz
from dpmf.plan import PrivatePlan
from dpmf.train.config import TrainConfig
from dpmf.train.run import train
from dpmf.workloads import prefix_sum

QUIET = {"progress": False, "log": lambda *a: None}
TRAIN = ["train", "--dataset", "digits", "--model", "mlp", "--epochs", "1", "--batch-size", "256"]
TRAIN += ["--noise-multiplier", "1.0", "--no-progress"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    cfg = TrainConfig(
        dataset="digits", model="mlp", epochs=1, batch_size=256, epsilon=None, noise_multiplier=1.0
    )
    train(cfg, str(out), **QUIET)
    return out


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "foreign"])
def test_a_damaged_checkpoint_is_refused_in_one_line_and_left_alone(finished, tmp_path, capsys, damage):
    out = tmp_path / "run"
    out.mkdir()
    good = (finished / "checkpoint.pt").read_bytes()
    bad = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "garbage": b"\x00\x01not a checkpoint at all",
        "foreign": None,
    }[damage]
    if bad is None:
        torch.save({"weights": torch.zeros(3)}, out / "checkpoint.pt")
    else:
        (out / "checkpoint.pt").write_bytes(bad)
    before = (out / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpoint" in err and "Traceback" not in err
    assert (out / "checkpoint.pt").read_bytes() == before
    assert not (out / "results.json").exists()  # refused before any work


def test_a_pickle_that_runs_code_is_not_loaded(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "owned"),))

    out = tmp_path / "run"
    out.mkdir()
    torch.save({"x": Evil()}, out / "checkpoint.pt")
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 2
    assert not (tmp_path / "owned").exists()


def test_resume_on_other_data_is_refused(finished, tmp_path, capsys):
    from dpmf.train.checkpoint import load_checkpoint, save_checkpoint

    out = tmp_path / "run"
    out.mkdir()
    state = load_checkpoint(str(finished / "checkpoint.pt"))
    state["data"] = "0" * 16  # the digest of other data with the same size
    save_checkpoint(str(out / "checkpoint.pt"), state)
    capsys.readouterr()
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 2
    assert "data differ" in capsys.readouterr().err


def test_files_agree_after_a_failure(tmp_path, monkeypatch):
    from dpmf.train import loop

    calls = {"n": 0}
    original = loop.Trainer._step

    def failing(self, t):
        calls["n"] += 1
        if t == 7:
            raise FloatingPointError("step 7 diverged (simulated)")
        return original(self, t)

    monkeypatch.setattr(loop.Trainer, "_step", failing)
    cfg = TrainConfig(
        dataset="digits", model="mlp", epochs=2, batch_size=256, epsilon=None, noise_multiplier=1.0
    )
    with pytest.raises(FloatingPointError):
        train(cfg, str(tmp_path / "run"), **QUIET)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "failed" and "diverged" in res["error"]
    assert res["completed_epochs"] == 1 and res["checkpoint"] == "checkpoint.pt"
    rows = (tmp_path / "run" / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 2  # header + the one completed epoch, as in the checkpoint


def test_interrupt_before_any_epoch_does_not_promise_a_checkpoint(tmp_path, monkeypatch, capsys):
    from dpmf.train import loop

    def interrupt(self, t):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.Trainer, "_step", interrupt)
    out = tmp_path / "run"
    assert main(TRAIN + ["--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "checkpoint.pt" not in err
    assert json.loads((out / "results.json").read_text())["status"] == "interrupted"


def test_a_non_finite_sensitivity_is_refused():
    n = 8
    big = ScaledToeplitz(np.full(n, 1e200))  # column norms overflow to inf
    f = Factorization("custom", None, prefix_sum(n), big)  # no noise field: C⁻¹ derived when needed
    with pytest.raises(ValueError, match="sensitivity.*finite"):
        PrivatePlan(80, 10, steps=n, scheme="single_release", strategy=f)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["epsilon", "--scheme", "poisson", "--min-sep", "4"], "min_sep"),
        (["epsilon", "--scheme", "fixed_order", "--min-sep", "4"], "min_sep"),
        (["epsilon", "--scheme", "poisson", "--samples", "1000"], "samples"),
        (
            ["epsilon", "--scheme", "poisson", "--schedule", "cosine", "--beta", "0.1", "--gamma", "2"],
            "gamma",
        ),
        (
            ["pick", "--scheme", "balls_in_bins", "--accountant", "pld", "--schedule", "constant"],
            "accountant",
        ),
    ],
)
def test_flags_that_do_not_apply_are_refused(argv, match, capsys):
    run = ["--dataset-size", "400", "--batch-size", "10", "--steps", "40", "--delta", "1e-5"]
    run += ["--epsilon", "3"] if argv[0] == "pick" else ["--noise-multiplier", "1"]
    assert main(argv + run) == 2
    assert match in capsys.readouterr().err


def test_more_bands_than_steps_are_labelled_as_built(capsys):
    argv = ["epsilon", "--scheme", "fixed_order", "--factorization", "bsr:100", "--dataset-size", "400"]
    argv += ["--batch-size", "10", "--steps", "40", "--noise-multiplier", "1", "--delta", "1e-5", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["factorization"] == "bsr:40"
