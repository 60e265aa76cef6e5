# %% [markdown]
# # 02 · Where does the learning-rate-aware factorization win?
#
# **Question.** For exponential learning-rate decay to β over n steps, on which part of the
# (n, β) plane does the learning-rate-aware factorization C = Toep(χ)^{1/2} beat the prefix-sum
# based one C = A₁^{1/2}?
#
# The gain is the ratio error(lr_aware) / error(sqrt_prefix): below 1 (red) the
# learning-rate-aware factorization is better, above 1 (blue) worse; the black line is the
# break-even level 1 (as in the paper's gain colormap, Figure 1).

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
if SIZE == "small":
    NS, BETAS = [16, 64, 256], [1e-9, 1e-3, 0.5]
else:
    NS = [16, 32, 64, 128, 256, 512, 1024, 2048]
    BETAS = [1e-12, 1e-9, 1e-6, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 0.6, 0.9]

# %%
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from dpmf.mechanisms.sweeps import gain_grid
from dpmf.plots import figure_gain

grids = {m: gain_grid("lr_aware", "sqrt_prefix", m, "exponential", NS, BETAS) for m in ("max_se", "mean_se")}
fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
for ax, (metric, grid) in zip(axes, grids.items(), strict=True):
    figure_gain(grid, ax=ax, title=f"{'MaxSE' if metric == 'max_se' else 'MeanSE'}: lr_aware / sqrt_prefix")
fig.suptitle("Exponential learning-rate decay, single participation (red: lr_aware better)")

# %%
lines = []
for metric, grid in grids.items():
    name = "MaxSE" if metric == "max_se" else "MeanSE"
    wins = grid.gain < 1
    lines.append(
        f"* **{name}:** `lr_aware` is better in {int(wins.sum())} of {wins.size} cells "
        f"(gain from {grid.gain.min():.3f} to {grid.gain.max():.3f})."
    )
    for j, n in enumerate(grid.ns):
        won = [f"{b:g}" for b in grid.betas[wins[:, j]]]
        lines.append(
            f"  * n = {int(n)}: better at β ∈ {{{', '.join(won)}}}"
            if won
            else f"  * n = {int(n)}: never better"
        )
mean = grids["mean_se"]
i0 = int(np.argmin(mean.betas))
small = [int(n) for n, g in zip(mean.ns, mean.gain[i0], strict=True) if g < 1]
large = [int(n) for n, g in zip(mean.ns, mean.gain[i0], strict=True) if g >= 1]
# the small-β region where lr_aware wins in MeanSE, per n: the largest β such that it wins at
# every β of the grid up to it (None: it loses already at the smallest β)
order = np.argsort(mean.betas)
onset = []
for j in range(len(mean.ns)):
    wins_sorted = mean.gain[order, j] < 1
    run = int(np.argmin(wins_sorted)) if not wins_sorted.all() else len(order)
    onset.append(float(mean.betas[order][run - 1]) if run else None)
won = [b for b in onset if b is not None]
shrinks = all(a >= b for a, b in zip(won[:-1], won[1:], strict=True)) if len(won) > 1 else None
lines.append(
    f"* At the smallest β of the grid ({mean.betas[i0]:g}) `lr_aware` wins in MeanSE for n ∈ {small}"
    + (f" but not for n ∈ {large}" if large else "")
    + ". The small-β region where it wins (every β of the grid up to): "
    + ", ".join(
        f"n = {int(n)}: {'none' if b is None else f'{b:g}'}" for n, b in zip(mean.ns, onset, strict=True)
    )
    + "."
)
lines.append(
    "* The paper's result (for any fixed n, a small enough β makes the learning-rate-aware "
    "factorization better in MeanSE): "
    + (
        "**holds on this grid** for every n"
        if not large
        else f"**not reached on this grid** for n ∈ {large} (a smaller β than {mean.betas[i0]:g} may be needed)"
    )
    + (
        "; that region shrinks as n grows (the smaller n, the larger the β at which it starts to win)."
        if shrinks
        else "; that region does not shrink monotonically with n."
        if shrinks is False
        else "."
    )
)
display(Markdown("\n".join(lines)))
