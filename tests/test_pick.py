"""dpmf pick: every entry's σ, sensitivity and errors recomputed independently; the ranking."""

import json
import math

import numpy as np
import pytest

from dpmf import calibrate
from dpmf.cli import main
from dpmf.mechanisms import factorize
from dpmf.pick import candidate_specs, pick
from dpmf.workloads import Schedule, from_schedule

# a small run: N = 1000, B = 100 → b = 10 steps per epoch, 3 epochs
N, B, STEPS, EPS, DELTA = 1000, 100, 30, 4.0, 1e-5
SCHED = Schedule("exponential", 0.1)


@pytest.fixture(scope="module")
def small():
    return pick(
        dataset_size=N,
        batch_size=B,
        steps=STEPS,
        epsilon=EPS,
        delta=DELTA,
        schedule=SCHED,
        max_bands=4,
        progress=False,
    )


def _dense_b(label):
    w = from_schedule(SCHED, STEPS)
    f = factorize(w, label)
    return w.dense() @ np.linalg.inv(f.C.dense()), f.C.dense()


def test_candidates_cover_the_grid():
    specs = candidate_specs(SCHED, 64, 8, optimized=True, dense_max_steps=64)
    for s in ["identity", "sqrt_prefix", "lr_aware", "bsr:2", "bisr:8", "lr_bsr:4", "lr_bisr:8"]:
        assert s in specs
    assert {"bisr_opt:8", "bsr_opt:8", "blt:2", "blt:4", "dense"} <= set(specs)
    assert "dense" not in candidate_specs(SCHED, 65, 8, optimized=True, dense_max_steps=64)
    # constant schedule: the learning-rate-aware ones coincide with their plain versions
    const = candidate_specs(Schedule("constant"), 64, 4, optimized=False, dense_max_steps=64)
    assert not any(s.startswith("lr_") for s in const) and "bsr:16" not in const


def test_ranking_sorted_and_recommendation_first(small):
    vals = [e.noise_mean_se for e in small.ranking]
    assert vals == sorted(vals)
    assert small.recommendation == small.ranking[0]
    assert len(small.ranking) >= 15
    for e in small.ranking:
        assert e.epsilon <= EPS * (1 + 1e-9) and e.epsilon > 0.9 * EPS
        assert math.isclose(e.noise_mean_se, e.noise_multiplier * e.mean_se, rel_tol=1e-12)
        assert math.isclose(e.noise_max_se, e.noise_multiplier * e.max_se, rel_tol=1e-12)


def test_dp_sgd_entry_is_poisson_calibration_and_frobenius_norm(small):
    e = next(e for e in small.ranking if e.factorization == "identity")
    ref = calibrate("poisson", epsilon=EPS, dataset_size=N, batch_size=B, steps=STEPS, delta=DELTA)
    assert e.scheme == "poisson" and e.sensitivity == 1.0
    assert math.isclose(e.noise_multiplier, ref.noise_multiplier, rel_tol=1e-9)
    A = from_schedule(SCHED, STEPS).dense()
    assert math.isclose(e.mean_se, np.linalg.norm(A) / math.sqrt(STEPS), rel_tol=1e-10)
    assert math.isclose(e.max_se, np.max(np.linalg.norm(A, axis=1)), rel_tol=1e-10)


def test_banded_entry_cyclic_poisson_with_max_column_norm(small):
    """bsr:4 under auto is cyclic Poisson: σ of DP-SGD with ⌈n/4⌉ steps at q = 4B/N, s = max
    column norm of C, errors from the dense B = A·C⁻¹."""
    e = next(e for e in small.ranking if e.factorization == "bsr:4")
    Bm, C = _dense_b("bsr:4")
    s = np.max(np.linalg.norm(C, axis=0))
    assert e.scheme == "cyclic_poisson" and e.bands == 4
    assert math.isclose(e.sensitivity, s, rel_tol=1e-10)
    assert math.isclose(e.mean_se, s * np.linalg.norm(Bm) / math.sqrt(STEPS), rel_tol=1e-9)
    assert math.isclose(e.max_se, s * np.max(np.linalg.norm(Bm, axis=1)), rel_tol=1e-9)
    ref = calibrate(
        "poisson", epsilon=EPS, dataset_size=N, batch_size=4 * B, steps=math.ceil(STEPS / 4), delta=DELTA
    )
    assert math.isclose(e.noise_multiplier, ref.noise_multiplier, rel_tol=1e-6)


