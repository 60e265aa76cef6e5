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
# At fixed ε and epochs σ itself grows with B, so the threshold is where the ratio
# B·(σ₁ − σ₂)/(σ(B)·ζ·(√m + √n)) crosses 1. Below it DP-Muon orthogonalizes mostly noise; above
# it the gradient's directions emerge. Here: plain DP-SGD noise (Poisson sampling, PLD), the
# small GroupNorm CNN, the same ε for every run, gradient spectra measured on the data.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
if SIZE == "small":
    DATASET, EPOCHS, BATCH_SIZES, SPECTRUM_EXAMPLES = "digits", 1, [32, 256], 512
else:
    DATASET, EPOCHS, BATCH_SIZES, SPECTRUM_EXAMPLES = "fashion-mnist", 5, [128, 512, 2048, 8192], 8192
EPSILON, DELTA, CLIP = 3.0, 1e-5, 1.0

# %%
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import Markdown, display

from dpmf.optim import matrix_shape
from dpmf.optim.clipping import clip_factors, per_example_gradients, trainable_parameters
from dpmf.train import TrainConfig, load_dataset, train

data = load_dataset(DATASET)
OPTIMIZERS = {"dp-sgd": dict(lr=0.5, momentum=0.9), "dp-muon": dict(lr=0.05)}
runs = []
models = {}
for B in BATCH_SIZES:
    for opt, hp in OPTIMIZERS.items():
        cfg = TrainConfig(
            dataset=DATASET,
            model="cnn",
            optimizer=opt,
            factorization="identity",
            scheme="poisson",
            epochs=EPOCHS,
            batch_size=B,
            epsilon=EPSILON,
            delta=DELTA,
            clip_norm=CLIP,
            seed=0,
            **hp,
        )
        with tempfile.TemporaryDirectory() as out:
            res = train(cfg, out, progress=False, log=lambda *a, **k: None)
        models[(opt, B)] = res.model
        runs.append(
            dict(
                optimizer=opt,
                batch_size=B,
                steps=res.steps,
                sigma=res.privacy.noise_multiplier,
                epsilon=res.privacy.epsilon,
                test_accuracy=res.test_accuracy,
            )
        )
runs = pd.DataFrame(runs)
runs

# %% [markdown]
# ## Gradient spectra
# The clean mean clipped gradient G of each weight matrix (conv kernels viewed as
# out × in·kh·kw), from `SPECTRUM_EXAMPLES` training examples, at the DP-SGD model trained with
# the smallest batch (mid-training gradients, as the optimizer sees them).

# %%
model = models[("dp-sgd", BATCH_SIZES[0])]
named = trainable_parameters(model)
idx = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(0))[:SPECTRUM_EXAMPLES]
sums = [torch.zeros_like(p) for _, p in named]
for chunk in idx.split(512):
    grads = per_example_gradients(model, F.cross_entropy, data.train_x[chunk], data.train_y[chunk])
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
    scale = clip_factors(norms, CLIP)
    for s, g in zip(sums, grads, strict=True):
        s += (g * scale.view(-1, *[1] * (g.ndim - 1))).sum(0)
spectra = []
for (name, p), s in zip(named, sums, strict=True):
    if p.ndim < 2:
        continue
    m, n = matrix_shape(p.shape)
    sv = torch.linalg.svdvals((s / len(idx)).reshape(m, n).double()).numpy()
    spectra.append(
        dict(
            layer=name,
            m=m,
            n=n,
            sigma1=sv[0],
            sigma2=sv[1],
            gap=sv[0] - sv[1],
            noise_factor=np.sqrt(m) + np.sqrt(n),
        )
    )
spectra = pd.DataFrame(spectra)
spectra

# %% [markdown]
# ## The threshold against the measured accuracies

# %%
sig = runs[runs.optimizer == "dp-sgd"].set_index("batch_size").sigma  # σ(B) at the fixed ε
ratio = pd.DataFrame(
    {
        row.layer: [B * row.gap / (sig[B] * CLIP * row.noise_factor) for B in BATCH_SIZES]
        for row in spectra.itertuples()
    },
    index=BATCH_SIZES,
)
ratio.index.name = "batch_size"


def crossing(bs, r):
    """B where the ratio crosses 1, interpolated on log scales (None outside the grid)."""
    lb, lr = np.log(bs), np.log(r)
    for i in range(len(bs) - 1):
        if (lr[i] - 0) * (lr[i + 1] - 0) <= 0 and lr[i] != lr[i + 1]:
            return float(np.exp(lb[i] + (0 - lr[i]) * (lb[i + 1] - lb[i]) / (lr[i + 1] - lr[i])))
    return None


thresholds = {layer: crossing(np.array(BATCH_SIZES, float), ratio[layer].to_numpy()) for layer in ratio}
largest = spectra.loc[(spectra.m * spectra.n).idxmax(), "layer"]
b_star = thresholds[largest]

fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
for opt, marker in [("dp-sgd", "o"), ("dp-muon", "s")]:
    r = runs[runs.optimizer == opt]
    ax.plot(
        r.batch_size,
        100 * r.test_accuracy,
        marker=marker,
        label={"dp-sgd": "DP-SGD", "dp-muon": "DP-Muon"}[opt],
    )
if b_star is not None:
    ax.axvline(b_star, color="k", ls="--", label=f"recovery threshold B* ≈ {b_star:.0f} ({largest})")
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size B (examples)")
ax.set_ylabel("test accuracy (%)")
ax.set_title(f"{DATASET}, ε = {EPSILON:g}, δ = {DELTA:g}, {EPOCHS} epochs, DP-SGD noise (Poisson)")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
ratio

# %%
pivot = runs.pivot(index="batch_size", columns="optimizer", values="test_accuracy")
gain = 100 * (pivot["dp-muon"] - pivot["dp-sgd"])
lines = [
    "* DP-Muon − DP-SGD (percentage points) by batch size: "
    + ", ".join(f"B = {b}: {g:+.1f}" for b, g in gain.items())
    + "."
]
lines.append(
    f"* Estimated threshold for the largest layer `{largest}`: "
    + (
        f"B* ≈ {b_star:.0f}."
        if b_star is not None
        else "no crossing inside the batch sizes tried "
        f"(ratio from {ratio[largest].min():.2f} to {ratio[largest].max():.2f})."
    )
)
best_b = gain.idxmax()
lines.append(
    f"* DP-Muon's advantage is largest at B = {best_b} ({gain.max():+.1f} points)"
    + ("; it grows with the batch size, as the threshold predicts." if gain.is_monotonic_increasing else ".")
)
display(Markdown("\n".join(lines)))
