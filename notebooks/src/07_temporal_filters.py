# %% [markdown]
# # 07 · Temporal filters and orthogonalization: the ablation
#
# **Question.** Temporal filters (DiSK, a simplified Kalman filter; DOPPLER, a low-pass IIR
# filter) smooth the privatized gradients along the training trajectory; DP-Muon denoises across
# a weight matrix's singular directions. Are they complementary, and how does each behave as
# the batch size grows at a fixed ε?
#
# The ablation of *Spectral Gradient Orthogonalization Improves Differentially Private Training
# at Scale* at CPU scale: DP-SGD, DP-Muon, DiSK-SGD, DOPPLER-SGD, DiSK-Muon and DOPPLER-Muon with
# the same private gradient (Poisson sampling, σ calibrated to ε for each batch size). Filters
# are post-processing: ε is the same with and without them (the table shows it). Composition
# "replace": the filter takes the place of the optimizer's momentum (see
# `benchmarks/ablation_filters.py`, which runs the full-size version from the command line).

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
if SIZE == "small":
    DATASET, BATCH_SIZES, SEEDS, EPOCHS = "digits", (64,), (0,), 1
else:
    DATASET, BATCH_SIZES, SEEDS, EPOCHS = "fashion-mnist", (256, 1024, 4096), (0, 1, 2), 1
EPSILON = 4.0

# %%
import tempfile

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display

from dpmf.train.ablation import METHODS, run_ablation, summarize

with tempfile.TemporaryDirectory() as out:
    rows = run_ablation(
        out,
        batch_sizes=BATCH_SIZES,
        seeds=SEEDS,
        epsilon=EPSILON,
        epochs=EPOCHS,
        overrides={"dataset": DATASET},
        log=lambda *a: None,
    )
summary = pd.DataFrame(summarize(rows))
table = summary.assign(
    accuracy=[f"{m:.1f} ± {s:.1f}" for m, s in zip(summary["mean"], summary["std"], strict=True)]
)
table.pivot(index="method", columns="batch_size", values="accuracy").loc[list(METHODS)]

# %%
fig, ax = plt.subplots(figsize=(7, 4.3), constrained_layout=True)
for method in METHODS:
    s = summary[summary.method == method].sort_values("batch_size")
    ax.errorbar(
        s.batch_size,
        s["mean"],
        yerr=s["std"],
        marker="o",
        capsize=3,
        linestyle="-" if "Muon" in method else "--",
        label=method,
    )
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size B (examples)")
ax.set_ylabel("test accuracy (%), mean ± std over seeds")
ax.set_title(f"{DATASET}, ε = {EPSILON:g}, {EPOCHS} epoch(s), {len(SEEDS)} seed(s) per point")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)

# %%
eps = summary.groupby("batch_size").epsilon.agg(["min", "max"])
best = summary.loc[summary.groupby("batch_size")["mean"].idxmax(), ["batch_size", "method", "mean"]]
lines = [
    "* ε per batch size (all methods): "
    + ", ".join(
        f"B = {b}: {r['max']:.4f}" + ("" if r["max"] - r["min"] < 1e-9 else " (differs!)")
        for b, r in eps.iterrows()
    )
    + " — the filters cost no privacy.",
    "* Best method per batch size: "
    + ", ".join(f"B = {r.batch_size}: {r.method} ({r['mean']:.1f} %)" for _, r in best.iterrows())
    + ".",
]
pv = summary.pivot(index="batch_size", columns="method", values="mean")
lines.append(
    "* DP-Muon − DP-SGD (points): "
    + ", ".join(f"B = {b}: {d:+.1f}" for b, d in (pv["DP-Muon"] - pv["DP-SGD"]).items())
    + "; DOPPLER-Muon − DP-Muon: "
    + ", ".join(f"B = {b}: {d:+.1f}" for b, d in (pv["DOPPLER-Muon"] - pv["DP-Muon"]).items())
    + "."
)
display(Markdown("\n".join(lines)))
