"""Temporal filters inside the private training: DiSK's evaluation plan in the clipping (the
combined per-example vector is what gets clipped, against per-example autograd), ε unchanged
by any filter (through the training configuration and the CLI), exact resume with DiSK."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf.cli import main
from dpmf.optim import Doppler, EvaluationPoint
from dpmf.optim.clipping import clipped_sum, per_example_gradients
from dpmf.train.build import build_optimizer
from dpmf.train.checkpoint import load_checkpoint
from dpmf.train.config import TrainConfig
from dpmf.train.run import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


QUIET = {"progress": False, "log": lambda *a: None}


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def brute_force_vector(model, shift, weights, x, y):
    """w₀·∇ℓ(θ; x) + w₁·∇ℓ(θ + shift; x) for one example, by plain autograd on copies."""
    total = []
    for w, s in zip(weights, (None, shift), strict=True):
        m = small_model()
        m.load_state_dict(model.state_dict())
        if s is not None:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.add_(s[n])
        loss = F.cross_entropy(m(x[None]), y[None])
        g = torch.autograd.grad(loss, list(m.parameters()))
        total.append([w * gi for gi in g])
    return [a + b for a, b in zip(*total, strict=True)]


def test_plan_clips_the_combined_per_example_vector():
    model = small_model()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (6,), generator=gen)
    shift = {
        n: 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()
    }
    weights = (0.2, 0.8)
    plan = (EvaluationPoint(weights[0]), EvaluationPoint(weights[1], shift))
    zeta = 0.05
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=zeta, points=plan, micro_batch_size=4)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    norms = []
    for i in range(6):
        v = brute_force_vector(model, shift, weights, x[i], y[i])
        norm = torch.sqrt(sum((g**2).sum() for g in v))
        norms.append(float(norm))
        for e, g in zip(expected, v, strict=True):
            e += g * min(1.0, zeta / float(norm))
    assert min(norms) > zeta  # every example is clipped: the sum is the sum of clipped combinations
    torch.testing.assert_close(got.norms, torch.tensor(norms, dtype=torch.float64))
    for a, b in zip(got.grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # one point of weight 1 at θ is the plain per-example gradient
    plain = per_example_gradients(model, F.cross_entropy, x, y)
    single = per_example_gradients(model, F.cross_entropy, x, y, points=(EvaluationPoint(1.0),))
    for a, b in zip(plain, single, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "points, match",
    [
        ((), "at least one point"),
        ((EvaluationPoint(float("nan")),), "weight"),
        ((EvaluationPoint(1.0, {"0.weight": torch.zeros(3, 4)}),), "every trainable parameter"),
    ],
)
def test_bad_plans_refused(points, match):
    model = small_model()
    x, y = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        clipped_sum(model, F.cross_entropy, x, y, clip_norm=1.0, points=points)


def cfg(**kw):
    args = dict(dataset="digits", epochs=2, batch_size=128, epsilon=3.0, optimizer="dp-muon", seed=0)
    args.update(kw)
    return TrainConfig(**args)


def test_filters_do_not_change_the_privacy_of_the_run(tmp_path):
    results = {}
    for name in ("none", "doppler", "disk"):
        out = tmp_path / name
        res = train(cfg(filter=name, epochs=1), str(out), **QUIET)
        written = json.loads((out / "results.json").read_text())
        results[name] = (res.privacy.to_dict(), written["noise"]["noise_std_on_sum"], res.steps)
        assert written["config"]["filter"] == name
    assert results["doppler"] == results["none"] == results["disk"]
    privacy, _, steps = results["none"]
    assert privacy["epsilon"] <= 3.0 and privacy["steps"] == steps  # every step accounted once
    # σ given instead of ε: the same ε with and without the filter
    eps = {
        name: train(
            cfg(filter=name, epochs=1, noise_multiplier=1.3, epsilon=None),
            str(tmp_path / f"s_{name}"),
            **QUIET,
        ).privacy.epsilon
        for name in ("none", "disk")
    }
    assert eps["disk"] == eps["none"]


def test_cli_filter_flags_build_the_filtered_optimizer(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--batch-size",
        "256",
        "--no-progress",
        "--epsilon",
        "3",
        "--optimizer",
        "dp-sgd",
        "--filter",
        "doppler",
        "--doppler-a",
        "1,-0.8",
        "--doppler-b",
        "0.2",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["filter"] == "doppler" and res["config"]["doppler_a"] == [1.0, -0.8]
    ckpt = load_checkpoint(out / "checkpoint.pt")
    assert ckpt["optimizer"]["param_groups"][0]["filter"] == {
        "dpmf_stage": repr(Doppler((1.0, -0.8), (0.2,)))
    }
    assert main(["train", "--dataset", "digits", "--filter", "lowpass", "--out", str(tmp_path / "bad")]) == 2
    assert "filter='lowpass' is invalid" in capsys.readouterr().err
    opt = build_optimizer(
        cfg(filter="disk", disk_kappa=0.5, disk_gamma=1.0), small_model(), log=lambda *a: None
    )
    assert all(repr(g["filter"]) == "Disk(kappa=0.5, gamma=1.0)" for g in opt.param_groups)


class Kill(Exception):
    pass


@pytest.mark.parametrize("optimizer", ["dp-sgd", "dp-muon"])
def test_disk_kill_and_resume_gives_identical_weights(tmp_path, optimizer):
    c = cfg(filter="disk", optimizer=optimizer, seed=5)
    ref = train(c, str(tmp_path / "ref"), **QUIET)

    def kill(epoch, row):
        if epoch == 1:
            raise Kill

    with pytest.raises(Kill):
        train(c, str(tmp_path / "run"), on_epoch_end=[kill], **QUIET)
    assert "lookahead" in load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    resumed = train(c, str(tmp_path / "run"), resume=True, **QUIET)
    for a, b in zip(ref.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ref.test_accuracy > 0.3  # it learns (10 classes)
