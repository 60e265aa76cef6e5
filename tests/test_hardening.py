"""Hostile input and edge cases: each test pins one failure found by attacking the toolkit as a
user would (a crash, a hang, a silent or misleading answer, an unusable output) and the
behaviour that replaced it."""

import logging
import math
import os
import stat

import mpmath
import numpy as np
import pytest
from scipy.stats import norm

from dpmf import calibrate, cli
from dpmf._io import atomic_write_csv, atomic_write_text, check_out_dir
from dpmf.accountants import samples_needed
from dpmf.accountants.calibration import check_monte_carlo
from dpmf.accountants.events import GaussianEvent, PoissonGaussianEvent
from dpmf.accountants.gaussian import EXACT_MAX_MU, gaussian_delta, gaussian_epsilon, gaussian_mu
from dpmf.accountants.library import (
    DeltaTooSmallError,
    NoiseTooSmallError,
    PLDAccountant,
    RDPAccountant,
)
from dpmf.accountants.montecarlo import (
    MIN_CONFIDENCE,
    MonteCarloAccountant,
    TooManySamplesError,
    sample_limit,
    sample_privacy_losses,
)

SINGLE = ["--scheme", "single_release", "--dataset-size", "1000", "--batch-size", "100", "--steps", "1"]
BINS = ["--scheme", "balls_in_bins", "--noise-multiplier", "1", "--dataset-size", "1000"]
BINS += ["--batch-size", "100", "--epochs", "2"]


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"dpmf {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


# --- 1. prv-accountant's discretization failure ------------------------------------------------


