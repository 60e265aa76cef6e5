"""A training run from a ``TrainConfig``: data → model → strategy → accounting → sampler →
noise → optimizer → loop, with the run's (ε, δ) computed before the first step.

Order of work, so that bad input fails before anything expensive: the config is validated
when built; then the data set is located, the step count n = epochs·⌈N/B⌉ fixed, the
learning-rate schedule χ and its workload A_χ built, the strategy factorized, and the privacy
accounted (σ calibrated for a target ε, or ε computed for a given σ). Only then are the model,
sampler, noise stream and optimizer created and the loop started.

Files in ``out_dir``: ``results.json`` (config, privacy, final metrics; written at the start
and at the end), ``metrics.csv``, ``curves.png`` and ``checkpoint.pt`` (every epoch), all
written atomically.

Privacy note: the noise is a deterministic function of ``seed`` (that is what makes a run
reproducible and resumable). A published model keeps its guarantee only if the seed stays
secret: do not publish ``results.json`` or the checkpoint with the model, or train the released
model with a seed drawn from a secure source.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpmf._io import atomic_write_json
from dpmf.accountants import account, calibrate
from dpmf.accountants.schemes import build_event, check_run, strategy_bandwidth
from dpmf.mechanisms import DenseLowerTriangular, Factorization, ScaledToeplitz
from dpmf.optim import (
    DPSGD,
    Disk,
    DPAdam,
    DPMuon,
    DPMuonBC,
    DPMuonS,
    LearningRateSchedule,
    Transform,
    make_filter,
    matrix_shape,
    route_parameters,
)
from dpmf.optim.clipping import trainable_parameters
from dpmf.optim.noise import noise_for_factorization
from dpmf.optim.privatize import Privatizer
from dpmf.pick import build_strategy
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset
from dpmf.train.loop import CHECKPOINT, Trainer, TrainOutcome
from dpmf.train.models import build_model
from dpmf.train.samplers import make_sampler, steps_per_epoch
from dpmf.workloads import Schedule, Workload

__all__ = [
    "RESULTS",
    "TrainResult",
    "train",
    "build_optimizer",
    "build_filter",
    "resolve_device",
    "leading_block",
    "epsilon_after",
    "sub_seed",
]

RESULTS = "results.json"


@dataclass(frozen=True)
class TrainResult:
    """The outcome of ``train``.

    Attributes:
        config: the run's configuration.
        privacy: the accountant's ``PrivacyResult`` for the whole run (computed before training).
        metrics: one dict per epoch (test loss/accuracy, ε, …).
        steps: steps taken (all counted by the accountant, empty batches included).
        empty_batches: steps without any example.
        out_dir: where the files are.
        model: the trained model.
    """

    config: TrainConfig
    privacy: object
    metrics: list
    steps: int
    empty_batches: int
    out_dir: str
    model: nn.Module

    @property
    def test_accuracy(self) -> float:
        return float(self.metrics[-1]["test_accuracy"])


def sub_seed(seed: int, purpose: int) -> int:
    """An independent 31-bit seed for one purpose (0 model, 1 sampler, 2 noise, 3 probes)."""
    return int(np.random.SeedSequence([int(seed), int(purpose)]).generate_state(1)[0] & 0x7FFFFFFF)


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU.

    Raises:
        ValueError: ``cuda`` requested but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid: CUDA is not available here (use cpu or auto)")
    return torch.device(name)


def leading_block(factorization: Factorization, steps: int) -> Factorization:
    """The factorization of the first ``steps`` steps: the leading t×t blocks of A and C.

    The first t rows of C·G + Z depend only on the first t gradients through C's leading block
    (C is lower-triangular), so the privacy spent after t steps is that of this factorization.

    Raises:
        ValueError: steps outside [1, n].
    """
    n = factorization.n
    if not 1 <= steps <= n:
        raise ValueError(f"steps={steps} is invalid: must be in [1, {n}]")
    if steps == n:
        return factorization
    w = factorization.workload
    scale = None if w.column_scale is None else np.asarray(w.column_scale)[:steps]
    workload = Workload(np.asarray(w.coeffs)[:steps], scale, name=w.name)
    C = factorization.C
    if isinstance(C, ScaledToeplitz):
        cut = lambda v: None if v is None else v[:steps]  # noqa: E731
        C_t = ScaledToeplitz(C.coeffs[:steps], cut(C.row_scale), cut(C.col_scale))
    else:
        C_t = DenseLowerTriangular(C.dense()[:steps, :steps])
    return Factorization(factorization.name, factorization.bands, workload, C_t)


def build_filter(config: TrainConfig) -> Transform | None:
    """The temporal filter stage of ``config`` (``dpmf.optim.filters``), or None."""
    return make_filter(
        config.filter,
        a=config.doppler_a,
        b=config.doppler_b,
        kappa=config.disk_kappa,
        gamma=config.disk_gamma,
    )


def build_optimizer(config: TrainConfig, model: nn.Module, *, log=print) -> torch.optim.Optimizer:
    """The DP optimizer of ``config`` over the model's trainable parameters.

    ``dp-sgd``: heavy-ball momentum ``momentum``; ``dp-adam``: Adam; ``dp-muon`` / ``dp-muon-s`` /
    ``dp-muon-bc``: Newton–Schulz for the matrix parameters (conv kernels as out × in·kh·kw,
    EMA momentum ``muon_beta``), DP-SGD with momentum ``momentum`` for the 1-D ones. A
    parameter of two or more dimensions whose matrix view has a single row or column — e.g. a
    per-channel scale of shape (C, 1, 1) — is a vector, not a matrix: it is routed to the
    1-D rule, with a notice. The ``filter`` (``build_filter``) runs first in every group, before
    the optimizer's own momentum (DOPPLER-SGD, DiSK-Muon, …).
    """
    filt = build_filter(config)
    if config.optimizer == "dp-sgd":
        return DPSGD(
            model.parameters(),
            lr=config.base_lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            filter=filt,
        )
    if config.optimizer == "dp-adam":
        return DPAdam(model.parameters(), lr=config.base_lr, weight_decay=config.weight_decay, filter=filt)
    vectors = {}
    for name, p in trainable_parameters(model):
        if p.ndim >= 2 and 1 in matrix_shape(tuple(p.shape)):
            vectors[name] = "sgd"
    if vectors:
        log(
            f"note: {', '.join(f'{k} {tuple(dict(model.named_parameters())[k].shape)}' for k in vectors)} "
            "has a degenerate matrix view (a per-channel vector): updated by the 1-D rule (DP-SGD "
            "with momentum), not Newton–Schulz"
        )
    groups = route_parameters(model, rules=vectors or None)
    cls = {"dp-muon": DPMuon, "dp-muon-s": DPMuonS, "dp-muon-bc": DPMuonBC}[config.optimizer]
    kwargs = dict(
        lr=config.base_lr,
        beta=config.muon_beta,
        vector_momentum=config.momentum,
        weight_decay=config.weight_decay,
        vector_lr=config.vector_lr,
        filter=filt,
    )
    if config.optimizer == "dp-muon-bc":
        kwargs["probe_seed"] = sub_seed(config.seed, 3)
    return cls(groups, **kwargs)


def _account(
    config: TrainConfig,
    factorization,
    dataset_size: int,
    steps: int,
    *,
    progress: bool,
    noise_multiplier: float | None = None,
    accountant: str | None = None,
    min_sep: int | None = None,
):
    common = dict(
        dataset_size=dataset_size,
        batch_size=config.batch_size,
        steps=steps,
        delta=config.delta,
        factorization=factorization,
        accountant=accountant or config.accountant,
        samples=config.samples,
        seed=config.seed,
        progress=progress,
        min_sep=min_sep,
    )
    sigma = noise_multiplier if noise_multiplier is not None else config.noise_multiplier
    if sigma is not None:
        return account(config.scheme, noise_multiplier=sigma, **common)
    return calibrate(config.scheme, epsilon=config.epsilon, **common)


def epsilon_after(
    config: TrainConfig, factorization, privacy, dataset_size: int, steps: int, *, min_sep: int | None = None
) -> float:
    """ε spent after the first ``steps`` steps of a run whose whole-run accounting is ``privacy``.

    The first t rows of C·G + Z are the release of the leading block C_t (``leading_block``)
    with the noise the run actually adds, std σ·ζ·s_n (s_n = ``privacy.sensitivity``). The
    accountant measures a run whose noise is σ'·ζ·s_t with s_t its own normalization for C_t
    (s_t ≤ s_n), so it is called with σ' = σ·s_n/s_t.
    """
    if steps == factorization.n:
        return float(privacy.epsilon)
    block = leading_block(factorization, steps)
    run = check_run(config.scheme, dataset_size, config.batch_size, steps, block, min_sep)
    s_t = build_event(run, 1.0)[1]["sensitivity"]
    sigma = privacy.noise_multiplier * privacy.sensitivity / s_t
    return float(
        _account(
            config,
            block,
            dataset_size,
            steps,
            progress=False,
            noise_multiplier=sigma,
            accountant=privacy.accountant,
            min_sep=min_sep,
        ).epsilon
    )


def choose_strategy(config: TrainConfig, dataset_size: int, steps: int, *, progress=True, log=print):
    """``config`` with ``factorization="auto"`` resolved by ``dpmf.pick.pick``: the
    recommended factorization and scheme for this run's N, B, n, (ε, δ), schedule and
    ``max_bands`` (ranked by σ·MeanSE). Deterministic: the same config gives the same choice
    (so ``--resume`` finds the same strategy). Logs the five best candidates.

    Raises:
        ValueError: no candidate can be accounted under the requested scheme.
    """
    from dpmf.pick import pick

    res = pick(
        dataset_size=dataset_size,
        batch_size=config.batch_size,
        steps=steps,
        epsilon=config.epsilon,
        delta=config.delta,
        schedule=Schedule(config.schedule, config.beta, config.gamma),
        max_bands=config.max_bands,
        scheme="auto" if config.scheme == "poisson" else config.scheme,
        accountant=config.accountant if config.accountant in ("pld", "rdp", "prv") else None,
        samples=config.samples,
        seed=config.seed,
        progress=progress,
    )
    for i, e in enumerate(res.ranking[:5], 1):
        log(
            f"pick {i}: {e.factorization} ({e.scheme}) σ = {e.noise_multiplier:.4g}, "
            f"σ·MeanSE = {e.noise_mean_se:.4g}, σ·MaxSE = {e.noise_max_se:.4g}"
        )
    rec = res.recommendation
    return config.replace(factorization=rec.factorization, scheme=rec.scheme)


def train(
    config: TrainConfig,
    out_dir: str,
    *,
    resume: bool = False,
    progress: bool = True,
    on_epoch_end=(),
    log=print,
) -> TrainResult:
    """Train ``config`` privately, writing results, metrics, curves and checkpoints to ``out_dir``.

    Args:
        config: the run (validated).
        out_dir: output folder (created).
        resume: continue from ``out_dir/checkpoint.pt`` (same config and seed); the final
            weights equal those of an uninterrupted run.
        progress: show progress bars.
        on_epoch_end: callables ``f(epoch, row)`` after each epoch's checkpoint.
        log: where to print notices and the summary (``print``; a no-op silences them).

    Returns:
        ``TrainResult``.

    Raises:
        ValueError / TypeError: any invalid setting (data folder, batch larger than the data
            set, a strategy the scheme cannot account, …), before training starts.
        NonFiniteGradientError, NonFiniteWeightsError: a numerical failure at a named step.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config={config!r} is invalid: must be a TrainConfig")
    checkpoint = os.path.join(out_dir, CHECKPOINT)
    if os.path.exists(checkpoint) and not resume:
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds a checkpoint of an earlier run; pass --resume "
            "to continue it or choose another --out"
        )
    device = resolve_device(config.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_dataset(config.dataset, config.data_dir)
    for w in caught:
        log(f"notice: {w.message}")
    N = len(data)
    spe = steps_per_epoch(N, config.batch_size)
    n = config.epochs * spe
    chi_schedule = LearningRateSchedule(Schedule(config.schedule, config.beta, config.gamma), n)
    if config.factorization == "auto":
        config = choose_strategy(config, N, n, progress=progress, log=log)
    factorization = build_strategy(chi_schedule.workload(), config.factorization, config.scheme, spe)
    groups = strategy_bandwidth(factorization.C) if config.scheme == "cyclic_poisson" else None
    privacy = _account(config, factorization, N, n, progress=progress, min_sep=groups)
    sigma, sens = privacy.noise_multiplier, privacy.sensitivity
    log(
        f"privacy: ε = {privacy.epsilon:.4g} at δ = {privacy.delta:g} ({privacy.guarantee}, "
        f"{privacy.accountant}), σ = {sigma:.4g}, sens = {sens:.4g}, scheme {privacy.scheme}, "
        f"strategy {factorization.label}, {n} steps ({config.epochs} epochs × {spe}), "
        f"N = {N} ({data.name}), B = {config.batch_size}"
    )

    model = build_model(config.model, data.input_shape, data.num_classes, seed=sub_seed(config.seed, 0))
    model = model.to(device)
    dtype = next(model.parameters()).dtype
    dim = sum(p.numel() for _, p in trainable_parameters(model))
    noise = noise_for_factorization(
        factorization, dim, seed=sub_seed(config.seed, 2), device=device, dtype=dtype
    )
    sampler = make_sampler(
        config.scheme, N, config.batch_size, n, seed=sub_seed(config.seed, 1), groups=groups
    )
    privatizer = Privatizer(
        model,
        F.cross_entropy,
        clip_norm=config.clip_norm,
        noise_multiplier=sigma,
        sensitivity=sens,
        expected_batch_size=sampler.expected_batch_size,
        noise=noise,
        micro_batch_size=config.micro_batch_size,
        clipping=config.clipping,
    )
    optimizer = build_optimizer(config, model, log=log)
    # DiSK's prediction: per-example gradients at θ_t and θ_t + γ(θ_t − θ_{t−1}), combined
    # before clipping (one release per step at the same sensitivity: ε is unchanged).
    filt = build_filter(config)
    lookahead = filt.lookahead() if isinstance(filt, Disk) else None

    def epsilon_at(t: int) -> float:
        return epsilon_after(config, factorization, privacy, N, t, min_sep=groups)

    os.makedirs(out_dir, exist_ok=True)
    header = {
        "status": "running",
        "config": config.to_dict(),
        "dataset": {"name": data.name, "source": data.source, "train": N, "test": int(data.test_x.shape[0])},
        "device": str(device),
        "steps": n,
        "steps_per_epoch": spe,
        "expected_batch_size": sampler.expected_batch_size,
        "noise": {
            "generator": type(noise).__name__,
            "state_numel": noise.documented_state_numel,
            "noise_std_on_sum": privatizer.noise_std,
        },
        "privacy": privacy.to_dict(),
    }
    trainer = Trainer(
        model=model,
        data=data,
        sampler=sampler,
        privatizer=privatizer,
        optimizer=optimizer,
        lr_multipliers=chi_schedule.multipliers,
        epochs=config.epochs,
        out_dir=out_dir,
        device=device,
        run_identity=config.run_identity(),
        epsilon_at=epsilon_at if config.per_epoch_epsilon else None,
        final_epsilon=privacy.epsilon,
        delta=config.delta,
        eval_batch_size=config.eval_batch_size,
        progress=progress,
        title=f"{config.optimizer}, {factorization.label}, {data.name}",
        lookahead=lookahead,
    )
    if not os.path.exists(checkpoint):
        atomic_write_json(os.path.join(out_dir, RESULTS), _jsonable(header))
    began = time.perf_counter()
    outcome: TrainOutcome = trainer.run(resume=resume, on_epoch_end=on_epoch_end)
    last = outcome.metrics[-1]
    header.update(
        status="complete",
        final=last,
        wall_seconds=round(time.perf_counter() - began, 2),
        empty_batches=outcome.empty_batches,
        resumed_from_epoch=outcome.resumed_from_epoch,
    )
    atomic_write_json(os.path.join(out_dir, RESULTS), _jsonable(header))
    log(
        f"test accuracy {100 * float(last['test_accuracy']):.2f} %, "
        f"test loss {float(last['test_loss']):.4f}, "
        f"ε = {privacy.epsilon:.4g} (δ = {privacy.delta:g}); wrote {out_dir}/{{{RESULTS}, metrics.csv, "
        "curves.png, checkpoint.pt}"
    )
    return TrainResult(config, privacy, outcome.metrics, outcome.steps, outcome.empty_batches, out_dir, model)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj
