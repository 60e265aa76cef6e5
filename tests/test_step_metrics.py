"""Per-step metrics (``log_every``/``--log-every``): steps.csv is written without changing the
trajectory, a resumed log keeps the rows up to the checkpoint, and the setting is validated."""

import logging

import numpy as np
import pytest
from cli_helpers import _one_line_error

from dpmf import cli
from dpmf.seeds import SeedPolicy
from dpmf.step import build

# --- per-step metrics ----------------------------------------------------------------------


def _trainer(data, out, *, log_every=None, epochs=2, batch=256, seed=3):
    import torch
    import torch.nn.functional as F

    from dpmf.plan import PrivatePlan
    from dpmf.train.loop import Trainer
    from dpmf.train.models import build_model

    n = len(data)
    steps = epochs * -(-n // batch)
    model = build_model("mlp", data.input_shape, data.num_classes, seed=seed)
    plan = PrivatePlan(n, batch, steps=steps, noise_multiplier=0.8, clip_norm=0.5)  # DP-SGD, Poisson
    step = build(plan, model, F.cross_entropy, seed=SeedPolicy.adopt(seed + 1, given=True))
    trainer = Trainer(
        model=model,
        data=data,
        step=step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        lr_multipliers=np.linspace(1.0, 0.2, steps),
        epochs=epochs,
        out_dir=str(out),
        device="cpu",
        run_identity={"seed": seed},
        final_epsilon=1.0,
        delta=1e-5,
        progress=False,
        log_every=log_every,
    )
    return trainer, model


@pytest.mark.usefixtures("one_torch_thread")
def test_log_every_writes_steps_csv_without_changing_the_trajectory(tmp_path, caplog):
    import csv
    import importlib.util

    import torch

    from dpmf.train.data import load_dataset

    data = load_dataset("digits")
    plain, m0 = _trainer(data, tmp_path / "plain")
    plain.run()
    logged, m1 = _trainer(data, tmp_path / "logged", log_every=3)
    with caplog.at_level(logging.INFO, logger="dpmf"):
        logged.run()
    for a, b in zip(m0.state_dict().values(), m1.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the extra forward passes consume no randomness
    with open(tmp_path / "logged" / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    steps = 2 * -(-len(data) // 256)
    assert [int(r["step"]) for r in rows] == list(range(3, steps + 1, 3))
    chi = np.linspace(1.0, 0.2, steps)
    for r in rows:
        t = int(r["step"])
        assert int(r["epoch"]) == (t - 1) // (steps // 2) + 1
        assert float(r["lr"]) == pytest.approx(0.5 * chi[t - 1], rel=1e-12)
        assert 0.0 <= float(r["clipped_fraction"]) <= 1.0
        assert 0.0 < float(r["train_loss"]) < 10.0
    assert float(rows[0]["train_loss"]) > float(rows[-1]["train_loss"])  # it learns
    assert not (tmp_path / "plain" / "steps.csv").exists()
    if importlib.util.find_spec("tensorboard") is None:
        assert any("tensorboard is not installed" in r.getMessage() for r in caplog.records)
        assert not (tmp_path / "logged" / "tensorboard").exists()
    else:
        assert any(p.name.startswith("events.") for p in (tmp_path / "logged" / "tensorboard").iterdir())


def test_step_log_resume_keeps_rows_up_to_the_checkpoint(tmp_path):
    from dpmf.train.metrics import StepLog

    first = StepLog(str(tmp_path), 2, tensorboard=False)
    for t in (2, 4, 6, 8):
        first.record(t, 1, 1.0 / t, 0.5, 0.1)
    first.flush()
    resumed = StepLog(str(tmp_path), 2, start_step=4, tensorboard=False)
    resumed.record(6, 2, None, 0.25, 0.1)  # an empty batch has no loss
    resumed.flush()
    lines = (tmp_path / "steps.csv").read_text().splitlines()
    assert lines[0] == "step,epoch,train_loss,clipped_fraction,lr"
    assert [ln.split(",")[0] for ln in lines[1:]] == ["2", "4", "6"]
    assert lines[-1] == "6,2,,0.25,0.1"


def test_log_every_is_validated(capsys, tmp_path):
    from dpmf.train.config import TrainConfig

    with pytest.raises(ValueError, match="log_every=0 is invalid"):
        TrainConfig(dataset="digits", log_every=0)
    assert (
        TrainConfig(dataset="digits", log_every=3).run_identity()
        == TrainConfig(dataset="digits").run_identity()
    )
    assert cli.main(["train", "--dataset", "digits", "--log-every", "0", "--out", str(tmp_path / "o")]) == 2
    assert "log_every=0" in _one_line_error(capsys, "train")
