"""The papers' training experiments, at any size, on CPU or GPU: one grid runner shared by the
notebooks (06, 10) and this command line, so that their settings cannot drift apart.

``phase_transition`` — *Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale* (DP-Muon): DP-SGD against DP-Muon over batch sizes at one ε (Poisson
sampling, PLD), and the recovery threshold of its Proposition 1 (Wedin's sin θ theorem),

    B > B* = σ(B)·ζ·(√m + √n) / (σ₁(G) − σ₂(G)),

measured from the spectra of the clean mean clipped gradient G of each weight matrix (m × n)
of the DP-SGD model trained at each batch size: the threshold is where the ratio
B·(σ₁ − σ₂)/(σ(B)·ζ·(√m + √n)) crosses 1 (σ(B) is the noise multiplier calibrated at that B).

``lr_scheduling`` — *Learning Rate Scheduling with Matrix Factorization for Private Training*
(Figures 3–4): constant against exponential, linear, cosine and polynomial (γ = 2) decay for
DP-SGD (identity strategy, Poisson sampling), BISR (``bisr:p``, built on the prefix sum, the
schedule ignored) and BISR with the learning-rate-aware factorization (``lr_bisr:p``, built
on Toep(χ)); the base learning rate is chosen on a validation split held out from the training
set (never the test set), then the remaining seeds are trained at that rate and their test
accuracy reported.

Usage (the data must be on disk: nothing is downloaded)::

    python benchmarks/paper_experiments.py --experiment lr_scheduling --dataset cifar10 \\
        --data-dir DIR --model cnn3 --epochs 10 --batch-size 128 --epsilon 9 \\
        --matrix-scheme balls_in_bins --lrs 0.5,1,2,4 --seeds 3 --device cuda --out runs/lr
    python benchmarks/paper_experiments.py --experiment phase_transition --dataset cifar10 \\
        --data-dir DIR --model wrn16-4 --epochs 10 --batch-sizes 256,1024,4096 --epsilon 4 \\
        --sgd-lrs 0.5,1.5 --muon-lrs 0.05,0.15 --seeds 3 --device cuda --out runs/muon

Both experiments hold out ``--val-size`` training examples (default 5000) to choose the learning
rate on; the model defaults to the MLP (the notebooks' CPU size).

Each writes OUT/runs.csv (one row per training run), OUT/summary.csv and OUT/conclusions.md
(the claims checked against the numbers); ``phase_transition`` also OUT/spectra.csv. On CPU,
``--workers 2 --threads 1`` runs two independent runs at once.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpmf._validation import check_choice, check_int, check_real  # noqa: E402
from dpmf.optim import matrix_shape  # noqa: E402
from dpmf.optim.clipping import clipped_sum, trainable_parameters  # noqa: E402
from dpmf.train import Dataset, TrainConfig, evaluate, load_dataset, train  # noqa: E402
from dpmf.train.planning import plan_for  # noqa: E402

__all__ = [
    "EXPERIMENTS",
    "SCHEDULES",
    "MECHANISMS",
    "Split",
    "Run",
    "load_split",
    "execute",
    "run_all",
    "calibrated",
    "gradient_spectra",
    "phase_transition",
    "summarize_phase_transition",
    "phase_transition_conclusions",
    "lr_scheduling",
    "summarize_lr_scheduling",
    "lr_scheduling_claims",
    "compare",
    "main",
]

EXPERIMENTS = ("phase_transition", "lr_scheduling")
SCHEDULES = ("constant", "exponential", "linear", "cosine", "polynomial")
MECHANISMS = ("DP-SGD", "BISR", "BISR w/ LRS")
# One colour per optimizer / mechanism / schedule, for every axes of a figure.
COLORS = {
    "dp-sgd": "tab:blue",
    "dp-muon": "tab:red",
    "DP-SGD": "tab:blue",
    "BISR": "tab:orange",
    "BISR w/ LRS": "tab:green",
    "constant": "tab:gray",
    "exponential": "tab:blue",
    "linear": "tab:orange",
    "cosine": "tab:green",
    "polynomial": "tab:purple",
}


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Split:
    """Which examples a run trains on and which it is validated on.

    A fixed permutation (``seed``) of the data set's training split: the first ``val_size``
    examples are the validation split, the next ``train_size`` (None: all the rest) are
    trained on. The test split is never used for a choice.

    Attributes:
        dataset: ``fashion-mnist``, ``cifar10`` or ``digits``.
        data_dir: the data set's folder (None: its default place).
        train_size: examples trained on, ≥ 1 (None: every example not held out).
        val_size: examples held out for validation, ≥ 0 (0: the test split is the only
            evaluation, and the validation accuracy equals the test accuracy).
        seed: the permutation's seed.
    """

    dataset: str
    data_dir: str | None = None
    train_size: int | None = None
    val_size: int = 0
    seed: int = 0

    def __post_init__(self):
        from dpmf.train.data import DATASETS

        check_choice("dataset", self.dataset, DATASETS)
        if self.train_size is not None:
            check_int("train_size", self.train_size, minimum=1)
        check_int("val_size", self.val_size, minimum=0)
        check_int("seed", self.seed, minimum=0)

    def describe(self, data_len: int | None = None) -> str:
        n = self.train_size if self.train_size is not None else data_len
        held = f", {self.val_size} held out for validation" if self.val_size else ""
        return f"{n} training examples of {self.dataset}{held} (split seed {self.seed})"


@functools.lru_cache(maxsize=2)
def load_split(split: Split) -> tuple[Dataset, torch.Tensor, torch.Tensor]:
    """The training data of ``split``, with its validation split as the ``test_x``/``test_y``
    that the training loop evaluates, and the real test split beside it.

    Returns:
        (data, test_x, test_y): ``data`` a ``Dataset`` of ``train_size`` examples (shape
        (N, C, H, W)) whose test split is the validation split (or the test split when
        ``val_size`` is 0); ``test_x`` (T, C, H, W) and ``test_y`` (T,) the test split.

    Raises:
        ValueError: ``val_size + train_size`` larger than the training split; the data set's
            own errors (missing files) from ``load_dataset``.
    """
    full = load_dataset(split.dataset, split.data_dir, fallback=split.data_dir is None)
    if full.name != split.dataset:
        raise ValueError(
            f"dataset={split.dataset!r} is invalid here: its files were not found (got {full.name}); "
            "pass data_dir"
        )
    n = len(full)
    size = n - split.val_size if split.train_size is None else split.train_size
    if size < 1 or split.val_size + size > n:
        raise ValueError(
            f"train_size={split.train_size!r}, val_size={split.val_size} is invalid: together they must "
            f"fit in the {n} training examples of {split.dataset}; lower them"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split.seed))
    val, tr = perm[: split.val_size], perm[split.val_size : split.val_size + size]
    if split.val_size:
        ex, ey = full.train_x[val], full.train_y[val]
    else:
        ex, ey = full.test_x, full.test_y
    data = Dataset(
        full.name,
        full.train_x[tr],
        full.train_y[tr],
        ex,
        ey,
        full.num_classes,
        f"{full.source} ({split.describe()})",
    )
    return data, full.test_x, full.test_y


# ---------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Run:
    """One training run of a grid.

    Attributes:
        split: the data it trains and validates on.
        config: the run (its ``seed`` set: reproducible).
        tags: (key, value) pairs copied into its results row (optimizer, batch size, …).
        spectrum_examples: > 0: after training, the spectra of the clean mean clipped gradient
            of every weight matrix over this many training examples go into the row.
    """

    split: Split
    config: TrainConfig
    tags: tuple = ()
    spectrum_examples: int = 0


def gradient_spectra(model, data: Dataset, *, clip_norm: float, examples: int, seed: int = 0) -> list[dict]:
    """σ₁, σ₂ of the clean mean clipped gradient G = (1/M)·Σ_i clip_ζ(∇ℓ(θ; x_i)) of every weight
    matrix (conv kernels viewed as out × in·kh·kw), over M random training examples.

    Args:
        model: the trained model (on its device).
        data: the training data (examples drawn from ``train_x``).
        clip_norm: ζ, the clipping of the run.
        examples: M ≥ 1 (at most the data set's size).
        seed: which examples.

    Returns:
        One dict per 2-D weight: ``layer``, ``m``, ``n``, ``sigma1``, ``sigma2``, ``gap`` =
        σ₁ − σ₂ (units of gradient norm) and ``noise_factor`` = √m + √n (the operator norm of
        an m×n standard Gaussian matrix is about √m + √n, Davidson & Szarek).
    """
    examples = min(check_int("examples", examples, minimum=1), len(data))
    device = next(model.parameters()).device
    idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:examples]
    named = trainable_parameters(model)
    sums = None
    for chunk in idx.split(512):
        cs = clipped_sum(
            model,
            F.cross_entropy,
            data.train_x[chunk].to(device),
            data.train_y[chunk].to(device),
            clip_norm=clip_norm,
            clipping="vmap",
        )
        sums = cs.grads if sums is None else [s + g for s, g in zip(sums, cs.grads, strict=True)]
    rows = []
    for (name, p), s in zip(named, sums, strict=True):
        if p.ndim < 2:
            continue
        m, n = matrix_shape(p.shape)
        sv = torch.linalg.svdvals((s / examples).reshape(m, n).double().cpu()).numpy()
        rows.append(
            dict(
                layer=name,
                m=m,
                n=n,
                sigma1=float(sv[0]),
                sigma2=float(sv[1]),
                gap=float(sv[0] - sv[1]),
                noise_factor=math.sqrt(m) + math.sqrt(n),
            )
        )
    return rows


def execute(run: Run, threads: int | None = None) -> dict:
    """Train ``run`` and return its results row.

    Returns:
        ``tags`` plus ``val_accuracy`` (on the split's validation examples; the test accuracy
        when it holds none out), ``test_accuracy`` (the test split), ``epsilon``, ``sigma``
        (the noise multiplier), ``steps``, ``seconds`` and, with ``spectrum_examples``,
        ``spectra`` (``gradient_spectra``). Accuracies in [0, 1].
    """
    if threads is not None:
        torch.set_num_threads(threads)
    data, test_x, test_y = load_split(run.split)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        res = train(run.config, out, progress=False, log=lambda *a, **k: None, data=data)
    seconds = time.perf_counter() - t0
    device = next(res.model.parameters()).device
    _, test_acc = evaluate(res.model, test_x, test_y, batch_size=run.config.eval_batch_size, device=device)
    row = dict(run.tags)
    row.update(
        val_accuracy=float(res.test_accuracy),
        test_accuracy=float(test_acc),
        epsilon=float(res.privacy.epsilon),
        sigma=float(res.privacy.noise_multiplier),
        steps=int(res.steps),
        seconds=round(seconds, 2),
    )
    if run.spectrum_examples:
        row["spectra"] = gradient_spectra(
            res.model, data, clip_norm=run.config.clip_norm, examples=run.spectrum_examples
        )
    return row


def _execute_star(args):
    return execute(*args)


def run_all(runs, *, workers: int = 1, threads: int | None = None) -> list[dict]:
    """``execute`` every run, in order; ``workers`` > 1 runs that many at once in fresh
    processes (spawned, each with ``threads`` torch threads), for CPUs with cores to spare."""
    runs = list(runs)
    check_int("workers", workers, minimum=1)
    if workers == 1 or len(runs) <= 1:
        return [execute(r, threads) for r in runs]
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_execute_star, [(r, threads) for r in runs]))


def _calibrate_one(args):
    config, split = args
    data, _, _ = load_split(split)
    _, plan = plan_for(config, len(data), progress=False, log=lambda *a, **k: None)
    return plan.noise_multiplier


def calibrated(configs, split: Split, *, workers: int = 1) -> list[TrainConfig]:
    """Each config with its σ calibrated once for its target ε on ``split``'s training size
    (``noise_multiplier`` set, ``epsilon`` cleared), so that the runs sharing a privacy setting
    and differing only in learning rate or seed do not repeat the calibration (costly for
    Monte Carlo accounting); every run still accounts its ε, which is reported."""
    configs = list(configs)
    jobs = [(c, split) for c in configs]
    if workers == 1 or len(jobs) <= 1:
        sigmas = [_calibrate_one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            sigmas = list(pool.map(_calibrate_one, jobs))
    return [c.replace(noise_multiplier=s) for c, s in zip(configs, sigmas, strict=True)]


def compare(a, b) -> dict:
    """Mean difference of two samples a − b, its standard error √(s_a²/n_a + s_b²/n_b) and a
    verdict: ``higher`` (difference > 2 standard errors), ``lower`` (< −2) or ``within noise``.

    With 3 seeds per side this is a rough screen, not a significance test."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    d = float(a.mean() - b.mean())
    se = (
        float(math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b)))
        if min(len(a), len(b)) > 1
        else float("nan")
    )
    verdict = "within noise" if not np.isfinite(se) or abs(d) <= 2 * se else ("higher" if d > 0 else "lower")
    return dict(diff=d, se=se, verdict=verdict)