def test_full_strategy_is_fixed_order_with_multi_epoch_sensitivity(small):
    """sqrt_prefix (not banded) under auto: no amplification, μ = 1/σ, s = sens under
    fixed_epochs(10, 3) = max over positions of ‖Σ_k C[:, j + 10k]‖."""
    e = next(e for e in small.ranking if e.factorization == "sqrt_prefix")
    _, C = _dense_b("sqrt_prefix")
    G = C.T @ C
    s = max(math.sqrt(G[np.ix_(idx, idx)].sum()) for idx in (np.arange(j, STEPS, 10) for j in range(10)))
    assert e.scheme == "fixed_order"
    assert math.isclose(e.sensitivity, s, rel_tol=1e-9)
    # μ-GDP with μ = 1/σ: δ(ε) of the Gaussian mechanism at the reported ε equals the target δ
    from scipy.stats import norm

    mu = 1.0 / e.noise_multiplier
    d = norm.cdf(-e.epsilon / mu + mu / 2) - math.exp(e.epsilon) * norm.cdf(-e.epsilon / mu - mu / 2)
    assert math.isclose(d, DELTA, rel_tol=1e-3)


def test_optimized_candidates_present_and_not_worse_than_their_start(small):
    labels = {e.factorization: e for e in small.ranking}
    assert "dense" in labels and "blt:2" in labels and "bisr_opt:4" in labels
    # dense is optimized for fixed_epochs(10, 3), the participation fixed_order accounts
    assert labels["dense"].scheme == "fixed_order"
    assert labels["dense"].mean_se <= labels["sqrt_prefix"].mean_se * (1 + 1e-6)
    assert labels["dense"].mean_se <= labels["lr_aware"].mean_se * (1 + 1e-6)


def test_bad_input_named_before_work():
    kw = dict(dataset_size=N, batch_size=B, steps=STEPS, epsilon=EPS, delta=DELTA, schedule=SCHED)
    for bad, word in [
        ({"epsilon": -1.0}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"batch_size": N + 1}, "batch_size"),
        ({"max_bands": 0}, "max_bands"),
        ({"scheme": "shuffle"}, "scheme"),
        ({"metric": "rmse"}, "metric"),
        ({"scheme": "single_release"}, "single_release"),
    ]:
        with pytest.raises(ValueError, match=word):
            pick(**{**kw, **bad})
    with pytest.raises(TypeError, match="schedule"):
        pick(**{**kw, "schedule": "exponential"})


def test_cli_json_keys_and_table(capsys):
    args = [
        "pick",
        "--dataset-size",
        "600",
        "--batch-size",
        "100",
        "--epochs",
        "2",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        "--schedule",
        "exponential",
        "--beta",
        "0.1",
        "--max-bands",
        "2",
        "--no-optimized",
        "--no-progress",
    ]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ["epsilon", "delta", "noise_multiplier", "scheme", "accountant", "guarantee", "steps"]:
        assert key in out
    assert out["steps"] == 12
    rank = out["ranking"]
    for key in ["factorization", "noise_multiplier", "max_se", "mean_se", "noise_max_se", "noise_mean_se"]:
        assert key in rank[0]
    assert out["recommendation"]["noise_mean_se"] == min(r["noise_mean_se"] for r in rank)
    assert out["noise_multiplier"] == out["recommendation"]["noise_multiplier"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "recommendation:" in table and out["factorization"] in table.splitlines()[-1]


def test_cli_rejects_missing_beta(capsys):
    rc = main(
        ["pick", "--dataset-size", "600", "--batch-size", "100", "--epochs", "2", "--epsilon", "3"]
        + ["--delta", "1e-5", "--schedule", "exponential"]
    )
    assert rc != 0
    assert "--beta" in capsys.readouterr().err
