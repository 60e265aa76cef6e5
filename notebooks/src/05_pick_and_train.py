# %% [markdown]
# # 05 · Pick a strategy for a privacy budget, then train with it
#
# **Question.** For a given data set, batch size, number of epochs, learning-rate schedule and
# (ε, δ), which correlated-noise strategy puts the least noise on the trained model — and does the
# choice carry over to accuracy when DP-SGD, DP-Adam and DP-Muon are trained with it?
#
# `dpmf.pick.pick` (the `dpmf pick` command) calibrates σ for every candidate strategy under its
# batch-sampling scheme (cyclic Poisson for banded C, Poisson for DP-SGD, no amplification
# otherwise) and ranks the candidates by σ·MeanSE, the root-mean-square noise on the model's
# trajectory in units of the clip norm per expected batch. The recommended strategy then trains
# three optimizers at the same ε; plain DP-SGD noise (identity strategy, Poisson sampling) is the
# baseline. Every run is repeated with three seeds (model initialisation, sampling and noise);
# accuracies are mean ± sd, and a difference counts only when it exceeds two standard errors.
#
# Size, for the CPU budget: a fixed subset of `N_TRAIN` Fashion-MNIST training examples (the
# data set `pick` plans for), the MLP, a few epochs, the optimizers' default learning rates.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
if SIZE == "small":
    DATASET, N_TRAIN, EPOCHS, BATCH, MAX_BANDS, SEEDS = "digits", 1438, 1, 256, 4, (0, 1)
else:
    DATASET, N_TRAIN, EPOCHS, BATCH, MAX_BANDS, SEEDS = "fashion-mnist", 20_000, 3, 512, 64, (0, 1, 2)
MODEL = "mlp"
EPSILON, DELTA = 3.0, 1e-5
SCHEDULE, BETA = "cosine", 0.1

# %%
import math

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display
from matplotlib.patches import Patch

from dpmf.pick import pick
from dpmf.workloads import Schedule

steps = EPOCHS * math.ceil(N_TRAIN / BATCH)
choice = pick(
    dataset_size=N_TRAIN,
    batch_size=BATCH,
    steps=steps,
    epsilon=EPSILON,
    delta=DELTA,
    schedule=Schedule(SCHEDULE, BETA),
    max_bands=MAX_BANDS,
    progress=False,
)
ranking = pd.DataFrame([e.__dict__ for e in choice.ranking])
rec = choice.recommendation
dpsgd = ranking[ranking.factorization == "identity"].iloc[0]
display(
    Markdown(
        f"{len(ranking)} strategies ranked in {choice.seconds:.0f} s for N = {N_TRAIN}, B = {BATCH}, "
        f"{steps} steps, ε = {EPSILON:g}, δ = {DELTA:g}, {SCHEDULE} schedule (β = {BETA:g}). "
        f"Recommendation: **`{rec.factorization}`** under {rec.scheme} with σ = {rec.noise_multiplier:.3f}: "
        f"σ·MeanSE = {rec.noise_mean_se:.2f} against {dpsgd.noise_mean_se:.2f} for DP-SGD noise "
        f"({dpsgd.noise_mean_se / rec.noise_mean_se:.2f}× less noise)."
    )
)
ranking[
    ["factorization", "scheme", "noise_multiplier", "sensitivity", "mean_se", "noise_mean_se", "noise_max_se"]
].head(10)

# %%
fig, ax = plt.subplots(figsize=(9, 0.22 * len(ranking) + 1.2), constrained_layout=True)
colors = {"cyclic_poisson": "tab:blue", "fixed_order": "tab:orange", "poisson": "tab:green"}
r = ranking.iloc[::-1]
ax.barh(r.factorization, r.noise_mean_se, color=[colors.get(s, "tab:gray") for s in r.scheme])
handles = [Patch(color=colors.get(s, "tab:gray"), label=s) for s in dict.fromkeys(ranking.scheme)]
ax.set_xscale("log")
ax.set_xlabel("σ·MeanSE (noise on the model, units of clip norm per expected batch)")
ax.set_ylabel("strategy")
ax.set_title(f"pick: {DATASET}, B = {BATCH}, {EPOCHS} epochs, ε = {EPSILON:g}, {SCHEDULE} β = {BETA:g}")
ax.legend(handles=handles, title="scheme")
ax.grid(True, axis="x", which="both", alpha=0.3)

# %%
import sys
import tempfile