def _pm(values, scale=100.0) -> str:
    v = scale * np.asarray(values, float)
    return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}" if len(v) > 1 else f"{v.mean():.1f}"


# ---------------------------------------------------------------------------- phase transition

DEFAULT_OPTIMIZERS = {"dp-sgd": dict(momentum=0.9), "dp-muon": {}}
DEFAULT_LRS = {"dp-sgd": (0.5, 1.5), "dp-muon": (0.05, 0.15)}


def selected(rows, keys) -> pd.DataFrame:
    """The rows at the learning rate chosen per ``keys``: the best validation accuracy of the
    stage-1 seed; its row and the stage-2 rows (the other seeds at that rate). Adds
    ``lr_at_edge`` (the chosen rate is the smallest or largest tried) and ``lr_tried`` (how
    many rates were tried)."""
    df = pd.DataFrame(rows)
    keep = []
    for _, sub in df.groupby(list(keys), sort=False):
        st1 = sub[sub.stage == 1]
        lr = float(st1.loc[st1.val_accuracy.idxmax(), "lr"])
        tried = sorted(st1.lr.unique())
        at = sub[(sub.lr == lr) & ((sub.stage == 2) | (sub.seed == st1.seed.iloc[0]))]
        keep.append(at.assign(lr_at_edge=len(tried) > 1 and lr in (tried[0], tried[-1]), lr_tried=len(tried)))
    return pd.concat(keep, ignore_index=True)


