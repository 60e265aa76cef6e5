"""The paper-experiment grid runner (benchmarks/paper_experiments.py) and ``train(data=...)``:
splits that hold validation out of the training set, the threshold and claim arithmetic, and
the command line on a small fake CIFAR-10 folder."""

import math
import os
import pickle
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from dpmf.train import Dataset, TrainConfig, load_dataset, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import paper_experiments as pe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def quiet(*a, **k):
    pass


def tiny_config(**kw):
    base = dict(
        dataset="digits", model="mlp", epochs=1, batch_size=128, epsilon=None, noise_multiplier=1.0, seed=5
    )
    base.update(kw)
    return TrainConfig(**base)


def rows_of(x):
    return {bytes(r.numpy().tobytes()) for r in x}


def test_train_on_the_loaded_data_set_is_the_same_run(tmp_path):
    a = train(tiny_config(), str(tmp_path / "a"), progress=False, log=quiet)
    b = train(tiny_config(), str(tmp_path / "b"), progress=False, log=quiet, data=load_dataset("digits"))
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a.privacy.epsilon == b.privacy.epsilon


def test_train_on_a_subset_accounts_for_its_size(tmp_path):
    full = load_dataset("digits")
    sub = Dataset(full.name, full.train_x[:500], full.train_y[:500], full.test_x, full.test_y, 10, "subset")
    res = train(tiny_config(), str(tmp_path), progress=False, log=quiet, data=sub)
    assert res.steps == math.ceil(500 / 128)  # one epoch of ⌈N/B⌉ steps with N = 500, not 1438
    whole = train(tiny_config(), str(tmp_path / "w"), progress=False, log=quiet)
    assert whole.steps == math.ceil(1438 / 128)
    # q = B/N is larger on the subset: the same σ gives a larger ε
    assert res.privacy.epsilon > whole.privacy.epsilon


def test_train_refuses_data_of_another_data_set_before_any_work(tmp_path):
    d = load_dataset("digits")
    other = Dataset("cifar10", d.train_x, d.train_y, d.test_x, d.test_y, 10, "x")
    with pytest.raises(ValueError, match="data='cifar10' is invalid for dataset='digits'"):
        train(tiny_config(), str(tmp_path), progress=False, log=quiet, data=other)
    with pytest.raises(TypeError, match="data=dict is invalid"):
        train(tiny_config(), str(tmp_path), progress=False, log=quiet, data={})
    assert not os.path.exists(tmp_path / "results.json")


def test_the_validation_split_is_held_out_of_the_training_split_never_the_test_split():
    full = load_dataset("digits")
    data, test_x, test_y = pe.load_split(pe.Split("digits", train_size=900, val_size=300, seed=3))
    assert data.train_x.shape[0] == 900 and data.test_x.shape[0] == 300
    train_rows, val_rows = rows_of(data.train_x), rows_of(data.test_x)
    assert not train_rows & val_rows  # disjoint (digits has duplicate images: compare indices too)
    perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(3))
    assert torch.equal(data.test_x, full.train_x[perm[:300]])
    assert torch.equal(data.train_x, full.train_x[perm[300:1200]])
    assert torch.equal(test_x, full.test_x) and torch.equal(test_y, full.test_y)
    # no validation split: the loop evaluates on the test split
    d0, _, _ = pe.load_split(pe.Split("digits", val_size=0))
    assert torch.equal(d0.test_x, full.test_x) and d0.train_x.shape[0] == len(full)


def test_a_split_larger_than_the_training_split_is_refused():
    with pytest.raises(ValueError, match="val_size=300 is invalid"):
        pe.load_split(pe.Split("digits", train_size=1200, val_size=300))
    with pytest.raises(ValueError, match="val_size"):
        pe.Split("digits", val_size=-1)


def test_compare_uses_the_standard_error_of_the_difference_of_means():
    c = pe.compare([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])  # se = √(1/3) = 0.577; d = 2 > 2·se
    assert c["diff"] == pytest.approx(2.0) and c["se"] == pytest.approx(math.sqrt(1 / 3))
    assert c["verdict"] == "higher"
    assert pe.compare([0.0, 0.0, 0.0], [1.0, 2.0, 3.0])["verdict"] == "lower"
    assert pe.compare([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])["verdict"] == "within noise"  # 0.5 < 2·0.816