def test_prv_discretization_failure_falls_back_to_pld_with_a_notice(capsys):
    # prv-accountant raises "Discrete mean differs from continuous mean significantly" here
    # (as for σ = 0.8, q = 1/8, 1000 steps, δ = 1e-6, where PLD gives 56.726)
    import json

    argv = ["epsilon", "--scheme", "poisson", "--noise-multiplier", "0.8", "--dataset-size", "800"]
    argv += ["--batch-size", "100", "--steps", "100", "--delta", "1e-6", "--accountant", "prv", "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    pld = PLDAccountant().epsilon(PoissonGaussianEvent(0.8, 0.125, 100), 1e-6)
    assert result["epsilon"] == pytest.approx(pld.epsilon, rel=1e-12)
    assert result["accountant"] == "pld" and result["guarantee"] == "upper_bound"
    assert "prv-accountant failed" in result["method"]
    assert "pld accountant instead" in out.err and "Traceback" not in out.err


# --- 2. Monte Carlo sample counts beyond reach -----------------------------------------------


def test_monte_carlo_refuses_a_sample_count_above_the_limit_before_sampling(capsys):
    need = samples_needed(1e-5, ratio=0.5, confidence=0.99)
    assert cli.main(["epsilon", *BINS, "--delta", "1e-5", "--max-samples", "1000"]) == 2
    line = _one_line_error(capsys, "epsilon")
    assert f"samples={need:.3g}" in line and "max_samples=1e+03" in line
    assert "would take about" in line


def test_monte_carlo_default_limit_refuses_delta_1e_12_with_the_count_and_time(capsys):
    need = samples_needed(1e-12, ratio=0.5, confidence=0.99)
    assert need > 10**13  # about 8.8e13: months of sampling
    assert cli.main(["epsilon", *BINS, "--delta", "1e-12"]) == 2
    line = _one_line_error(capsys, "epsilon")
    assert f"samples={need:.3g}" in line
    assert "days" in line or "years" in line


def test_sample_limit_and_max_samples_parameter():
    event = GaussianEvent(1.0)
    with pytest.raises(TooManySamplesError, match="max_samples=10"):
        sample_privacy_losses(event, 11, max_samples=10)
    with sample_limit(10), pytest.raises(TooManySamplesError):
        sample_privacy_losses(event, 11)
    assert sample_privacy_losses(event, 10, max_samples=10).samples == 10
    acc = MonteCarloAccountant(samples=5000, max_samples=4999)
    with pytest.raises(TooManySamplesError, match="samples=5e\\+03"):
        acc.epsilon(event, 0.01)


# --- 4. a bad --out is refused before any work ------------------------------------------------


@pytest.mark.parametrize("where", ["file", "under_file", "unwritable"])
def test_bad_out_folder_is_refused_before_any_work(where, tmp_path, capsys, monkeypatch):
    f = tmp_path / "a_file"
    f.write_text("x")
    out = {"file": f, "under_file": f / "sub", "unwritable": "/proc/dpmf-out"}[where]

    def boom(*a, **k):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr("dpmf.mechanisms.sweeps.error_curves", boom)
    monkeypatch.setattr("dpmf.mechanisms.sweeps.gain_grid", boom)
    monkeypatch.setattr("dpmf.train.run.train", boom)
    argvs = {
        "curves": ["curves", "--schedule", "cosine", "--n", "16", "--factorizations", "sqrt_prefix"],
        "colormap": ["colormap", "--numerator", "lr_aware", "--denominator", "sqrt_prefix"]
        + ["--metric", "max_se", "--schedule", "cosine", "--n", "16", "--beta", "0.1"],
        "train": ["train", "--dataset", "digits", "--epochs", "1"],
    }
    for command, argv in argvs.items():
        assert cli.main([*argv, "--out", str(out)]) == 2
        line = _one_line_error(capsys, command)
        assert "--out=" in line
    with pytest.raises(ValueError, match="is a file|under the file|cannot write"):
        check_out_dir(out)


def test_check_out_dir_accepts_new_and_existing_folders_without_creating(tmp_path):
    new = tmp_path / "a" / "b"
    assert check_out_dir(new) == new
    assert not (tmp_path / "a").exists()
    assert check_out_dir(tmp_path) == tmp_path
    assert list(tmp_path.iterdir()) == []  # the write probe is removed


# --- 6. noise multipliers so small that 1/σ² overflows ----------------------------------------


def _exact_delta(mu, eps, digits=60):
    """δ(ε) of μ-GDP in mpmath at high precision (no cancellation)."""
    with mpmath.workdps(digits):
        mu, eps = mpmath.mpf(mu), mpmath.mpf(eps)
        cdf = lambda x: mpmath.ncdf(x)  # noqa: E731
        return cdf(-eps / mu + mu / 2) - mpmath.exp(eps) * cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("mu", [2e3, 1e5, 1e8])
def test_gaussian_epsilon_beyond_the_exact_range_is_a_tight_upper_bound(mu):
    delta = 1e-5
    eps = gaussian_epsilon(mu, delta)
    assert mu > EXACT_MAX_MU
    assert _exact_delta(mu, eps) <= delta  # a valid ε
    # and tight: the exact ε (found in mpmath) is within a relative 1e-5
    with mpmath.workdps(60):
        exact = mpmath.findroot(lambda e: _exact_delta(mu, e) - delta, eps)
    assert float(exact) <= eps <= float(exact) * (1 + 1e-5)


def test_gaussian_profile_at_infinite_mu():
    assert gaussian_epsilon(math.inf, 1e-5) == math.inf
    assert gaussian_delta(math.inf, 10.0) == 1.0
    assert gaussian_epsilon(1e300, 1e-5) == math.inf  # μ²/2 overflows


def test_gaussian_mu_for_an_enormous_epsilon():
    delta = 1e-5
    z = norm.isf(delta)
    for eps in (1e6, 1e100, 1e300):
        mu = gaussian_mu(eps, delta)
        assert mu == pytest.approx(math.sqrt(z * z + 2 * eps) - z, rel=1e-9)
        assert gaussian_delta(mu, eps) <= delta
    assert _exact_delta(gaussian_mu(1e6, delta), 1e6) <= delta


@pytest.mark.parametrize("sigma", ["1e-300", "1e-155"])
def test_tiny_noise_multiplier_gives_infinite_epsilon_with_a_reason(sigma, capsys):
    argv = ["epsilon", *SINGLE, "--noise-multiplier", sigma, "--delta", "1e-5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "epsilon           inf" in out.out
    assert "noise is negligible" in out.out and "Traceback" not in out.err
    for acc in ("rdp", "prv"):
        assert cli.main([*argv, "--accountant", acc]) == 0
        assert "epsilon           inf" in capsys.readouterr().out


def test_calibrate_enormous_epsilon_returns_the_tiny_sigma(capsys):
    argv = ["calibrate", *SINGLE, "--epsilon", "1e300", "--delta", "1e-5", "--json"]
    assert cli.main(argv) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    z = norm.isf(1e-5)
    assert result["noise_multiplier"] == pytest.approx(1.0 / (math.sqrt(z * z + 2e300) - z), rel=1e-9)
    assert result["epsilon"] <= 1e300


def test_rdp_refuses_a_subsampled_noise_multiplier_whose_square_underflows():
    # dp-accounting's RDP answered ε = 0 here (and divided by zero at 1e-200)
    for sigma in (1e-160, 1e-200):
        with pytest.raises(NoiseTooSmallError, match="noise_multiplier=1e-.*rdp.*>= 1e-50"):
            RDPAccountant().epsilon(PoissonGaussianEvent(sigma, 0.1, 10), 1e-5)
    assert RDPAccountant().epsilon(PoissonGaussianEvent(1e-40, 0.1, 10), 1e-5).epsilon > 1e70


# --- 8. PLD at a δ it cannot resolve ----------------------------------------------------------


def test_pld_names_rdp_when_delta_is_below_its_resolution(capsys):
    event = PoissonGaussianEvent(3.0, 0.1, 100)
    with pytest.raises(DeltaTooSmallError, match="delta=1e-300 .*pld.*rdp"):
        PLDAccountant().epsilon(event, 1e-300)
    assert math.isfinite(RDPAccountant().epsilon(event, 1e-300).epsilon)
    run = ["--scheme", "poisson", "--dataset-size", "1000", "--batch-size", "100", "--steps", "100"]
    assert cli.main(["epsilon", *run, "--noise-multiplier", "3", "--delta", "1e-300"]) == 2
    assert "accountant='rdp'" in _one_line_error(capsys, "epsilon")
    assert cli.main(["calibrate", *run, "--epsilon", "1", "--delta", "1e-300"]) == 2
    line = _one_line_error(capsys, "calibrate")
    assert "accountant='rdp'" in line and "1e6" not in line
    with pytest.raises(DeltaTooSmallError):
        calibrate("poisson", epsilon=1.0, delta=1e-300, dataset_size=1000, batch_size=100, steps=100)


# --- 9. a confidence too low to call the answer certified --------------------------------------


def test_confidence_below_one_half_is_refused(capsys):
    with pytest.raises(ValueError, match="confidence=0.0001 is invalid: must be in \\[0.5, 1\\)"):
        MonteCarloAccountant(confidence=1e-4)
    with pytest.raises(ValueError, match="confidence"):
        check_monte_carlo(None, 0, 0.3)
    assert MonteCarloAccountant(confidence=MIN_CONFIDENCE).confidence == 0.5
    assert cli.main(["epsilon", *BINS, "--delta", "1e-5", "--confidence", "0.0001"]) == 2
    assert "confidence=0.0001" in _one_line_error(capsys, "epsilon")


# --- 14. written files respect the umask -----------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_umask_mode(umask, tmp_path):
    old = os.umask(umask)
    try:
        a = atomic_write_text(tmp_path / "a.txt", "x")
        b = atomic_write_csv(tmp_path / "b.csv", ("n",), [(1,)])
        plain = tmp_path / "plain.txt"
        with open(plain, "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert stat.S_IMODE(plain.stat().st_mode) == want
    for p in (a, b):
        assert stat.S_IMODE(os.stat(p).st_mode) == want
    assert np.array_equal(sorted(os.listdir(tmp_path)), ["a.txt", "b.csv", "plain.txt"])


# --- 5. bad data files ------------------------------------------------------------------------


def _write_idx(path, arr):
    import gzip

    arr = np.asarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + arr.tobytes())


def _fmnist(folder, *, train_labels=None, n_train=12):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, n_train) if train_labels is None else train_labels,
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (5, 28, 28)),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, 5),
    }
    for name, arr in arrays.items():
        _write_idx(folder / name, arr)