def phase_transition(
    split: Split,
    *,
    batch_sizes,
    seeds,
    epochs: int,
    epsilon: float,
    delta: float = 1e-5,
    clip_norm: float = 1.0,
    model: str = "mlp",
    optimizers: dict | None = None,
    lrs: dict | None = None,
    spectrum_examples: int = 4096,
    device: str = "cpu",
    workers: int = 1,
    threads: int | None = None,
) -> list[dict]:
    """DP-SGD and DP-Muon at every batch size, all at the same ε (plain DP-SGD noise, Poisson
    sampling, PLD accounting), the learning rate chosen per (optimizer, B) on validation; the
    DP-SGD runs also measure the gradient spectra.

    Two stages, as in ``lr_scheduling``: every learning rate of ``lrs[optimizer]`` with
    ``seeds[0]``, then the other seeds at the rate with the best validation accuracy.

    Args:
        split: the data (``val_size`` > 0 for an honest choice of the rate).
        batch_sizes: expected batch sizes B.
        seeds: training seeds (model initialisation, sampling, noise).
        epochs, epsilon, delta, clip_norm, model, device: as in ``TrainConfig``.
        optimizers: optimizer name → other ``TrainConfig`` overrides (default: DP-SGD with
            momentum 0.9, DP-Muon with its defaults).
        lrs: optimizer name → base learning rates tried (default: DP-SGD 0.5, 1.5; DP-Muon
            0.05, 0.15).
        spectrum_examples: training examples for ``gradient_spectra``.
        workers, threads: as in ``run_all``.

    Returns:
        One row per run (``optimizer``, ``batch_size``, ``lr``, ``seed``, ``stage`` and
        ``execute``'s fields).
    """
    optimizers = DEFAULT_OPTIMIZERS if optimizers is None else optimizers
    lrs = DEFAULT_LRS if lrs is None else lrs
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds=[] is invalid: give at least one seed")

    def make(opt, b, lr, seed, stage):
        cfg = TrainConfig(
            dataset=split.dataset,
            model=model,
            optimizer=opt,
            factorization="identity",
            scheme="poisson",
            epochs=epochs,
            batch_size=b,
            epsilon=epsilon,
            delta=delta,
            clip_norm=clip_norm,
            seed=seed,
            lr=lr,
            device=device,
            epsilon_each_epoch=False,
            **optimizers[opt],
        )
        tags = (("optimizer", opt), ("batch_size", b), ("lr", lr), ("seed", seed), ("stage", stage))
        return Run(split, cfg, tags, spectrum_examples if opt == "dp-sgd" else 0)

    keys = [(opt, b) for b in batch_sizes for opt in optimizers]
    rows = run_all(
        [make(o, b, lr, seeds[0], 1) for o, b in keys for lr in lrs[o]], workers=workers, threads=threads
    )
    first = pd.DataFrame(rows)
    chosen = {}
    for o, b in keys:
        sub = first[(first.optimizer == o) & (first.batch_size == b)]
        chosen[(o, b)] = float(sub.loc[sub.val_accuracy.idxmax(), "lr"])
    rows += run_all(
        [make(o, b, chosen[(o, b)], s, 2) for o, b in keys for s in seeds[1:]],
        workers=workers,
        threads=threads,
    )
    return rows


