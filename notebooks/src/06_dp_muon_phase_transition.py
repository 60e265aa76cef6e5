# %% [markdown]
# # 06 · DP-SGD against DP-Muon over batch sizes: the recovery threshold
#
# **Question.** At a fixed privacy budget, when does orthogonalizing the privatized momentum
# (DP-Muon: five Newton–Schulz steps) beat plain DP-SGD, and does the switch happen where the
# spectral recovery threshold predicts?
#
# *Spectral Gradient Orthogonalization Improves Differentially Private Training at Scale*:
# the Gaussian noise on a mean gradient G ∈ ℝ^{m×n} has operator norm about σ·ζ·(√m + √n)/B,
# and by Wedin's theorem the leading singular direction of G survives the noise when this is
# below the spectral gap σ₁(G) − σ₂(G), i.e. when
#
# $$B > B^\star = \frac{\sigma\,\zeta\,(\sqrt m + \sqrt n)}{\sigma_1(G) - \sigma_2(G)} .$$
#
# At fixed ε and epochs σ itself grows with B, and the gap depends on where training is, so the
# threshold is measured: at each batch size, the spectra of the clean mean clipped gradient of
# each weight matrix of the DP-SGD model trained at that B give the ratio
# B·(σ₁ − σ₂)/(σ(B)·ζ·(√m + √n)), and B* is where it crosses 1. **The prediction:** DP-Muon is
# no better than DP-SGD below B* and better above it.
#
# Protocol: plain DP-SGD noise (Poisson sampling, PLD accounting), the same ε for every run;
# the learning rate of each (optimizer, B) chosen from two values by the validation accuracy of
# seed 0 on a split held out from the training set, then seeds 1 and 2 at that rate; test
# accuracy as mean ± sd over the three seeds; a difference counts when the paired difference
# over seeds exceeds two standard errors. The grid runner is `benchmarks/paper_experiments.py`,
# which runs the same experiment on CIFAR-10 and a GPU from the command line.
#
# Size, for the CPU budget: the MLP (a 256 × 784 and a 10 × 256 weight) rather than a CNN (its
# per-example gradients cost about three times as much per example on a CPU), 3 epochs — fewer
# than the paper's, traded for three seeds and a chosen learning rate per point.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
if SIZE == "small":
    DATASET, VAL, EPOCHS, BATCH_SIZES, SEEDS, SPECTRUM_EXAMPLES = "digits", 300, 1, [32, 256], (0, 1), 256
    LRS = {"dp-sgd": (0.5,), "dp-muon": (0.05,)}
else:
    DATASET, VAL, EPOCHS, BATCH_SIZES, SEEDS, SPECTRUM_EXAMPLES = (
        "fashion-mnist",
        5000,
        3,
        [128, 512, 2048, 8192],
        (0, 1, 2),
        4096,
    )
    LRS = {"dp-sgd": (0.5, 1.5), "dp-muon": (0.05, 0.15)}
MODEL, EPSILON, DELTA, CLIP, WORKERS = "mlp", 3.0, 1e-5, 1.0, 1

# %%
import sys
import time

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

sys.path.insert(0, os.path.join(os.pardir, "benchmarks"))  # the grid runner of the command line
from paper_experiments import (
    COLORS,
    Split,
    load_split,
    phase_transition,
    phase_transition_conclusions,
    summarize_phase_transition,
)

split = Split(DATASET, val_size=VAL)
data, test_x, _ = load_split(split)
t0 = time.perf_counter()
rows = phase_transition(
    split,
    batch_sizes=BATCH_SIZES,
    seeds=SEEDS,
    epochs=EPOCHS,
    epsilon=EPSILON,
    delta=DELTA,
    clip_norm=CLIP,
    model=MODEL,
    lrs=LRS,
    spectrum_examples=SPECTRUM_EXAMPLES,
    workers=WORKERS,
    threads=1,
)
summary = summarize_phase_transition(rows, clip_norm=CLIP)
runs = summary["runs"]
display(
    Markdown(
        f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s: {split.describe(len(data))}, "
        f"{test_x.shape[0]} test examples, `{MODEL}`, {EPOCHS} epoch(s), ε = {EPSILON:g}, δ = {DELTA:g}, "
        f"ζ = {CLIP:g}, seeds {list(SEEDS)}; learning rates tried: "
        + "; ".join(f"{o} {', '.join(f'{x:g}' for x in v)}" for o, v in LRS.items())
        + "."
    )
)
table = runs.groupby(["batch_size", "optimizer"]).agg(
    lr=("lr", "first"),
    steps=("steps", "first"),
    sigma=("sigma", "first"),
    epsilon=("epsilon", "max"),
    test=(
        "test_accuracy",
        lambda t: (
            f"{100 * t.mean():.1f} ± {100 * t.std(ddof=1):.1f}" if len(t) > 1 else f"{100 * t.mean():.1f}"
        ),
    ),
)
table

# %% [markdown]
# ## Gradient spectra and the recovery ratio
# The clean mean clipped gradient G of each weight matrix over `SPECTRUM_EXAMPLES` training
# examples, at the end of each DP-SGD run (the chosen learning rate, every seed); the ratio
# B·(σ₁ − σ₂)/(σ(B)·ζ·(√m + √n)), averaged over seeds.

# %%
spec = summary["spectra"]
spec.groupby(["batch_size", "layer"])[["m", "n", "sigma1", "sigma2", "gap", "sigma", "ratio"]].mean()

# %% [markdown]
# ## The threshold against the measured accuracies

# %%
b_star, layer, ratio = summary["b_star"], summary["layer"], summary["ratio"]
acc = summary["accuracy"]
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), constrained_layout=True)
for opt, marker, name in [("dp-sgd", "o", "DP-SGD"), ("dp-muon", "s", "DP-Muon")]:
    r = acc[acc.optimizer == opt]
    ax.errorbar(
        r.batch_size, r["mean"], yerr=r["std"], marker=marker, capsize=3, color=COLORS[opt], label=name
    )
for a in (ax, ax2):
    if b_star is not None:
        a.axvline(b_star, color="k", ls="--", label=f"measured threshold B* ≈ {b_star:.0f} ({layer})")
    a.set_xscale("log", base=2)
    a.set_xlabel("batch size B (examples)")
    a.grid(True, which="both", alpha=0.3)
ax.set_ylabel(f"test accuracy (%), mean ± sd over {len(SEEDS)} seeds")
ax.set_title(f"{DATASET}, ε = {EPSILON:g}, δ = {DELTA:g}, {EPOCHS} epoch(s), DP-SGD noise (Poisson)")
ax.legend()
for col in ratio:
    ax2.plot(ratio.index, ratio[col], marker="o", label=f"{col} ({'largest' if col == layer else 'other'})")
ax2.axhline(1.0, color="gray", lw=1)
ax2.set_yscale("log")
ax2.set_ylabel("B·(σ₁ − σ₂) / (σ(B)·ζ·(√m + √n))")
ax2.set_title("recovery ratio (> 1: the leading direction survives the noise)")
ax2.legend(fontsize=8)

# %%
display(Markdown("\n".join(phase_transition_conclusions(summary, dataset_size=len(data)))))
summary["gain"].round(2)