def test_gzipped_garbage_is_a_one_line_error_naming_the_file(tmp_path):
    from dpmf.train.data import load_dataset

    _fmnist(tmp_path)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(b"this is not gzip at all")
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz is invalid: not a readable gzip"):
        load_dataset("fashion-mnist", str(tmp_path))


@pytest.mark.parametrize(
    "labels, match",
    [
        (np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]), r"label 10 is outside \[0, 10\)"),
        (np.arange(11) % 10, r"it holds 11 labels but .*train-images-idx3-ubyte\.gz holds 12 images"),
    ],
)
def test_labels_are_checked_when_loading(labels, match, tmp_path):
    from dpmf.train.data import load_dataset

    _fmnist(tmp_path, train_labels=labels)
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz is invalid: " + match):
        load_dataset("fashion-mnist", str(tmp_path))


def test_cifar_batch_with_bad_labels_is_refused(tmp_path):
    import pickle

    from dpmf.train.data import load_dataset

    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        labels = [int(v) for v in rng.integers(0, 10, 4)]
        if i == 2:
            labels[1] = -1
        d = {b"data": rng.integers(0, 256, (4, 3072)).astype(np.uint8), b"labels": labels}
        (base / name).write_bytes(pickle.dumps(d))
    with pytest.raises(ValueError, match=r"data_batch_3 is invalid: label -1 is outside \[0, 10\)"):
        load_dataset("cifar10", str(tmp_path))
    (base / "test_batch").write_bytes(b"garbage")
    (base / "data_batch_3").write_bytes(
        pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]})
    )
    with pytest.raises(ValueError, match=r"test_batch is invalid: not a CIFAR-10 python batch"):
        load_dataset("cifar10", str(tmp_path))