def _crossing(bs, r):
    """B where r(B) crosses 1, interpolated on log–log scales; None when it does not."""
    lb, lr = np.log(np.asarray(bs, float)), np.log(np.asarray(r, float))
    for i in range(len(lb) - 1):
        if lr[i] * lr[i + 1] <= 0 and lr[i] != lr[i + 1]:
            return float(np.exp(lb[i] - lr[i] * (lb[i + 1] - lb[i]) / (lr[i + 1] - lr[i])))
    return None


def summarize_phase_transition(rows, *, clip_norm: float = 1.0):
    """Tables of a ``phase_transition`` grid.

    Only the runs at the learning rate chosen on validation count (``selected``).

    Returns:
        dict with ``runs`` (one row per selected run), ``accuracy`` (mean, sd of the test accuracy in %
        per optimizer and B), ``gain`` (per B: DP-Muon − DP-SGD in points, paired by seed:
        mean, sd, and ``compare``'s verdict), ``spectra`` (per B, seed, layer: σ₁, σ₂, gap and
        the ratio B·gap/(σ(B)·ζ·(√m + √n))), ``ratio`` (its mean over seeds, B × layer),
        ``layer`` (the largest weight matrix), ``thresholds`` (B* per layer from the mean
        ratio, None where it does not cross 1 inside the grid) and ``b_star`` (that of
        ``layer``).
    """
    sel = selected(rows, ["optimizer", "batch_size"])
    df = sel.drop(columns=[c for c in ("spectra",) if c in sel])
    acc = (
        df.groupby(["optimizer", "batch_size"])
        .test_accuracy.agg(["mean", "std", "count"])
        .mul([100, 100, 1])
        .reset_index()
    )
    piv = df.pivot_table(index=["batch_size", "seed"], columns="optimizer", values="test_accuracy")
    diff = 100 * (piv["dp-muon"] - piv["dp-sgd"])
    gain = []
    for b, d in diff.groupby(level=0):
        a = df[(df.batch_size == b) & (df.optimizer == "dp-muon")].test_accuracy.to_numpy()
        s = df[(df.batch_size == b) & (df.optimizer == "dp-sgd")].test_accuracy.to_numpy()
        c = compare(100 * a, 100 * s)
        sd = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
        paired_se = sd / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        verdict = (
            "within noise"
            if not np.isfinite(paired_se) or abs(d.mean()) <= 2 * paired_se
            else ("DP-Muon better" if d.mean() > 0 else "DP-SGD better")
        )
        gain.append(
            dict(
                batch_size=b,
                gain=float(d.mean()),
                sd=sd,
                paired_se=paired_se,
                verdict=verdict,
                unpaired_verdict=c["verdict"],
            )
        )
    gain = pd.DataFrame(gain)
    spec = []
    for r in sel[sel.optimizer == "dp-sgd"].itertuples():
        for s in r.spectra:
            spec.append(dict(batch_size=r.batch_size, seed=r.seed, sigma=r.sigma, **s))
    spec = pd.DataFrame(spec)
    spec["ratio"] = spec.batch_size * spec.gap / (spec.sigma * clip_norm * spec.noise_factor)
    ratio = spec.pivot_table(index="batch_size", columns="layer", values="ratio", aggfunc="mean")
    sizes = spec.drop_duplicates("layer").set_index("layer")
    layer = (sizes.m * sizes.n).idxmax()
    thresholds = {col: _crossing(ratio.index, ratio[col].to_numpy()) for col in ratio}
    return dict(
        runs=df,
        accuracy=acc,
        gain=gain,
        spectra=spec,
        ratio=ratio,
        layer=layer,
        thresholds=thresholds,
        b_star=thresholds[layer],
    )


def _extrapolated_threshold(r) -> float | None:
    """B where the ratio would reach 1, extrapolated on log–log scales from its two largest
    batch sizes (None when it does not grow there)."""
    b, v = np.log(np.asarray(r.index[-2:], float)), np.log(r.to_numpy()[-2:])
    slope = (v[1] - v[0]) / (b[1] - b[0])
    return float(np.exp(b[1] - v[1] / slope)) if slope > 0 else None