def test_the_threshold_is_where_the_ratio_crosses_one_on_log_scales():
    assert pe._crossing([100, 10_000], [0.1, 10.0]) == pytest.approx(1000.0)  # r = B/1000
    assert pe._crossing([128, 512, 2048], [0.2, 0.5, 0.9]) is None
    # r = (B/300)² between 256 and 1024: crossing at 300
    assert pe._crossing([256, 1024], [(256 / 300) ** 2, (1024 / 300) ** 2]) == pytest.approx(300.0)


def spectra_rows(gains, gap_per_b, sigma=1.0):
    """Synthetic phase-transition rows: per B three seeds with DP-Muon − DP-SGD = gains[B] ± 0.01."""
    rows = []
    for b, g in gains.items():
        for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
            spec = [
                dict(
                    layer="w",
                    m=16,
                    n=9,
                    sigma1=gap_per_b[b] + 0.1,
                    sigma2=0.1,
                    gap=gap_per_b[b],
                    noise_factor=7.0,
                )
            ]
            common = dict(batch_size=b, seed=seed, lr=1.0, stage=1 if seed == 0 else 2, sigma=sigma)
            rows.append(dict(optimizer="dp-sgd", test_accuracy=0.5, val_accuracy=0.5, spectra=spec, **common))
            acc = 0.5 + g / 100 + jitter / 100
            rows.append(dict(optimizer="dp-muon", test_accuracy=acc, val_accuracy=acc, **common))
            # a stage-1 run at a worse rate, which the summary must leave out
            if seed == 0:
                rows.append(dict(common, optimizer="dp-muon", lr=9.0, test_accuracy=0.99, val_accuracy=0.1))
    return rows


def test_the_wedin_verdict_agrees_only_when_the_gain_appears_above_the_threshold():
    gap = {64: 7.0 / 640, 256: 7.0 / 640, 1024: 7.0 / 640}  # ratio B·gap/(σ·7) = B/640: B* = 640
    agree = pe.summarize_phase_transition(spectra_rows({64: 0.0, 256: -1.0, 1024: 3.0}, gap))
    assert agree["b_star"] == pytest.approx(640.0)
    text = "\n".join(pe.phase_transition_conclusions(agree))
    assert "agree with the Wedin-threshold prediction" in text and "B* ≈ 640" in text
    against = pe.summarize_phase_transition(spectra_rows({64: 2.6, 256: -0.6, 1024: 1.0}, gap))
    text = "\n".join(pe.phase_transition_conclusions(against))
    assert "contradict the Wedin-threshold prediction" in text and "B = [64]" in text
    assert "largest mean gain is at B = 64" in text and "below the threshold" in text
    # the ratio below 1 everywhere (B/6400): every B is below B*, so a DP-Muon gain contradicts it
    low = {b: 7.0 / 6400 for b in gap}
    below = pe.summarize_phase_transition(spectra_rows({64: 0.0, 256: 0.0, 1024: 2.0}, low))
    assert below["b_star"] is None
    text = "\n".join(pe.phase_transition_conclusions(below, dataset_size=2000))
    assert "below 1 at every batch size" in text and "B* ≈ 6.4e+03" in text
    assert "more than the 2000 training examples" in text
    assert "contradict the Wedin-threshold prediction" in text and "B = [1024]" in text
    quiet_below = pe.summarize_phase_transition(spectra_rows({64: 0.0, 256: 0.0, 1024: 0.0}, low))
    assert "below the threshold only" in "\n".join(pe.phase_transition_conclusions(quiet_below))


def summary_of(values):
    rows = []
    for (sched, mech), accs in values.items():
        t = np.asarray(accs) / 100
        rows.append(
            dict(
                epsilon_target=9.0,
                schedule=sched,
                mechanism=mech,
                lr=1.0,
                lr_at_edge=False,
                mean=100 * t.mean(),
                sd=100 * t.std(ddof=1),
                seeds=len(t),
                epsilon=9.0,
                sigma=1.0,
                test=list(t),
            )
        )
    return pd.DataFrame(rows)