def test_digits_refuses_a_data_dir():
    from dpmf.train.data import load_dataset

    with pytest.raises(ValueError, match=r"data_dir='/nonexistent' is invalid with dataset='digits'"):
        load_dataset("digits", "/nonexistent")


def test_train_with_bad_labels_fails_before_accounting_and_writes_nothing(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    _fmnist(data, train_labels=np.full(12, 12))
    out = tmp_path / "run"
    argv = ["train", "--dataset", "fashion-mnist", "--data-dir", str(data), "--epochs", "1"]
    argv += ["--batch-size", "4", "--noise-multiplier", "1", "--device", "cpu", "--out", str(out)]
    assert cli.main(argv) == 2
    line = _one_line_error(capsys, "train")
    assert "label 12 is outside [0, 10)" in line
    assert not (out / "results.json").exists()


# --- 15. figures: format, resolution, readable ticks, the bound named, sensitivity ------------


def _curves(tmp_path, *extra, n="16,32"):
    argv = ["curves", "--schedule", "exponential", "--beta", "0.5", "--n", n]
    argv += ["--factorizations", "sqrt_prefix,lr_aware", "--out", str(tmp_path), "--no-progress", *extra]
    assert cli.main(argv) == 0


def _png_size(path):
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")


def test_curves_format_and_dpi(tmp_path):
    _curves(tmp_path / "a", "--dpi", "40")
    _curves(tmp_path / "b", "--dpi", "80")
    (wa, ha), (wb, hb) = _png_size(tmp_path / "a" / "curves.png"), _png_size(tmp_path / "b" / "curves.png")
    assert (wb, hb) == (2 * wa, 2 * ha)
    _curves(tmp_path / "c", "--format", "pdf")
    assert (tmp_path / "c" / "curves.pdf").read_bytes()[:5] == b"%PDF-"
    _curves(tmp_path / "d", "--format", "svg")
    assert b"<svg" in (tmp_path / "d" / "curves.svg").read_bytes()[:1000]
    assert not (tmp_path / "d" / "curves.png").exists()


def test_bad_dpi_exits_2(tmp_path, capsys):
    argv = ["curves", "--schedule", "linear", "--n", "16", "--factorizations", "identity"]
    assert cli.main([*argv, "--dpi", "0", "--out", str(tmp_path)]) == 2
    assert "--dpi=0" in _one_line_error(capsys, "curves")


def test_log_ticks_on_short_ranges_are_plain_round_numbers():
    from dpmf.plots import log_ticks

    assert log_ticks(1.3, 1.7) == [1.3, 1.4, 1.5, 1.6, 1.7]
    assert log_ticks(0.76, 2.6) == [0.8, 1.0, 1.5, 2.0, 2.5]
    assert log_ticks(1.40, 1.45) == [1.4, 1.41, 1.42, 1.43, 1.44, 1.45]
    assert log_ticks(0.0, 1.0) == []


def test_curves_figure_has_readable_ticks_the_named_bound_and_a_sensitivity_panel():
    from dpmf.mechanisms.sweeps import error_curves
    from dpmf.plots import figure_curves
    from dpmf.workloads import Schedule

    rows = error_curves(Schedule("exponential", 0.5), [16, 32], ["sqrt_prefix", "lr_aware"])
    fig = figure_curves(rows)
    fig.canvas.draw()
    maxse, _, sens = fig.axes[:3]
    lo, hi = maxse.get_ylim()
    shown = [t for t in maxse.get_yticks() if lo <= t <= hi]
    labels = [t.get_text() for t in maxse.get_yticklabels() if t.get_text()]
    assert len(shown) >= 3 and all(lab.replace(".", "").isdigit() for lab in labels), labels
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("lower bound ‖A‖*/n") for t in legend)
    assert sens.get_title().startswith("sensitivity")
    by_label = {ln.get_label(): ln.get_ydata() for ln in sens.get_lines()}
    want = [r.sensitivity for r in rows if r.factorization == "lr_aware"]
    assert np.allclose(by_label["lr_aware"], want, rtol=0, atol=0)