def phase_transition_conclusions(summary, dataset_size: int | None = None) -> list[str]:
    """The Wedin-threshold prediction checked against the measurements, as Markdown bullets.

    The prediction: DP-Muon is no better than DP-SGD below B* and better above it. Where the
    ratio stays below 1 (above 1) at every batch size of the grid, every batch size is below
    (above) the threshold. The data *contradict* the prediction when DP-Muon is significantly
    better (paired difference over seeds > 2 standard errors) at some B below B*, or
    significantly worse at some B above it; they *agree* when neither happens and DP-Muon is
    significantly better at some B above B*; with no B above B*, only the first half is
    tested; otherwise the runs do not resolve it.

    Args:
        summary: ``summarize_phase_transition``'s result.
        dataset_size: N, to say when an extrapolated threshold exceeds the data set.
    """
    gain, b_star, layer, ratio = summary["gain"], summary["b_star"], summary["layer"], summary["ratio"]
    lines = [
        "* DP-Muon − DP-SGD (test accuracy, points, mean ± sd of the paired difference over seeds): "
        + ", ".join(
            f"B = {r.batch_size}: {r.gain:+.1f} ± {r.sd:.1f} ({r.verdict})" for r in gain.itertuples()
        )
        + "."
    ]
    r = ratio[layer]
    measured = (
        f"ratio of the largest weight `{layer}` "
        + ", ".join(f"{x:.3g}" for x in r.to_numpy())
        + f" at B = {', '.join(str(b) for b in r.index)}"
    )
    if b_star is None and (r < 1).all():
        threshold = math.inf
        ext = _extrapolated_threshold(r)
        lines.append(
            f"* Measured recovery {measured}: **below 1 at every batch size**, so every B tried is below "
            "the threshold"
            + (
                f"; extrapolated from the two largest B, B* ≈ {ext:.3g}"
                + (
                    f", more than the {dataset_size} training examples: the threshold cannot be bracketed "
                    "on this data set"
                    if dataset_size is not None and ext > dataset_size
                    else ""
                )
                if ext is not None
                else "; the ratio does not grow between the two largest B (no extrapolated threshold)"
            )
            + "."
        )
    elif b_star is None:
        threshold = 0.0
        lines.append(
            f"* Measured recovery {measured}: **above 1 at every batch size**, so every B tried is above it."
        )
    else:
        threshold = b_star
        others = ", ".join(
            f"`{k}`: {'none in the grid' if v is None else f'{v:.0f}'}"
            for k, v in summary["thresholds"].items()
            if k != layer
        )
        lines.append(
            f"* Measured recovery {measured}: **B* ≈ {b_star:.0f}**"
            + (f" (other weights: {others})" if others else "")
            + "."
        )
    below, above = gain[gain.batch_size < threshold], gain[gain.batch_size > threshold]
    bad_below = below[below.verdict == "DP-Muon better"].batch_size.tolist()
    bad_above = above[above.verdict == "DP-SGD better"].batch_size.tolist()
    good_above = above[above.verdict == "DP-Muon better"].batch_size.tolist()
    best = gain.loc[gain.gain.idxmax()]
    lines.append(
        f"* The largest mean gain is at B = {int(best.batch_size)} ({best.gain:+.1f} points), "
        + ("above" if best.batch_size > threshold else "below")
        + " the threshold; the gain "
        + ("increases" if gain.gain.is_monotonic_increasing else "does not increase monotonically")
        + " with B."
    )
    if bad_below or bad_above:
        verdict = (
            "**The data contradict the Wedin-threshold prediction**: "
            + (f"DP-Muon is significantly better below B* (B = {bad_below})" if bad_below else "")
            + ("; " if bad_below and bad_above else "")
            + (f"DP-SGD is significantly better above B* (B = {bad_above})" if bad_above else "")
            + "."
        )
    elif good_above:
        verdict = (
            "**The data agree with the Wedin-threshold prediction**: DP-Muon is not significantly "
            f"better below B*, and significantly better above it (B = {good_above})."
        )
    elif not len(above):
        verdict = (
            "**Consistent with the prediction below the threshold only**: DP-Muon is not significantly "
            "better at any B tried, all below B*; the regime above B* was not reached."
        )
    else:
        verdict = (
            "**The prediction is not resolved by these runs**: no batch size above B* shows DP-Muon "
            "better by more than two standard errors."
        )
    lines.append("* " + verdict)
    return lines + _edge_lines(summary["runs"])


def _edge_lines(df) -> list[str]:
    edge = df[df.lr_at_edge].drop_duplicates(["optimizer", "batch_size"])
    if not len(edge):
        return []
    few = bool((edge.lr_tried <= 2).all())
    return [
        "* The chosen learning rate is at an edge of the grid for "
        + ", ".join(f"{r.optimizer} at B = {r.batch_size} (η = {r.lr:g})" for r in edge.itertuples())
        + (": with two rates per point every choice is an edge; " if few else ": ")
        + "a wider grid might change these numbers."
    ]


# ---------------------------------------------------------------------------- learning-rate scheduling


def _mechanism(name: str, bands: int, matrix_scheme: str) -> tuple[str, str]:
    return {
        "DP-SGD": ("identity", "poisson"),
        "BISR": (f"bisr:{bands}", matrix_scheme),
        "BISR w/ LRS": (f"lr_bisr:{bands}", matrix_scheme),
    }[name]


