"""`dpmf train` end to end on the bundled digits: accounting, files, resume, bad input."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from dpmf.cli import main
from dpmf.mechanisms import factorize
from dpmf.plan.plan import leading_block
from dpmf.train.build import build_optimizer
from dpmf.train.checkpoint import load_checkpoint
from dpmf.train.config import TrainConfig
from dpmf.train.metrics import read_metrics_csv
from dpmf.train.run import train
from dpmf.workloads import Schedule, from_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


BASE = ["--dataset", "digits", "--epochs", "3", "--batch-size", "128", "--no-progress"]


def cfg(**kw):
    args = dict(dataset="digits", epochs=3, batch_size=128, epsilon=3.0, seed=0)
    args.update(kw)
    return TrainConfig(**args)


def test_cli_trains_accounts_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        *BASE,
        "--epsilon",
        "3",
        "--optimizer",
        "dp-muon",
        "--factorization",
        "bsr:4",
        "--scheme",
        "cyclic_poisson",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "privacy: ε = 3" in text and "test accuracy" in text
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "complete"
    priv = res["privacy"]
    assert priv["epsilon"] <= 3.0 and priv["delta"] == 1e-5 and priv["scheme"] == "cyclic_poisson"
    # every step is accounted: the accountant's steps are the steps taken
    assert priv["steps"] == res["steps"] == 3 * 12 and res["final"]["step"] == 36
    # the noise on the sum is σ·ζ·sens with the accountant's σ and sens
    assert res["noise"]["noise_std_on_sum"] == pytest.approx(priv["noise_multiplier"] * priv["sensitivity"])
    rows = read_metrics_csv(out / "metrics.csv")
    eps = [float(r["epsilon"]) for r in rows]
    assert len(rows) == 3 and eps[0] < eps[1] < eps[2] == pytest.approx(priv["epsilon"])
    assert float(rows[-1]["test_accuracy"]) > 0.5
    assert (out / "curves.png").stat().st_size > 1000 and (out / "checkpoint.pt").exists()


class Kill(Exception):
    pass


@pytest.mark.parametrize("optimizer", ["dp-sgd", "dp-muon-bc"])
def test_same_seed_same_metrics_and_kill_resume_gives_identical_weights(tmp_path, optimizer):
    c = cfg(
        optimizer=optimizer,
        factorization="bisr:3",
        scheme="fixed_order",
        seed=11,
        schedule="cosine",
        beta=0.2,
    )
    quiet = {"progress": False, "log": lambda *a: None}
    ref = train(c, str(tmp_path / "ref"), **quiet)
    again = train(c, str(tmp_path / "again"), **quiet)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(read_metrics_csv(tmp_path / "ref" / "metrics.csv")) == strip(
        read_metrics_csv(tmp_path / "again" / "metrics.csv")
    )
    for a, b in zip(ref.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)

    def kill(epoch, row):
        if epoch == 2:
            raise Kill

    with pytest.raises(Kill):
        train(c, str(tmp_path / "run"), on_epoch_end=[kill], **quiet)
    torch.rand(10)  # the resumed run must restore the global generators itself
    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "3",
        "--batch-size",
        "128",
        "--epsilon",
        "3",
        "--optimizer",
        optimizer,
        "--factorization",
        "bisr:3",
        "--scheme",
        "fixed_order",
        "--seed",
        "11",
        "--schedule",
        "cosine",
        "--beta",
        "0.2",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
        "--resume",
    ]
    assert main(args) == 0
    final = load_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))
    assert final["epoch"] == 3
    for k, v in ref.model.state_dict().items():
        assert torch.equal(final["model"][k], v.cpu()), k
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["resumed_from_epoch"] == 2 and res["final"]["step"] == ref.steps


def test_gradient_accumulation_is_accounted_at_the_logical_batch(tmp_path):
    quiet = {"progress": False, "log": lambda *a: None}
    whole = train(cfg(epochs=1, noise_multiplier=1.0, epsilon=None), str(tmp_path / "a"), **quiet)
    micro = train(
        cfg(epochs=1, noise_multiplier=1.0, epsilon=None, micro_batch_size=16), str(tmp_path / "b"), **quiet
    )
    assert micro.privacy.to_dict() == whole.privacy.to_dict()  # same steps, same batch size, same ε
    assert micro.steps == whole.steps == 12
    for a, b in zip(whole.model.parameters(), micro.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--noise-multiplier", "-1"], "noise_multiplier=-1.0 is invalid"),
        (["--epsilon", "3", "--batch-size", "5000"], "batch_size=5000 is invalid: larger than the data set"),
        (
            ["--epsilon", "3", "--dataset", "fashion-mnist", "--data-dir", "/nonexistent/fmnist"],
            "no such folder",
        ),
        (["--epsilon", "3", "--optimizer", "sgd"], "optimizer='sgd' is invalid"),
        (["--epsilon", "3", "--factorization", "bisr:4", "--scheme", "poisson"], "factorization='bisr:4'"),
        (["--epsilon", "3", "--config", "/nonexistent.yaml"], "no such file"),
        (["--noise-multiplier", "1", "--factorization", "auto"], "needs a target epsilon"),
        (["--epsilon", "3", "--factorization", "auto", "--scheme", "epoch_balls_in_bins"], "scheme="),
        (["--epsilon", "3", "--factorization", "auto", "--max-bands", "0"], "max_bands=0 is invalid"),
        (["--epsilon", "3", "--factorization", "bisr:4", "--scheme", "auto"], "scheme='auto' is invalid"),
        (["--epsilon", "3", "--schedule", "cosine"], "beta=1.0 is invalid with schedule='cosine'"),
        (["--epsilon", "3", "--beta", "0.1"], "beta=0.1 is invalid with schedule='constant'"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, extra, match):
    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


def test_existing_run_needs_resume(tmp_path, capsys):
    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--batch-size",
        "512",
        "--noise-multiplier",
        "1",
        "--no-progress",
        "--no-epsilon-each-epoch",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err


def test_config_file_with_flag_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "dataset: digits\nepochs: 1\nbatch_size: 256\nnoise_multiplier: 2.0\noptimizer: dp-adam\n"
    )
    out = tmp_path / "o"
    assert (
        main(
            [
                "train",
                "--config",
                str(tmp_path / "run.yaml"),
                "--batch-size",
                "512",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["batch_size"] == 512 and res["config"]["optimizer"] == "dp-adam"
    assert res["privacy"]["noise_multiplier"] == 2.0 and res["steps"] == 3  # ⌈1438/512⌉


class ChannelScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.scale = nn.Parameter(torch.ones(4, 1, 1))  # per-channel: a vector, not a matrix
        self.head = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.conv(x) * self.scale, 1))


@pytest.mark.parametrize("optimizer", ["dp-muon", "dp-muon-s", "dp-muon-bc"])
def test_per_channel_parameter_goes_to_the_vector_rule(optimizer):
    model = ChannelScaled()
    notes = []
    opt = build_optimizer(cfg(optimizer=optimizer), model, log=notes.append)
    rules = {id(p): g["rule"] for g in opt.param_groups for p in g["params"]}
    assert rules[id(model.scale)] == "sgd" and rules[id(model.conv.bias)] == "sgd"
    assert rules[id(model.conv.weight)] != "sgd" and rules[id(model.head.weight)] != "sgd"
    assert "scale (4, 1, 1)" in notes[0]
    # a stand-in privatizer: its step's fresh-noise std, and gradients it vouches for
    opt.bind(SimpleNamespace(fresh_noise_std=0.01, check_gradients=lambda *_: None, consume=lambda: None))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_leading_block_is_the_top_left_corner():
    w = from_schedule(Schedule("exponential", 0.1), 12)
    for spec in ("sqrt_prefix_scaled", "bsr:3", "sqrt"):
        f = factorize(w, spec)
        g = leading_block(f, 5)
        np.testing.assert_allclose(g.C.dense(), f.C.dense()[:5, :5])
        np.testing.assert_allclose(g.workload.dense(), w.dense()[:5, :5])
        assert g.n == 5
    with pytest.raises(ValueError, match="steps=13"):
        leading_block(f, 13)


def test_device_auto_is_cuda_when_available_else_cpu():
    from dpmf.train.build import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_keeps_noise_and_weights_on_the_device(tmp_path):
    res = train(
        cfg(epochs=1, device="cuda", noise_multiplier=1.0, epsilon=None),
        str(tmp_path),
        progress=False,
        log=lambda *a: None,
    )
    assert all(p.device.type == "cuda" for p in res.model.parameters())
    assert float(res.metrics[-1]["test_accuracy"]) > 0.3


def test_numerical_failure_is_one_line_and_exit_1(tmp_path, capsys):
    # a learning rate that overflows float32 at the first step: the step is undone and named
    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--batch-size",
        "512",
        "--noise-multiplier",
        "1000",
        "--lr",
        "3e38",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "step 0" in err and "NaN/inf" in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("os").path.isdir("/usr/share/datasets/fashion-mnist"), reason="Fashion-MNIST not installed"
)
def test_fashion_mnist_one_epoch_at_epsilon_3_reaches_80_percent(tmp_path):
    """The real-data path at small scale: 118 steps of DP-SGD (B = 512) at ε = 3, δ = 1e-5."""
    c = TrainConfig(dataset="fashion-mnist", epochs=1, batch_size=512, epsilon=3.0, delta=1e-5)
    res = train(c, str(tmp_path), progress=False, log=lambda *a: None)
    assert res.privacy.epsilon <= 3.0 and res.steps == 118
    assert res.test_accuracy >= 0.80


def test_factorization_auto_trains_with_the_pick_recommendation(tmp_path):
    """auto = the first entry of pick's ranking for this run; the run is accounted at ε under
    that strategy's scheme, and its noise generator is the strategy's."""
    from dpmf.pick import pick

    c = cfg(factorization="auto", epochs=2, batch_size=256, max_bands=2, schedule="cosine", beta=0.1)
    logs = []
    res = train(c, str(tmp_path), progress=False, log=logs.append)
    N, b = 1438, 6  # digits training split; ⌈1438/256⌉ steps per epoch
    ref = pick(
        dataset_size=N,
        batch_size=256,
        steps=2 * b,
        epsilon=3.0,
        delta=1e-5,
        schedule=Schedule("cosine", 0.1),
        max_bands=2,
        progress=False,
    )
    rec = ref.recommendation
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["config"]["factorization"] == rec.factorization
    assert out["config"]["scheme"] == rec.scheme
    assert res.privacy.noise_multiplier == pytest.approx(rec.noise_multiplier, rel=1e-9)
    assert res.privacy.epsilon <= 3.0 + 1e-9
    assert any(line.startswith("pick 1: " + rec.factorization) for line in logs)
