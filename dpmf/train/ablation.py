"""Ablation of temporal and spectral denoising: DP-SGD, DP-Muon, DiSK-SGD, DOPPLER-SGD,
DiSK-Muon and DOPPLER-Muon at one ε over several batch sizes and seeds.

The experiment of the DP-Muon paper's ablation ("Spectral Gradient Orthogonalization Improves
Differentially Private Training at Scale", Ablation Study), at the scale of a CPU: Fashion-MNIST,
the small CNN, a few epochs. Every method uses the same private gradient (Poisson sampling,
clipping ζ, σ calibrated to the target ε for each batch size) and the training stack's default
hyperparameters. Filters are post-processing, so ε is the same with and without them (the
table shows it). Two ways to compose a filter with an optimizer (``--composition``):

- ``replace`` (default): the filter is the temporal smoothing and takes the place of the
  optimizer's momentum — DiSK-SGD = DiSK → SGD without momentum, DiSK-Muon = DiSK →
  Newton–Schulz (EMA β = 0). The filters have DC gain 1 where heavy-ball momentum μ has
  1/(1−μ), so the SGD step (and DP-Muon's 1-D parameters' step) is multiplied by 1/(1−μ):
  the same step per unit of constant gradient as the baseline. Newton–Schulz is scale-free.
- ``stack``: the filter is put in front of the unchanged optimizer (its momentum kept).

The command-line script ``benchmarks/ablation_filters.py`` runs it (the defaults fit in under
an hour on two CPU cores):

    python benchmarks/ablation_filters.py --out runs/ablation

and writes OUT/ablation.csv (one row per run), OUT/ablation_summary.csv and OUT/ablation.md
(mean ± std over seeds) and OUT/ablation.png; each run's own files are in OUT/runs/…. A run
whose results.json says "complete" is reused, so an interrupted ablation continues where it
stopped. Notebook 07 calls ``run_ablation`` and ``summarize`` directly.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from dpmf._io import atomic_savefig, atomic_write_csv, atomic_write_text
from dpmf.plan.schemes import Poisson

#: The methods: optimizer and filter of each (other settings shared).
METHODS = {
    "DP-SGD": {"optimizer": "dp-sgd", "filter": "none"},
    "DP-Muon": {"optimizer": "dp-muon", "filter": "none"},
    "DiSK-SGD": {"optimizer": "dp-sgd", "filter": "disk"},
    "DOPPLER-SGD": {"optimizer": "dp-sgd", "filter": "doppler"},
    "DiSK-Muon": {"optimizer": "dp-muon", "filter": "disk"},
    "DOPPLER-Muon": {"optimizer": "dp-muon", "filter": "doppler"},
}

COMPOSITIONS = ("replace", "stack")

#: Settings shared by every run unless overridden.
BASE = {
    "dataset": "fashion-mnist",
    "model": "cnn",
    "scheme": Poisson.name,
    "factorization": "identity",
    "delta": 1e-5,
    "clip_norm": 1.0,
    "epsilon_each_epoch": False,
}

ROW_FIELDS = [
    "method",
    "optimizer",
    "filter",
    "batch_size",
    "seed",
    "epochs",
    "steps",
    "epsilon",
    "delta",
    "noise_multiplier",
    "test_accuracy",
    "test_loss",
    "seconds",
]


def run_name(method: str, batch_size: int, seed: int) -> str:
    """Folder name of one run."""
    return f"{method.lower()}_b{batch_size}_s{seed}"


def method_settings(method: str, composition: str = "replace") -> dict:
    """The ``TrainConfig`` fields of ``method`` under ``composition`` (module docstring).

    Raises:
        ValueError: an unknown method or composition.
    """
    from dpmf.train.config import DEFAULT_LR, TrainConfig

    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {', '.join(METHODS)}")
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition={composition!r} is invalid: must be one of {', '.join(COMPOSITIONS)}")
    settings = dict(METHODS[method])
    if settings["filter"] == "none" or composition == "stack":
        return settings
    gain = 1.0 / (1.0 - TrainConfig.momentum)  # DC gain of the baseline's heavy-ball momentum
    if settings["optimizer"] == "dp-sgd":
        settings.update(momentum=0.0, lr=round(DEFAULT_LR["dp-sgd"] * gain, 12))
    else:
        settings.update(
            muon_beta=0.0, momentum=0.0, vector_lr=round(DEFAULT_LR[settings["optimizer"]] * gain, 12)
        )
    return settings


def run_one(
    method: str,
    batch_size: int,
    seed: int,
    out_dir: str,
    *,
    epsilon: float,
    epochs: int,
    overrides: dict | None = None,
    composition: str = "replace",
    log=print,
) -> dict:
    """Train one method at one batch size and seed; return its table row.

    A run whose ``results.json`` in ``out_dir`` is complete is read back instead of retrained.

    Raises:
        ValueError: an unknown method or composition, or an invalid setting (``TrainConfig``).
    """
    from dpmf.train.config import TrainConfig
    from dpmf.train.loop import CHECKPOINT
    from dpmf.train.outputs import RESULTS
    from dpmf.train.run import train

    settings = dict(BASE, **(overrides or {}), **method_settings(method, composition))
    config = TrainConfig.from_dict(
        dict(settings, batch_size=batch_size, seed=seed, epsilon=epsilon, epochs=epochs)
    )
    results_path = os.path.join(out_dir, RESULTS)
    done = _read_complete(results_path, config)
    if done is None:
        began = time.perf_counter()
        resume = os.path.exists(os.path.join(out_dir, CHECKPOINT))  # else an unfinished start
        train(config, out_dir, resume=resume, overwrite=not resume, progress=False, log=lambda *_: None)
        log(f"{method:>13} B={batch_size:<5} seed={seed}: {time.perf_counter() - began:.0f} s")
        done = _read_complete(results_path, config)
    privacy, final = done["privacy"], done["final"]
    return {
        "method": method,
        "optimizer": config.optimizer,
        "filter": METHODS[method]["filter"],
        "batch_size": batch_size,
        "seed": seed,
        "epochs": epochs,
        "steps": done["steps"],
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "noise_multiplier": privacy["noise_multiplier"],
        "test_accuracy": float(final["test_accuracy"]),
        "test_loss": float(final["test_loss"]),
        "seconds": done.get("wall_seconds"),
    }


def _read_complete(path: str, config) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        done = json.load(f)
    if done.get("status") != "complete" or done.get("config") != json.loads(json.dumps(config.to_dict())):
        return None
    return done


def run_ablation(
    out_dir: str,
    *,
    methods=tuple(METHODS),
    batch_sizes=(256, 1024, 4096),
    seeds=(0, 1, 2),
    epsilon: float = 4.0,
    epochs: int = 2,
    overrides: dict | None = None,
    composition: str = "replace",
    log=print,
) -> list[dict]:
    """Every method × batch size × seed (seeds innermost), one after another.

    Returns:
        the rows of ``run_one``, also written to ``out_dir/ablation.csv`` after each run.
    """
    rows = []
    for batch_size in batch_sizes:
        for method in methods:
            for seed in seeds:
                run_dir = os.path.join(out_dir, "runs", run_name(method, batch_size, seed))
                rows.append(
                    run_one(
                        method,
                        batch_size,
                        seed,
                        run_dir,
                        epsilon=epsilon,
                        epochs=epochs,
                        overrides=overrides,
                        composition=composition,
                        log=log,
                    )
                )
                write_csv(os.path.join(out_dir, "ablation.csv"), rows, ROW_FIELDS)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and sample std (n − 1) of the test accuracy per (method, batch size), in %.

    Returns:
        one dict per (method, batch size) in order of first appearance, with ``mean``, ``std``
        (0 for a single seed), ``runs``, ``epsilon`` (equal for all seeds and methods at one
        batch size), ``steps`` and ``noise_multiplier``.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["method"], int(row["batch_size"])), []).append(row)
    out = []
    for (method, batch_size), items in groups.items():
        acc = [100.0 * float(r["test_accuracy"]) for r in items]
        out.append(
            {
                "method": method,
                "batch_size": batch_size,
                "runs": len(acc),
                "mean": statistics.fmean(acc),
                "std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                "epsilon": max(float(r["epsilon"]) for r in items),
                "steps": int(items[0]["steps"]),
                "noise_multiplier": float(items[0]["noise_multiplier"]),
            }
        )
    return out


def markdown_table(summary: list[dict]) -> str:
    """Methods as rows, batch sizes as columns, cells "mean ± std" (test accuracy, %); a last
    row gives each column's steps, σ and ε."""
    methods = list(dict.fromkeys(s["method"] for s in summary))
    sizes = sorted({s["batch_size"] for s in summary})
    cell = {(s["method"], s["batch_size"]): s for s in summary}
    lines = ["| method | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for m in methods:
        values = [
            f"{cell[m, b]['mean']:.1f} ± {cell[m, b]['std']:.1f}" if (m, b) in cell else "" for b in sizes
        ]
        lines.append(f"| {m} | " + " | ".join(values) + " |")
    info = []
    for b in sizes:
        s = next(x for x in summary if x["batch_size"] == b)
        info.append(f"{s['steps']} steps, σ = {s['noise_multiplier']:.3g}, ε = {s['epsilon']:.3g}")
    lines.append("| (run) | " + " | ".join(info) + " |")
    return "\n".join(lines) + "\n"


def plot_ablation(summary: list[dict], path: str, *, title: str = "") -> None:
    """Test accuracy (mean ± std over seeds) against batch size, one line per method; written
    atomically to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in dict.fromkeys(s["method"] for s in summary):
        pts = sorted((s["batch_size"], s["mean"], s["std"]) for s in summary if s["method"] == method)
        b, mean, std = zip(*pts, strict=True)
        style = "-" if "Muon" in method else "--"
        ax.errorbar(b, mean, yerr=std, marker="o", linestyle=style, capsize=3, label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title or "Temporal vs spectral denoising at fixed ε")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def write_csv(path: str, rows: list[dict], fields: list[str]) -> None:
    """Write ``rows`` (dicts) as CSV with the columns ``fields``, atomically."""
    atomic_write_csv(path, fields, ([row.get(k) for k in fields] for row in rows))


def write_outputs(out_dir: str, rows: list[dict], *, title: str = "") -> list[dict]:
    """ablation.csv, ablation_summary.csv, ablation.md and ablation.png in ``out_dir``."""
    summary = summarize(rows)
    write_csv(os.path.join(out_dir, "ablation.csv"), rows, ROW_FIELDS)
    write_csv(
        os.path.join(out_dir, "ablation_summary.csv"),
        summary,
        ["method", "batch_size", "runs", "mean", "std", "epsilon", "steps", "noise_multiplier"],
    )
    atomic_write_text(os.path.join(out_dir, "ablation.md"), markdown_table(summary))
    plot_ablation(summary, os.path.join(out_dir, "ablation.png"), title=title)
    return summary