def lr_scheduling(
    split: Split,
    *,
    schedules=SCHEDULES,
    mechanisms=MECHANISMS,
    lrs,
    seeds,
    epsilons,
    epochs: int,
    batch_size: int,
    beta: float = 0.1,
    gamma: float = 2.0,
    bands: int = 16,
    matrix_scheme: str = "fixed_order",
    model: str = "mlp",
    momentum: float = 0.0,
    delta: float = 1e-5,
    clip_norm: float = 1.0,
    device: str = "cpu",
    workers: int = 1,
    threads: int | None = None,
) -> list[dict]:
    """The learning-rate-scheduling grid, in two stages.

    1. Every (ε, schedule, mechanism, base learning rate) with ``seeds[0]``; the rate with the
       best validation accuracy is chosen per (ε, schedule, mechanism).
    2. The other seeds at the chosen rate.

    ``BISR w/ LRS`` under the constant schedule is BISR itself (Toep(χ) = A₁) and is not run.
    σ is calibrated once per (ε, schedule, mechanism) (``calibrated``).

    Args:
        split: the data (``val_size`` > 0 for an honest choice of the rate).
        schedules: names among ``SCHEDULES``; decays end at χ_n = ``beta``, polynomial with
            power ``gamma``.
        mechanisms: among ``MECHANISMS``.
        lrs: the base learning rates η tried (step t uses η·χ_t).
        seeds: ≥ 1 training seeds.
        epsilons: target ε values (δ = ``delta``).
        epochs, batch_size, model, momentum, clip_norm, device: as in ``TrainConfig``
            (momentum 0: the workload A_χ = A₁·diag(χ) the strategies are built for).
        bands: p of ``bisr:p`` and ``lr_bisr:p``.
        matrix_scheme: the batch sampling of BISR (``fixed_order``: no amplification, PLD;
            ``balls_in_bins``: amplified, Monte Carlo accounting as in the paper, minutes per
            calibration on a CPU).
        workers, threads: as in ``run_all``.

    Returns:
        One row per run: ``epsilon_target``, ``schedule``, ``mechanism``, ``lr``, ``seed``,
        ``stage`` (1 or 2) and ``execute``'s fields.

    Raises:
        ValueError: an unknown schedule or mechanism, no learning rate or seed.
    """
    for s in schedules:
        check_choice("schedule", s, SCHEDULES)
    for m in mechanisms:
        check_choice("mechanism", m, MECHANISMS)
    lrs = [check_real("lr", x, low=0.0, low_inclusive=False) for x in lrs]
    seeds = list(seeds)
    if not lrs or not seeds:
        raise ValueError(
            f"lrs={lrs!r}, seeds={seeds!r} is invalid: give at least one learning rate and one seed"
        )
    base = {}
    for eps in epsilons:
        for sched in schedules:
            for mech in mechanisms:
                if mech == "BISR w/ LRS" and sched == "constant":
                    continue
                fac, scheme = _mechanism(mech, bands, matrix_scheme)
                base[(eps, sched, mech)] = TrainConfig(
                    dataset=split.dataset,
                    model=model,
                    optimizer="dp-sgd",
                    factorization=fac,
                    scheme=scheme,
                    epochs=epochs,
                    batch_size=batch_size,
                    epsilon=eps,
                    delta=delta,
                    clip_norm=clip_norm,
                    momentum=momentum,
                    schedule=sched,
                    beta=1.0 if sched == "constant" else beta,
                    gamma=gamma if sched == "polynomial" else None,
                    device=device,
                    epsilon_each_epoch=False,
                    seed=seeds[0],
                    lr=lrs[0],
                )
    keys = list(base)
    base = dict(zip(keys, calibrated([base[k] for k in keys], split, workers=workers), strict=True))

    def make(key, lr, seed, stage):
        eps, sched, mech = key
        tags = (
            ("epsilon_target", eps),
            ("schedule", sched),
            ("mechanism", mech),
            ("lr", lr),
            ("seed", seed),
            ("stage", stage),
        )
        return Run(split, base[key].replace(lr=lr, seed=seed), tags)

    rows = run_all([make(k, lr, seeds[0], 1) for k in keys for lr in lrs], workers=workers, threads=threads)
    first = pd.DataFrame(rows)
    chosen = {}
    for k in keys:
        eps, sched, mech = k
        sub = first[(first.epsilon_target == eps) & (first.schedule == sched) & (first.mechanism == mech)]
        chosen[k] = float(sub.loc[sub.val_accuracy.idxmax(), "lr"])
    rows += run_all(
        [make(k, chosen[k], s, 2) for k in keys for s in seeds[1:]], workers=workers, threads=threads
    )
    return rows


def summarize_lr_scheduling(rows, lrs=None) -> pd.DataFrame:
    """Per (ε, schedule, mechanism): the chosen rate (best validation accuracy of stage 1),
    whether it is at the edge of the grid, and the test accuracy (%) of all seeds at it:
    ``mean``, ``sd``, ``seeds`` and the values themselves (``test``, a list in [0, 1])."""
    df = pd.DataFrame(rows)
    lrs = sorted(df.lr.unique()) if lrs is None else sorted(lrs)
    out = []
    for (eps, sched, mech), sub in df.groupby(["epsilon_target", "schedule", "mechanism"], sort=False):
        st1 = sub[sub.stage == 1]
        lr = float(st1.loc[st1.val_accuracy.idxmax(), "lr"])
        at = sub[sub.lr == lr]
        at = at[(at.stage == 2) | (at.seed == st1.seed.iloc[0])]
        t = at.test_accuracy.to_numpy()
        out.append(
            dict(
                epsilon_target=eps,
                schedule=sched,
                mechanism=mech,
                lr=lr,
                lr_at_edge=len(lrs) > 1 and lr in (lrs[0], lrs[-1]),
                mean=100 * t.mean(),
                sd=100 * t.std(ddof=1) if len(t) > 1 else float("nan"),
                seeds=len(t),
                epsilon=float(at.epsilon.max()),
                sigma=float(at.sigma.iloc[0]),
                test=list(t),
            )
        )
    return pd.DataFrame(out)


