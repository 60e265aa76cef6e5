"""A training run from a ``TrainConfig``: data → model → strategy → accounting → sampler →
noise → optimizer → loop, with the run's (ε, δ) computed before the first step.

Order of work, so that bad input fails before anything expensive: the config is validated
when built; then the data set is located, the step count n = epochs·⌈N/B⌉ fixed, the
learning-rate schedule χ and its workload A_χ built, the strategy factorized, and the privacy
accounted (σ calibrated for a target ε, or ε computed for a given σ). Only then are the model,
sampler, noise stream and optimizer created and the loop started.

Files in ``out_dir``: ``results.json`` (config, privacy, final metrics; written at the start
and at the end), ``metrics.csv``, ``curves.png`` and ``checkpoint.pt`` (every epoch), all
written atomically; ``checkpoint.pt`` (and a distributed run's shards) are 0600, the others
follow the umask. A folder holding an earlier run's outputs is refused unless the run is
resumed from its checkpoint (``resume=True``) or replaced (``overwrite=True``); ``resume=True``
without a checkpoint is refused (it would start a new run and spend the privacy budget again).
Every stop (exception, Ctrl-C, SIGTERM through the CLI, a failed write) leaves ``results.json``
saying how the run ended and agreeing with the last checkpoint written.

Privacy note: the noise is a deterministic function of the run's key (that is what makes a run
resumable). By default (``seed=None``) the key is 256 bits drawn from the operating system's
entropy (``dpmf.seeds``) and written only to the checkpoint (needed to resume; a resumed run
adopts it), never to ``results.json`` (``seed: null``) or the export (``model.pt`` and
``privacy.json``); the checkpoint holds the run's secrets (key, noise buffers, sampler state)
and must not be published. A given seed is the key: the run is reproducible and its noise
predictable to whoever knows the seed (the run prints ``dpmf.seeds.NOTICE``).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpmf import seeds
from dpmf._io import WriteError, atomic_write_json
from dpmf.accountants.events import PoissonGaussianEvent
from dpmf.accountants.registry import accountants_for
from dpmf.optim import (
    Disk,
    LearningRateSchedule,
    Transform,
    make_filter,
    matrix_shape,
    route_parameters,
)
from dpmf.optim.clipping import trainable_parameters
from dpmf.optim.optimizers import make_optimizer
from dpmf.optim.registry import get_optimizer
from dpmf.plan.plan import PrivatePlan, leading_block
from dpmf.plan.schemes import Poisson
from dpmf.train.checkpoint import load_checkpoint
from dpmf.train.config import TrainConfig
from dpmf.train.data import Dataset, load_dataset
from dpmf.train.ledger import LEDGER_FILE, MODEL_FILE, export, privacy_ledger
from dpmf.train.loop import (
    CHECKPOINT,
    CURVES,
    METRICS,
    Trainer,
    TrainOutcome,
    check_resumable,
    data_digest,
    saved_seed,
)
from dpmf.train.metrics import STEPS, TENSORBOARD, write_metrics_csv
from dpmf.train.models import build_model
from dpmf.train.samplers import steps_per_epoch
from dpmf.train.shards import merge_shards, remove_shards
from dpmf.workloads import Schedule

__all__ = [
    "RESULTS",
    "check_out_state",
    "TrainResult",
    "train",
    "build_optimizer",
    "build_filter",
    "resolve_device",
    "leading_block",
    "plan_for",
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


_PURPOSES = ("model", "sampler", "noise", "probes")


def sub_seed(seed: int, purpose: int) -> int:
    """A 63-bit seed for one purpose (0 model, 1 sampler, 2 noise, 3 probes) derived from the
    run's key by ``dpmf.seeds.derive_int`` (for ``torch.manual_seed``-style consumers: the
    model's initial weights, DP-MuonBC's public probes; the sampler and the noise derive their
    own 128-bit subkeys from the key itself)."""
    return seeds.derive_int(int(seed), _PURPOSES[purpose], bits=63)


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


def build_filter(config: TrainConfig) -> Transform | None:
    """The temporal filter stage of ``config`` (``dpmf.optim.filters``), or None."""
    return make_filter(
        config.filter,
        a=config.doppler_a,
        b=config.doppler_b,
        kappa=config.disk_kappa,
        gamma=config.disk_gamma,
    )


def build_optimizer(
    config: TrainConfig, model: nn.Module, *, log=print, seed: int | None = None
) -> torch.optim.Optimizer:
    """The DP optimizer of ``config`` over the model's trainable parameters.

    The optimizer is the registry's entry ``config.optimizer`` (``dpmf.optim.registry``),
    built by ``dpmf.optim.optimizers.make_optimizer`` with the learning rate ``base_lr``,
    ``weight_decay``, heavy-ball ``momentum`` and the ``filter`` (``build_filter``: run first in
    every group, before the optimizer's own momentum: DOPPLER-SGD, DiSK-Muon, …). A
    Newton–Schulz optimizer (``dp-muon``, ``dp-muon-s``, ``dp-muon-bc``) orthogonalizes the
    matrix parameters (conv kernels as out × in·kh·kw, EMA momentum ``muon_beta``) and updates
    the 1-D ones by DP-SGD with momentum ``momentum`` (``vector_lr``); a parameter of two or
    more dimensions whose matrix view has a single row or column — e.g. a per-channel scale of
    shape (C, 1, 1) — is a vector, not a matrix: it is routed to the 1-D rule, with a notice.
    An optimizer that draws random probes gets the seed ``sub_seed(seed, 3)``.
    """
    spec = get_optimizer(config.optimizer)
    filt = build_filter(config)
    kwargs = dict(lr=config.base_lr, weight_decay=config.weight_decay, momentum=config.momentum, filter=filt)
    if spec.probes:
        master = seed if seed is not None else config.seed
        kwargs["probe_seed"] = sub_seed(0 if master is None else master, 3)
    if not spec.newton_schulz:
        return make_optimizer(spec.name, model.parameters(), **kwargs)
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
    return make_optimizer(spec.name, groups, beta=config.muon_beta, vector_lr=config.vector_lr, **kwargs)


def plan_for(config: TrainConfig, dataset_size: int, *, progress: bool = False, log=print):
    """The run's calibrated ``PrivatePlan`` (and ``config`` with ``factorization="auto"`` resolved).

    The plan binds N, B, n = epochs·⌈N/B⌉, the scheme, the strategy (built on A_χ for the
    scheme's participation) and the schedule; σ is calibrated for ``config.epsilon`` or taken
    from ``config.noise_multiplier`` (its ε accounted), with the config's accountant and Monte
    Carlo settings. Everything the run samples, adds and reports comes from this plan.

    Returns:
        (config, plan): ``plan.noise_multiplier`` and ``plan.privacy`` set.

    Raises:
        ValueError: a strategy the scheme cannot account, or a target no σ meets.
    """
    n = config.epochs * steps_per_epoch(dataset_size, config.batch_size)
    mc = dict(samples=config.samples, seed=_mc_seed(config), progress=progress)
    own = dict(clip_norm=config.clip_norm, seed=config.seed)
    if config.factorization == "auto":  # pick's winner: built and calibrated once, by pick
        config, plan = choose_strategy(config, dataset_size, n, progress=progress, log=log)
        if _same_calibration(plan, config):
            return config, plan.with_settings(**own)
        plan = plan.replace(strategy=plan.strategy, accountant=config.accountant, **own)
        return config, plan.with_accountant(**mc).calibrate(config.epsilon, config.delta)
    plan = PrivatePlan(
        dataset_size,
        config.batch_size,
        steps=n,
        scheme=config.scheme,
        strategy=config.factorization,
        schedule=Schedule(config.schedule, config.beta, config.gamma),
        accountant=config.accountant,
        **own,
    )
    plan = plan.with_accountant(**mc)  # the accountant with the run's Monte Carlo settings
    if config.noise_multiplier is not None:
        privacy = plan.account(config.noise_multiplier, delta=config.delta)
        return config, plan.with_noise(config.noise_multiplier, privacy=privacy)
    return config, plan.calibrate(config.epsilon, config.delta)


def _same_calibration(plan: PrivatePlan, config: TrainConfig) -> bool:
    """True when the σ pick calibrated for ``plan`` is the one ``config``'s calibration gives:
    the same (ε, δ) target and the same deterministic accountant."""
    from dpmf.accountants.registry import get_accountant

    privacy = plan.privacy
    if privacy is None or privacy.delta != config.delta:
        return False
    name = plan.scheme.check_accountant(config.accountant)
    return privacy.accountant == name and not get_accountant(name).randomized


def _mc_seed(config: TrainConfig) -> int:
    """The Monte Carlo accountant's seed: the run's seed when given (reproducible), else 0 (it is
    reported with the result, so never the drawn noise seed)."""
    return 0 if config.seed is None else config.seed


def draw_seed() -> int:
    """A secret key of ``dpmf.seeds.KEY_BITS`` bits from the operating system's entropy."""
    return seeds.draw_key()


def choose_strategy(config: TrainConfig, dataset_size: int, steps: int, *, progress=True, log=print):
    """``config`` with ``factorization="auto"`` resolved by ``dpmf.pick.pick``, and the winner's
    calibrated plan: the recommended factorization and scheme for this run's N, B, n, (ε, δ),
    schedule and ``max_bands`` (ranked by σ·MeanSE). Deterministic: the same config gives the
    same choice (so ``--resume`` finds the same strategy). Logs the five best candidates.

    Returns:
        (config, plan): the plan as pick built and calibrated it (``plan.privacy`` set).

    Raises:
        ValueError: no candidate can be accounted under the requested scheme.
    """
    from dpmf.plan.pick import pick

    res = pick(
        dataset_size=dataset_size,
        batch_size=config.batch_size,
        steps=steps,
        epsilon=config.epsilon,
        delta=config.delta,
        schedule=Schedule(config.schedule, config.beta, config.gamma),
        max_bands=config.max_bands,
        scheme="auto" if config.scheme == Poisson.name else config.scheme,
        accountant=config.accountant if config.accountant in accountants_for(PoissonGaussianEvent) else None,
        samples=config.samples,
        seed=_mc_seed(config),
        progress=progress,
    )
    for i, e in enumerate(res.ranking[:5], 1):
        log(
            f"pick {i}: {e.factorization} ({e.scheme}) σ = {e.noise_multiplier:.4g}, "
            f"σ·MeanSE = {e.noise_mean_se:.4g}, σ·MaxSE = {e.noise_max_se:.4g}"
        )
    rec = res.recommendation
    return config.replace(factorization=rec.factorization, scheme=rec.scheme), rec.plan


def check_out_state(out_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, a run that would lose or silently replace an earlier one in
    ``out_dir``.

    * ``resume`` and ``overwrite`` together contradict each other;
    * ``resume`` needs ``out_dir/checkpoint.pt`` (otherwise a new run would start and spend the
      privacy budget again);
    * without either, ``out_dir`` must not hold a checkpoint, nor a run's released outputs
      (``model.pt``, ``privacy.json``, ``metrics.csv``, or a ``results.json`` other than that of
      a run stopped before its first epoch).

    Raises:
        ValueError: one line naming ``out_dir``, what it holds and the fix.
    """
    checkpoint = os.path.join(out_dir, CHECKPOINT)
    if resume and overwrite:
        raise ValueError(
            "resume=True and overwrite=True (--resume, --overwrite) are invalid together: resume "
            f"continues the run in {out_dir!r}, overwrite replaces it; pass one"
        )
    if overwrite:
        return
    if resume:
        if not os.path.exists(checkpoint):
            raise ValueError(
                f"resume=True (--resume) is invalid: {out_dir!r} holds no {CHECKPOINT} (nothing to resume; "
                "resuming would start a new run and spend the privacy budget again); run without "
                "--resume to start one, or pass the folder of the run to continue"
            )
        return
    if os.path.exists(checkpoint):
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds a checkpoint of an earlier run; pass --resume "
            "to continue it, --overwrite to replace it, or choose another --out"
        )
    found = [
        name for name in (MODEL_FILE, LEDGER_FILE, METRICS) if os.path.exists(os.path.join(out_dir, name))
    ]
    if _results_of_a_run(os.path.join(out_dir, RESULTS)):
        found.insert(0, RESULTS)
    if found:
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds the outputs of an earlier run "
            f"({', '.join(found)}) and no checkpoint to resume; pass --overwrite to replace them "
            "or choose another --out"
        )


def _results_of_a_run(path: str) -> bool:
    """Whether ``results.json`` at ``path`` describes a run with outputs: any file but that of a
    run stopped (interrupted or failed) before its first epoch."""
    if not os.path.exists(path):
        return False
    try:
        import json

        with open(path) as fh:
            res = json.load(fh)
    except (OSError, ValueError):
        return True  # unreadable: not ours to replace silently
    return not (
        isinstance(res, dict)
        and res.get("status") in ("interrupted", "failed")
        and res.get("completed_epochs") == 0
    )


def _clear_run_files(out_dir: str) -> None:
    """Remove an earlier run's files from ``out_dir`` (``overwrite=True``, after validation)."""
    remove_shards(os.path.join(out_dir, CHECKPOINT))
    for name in (CHECKPOINT, MODEL_FILE, LEDGER_FILE, METRICS, CURVES, STEPS, RESULTS):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    board = os.path.join(out_dir, TENSORBOARD)
    if os.path.isdir(board):
        import shutil

        shutil.rmtree(board)


def _stopped(header: dict, exc: BaseException, done: list, checkpoint: str, began: float) -> dict:
    """``header`` updated to say how the run stopped: ``interrupted`` (Ctrl-C, SIGTERM) or
    ``failed`` (with the error's one line), and the last checkpointed epoch and step."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    header.update(
        status="interrupted" if interrupted else "failed",
        error=None if interrupted else f"{type(exc).__name__}: {exc}",
        completed_epochs=len(done),
        checkpoint_step=int(done[-1]["step"]) if done else 0,
        checkpoint=CHECKPOINT if done and os.path.exists(checkpoint) else None,
        wall_seconds=round(time.perf_counter() - began, 2),
    )
    signal_name = getattr(exc, "signal_name", None)
    if signal_name is not None:
        header["signal"] = signal_name
    return header


def _record_stop(out_dir: str, header: dict, exc: BaseException, done: list, checkpoint: str, began) -> None:
    """Write ``results.json`` (and ``metrics.csv``) of a run that stopped, agreeing with the last
    checkpoint written; a write that fails in turn (the disk still full) is left unreported, the
    first error being the one that matters."""
    _stopped(header, exc, done, checkpoint, began)
    try:
        if done:
            write_metrics_csv(os.path.join(out_dir, METRICS), done)
        atomic_write_json(os.path.join(out_dir, RESULTS), _jsonable(header))
    except WriteError:
        pass


def train(
    config: TrainConfig,
    out_dir: str,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    on_epoch_end=(),
    log=print,
    distributed: bool = False,
    data: Dataset | None = None,
) -> TrainResult:
    """Train ``config`` privately, writing results, metrics, curves and checkpoints to ``out_dir``.

    Args:
        config: the run (validated).
        out_dir: output folder (created).
        resume: continue from ``out_dir/checkpoint.pt`` (same config and seed; a secret key is
            adopted from the checkpoint); the final weights equal those of an uninterrupted run.
            Refused without a checkpoint.
        overwrite: replace the files of an earlier run in ``out_dir`` (checkpoint, model,
            privacy ledger, results, metrics); without it (and without ``resume``) a folder
            holding them is refused (``check_out_state``).
        progress: show progress bars.
        on_epoch_end: callables ``f(epoch, row)`` after each epoch's checkpoint.
        log: where to print notices and the summary (``print``; a no-op silences them).
        distributed: run as one of the processes started by ``torchrun`` (``dpmf.distributed``):
            the same global batches and the same noise as one process with
            ``noise_keys="chunked"``, split by ``config.distributed_mode``; only rank 0 prints
            and writes results, metrics and the export; every rank writes its checkpoint shard.
        data: the ``Dataset`` to train on instead of loading ``config.dataset`` (e.g. a subset of
            the training split with a validation split held out as its ``test_x``/``test_y``);
            its ``name`` must be ``config.dataset``. N, and so the accounting, is its size.

    Returns:
        ``TrainResult``.

    Raises:
        ValueError / TypeError: any invalid setting (data folder, batch larger than the data
            set, a strategy the scheme cannot account, ``data`` not a ``Dataset`` of
            ``config.dataset``, ``out_dir`` holding another run, ``resume`` without a
            checkpoint, …), before training starts.
        NonFiniteGradientError, NonFiniteWeightsError: a numerical failure at a named step.
        dpmf._io.WriteError: a file could not be written (disk full, …); ``results.json``
            then says ``failed`` with the last checkpointed epoch (when it can be written).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config={config!r} is invalid: must be a TrainConfig")
    if data is not None and not isinstance(data, Dataset):
        raise TypeError(f"data={type(data).__name__} is invalid: must be a dpmf.train.Dataset or None")
    if data is not None and data.name != config.dataset:
        raise ValueError(
            f"data={data.name!r} is invalid for dataset={config.dataset!r}: pass the data set the "
            "config names"
        )
    collectives = None
    device = resolve_device(config.device)
    if distributed:
        from dpmf.distributed.launch import init_from_env

        collectives, device = init_from_env(device)
        if config.noise_keys != "chunked":
            config = config.replace(noise_keys="chunked")
        if collectives.rank != 0:  # one voice: rank 0 prints and shows progress
            log, progress = (lambda *a, **k: None), False
    checkpoint = os.path.join(out_dir, CHECKPOINT)
    check_out_state(out_dir, resume=resume, overwrite=overwrite)
    saved = load_checkpoint(checkpoint) if resume else None
    if saved is not None:
        saved = merge_shards(saved, checkpoint)  # a distributed checkpoint: all its shards
    if saved is not None:  # a corrupted or foreign checkpoint fails here, before any work
        saved_keys = saved.get("run_identity", {}).get("noise_keys", "stream")
        if saved_keys != config.noise_keys:
            raise ValueError(
                f"checkpoint {checkpoint!r} has noise keyed {saved_keys!r} and this run "
                f"{config.noise_keys!r}: resume it with --noise-keys {saved_keys}"
                + (" (or --distributed)" if saved_keys == "chunked" else "")
            )
        check_resumable(saved, config.run_identity(), checkpoint)
    if config.seed is not None:
        policy = seeds.SeedPolicy.of(config.seed)
        log(policy.notice)
    elif saved is not None:  # resume adopts the checkpoint's secret key
        policy = seeds.SeedPolicy.adopt(saved_seed(checkpoint, saved), given=False)
    else:
        policy = seeds.SeedPolicy.of(None)
    if collectives is not None and policy.is_secret:  # rank 0's secret key, in memory only
        policy = seeds.SeedPolicy.adopt(
            collectives.all_gather_object(policy.key if collectives.rank == 0 else None)[0], given=False
        )
    seed_given, seed = not policy.is_secret, policy.key
    if data is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = load_dataset(config.dataset, config.data_dir)
        for w in caught:
            log(f"notice: {w.message}")
    N = len(data)
    identity = {**config.run_identity(), "data": data_digest(data)}
    if saved is not None:  # the same data as the run being resumed
        check_resumable(saved, identity, checkpoint)
    config, plan = plan_for(config, N, progress=progress, log=log)
    privacy, n, spe = plan.privacy, plan.steps, plan.steps_per_epoch
    chi_schedule = LearningRateSchedule(plan.schedule, n)
    sigma, sens = plan.noise_multiplier, plan.sensitivity
    log(
        f"privacy: ε = {privacy.epsilon:.4g} at δ = {privacy.delta:g} ({privacy.guarantee}, "
        f"{privacy.accountant}), σ = {sigma:.4g}, sens = {sens:.4g}, scheme {privacy.scheme}, "
        f"strategy {plan.label}, {n} steps ({config.epochs} epochs × {spe}), "
        f"N = {N} ({data.name}), B = {config.batch_size}"
    )

    model = build_model(config.model, data.input_shape, data.num_classes, seed=sub_seed(seed, 0))
    model = model.to(device)
    optimizer = build_optimizer(config, model, log=log, seed=seed)
    step = plan.private_step(
        model,
        F.cross_entropy,
        seed=policy,
        process_group=collectives,
        optimizer=optimizer,
        flags=config.execution_flags(),
    )
    sampler, privatizer, noise = step.sampler, step.privatizer, step.noise
    privatizer.bind(optimizer)
    # DiSK's prediction: per-example gradients at θ_t and θ_t + γ(θ_t − θ_{t−1}), combined
    # before clipping (one release per step at the same sensitivity: ε is unchanged).
    filt = build_filter(config)
    lookahead = filt.lookahead() if isinstance(filt, Disk) else None

    def epsilon_at(t: int) -> float:
        return float(
            plan.epsilon_after(t, samples=config.samples, seed=_mc_seed(config), progress=False).epsilon
        )

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
            "keys": config.noise_keys,
            "state_numel": (  # the whole run's, whatever the split between ranks
                noise.documented_state_numel
                if collectives is None
                else sum(collectives.all_gather_object(noise.documented_state_numel))
            ),
            "noise_std_on_sum": privatizer.noise_std,
        },
        "processes": (
            {"world_size": 1}
            if collectives is None
            else {
                "world_size": collectives.world_size,
                "mode": config.distributed_mode,
                "backend": collectives.backend,
                "noise_state_numel_per_rank": collectives.all_gather_object(noise.state_numel()),
            }
        ),
        "privacy": privacy.to_dict(),
        "seed_given": seed_given,
        "plan": plan.to_dict(),
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
        run_identity=identity,
        secrets={"seed": seed},
        epsilon_at=epsilon_at if config.per_epoch_epsilon else None,
        final_epsilon=privacy.epsilon,
        delta=config.delta,
        eval_batch_size=config.eval_batch_size,
        progress=progress,
        title=f"{config.optimizer}, {plan.label}, {data.name}",
        lookahead=lookahead,
        log_every=config.log_every,
        collectives=collectives,
    )
    writer = collectives is None or collectives.rank == 0
    if overwrite and writer:
        _clear_run_files(out_dir)
    if collectives is not None:
        collectives.barrier()  # every rank has seen whether a checkpoint exists
    if not os.path.exists(checkpoint) and writer:
        atomic_write_json(os.path.join(out_dir, RESULTS), _jsonable(header))
    began = time.perf_counter()
    try:
        outcome: TrainOutcome = trainer.run(resume=resume, on_epoch_end=on_epoch_end)
    except BaseException as exc:  # every stop leaves results.json saying how the run ended
        if writer:
            _record_stop(out_dir, header, exc, trainer.outcome.metrics, checkpoint, began)
        raise
    last = outcome.metrics[-1]
    header.update(
        status="complete",
        final=last,
        wall_seconds=round(time.perf_counter() - began, 2),
        empty_batches=outcome.empty_batches,
        resumed_from_epoch=outcome.resumed_from_epoch,
    )
    ledger = privacy_ledger(
        plan, privacy, steps_taken=outcome.steps, clip_norm=config.clip_norm, seed_given=seed_given
    )
    if writer:
        try:
            export(out_dir, model, ledger)
            atomic_write_json(os.path.join(out_dir, RESULTS), _jsonable(header))
        except BaseException as exc:  # the export failed (disk full, a stop): not "complete"
            header.pop("final", None)
            _record_stop(out_dir, header, exc, outcome.metrics, checkpoint, began)
            raise
    log(
        f"test accuracy {100 * float(last['test_accuracy']):.2f} %, "
        f"test loss {float(last['test_loss']):.4f}, "
        f"ε = {privacy.epsilon:.4g} (δ = {privacy.delta:g}); wrote {out_dir}/{{{RESULTS}, metrics.csv, "
        "curves.png, checkpoint.pt, model.pt, privacy.json}"
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