# --- 16. colormap.csv describes itself --------------------------------------------------------


def test_colormap_csv_holds_metric_schedule_strategies_and_errors(tmp_path):
    import csv

    from dpmf.mechanisms import evaluate, factorize
    from dpmf.workloads import Schedule, from_schedule

    argv = ["colormap", "--numerator", "lr_aware", "--denominator", "sqrt_prefix", "--metric", "mean_se"]
    argv += ["--schedule", "cosine", "--n", "16,32", "--beta", "0.1,0.5", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-progress", "--format", "svg"]) == 0
    with open(tmp_path / "colormap.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:3] == ["n", "beta", "gain"] and len(rows) == 4
    for r in rows:
        assert (r["metric"], r["schedule"], r["numerator"], r["denominator"]) == (
            "mean_se",
            "cosine",
            "lr_aware",
            "sqrt_prefix",
        )
        assert r["participation"] == "single"
        w = from_schedule(Schedule("cosine", float(r["beta"])), int(r["n"]))
        num = evaluate(factorize(w, "lr_aware")).mean_se
        den = evaluate(factorize(w, "sqrt_prefix")).mean_se
        assert float(r["numerator_error"]) == pytest.approx(num, rel=1e-12)
        assert float(r["denominator_error"]) == pytest.approx(den, rel=1e-12)
        assert float(r["gain"]) == pytest.approx(num / den, rel=1e-12)
    assert (tmp_path / "colormap.svg").exists()


# --- 17. per-step metrics ----------------------------------------------------------------------


def _trainer(data, out, *, log_every=None, epochs=2, batch=256, seed=3):
    import torch
    import torch.nn.functional as F

    from dpmf.optim.privatize import Privatizer
    from dpmf.plan import PrivatePlan
    from dpmf.train.loop import Trainer
    from dpmf.train.models import build_model

    n = len(data)
    steps = epochs * -(-n // batch)
    model = build_model("mlp", data.input_shape, data.num_classes, seed=seed)
    d = sum(p.numel() for p in model.parameters())
    plan = PrivatePlan(n, batch, steps=steps, noise_multiplier=0.8)  # DP-SGD, Poisson
    sampler = plan.sampler(seed + 2)
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=0.5, noise=plan.noise(d, seed + 1))
    trainer = Trainer(
        model=model,
        data=data,
        sampler=sampler,
        privatizer=priv,
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


# --- 18. cvxpy is optional ------------------------------------------------------------------


def test_cvxpy_is_a_test_extra_not_a_dependency():
    import pathlib

    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("cvxpy") for d in meta["dependencies"])
    assert any(d.startswith("cvxpy") for d in meta["optional-dependencies"]["test"])


def test_dpmf_imports_and_works_without_cvxpy_and_installs_no_log_handlers():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['cvxpy'] = None\n"  # importing cvxpy now raises ImportError
        "import dpmf.cli, dpmf.mechanisms, dpmf.accountants, dpmf.plots\n"
        "from dpmf.mechanisms import factorize, evaluate\n"
        "from dpmf.mechanisms.dense_cvxpy import dense_cvxpy\n"
        "from dpmf.workloads import prefix_sum\n"
        "print(round(evaluate(factorize(prefix_sum(8), 'sqrt_prefix')).max_se, 6))\n"
        "try:\n"
        "    dense_cvxpy(prefix_sum(4))\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
        "import logging\n"
        "names = [n for n in logging.root.manager.loggerDict if n.startswith('dpmf')]\n"
        "print(len(names), sum(len(logging.getLogger(n).handlers) for n in names + ['dpmf']))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    r = [math.comb(2 * j, j) / 4**j for j in range(8)]
    assert float(lines[0]) == pytest.approx(sum(x * x for x in r), abs=1e-6)  # MaxSE = Σ r_j²
    assert lines[1].startswith("ImportError: dense_cvxpy needs cvxpy") and "pip install cvxpy" in lines[1]
    loggers, handlers = map(int, lines[2].split())
    assert loggers >= 2 and handlers == 0  # module loggers exist; the library configures none


# --- 19. library messages through logging ---------------------------------------------------


def test_library_messages_go_through_logging_and_can_be_silenced(caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="dpmf"):
        meas = PLDAccountant().epsilon(GaussianEvent(1e-300), 1e-5)
    assert meas.epsilon == math.inf
    rec = [r for r in caplog.records if r.name == "dpmf.accountants.library"]
    assert rec and rec[0].levelno == logging.WARNING and "noise is negligible" in rec[0].getMessage()
    argv = ["epsilon", *SINGLE, "--noise-multiplier", "1e-300", "--delta", "1e-5"]
    assert cli.main(argv) == 0
    assert "privacy: analytic Gaussian" in capsys.readouterr().err  # the CLI prints it
    lib = logging.getLogger("dpmf")
    before = lib.level
    lib.setLevel(logging.ERROR)
    try:
        assert cli.main(argv) == 0
        assert "privacy:" not in capsys.readouterr().err  # and the user can silence it
    finally:
        lib.setLevel(before)


# --- 20. the GPU check script ---------------------------------------------------------------


def test_gpu_check_says_there_is_no_gpu_and_exits_3(tmp_path):
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs scripts/gpu_check.sh itself (about 5 minutes)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path), DPMF_PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", os.path.join(root, "scripts", "gpu_check.sh")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    report = (tmp_path / "gpu_check.txt").read_text()
    assert "no CUDA device is usable by torch here" in report
    assert "status: skipped (no CUDA device)" in report and report in done.stdout
