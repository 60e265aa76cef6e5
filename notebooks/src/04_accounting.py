# %% [markdown]
# # 04 · How private is one training run under each batch-sampling scheme?
#
# **Question.** For one training configuration (data set size N, batch size B, epochs, δ) and a
# banded correlated-noise strategy, what ε does each batch-sampling scheme give for the same
# noise multiplier σ — and how much noise does each need to reach a target ε?
#
# Schemes compared (see `dpmf.accountants.schemes`):
#
# * **poisson** — DP-SGD (C = I) with Poisson sampling at q = B/N, PLD accounting (RDP shown as
#   the looser upper bound it is);
# * **cyclic_poisson** — the banded strategy with the data split into b′ groups (b′ = bands),
#   group t mod b′ Poisson-sampled at q = B·b′/N: amplified, equal to DP-SGD with ⌈n/b′⌉ steps;
# * **balls_in_bins** — every example in one fixed bin of the b = ⌈N/B⌉ bins, step t uses bin
#   t mod b; accounted by Monte Carlo with a **certified** δ (stated confidence);
# * **fixed_order** — shuffled once, fixed cyclic batches: no amplification, the Gaussian
#   mechanism on the fixed-epochs sensitivity.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
if SIZE == "small":
    N, B, EPOCHS, DELTA, MC_SAMPLES, TARGET_EPS = 2_000, 100, 2, 1e-3, 50_000, 4.0
else:
    N, B, EPOCHS, DELTA, MC_SAMPLES, TARGET_EPS = 60_000, 256, 10, 1e-5, 2_000_000, 3.0
BANDS = 16
SIGMA = 1.5

# %%
import math

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display

from dpmf import PrivatePlan, account, calibrate
from dpmf.accountants import samples_needed
from dpmf.mechanisms import factorize
from dpmf.workloads import prefix_sum

steps = EPOCHS * math.ceil(N / B)
strategy = factorize(prefix_sum(steps), f"bsr:{BANDS}")
common = dict(dataset_size=N, batch_size=B, steps=steps, delta=DELTA)
display(
    Markdown(
        f"N = {N}, B = {B}, {EPOCHS} epochs → **n = {steps} steps**, δ = {DELTA:g}, strategy `bsr:{BANDS}` on prefix sums."
    )
)

# %% [markdown]
# ## ε at the same noise level
# The noise multiplier σ is relative to a normalization s that depends on the scheme: the noise
# added to C·G has std **σ·ζ·s**, with s = 1 for DP-SGD, the largest column norm of C for the
# amplified schemes, and the multi-participation (fixed-epochs) sensitivity without
# amplification. Comparing schemes at equal σ would compare different amounts of noise, so the
# banded strategy is accounted at one noise std τ = σ·s (in units of ζ) under each scheme.

# %%
TAU = SIGMA * strategy.C.column_norms().max()  # noise std on C·G, units of ζ
cases = [
    ("DP-SGD, Poisson", "poisson", None, "pld"),
    ("DP-SGD, Poisson (RDP)", "poisson", None, "rdp"),
    (f"bsr:{BANDS}, cyclic Poisson", "cyclic_poisson", strategy, "pld"),
    (f"bsr:{BANDS}, balls-in-bins (Monte Carlo)", "balls_in_bins", strategy, "monte_carlo"),
    (f"bsr:{BANDS}, fixed order (no amplification)", "fixed_order", strategy, "pld"),
]


def mc_options(acc):
    return dict(samples=MC_SAMPLES, seed=0, confidence=0.99, progress=False) if acc == "monte_carlo" else {}


rows = []
for label, scheme, fact, acc in cases:
    # the normalization s of this scheme (no accounting needed); DP-SGD runs at σ = SIGMA itself
    s = PrivatePlan(N, B, steps=steps, scheme=scheme, strategy=fact or "identity").sensitivity
    sigma = SIGMA if fact is None else TAU / s
    r = account(
        scheme, noise_multiplier=sigma, factorization=fact, accountant=acc, **common, **mc_options(acc)
    )
    rows.append(
        dict(
            case=label,
            sigma=r.noise_multiplier,
            s=r.sensitivity,
            noise_std=r.noise_multiplier * r.sensitivity,
            epsilon=r.epsilon,
            estimate=r.epsilon_estimate,
            accountant=r.accountant,
            guarantee=r.guarantee,
        )
    )
eps_table = pd.DataFrame(rows)
eps_table

# %%
mc = eps_table[eps_table.accountant == "monte_carlo"].iloc[0]
display(
    Markdown(
        f"DP-SGD at σ = {SIGMA} reaches ε = {eps_table.epsilon[0]:.3f} (PLD; RDP gives the looser {eps_table.epsilon[1]:.3f}). "
        f"The banded strategy at noise std τ = {TAU:.3f}·ζ on C·G: cyclic Poisson ε = {eps_table.epsilon[2]:.3f}, "
        f"balls-in-bins certified ε = {mc.epsilon:.3f} (point estimate {mc.estimate:.3f}, {MC_SAMPLES:,} samples, "
        f"99 % confidence), no amplification ε = {eps_table.epsilon[4]:.3f}."
    )
)

# %% [markdown]
# ## Monte Carlo: how many samples does a certificate need?
# The certified δ is an upper confidence bound on the estimate; `samples_needed` gives the
# number of privacy-loss samples that certifies a target δ (here with the estimate at half the
# target, 99 % confidence).

# %%
targets = [1e-3, 1e-4, 1e-5, 1e-6]
need = pd.DataFrame({"target δ": targets, "samples needed": [samples_needed(d) for d in targets]})
need

# %% [markdown]
# ## Noise calibrated to a target ε
# The smallest σ meeting (ε, δ) under each scheme's accountant (conservative), and the noise
# std σ·s it puts on C·G — the number to compare across schemes of one strategy.

# %%
cal_rows = []
for label, scheme, fact, acc in cases:
    if acc == "rdp":
        continue
    r = calibrate(scheme, epsilon=TARGET_EPS, factorization=fact, accountant=acc, **common, **mc_options(acc))
    cal_rows.append(
        dict(
            case=label,
            sigma=r.noise_multiplier,
            s=r.sensitivity,
            noise_std=r.noise_multiplier * r.sensitivity,
            epsilon=r.epsilon,
            guarantee=r.guarantee,
        )
    )
cal = pd.DataFrame(cal_rows)

fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
ax.barh(cal.case, cal.noise_std, color="C0", label="noise std σ·s on C·G")
for y, v in enumerate(cal.noise_std):
    ax.text(v, y, f" {v:.3f}", va="center")
ax.set_xlabel("noise std on C·G (units of the clip norm ζ)")
ax.set_title(f"Noise for (ε = {TARGET_EPS:g}, δ = {DELTA:g}), N = {N}, B = {B}, {EPOCHS} epochs")
ax.invert_yaxis()
ax.legend(loc="lower right")
cal

# %%
corr = cal[cal.case.str.startswith("bsr")]
best = corr.loc[corr.noise_std.idxmin()]
worst = corr.loc[corr.noise_std.idxmax()]
display(
    Markdown(
        f"For `bsr:{BANDS}`, **{best.case}** needs the least noise on C·G (std {best.noise_std:.3f}·ζ, σ = {best.sigma:.3f}); "
        f"{worst.case} needs {worst.noise_std / best.noise_std:.2f}× as much. DP-SGD needs σ = {cal.sigma[0]:.3f}. "
        "Across strategies the comparison that matters is the error on the trained model, "
        "σ·s × (row norms of B) — see notebook 05 (`dpmf pick`)."
    )
)
