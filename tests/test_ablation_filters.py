"""The filter ablation script's functions: settings of each composition, the mean ± std table,
and a miniature end-to-end run on the bundled digits (ε equal across methods, reuse of
finished runs)."""

import os
import statistics

import pytest

from dpmf.train import ablation

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_replace_composition_matches_the_baselines_dc_gain():
    sgd = ablation.method_settings("DOPPLER-SGD")
    assert sgd["momentum"] == 0.0 and sgd["lr"] == pytest.approx(0.5 / (1 - 0.9))
    muon = ablation.method_settings("DiSK-Muon")
    assert muon["muon_beta"] == 0.0 and muon["vector_lr"] == pytest.approx(0.05 / (1 - 0.9))
    assert ablation.method_settings("DiSK-Muon", "stack") == {"optimizer": "dp-muon", "filter": "disk"}
    assert ablation.method_settings("DP-SGD") == {"optimizer": "dp-sgd", "filter": "none"}
    with pytest.raises(ValueError, match="method"):
        ablation.method_settings("Kalman-SGD")
    with pytest.raises(ValueError, match="composition"):
        ablation.method_settings("DP-SGD", "chain")


def test_summary_is_mean_and_sample_std_in_percent():
    acc = {("A", 256): [0.80, 0.82, 0.87], ("A", 1024): [0.5], ("B", 256): [0.7, 0.9]}
    rows = [
        dict(method=m, batch_size=b, seed=i, test_accuracy=a, epsilon=4.0, steps=10, noise_multiplier=0.6)
        for (m, b), values in acc.items()
        for i, a in enumerate(values)
    ]
    summary = {(s["method"], s["batch_size"]): s for s in ablation.summarize(rows)}
    assert summary["A", 256]["mean"] == pytest.approx(83.0)
    assert summary["A", 256]["std"] == pytest.approx(statistics.stdev([80.0, 82.0, 87.0]))
    assert summary["A", 1024]["std"] == 0.0 and summary["B", 256]["runs"] == 2
    table = ablation.markdown_table(list(summary.values()))
    assert "| A | 83.0 ± 3.6 | 50.0 ± 0.0 |" in table
    assert "| B | 80.0 ± 14.1 |  |" in table


def test_miniature_ablation_on_digits(tmp_path):
    kw = dict(
        methods=("DP-SGD", "DiSK-SGD"),
        batch_sizes=(256,),
        seeds=(0, 1),
        epsilon=3.0,
        epochs=1,
        overrides={"dataset": "digits", "data_dir": None},
        log=lambda *a: None,
    )
    rows = ablation.run_ablation(str(tmp_path), **kw)
    assert len(rows) == 4 and len({r["epsilon"] for r in rows}) == 1  # filters cost no ε
    assert {r["filter"] for r in rows} == {"none", "disk"}
    results = tmp_path / "runs" / "disk-sgd_b256_s1" / "results.json"
    stamp = os.path.getmtime(results)
    again = ablation.run_ablation(str(tmp_path), **kw)  # finished runs are read back
    assert again == rows and os.path.getmtime(results) == stamp
    ablation.write_outputs(str(tmp_path), rows)
    for name in ("ablation.csv", "ablation_summary.csv", "ablation.md", "ablation.png"):
        assert (tmp_path / name).stat().st_size > 0
