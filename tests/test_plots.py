"""Figures: format and resolution, readable ticks, the lower bound named, the sensitivity panel; and
colormap.csv describes itself (metric, schedule, strategies, errors)."""

import numpy as np
import pytest
from cli_helpers import _one_line_error

from dpmf import cli

# --- figures: format, resolution, readable ticks, the bound named, sensitivity ------------


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


# --- colormap.csv describes itself --------------------------------------------------------


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
