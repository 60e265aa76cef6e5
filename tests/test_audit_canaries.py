"""Canaries in training (dpmf.audit.canaries), the audit runner and `dpmf audit`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpmf.audit import canaries as K
from dpmf.audit.runner import run_audit
from dpmf.cli import main
from dpmf.optim.privatize import Privatizer
from dpmf.plan.plan import PrivatePlan
from dpmf.step import noise_stream
from dpmf.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 3))


class _Draws:
    """A sampler's ``watch`` only: the test announces each step's global batch itself."""

    def watch(self, fn):
        self.announce = fn


def _privatizers(plan, canaries):
    from dpmf.audit.stage import CanaryStage

    m1, m2 = _model(), _model()
    d = sum(p.numel() for p in m1.parameters())
    common = dict(plan=plan, clip_norm=1.0)
    a = Privatizer(m1, F.cross_entropy, noise=noise_stream(plan, d, 7), **common)
    b = Privatizer(m2, F.cross_entropy, noise=noise_stream(plan, d, 7), **common)
    draws = _Draws()
    included = np.ones(canaries.shape[0], dtype=bool)
    b.set_stage(CanaryStage(b, draws, canaries, included, 100, slots_in_batch=False))
    return m1, m2, a, b, draws


def test_canaries_are_added_to_the_clipped_sum_and_projected():
    plan = PrivatePlan(100, 10, steps=4, scheme="fixed_order", strategy="bsr:2").with_noise(1.0)
    d = 6 * 3 + 3
    canaries = K.gradient_canaries(d, 5, 1.0, seed=3)
    assert torch.allclose(canaries.norm(dim=1), torch.ones(5))
    m1, m2, a, b, draws = _privatizers(plan, canaries)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for t in range(3):  # canary slots 100 + 1 and 100 + 3 in the global batch of steps 0 and 2
        draws.announce(t, np.array([0, 5, 101, 103]) if t != 1 else np.array([0, 5]))
        a.privatize(x, y)
        b.privatize(x, y)
        ga = torch.cat([p.grad.reshape(-1) for p in m1.parameters()])
        gb = torch.cat([p.grad.reshape(-1) for p in m2.parameters()])
        added = (gb - ga) * plan.expected_batch_size
        want = canaries[[1, 3]].sum(0) if t != 1 else torch.zeros(d)
        torch.testing.assert_close(added, want, atol=1e-5, rtol=0)
        # the recorded projections are those of the released noisy sum on the unit directions
        np.testing.assert_allclose(
            b.stage.projections[t],
            (canaries @ gb).double().numpy() * plan.expected_batch_size,
            rtol=1e-5,
            atol=1e-5,
        )


def test_white_box_score_for_dpsgd_is_the_sum_of_projections():
    plan = PrivatePlan(100, 10, steps=6, scheme="fixed_order").with_noise(2.0)
    y = np.random.default_rng(0).normal(size=(6, 3))
    possible = np.zeros((6, 3), dtype=bool)
    possible[[0, 3], 0] = True
    possible[[1, 4], 1] = True
    possible[:, 2] = True
    std = plan.noise_std(1.0)
    want = [
        y[[0, 3], 0].sum() / (std * np.sqrt(2)),
        y[[1, 4], 1].sum() / (std * np.sqrt(2)),
        y[:, 2].sum() / (std * np.sqrt(6)),
    ]
    np.testing.assert_allclose(K.white_box_scores(y, possible, plan, 1.0), want, rtol=1e-12)


def test_input_canaries_have_wrong_labels():
    x, y = torch.randn(50, 1, 2, 2), torch.randint(0, 4, (50,))
    cx, cy = K.input_canaries(x, y, 30, 4, seed=1)
    assert cx.shape == (30, 1, 2, 2)
    # each canary is a copy of a training example with another label
    for i in range(30):
        same = [j for j in range(50) if torch.equal(x[j], cx[i])]
        assert same and all(int(y[j]) != int(cy[i]) for j in same)


def _config(**kw):
    base = dict(
        dataset="digits",
        epochs=2,
        batch_size=256,
        epsilon=4.0,
        seed=0,
        scheme="fixed_order",
        device="cpu",
        clipping="vmap",
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kind", ["white-box", "input"])
def test_runner_writes_the_audit_and_claims_the_plans_epsilon(kind, tmp_path):
    res = run_audit(
        _config(),
        str(tmp_path),
        canaries=200,
        kind=kind,
        method="one-run",
        progress=False,
        log=lambda *a: None,
    )
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert saved["epsilon_lower_bound"] == res["epsilon_lower_bound"]
    assert (tmp_path / "audit.png").stat().st_size > 1000
    assert saved["claimed"]["epsilon"] == pytest.approx(4.0, rel=1e-6)
    assert saved["plan"]["dataset_size"] == 1438 + 200  # digits' training split plus the canaries
    assert saved["canaries"]["in"] + saved["canaries"]["out"] == 200
    assert "seed" not in saved["config"]
    assert 0 <= saved["epsilon_lower_bound"] <= 4.0
    if kind == "white-box":
        assert saved["auroc"] > 0.6  # the canaries are visible (μ ≈ 1.08 for ε = 4 in fixed order)


def test_white_box_training_audit_catches_noise_far_below_the_plans(monkeypatch, tmp_path):
    # a training-level planted bug: the released noise at 1/10 of σ·ζ·s
    real = Privatizer.noise_std
    monkeypatch.setattr(Privatizer, "noise_std", property(lambda self: real.fget(self) / 10))
    res = run_audit(
        _config(epsilon=1.0),
        str(tmp_path),
        canaries=300,
        method="one-run",
        progress=False,
        log=lambda *a: None,
    )
    assert res["claimed"]["epsilon"] == pytest.approx(1.0, rel=1e-6)
    assert res["epsilon_lower_bound"] > 1.0


@pytest.mark.parametrize(
    "flags, word",
    [
        (["--canaries", "5"], "canaries"),
        (["--canary", "grey-box"], "canary"),
        (["--method", "bayes"], "method"),
        (["--significance", "0.7"], "significance"),
        (["--resume"], "--resume"),
        (["--filter", "disk"], "disk"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(flags, word, tmp_path, capsys):
    rc = main(["audit", "--dataset", "digits", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and word in err
    assert not os.path.exists(tmp_path / "o" / "audit.json")


def test_cli_audit_prints_claim_bound_and_auroc(tmp_path, capsys):
    rc = main(
        [
            "audit",
            "--dataset",
            "digits",
            "--epochs",
            "1",
            "--batch-size",
            "256",
            "--epsilon",
            "2",
            "--seed",
            "1",
            "--canaries",
            "100",
            "--method",
            "one-run-fdp",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "claimed: ε = 2 at δ = 1e-05" in out and "AUROC" in out and "one-run-fdp" in out
    assert json.loads((tmp_path / "audit.json").read_text())["method"] == "one-run-fdp"


def test_runner_scores_cyclic_poisson_canaries_over_their_group(tmp_path):
    # bsr:4 under cyclic Poisson: each canary is scored at the steps of its (public) group only
    cfg = _config(scheme="cyclic_poisson", factorization="bsr:4", epochs=4, batch_size=128, epsilon=8.0)
    res = run_audit(
        cfg, str(tmp_path), canaries=300, method="one-run-fdp", progress=False, log=lambda *a: None
    )
    assert res["plan"]["scheme"].startswith("cyclic_poisson")
    assert res["auroc"] > 0.6
    assert 0 <= res["epsilon_lower_bound"] <= res["claimed"]["epsilon"]


def test_cli_audit_refuses_an_earlier_audit_without_overwrite(tmp_path, capsys):
    flags = ["audit", "--dataset", "digits", "--epochs", "1", "--batch-size", "256"]
    flags += ["--noise-multiplier", "1", "--canaries", "20", "--no-progress", "--seed", "3"]
    assert main([*flags, "--out", str(tmp_path)]) == 0
    first = (tmp_path / "audit.json").read_bytes()
    capsys.readouterr()
    # a second audit into the same folder: one line, exit 2, before any work; the first stays
    assert main([*flags, "--seed", "4", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "audit.json" in err and "--overwrite" in err
    assert (tmp_path / "audit.json").read_bytes() == first
    assert main([*flags, "--seed", "4", "--out", str(tmp_path), "--overwrite"]) == 0
    assert (tmp_path / "audit.json").read_bytes() != first
    # --out a file: one line, exit 2; the library refuses the earlier audit as well
    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    assert main([*flags, "--out", str(tmp_path / "file")]) == 2
    assert "file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="earlier audit"):
        run_audit(_config(), str(tmp_path), canaries=20, progress=False, log=lambda *a: None)
