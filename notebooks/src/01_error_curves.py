# %% [markdown]
# # 01 · Error curves under learning-rate decay
#
# **Question.** When a training run decays its learning rate (A_χ = A₁·diag(χ)), how does the
# noise each factorization puts on the trained models grow with the number of steps n, and which
# factorization is best — in the worst step (MaxSE) and on average (MeanSE)?
#
# Setting of *Learning Rate Scheduling with Matrix Factorization for Private Training*
# (Figures 1 and 5): single participation, β = 0.1, the schedules exponential, linear, cosine,
# polynomial (γ = 2) and inverse power (γ = 1). Errors are unsquared and in units of σ·ζ
# (noise multiplier × clip norm); the dashed line is the nuclear-norm lower bound, which no
# factorization can beat.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")  # "small" runs in seconds (test suite)
NS = [16, 64, 256] if SIZE == "small" else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
BETA = 0.1

# %%
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display

from dpmf.mechanisms.sweeps import error_curves
from dpmf.workloads import Schedule

SCHEDULES = ["exponential", "linear", "cosine", "polynomial", "inverse_power"]
FACTORIZATIONS = ["identity", "output", "sqrt_prefix", "sqrt_prefix_scaled", "sqrt", "lr_aware"]

rows = []
for name in SCHEDULES:
    rows += error_curves(Schedule(name, BETA), NS, FACTORIZATIONS)
df = pd.DataFrame([r.__dict__ for r in rows])
df.head()

# %% [markdown]
# ## MaxSE and MeanSE against n
# One row of panels per schedule; `identity` is plain DP-SGD noise, `output` adds the noise
# to the models directly.

# %%
fig, axes = plt.subplots(len(SCHEDULES), 2, figsize=(11, 3.2 * len(SCHEDULES)), sharex=True)
for i, name in enumerate(SCHEDULES):
    sub = df[df.schedule == name]
    for j, (metric, title) in enumerate([("max_se", "MaxSE"), ("mean_se", "MeanSE")]):
        ax = axes[i, j]
        for f in FACTORIZATIONS:
            s = sub[sub.factorization == f]
            ax.plot(s.n, s[metric], marker="o", ms=3, label=f)
        lb = sub.drop_duplicates("n")
        ax.plot(lb.n, lb.lower_bound, "k--", label="lower bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel(f"{title} (units of σ·ζ)")
        ax.set_title(f"{name}, β = {BETA:g}: {title}")
        ax.grid(True, which="both", alpha=0.3)
for ax in axes[-1]:
    ax.set_xlabel("n (steps)")
axes[0, 0].legend(fontsize=8, ncol=2)
fig.tight_layout()

# %% [markdown]
# ## Which factorization is best?
# For each schedule and n, the factorization with the smallest error (the lower bound is not a
# factorization and is left out).

# %%
best = (
    df.loc[df.groupby(["schedule", "n"]).max_se.idxmin(), ["schedule", "n", "factorization"]]
    .rename(columns={"factorization": "best MaxSE"})
    .merge(
        df.loc[df.groupby(["schedule", "n"]).mean_se.idxmin(), ["schedule", "n", "factorization"]].rename(
            columns={"factorization": "best MeanSE"}
        )
    )
)
best.pivot(index="n", columns="schedule", values=["best MaxSE", "best MeanSE"])

# %%
cases = len(best)
lr_max = int((best["best MaxSE"] == "lr_aware").sum())
lr_mean = int((best["best MeanSE"] == "lr_aware").sum())
exp_best = best[best.schedule == "exponential"]
exp_mean_losers = exp_best[exp_best["best MeanSE"] != "lr_aware"]
exp = df[df.schedule == "exponential"].pivot(index="n", columns="factorization", values="mean_se")
gap = (exp.lr_aware / exp.sqrt_prefix - 1) * 100
lines = [
    f"* **MaxSE:** `lr_aware` has the smallest MaxSE in **{lr_max} of {cases}** (schedule, n) cases.",
    f"* **MeanSE:** `lr_aware` is best in {lr_mean} of {cases} cases.",
]
if len(exp_mean_losers):
    lines.append(
        f"* For exponential decay, in MeanSE `lr_aware` loses to "
        f"`{exp_mean_losers['best MeanSE'].mode()[0]}` for n ≥ {exp_mean_losers.n.min()} "
        f"(by {gap[gap > 0].min():.1f} % to {gap.max():.1f} %). "
        + (
            "This is the paper's observation: learning-rate-aware is best in MaxSE, not in MeanSE, at these n."
            if (exp_best["best MaxSE"] == "lr_aware").all()
            else "Unlike the paper, `lr_aware` is not best in MaxSE at every n either: "
            + ", ".join(
                f"n = {r.n}: `{r['best MaxSE']}`"
                for _, r in exp_best.iterrows()
                if r["best MaxSE"] != "lr_aware"
            )
            + "."
        )
    )
other = best[(best["best MeanSE"] != "lr_aware")].schedule.unique().tolist()
lines.append(f"* Schedules where `lr_aware` is not always best in MeanSE: {', '.join(other) or 'none'}.")
display(Markdown("\n".join(lines)))