def test_the_claims_hold_are_contradicted_or_not_resolved_from_the_seeds():
    s = summary_of(
        {
            ("constant", "DP-SGD"): [70, 71, 72],
            ("constant", "BISR"): [70, 71, 72],
            ("linear", "DP-SGD"): [75, 76, 77],  # higher: holds
            ("linear", "BISR"): [70, 72, 71],  # no change: not resolved
            ("linear", "BISR w/ LRS"): [65, 66, 67],  # lower than BISR: contradicts claim 6
            ("polynomial", "DP-SGD"): [60, 61, 62],  # lower: the paper's exception holds
            ("polynomial", "BISR"): [80, 81, 82],
            ("polynomial", "BISR w/ LRS"): [84, 85, 86],
        }
    )
    claims = pe.lr_scheduling_claims(s)
    got = {(r.claim, r.comparison): r.holds for r in claims.itertuples()}
    assert got[(4, "DP-SGD linear − DP-SGD constant")] == "yes"
    assert got[(4, "DP-SGD polynomial − DP-SGD constant")] == "yes"
    assert got[(5, "BISR linear − BISR constant")] == "not resolved"
    assert got[(6, "BISR w/ LRS linear − BISR linear")] == "no"
    assert got[(6, "BISR w/ LRS polynomial − BISR polynomial")] == "yes"
    text = "\n".join(pe.lr_scheduling_conclusions(s, claims))
    assert "Claim 6, ε = 9: holds in part, contradicted in part." in text
    assert "polynomial (+4.0 points), not linear as the paper reports" in text
    row = claims[claims.comparison == "DP-SGD linear − DP-SGD constant"].iloc[0]
    assert row["diff"] == pytest.approx(5.0) and row["se"] == pytest.approx(math.sqrt(2 / 3))


def fake_cifar(root, per_batch=48, test=48):
    base = root / "cifar-10-batches-py"
    os.makedirs(base)
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        labels = rng.integers(0, 10, n)
        # a learnable signal: the label sets the brightness of the red plane
        data = rng.integers(0, 64, (n, 3072)).astype(np.uint8)
        data[:, :1024] += (labels[:, None] * 19).astype(np.uint8)
        with open(base / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": list(labels)}, f)
    return str(root)


@pytest.mark.slow
def test_the_command_line_runs_both_experiments_on_a_cifar10_folder(tmp_path, capsys):
    root = fake_cifar(tmp_path / "data")
    out = tmp_path / "pt"
    rc = pe.main(
        [
            "--experiment",
            "phase_transition",
            "--dataset",
            "cifar10",
            "--data-dir",
            root,
            "--epochs",
            "1",
            "--batch-sizes",
            "16,64",
            "--seeds",
            "2",
            "--spectrum-examples",
            "64",
            "--val-size",
            "40",
            "--sgd-lrs",
            "0.5",
            "--muon-lrs",
            "0.05,0.1",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 2 * 2 * 2 and set(runs.optimizer) == {"dp-sgd", "dp-muon"}
    assert np.allclose(runs.epsilon, 3.0, rtol=1e-3)  # the default ε of the experiment
    spectra = pd.read_csv(out / "spectra.csv")
    assert len(spectra) == 2 * 2 * 2  # B × seeds × the two weight matrices of the MLP
    assert (spectra.sigma1 >= spectra.sigma2).all() and (spectra.gap >= 0).all()
    assert "DP-Muon − DP-SGD" in (out / "conclusions.md").read_text()
    out = tmp_path / "lr"
    rc = pe.main(
        [
            "--experiment",
            "lr_scheduling",
            "--dataset",
            "cifar10",
            "--data-dir",
            root,
            "--epochs",
            "1",
            "--batch-size",
            "32",
            "--val-size",
            "40",
            "--schedules",
            "linear",
            "--lrs",
            "0.5,2",
            "--bands",
            "2",
            "--epsilon",
            "9",
            "--seeds",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    runs = pd.read_csv(out / "runs.csv")
    # stage 1: 3 mechanisms × 2 rates (seed 0); stage 2: 3 × 1 (seed 1)
    assert len(runs) == 9 and (runs[runs.stage == 2].seed == 1).all()
    assert np.allclose(runs.epsilon, 9.0, rtol=1e-3)
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 3 and (summary.seeds == 2).all()
    first = runs[runs.stage == 1]
    for r in summary.itertuples():  # the chosen rate is the best on validation, never on test
        sub = first[(first.schedule == r.schedule) & (first.mechanism == r.mechanism)]
        assert r.lr == sub.loc[sub.val_accuracy.idxmax(), "lr"]
    assert "Claim 6" in capsys.readouterr().out


def test_the_command_line_refuses_a_missing_data_folder_with_status_2(tmp_path, capsys):
    rc = pe.main(
        [
            "--experiment",
            "lr_scheduling",
            "--dataset",
            "cifar10",
            "--data-dir",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "data_dir=" in err
    assert not (tmp_path / "o").exists()