def lr_scheduling_claims(summary: pd.DataFrame) -> pd.DataFrame:
    """The LR-scheduling paper's training claims (Figures 3–4), each checked per ε.

    Claims (A − B compared by ``compare`` on the seeds' test accuracies, in points):

    1. exponential decay improves DP-SGD over a constant rate (Fig. 3a);
    2. every mechanism gains from exponential decay over a constant rate (Fig. 3b; the constant
       baseline of BISR w/ LRS is BISR);
    3. BISR w/ LRS improves on BISR with exponential decay (Fig. 3b);
    4. every decay but polynomial (γ = 2) improves DP-SGD; polynomial makes it worse (Fig. 4);
    5. every decay improves BISR (Fig. 4);
    6. BISR w/ LRS improves on BISR for every decay, most for linear (Fig. 4).

    Returns:
        One row per (claim, ε, comparison): ``claim``, ``epsilon``, ``comparison``, ``a``, ``b``
        (mean ± sd), ``diff``, ``se``, ``expected`` (``higher``/``lower``), ``measured``
        (``compare``'s verdict) and ``holds`` (``yes``, ``no`` — the opposite significant — or
        ``not resolved``).
    """
    rows = []

    def get(eps, sched, mech):
        if mech == "BISR w/ LRS" and sched == "constant":
            mech = "BISR"
        sub = summary[
            (summary.epsilon_target == eps) & (summary.schedule == sched) & (summary.mechanism == mech)
        ]
        return None if sub.empty else sub.iloc[0]

    def add(claim, eps, a_key, b_key, expected):
        a, b = get(eps, *a_key), get(eps, *b_key)
        if a is None or b is None:
            return
        c = compare(100 * np.asarray(a.test), 100 * np.asarray(b.test))
        holds = (
            "yes"
            if c["verdict"] == expected
            else ("not resolved" if c["verdict"] == "within noise" else "no")
        )

        def label(key):
            return f"{'BISR' if key == ('constant', 'BISR w/ LRS') else key[1]} {key[0]}"

        rows.append(
            dict(
                claim=claim,
                epsilon=eps,
                comparison=f"{label(a_key)} − {label(b_key)}",
                a=f"{a['mean']:.1f} ± {a['sd']:.1f}",
                b=f"{b['mean']:.1f} ± {b['sd']:.1f}",
                diff=c["diff"],
                se=c["se"],
                expected=expected,
                measured=c["verdict"],
                holds=holds,
            )
        )

    decays = [s for s in SCHEDULES if s != "constant" and s in set(summary.schedule)]
    for eps in summary.epsilon_target.unique():
        add(1, eps, ("exponential", "DP-SGD"), ("constant", "DP-SGD"), "higher")
        for mech in MECHANISMS:
            add(2, eps, ("exponential", mech), ("constant", mech), "higher")
        add(3, eps, ("exponential", "BISR w/ LRS"), ("exponential", "BISR"), "higher")
        for s in decays:
            add(4, eps, (s, "DP-SGD"), ("constant", "DP-SGD"), "lower" if s == "polynomial" else "higher")
            add(5, eps, (s, "BISR"), ("constant", "BISR"), "higher")
            add(6, eps, (s, "BISR w/ LRS"), (s, "BISR"), "higher")
    return pd.DataFrame(rows)


def largest_lrs_gain(summary: pd.DataFrame, eps) -> tuple[str, float] | None:
    """The decay with the largest mean gain of BISR w/ LRS over BISR at ``eps`` (claim 6's
    "most for linear"), and that gain in points."""
    s = summary[summary.epsilon_target == eps].pivot(index="schedule", columns="mechanism", values="mean")
    if "BISR w/ LRS" not in s or "BISR" not in s:
        return None
    g = (s["BISR w/ LRS"] - s["BISR"]).dropna()
    return (str(g.idxmax()), float(g.max())) if len(g) else None


CLAIM_TEXT = {
    1: "Exponential decay improves DP-SGD over a constant learning rate (Fig. 3a)",
    2: "Every mechanism benefits substantially from exponential decay (Fig. 3b)",
    3: "BISR w/ LRS improves further on BISR with exponential decay (Fig. 3b)",
    4: "Every decay except polynomial (γ = 2) improves DP-SGD; polynomial deteriorates it (Fig. 4)",
    5: "Every decay substantially improves BISR (Fig. 4)",
    6: "BISR w/ LRS improves on BISR for every decay, the most for linear (Fig. 4)",
}


def lr_scheduling_conclusions(summary: pd.DataFrame, claims: pd.DataFrame) -> list[str]:
    """One Markdown bullet per claim and ε: how many of its comparisons hold, fail or are not
    resolved, with the numbers; and the edges of the learning-rate grid that were chosen."""
    lines = []
    for claim, text in CLAIM_TEXT.items():
        for eps, sub in claims[claims.claim == claim].groupby("epsilon", sort=False):
            n_yes, n_no = int((sub.holds == "yes").sum()), int((sub.holds == "no").sum())
            if n_yes == len(sub):
                status = "holds"
            elif n_no == len(sub):
                status = "contradicted"
            elif n_yes and n_no:
                status = "holds in part, contradicted in part"
            elif n_yes:
                status = "holds in part (the rest not resolved)"
            elif n_no:
                status = "contradicted in part (the rest not resolved)"
            else:
                status = "not resolved"
            detail = "; ".join(
                f"{r.comparison}: {r.diff:+.1f} ± {r.se:.1f} ({r.holds})" for r in sub.itertuples()
            )
            extra = ""
            if claim == 6:
                best = largest_lrs_gain(summary, eps)
                if best is not None:
                    extra = f" Largest gain of BISR w/ LRS over BISR: {best[0]} ({best[1]:+.1f} points)" + (
                        ", as the paper reports."
                        if best[0] == "linear"
                        else ", not linear as the paper reports."
                    )
            lines.append(
                f"* **Claim {claim}, ε = {eps:g}: {status}.** {text}. {detail} "
                f"(points, ± one standard error).{extra}"
            )
    edge = summary[summary.lr_at_edge]
    if len(edge):
        lines.append(
            "* The chosen learning rate is at the edge of the grid for "
            + ", ".join(
                f"{r.mechanism} {r.schedule} ε = {r.epsilon_target:g} (η = {r.lr:g})"
                for r in edge.itertuples()
            )
            + ": a wider grid might change these numbers."
        )
    return lines