sys.path.insert(0, os.path.join(os.pardir, "benchmarks"))  # the experiment helpers of the command line
from paper_experiments import Split, compare, load_split

from dpmf.train import TrainConfig, evaluate, train

split = Split(DATASET, train_size=N_TRAIN if DATASET != "digits" else None)
data, test_x, test_y = load_split(split)
assert len(data) == N_TRAIN, "pick and training must plan for the same data set size"
RUNS = [
    ("DP-SGD, DP-SGD noise", "dp-sgd", "identity", "poisson"),
    (f"DP-SGD, {rec.factorization}", "dp-sgd", rec.factorization, rec.scheme),
    (f"DP-Adam, {rec.factorization}", "dp-adam", rec.factorization, rec.scheme),
    (f"DP-Muon, {rec.factorization}", "dp-muon", rec.factorization, rec.scheme),
]
COLORS = dict(zip([r[0] for r in RUNS], ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
results = []
for label, optimizer, factorization, scheme in RUNS:
    for seed in SEEDS:
        config = TrainConfig(
            dataset=DATASET,
            model=MODEL,
            optimizer=optimizer,
            factorization=factorization,
            scheme=scheme,
            epochs=EPOCHS,
            batch_size=BATCH,
            epsilon=EPSILON,
            delta=DELTA,
            schedule=SCHEDULE,
            beta=BETA,
            seed=seed,
        )
        with tempfile.TemporaryDirectory() as out:
            res = train(config, out, progress=False, log=lambda *a, **k: None, data=data)
        _, acc = evaluate(res.model, test_x, test_y, batch_size=1024, device="cpu")
        results += [
            dict(
                run=label,
                seed=seed,
                epoch=row["epoch"],
                accuracy=100 * row["test_accuracy"],
                epsilon=row["epsilon"],
            )
            for row in res.metrics
        ]
        assert abs(100 * acc - results[-1]["accuracy"]) < 1e-9  # the loop evaluates the test split
curves = pd.DataFrame(results)
fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
for label, c in curves.groupby("run", sort=False):
    m = c.groupby("epoch").accuracy.agg(["mean", "std"])
    ax.errorbar(m.index, m["mean"], yerr=m["std"], marker="o", capsize=3, color=COLORS[label], label=label)
ax.set_xlabel("epoch")
ax.set_ylabel(f"test accuracy (%), mean ± sd over {len(SEEDS)} seeds")
ax.set_title(
    f"{DATASET} ({N_TRAIN} examples), ε = {EPSILON:g}, δ = {DELTA:g}, B = {BATCH}, {SCHEDULE} learning rate"
)
ax.grid(True, alpha=0.3)
ax.legend()

# %%
final = curves[curves.epoch == curves.epoch.max()]
acc = {label: final[final.run == label].sort_values("seed").accuracy.to_numpy() for label, *_ in RUNS}
eps = final.groupby("run", sort=False).epsilon.max()
means = {label: float(a.mean()) for label, a in acc.items()}
best = max(means, key=means.get)
base, rec_sgd = RUNS[0][0], RUNS[1][0]
d = compare(acc[rec_sgd], acc[base])
paired = acc[rec_sgd] - acc[base]
verdict = {
    "higher": "**more accurate** than",
    "lower": "**less accurate** than",
    "within noise": "**not distinguishable** (within two standard errors) from",
}[d["verdict"]]
display(
    Markdown(
        "\n".join(
            [
                f"* {label}: {a.mean():.1f} ± {a.std(ddof=1):.1f} % test accuracy over {len(a)} seeds "
                f"(ε = {eps[label]:.3f})"
                for label, a in acc.items()
            ]
            + [
                f"* Highest mean: {best} ({means[best]:.1f} %)"
                + (
                    "; the next is within two standard errors of it."
                    if any(compare(acc[best], acc[k])["verdict"] == "within noise" for k in acc if k != best)
                    else ", ahead of every other run by more than two standard errors."
                ),
                f"* With the same optimizer (DP-SGD), the recommended `{rec.factorization}` is {verdict} DP-SGD "
                f"noise: {d['diff']:+.1f} ± {d['se']:.1f} points (difference of means ± standard error; paired "
                f"by seed {', '.join(f'{x:+.1f}' for x in paired)}), although it puts "
                f"{dpsgd.noise_mean_se / rec.noise_mean_se:.2f}× less noise (σ·MeanSE) on the model.",
            ]
        )
    )
)