# ---------------------------------------------------------------------------- command line


def _list(kind):
    def parse(text):
        try:
            values = [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: must be {kind.__name__}s separated by commas"
            ) from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: every value must be > 0")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experiment", required=True, choices=EXPERIMENTS)
    p.add_argument("--dataset", default="fashion-mnist", choices=("fashion-mnist", "cifar10", "digits"))
    p.add_argument("--data-dir", default=None, help="the data set's folder (never downloaded)")
    p.add_argument(
        "--train-size", type=int, default=None, help="examples trained on (default: all not held out)"
    )
    p.add_argument(
        "--val-size",
        type=int,
        default=None,
        help="held out for validation (default 5000 for lr_scheduling, 0 otherwise)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="cnn, cnn3, mlp or wrn16-4 (default mlp)",
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    p.add_argument(
        "--epsilon", type=_list(float), default=None, help="target ε, comma-separated (default 9,2 / 3)"
    )
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=256, help="lr_scheduling: the batch size")
    p.add_argument(
        "--batch-sizes",
        type=_list(int),
        default=[128, 512, 2048, 8192],
        help="phase_transition: the batch sizes",
    )
    p.add_argument(
        "--lrs", type=_list(float), default=[1.0, 2.0, 4.0, 8.0], help="lr_scheduling: base learning rates"
    )
    p.add_argument(
        "--sgd-lrs",
        type=_list(float),
        default=list(DEFAULT_LRS["dp-sgd"]),
        help="phase_transition: DP-SGD's base learning rates",
    )
    p.add_argument(
        "--muon-lrs",
        type=_list(float),
        default=list(DEFAULT_LRS["dp-muon"]),
        help="phase_transition: DP-Muon's base learning rates",
    )
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--beta", type=float, default=0.1, help="final learning-rate factor of the decays")
    p.add_argument("--bands", type=int, default=16)
    p.add_argument("--matrix-scheme", default="fixed_order", choices=("fixed_order", "balls_in_bins"))
    p.add_argument("--spectrum-examples", type=int, default=4096)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--workers", type=int, default=1, help="runs at once (CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run")
    p.add_argument("--out", required=True)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_int("epochs", args.epochs, minimum=1)
        check_int("seeds", args.seeds, minimum=1)
        check_int("workers", args.workers, minimum=1)
        if args.threads is not None:
            check_int("threads", args.threads, minimum=1)
        check_int("spectrum_examples", args.spectrum_examples, minimum=1)
        schedules = [check_choice("schedule", s, SCHEDULES) for s in args.schedules.split(",")]
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' is invalid here: no CUDA device is visible; use --device cpu")
        lr_exp = args.experiment == "lr_scheduling"
        val = args.val_size if args.val_size is not None else (300 if args.dataset == "digits" else 5000)
        split = Split(args.dataset, args.data_dir, args.train_size, val)
        load_split(split)  # a missing or bad data folder fails here, before any training
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    seeds = list(range(args.seeds))
    if lr_exp:
        eps = args.epsilon or [9.0, 2.0]
        rows = lr_scheduling(
            split,
            schedules=schedules,
            lrs=args.lrs,
            seeds=seeds,
            epsilons=eps,
            epochs=args.epochs,
            batch_size=args.batch_size,
            beta=args.beta,
            bands=args.bands,
            matrix_scheme=args.matrix_scheme,
            model=args.model or "mlp",
            delta=args.delta,
            clip_norm=args.clip_norm,
            device=args.device,
            workers=args.workers,
            threads=args.threads,
        )
        summary = summarize_lr_scheduling(rows, args.lrs)
        claims = lr_scheduling_claims(summary)
        pd.DataFrame(rows).to_csv(os.path.join(args.out, "runs.csv"), index=False)
        summary.drop(columns="test").to_csv(os.path.join(args.out, "summary.csv"), index=False)
        claims.to_csv(os.path.join(args.out, "claims.csv"), index=False)
        lines = lr_scheduling_conclusions(summary, claims)
    else:
        eps = (args.epsilon or [3.0])[0]
        rows = phase_transition(
            split,
            batch_sizes=args.batch_sizes,
            seeds=seeds,
            epochs=args.epochs,
            epsilon=eps,
            delta=args.delta,
            clip_norm=args.clip_norm,
            model=args.model or "mlp",
            lrs={"dp-sgd": args.sgd_lrs, "dp-muon": args.muon_lrs},
            spectrum_examples=args.spectrum_examples,
            device=args.device,
            workers=args.workers,
            threads=args.threads,
        )
        summary = summarize_phase_transition(rows, clip_norm=args.clip_norm)
        summary["runs"].to_csv(os.path.join(args.out, "runs.csv"), index=False)
        summary["accuracy"].merge(summary["gain"], on="batch_size", how="left").to_csv(
            os.path.join(args.out, "summary.csv"), index=False
        )
        summary["spectra"].to_csv(os.path.join(args.out, "spectra.csv"), index=False)
        lines = phase_transition_conclusions(summary, dataset_size=len(load_split(split)[0]))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "conclusions.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
