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

import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpmf import seeds
from dpmf.optim import Disk, LearningRateSchedule
from dpmf.plan.plan import leading_block
from dpmf.step import build as build_step
from dpmf.train.build import build_filter, build_optimizer, draw_seed, resolve_device, sub_seed
from dpmf.train.config import TrainConfig
from dpmf.train.data import Dataset, load_dataset
from dpmf.train.ledger import export, privacy_ledger
from dpmf.train.loop import CHECKPOINT, Trainer, TrainOutcome
from dpmf.train.models import build_model, fully_shard_model, whole_state
from dpmf.train.outputs import RESULTS, check_out_state, clear_run_files, record_stop, write_results
from dpmf.train.planning import mc_seed, plan_for
from dpmf.train.state import check_run_state, data_digest, read_run_state, resumed_key

__all__ = [
    "RESULTS",
    "check_out_state",
    "TrainResult",
    "train",
    # re-exported from their modules (dpmf.train.build, dpmf.train.planning, dpmf.plan.plan)
    "build_optimizer",
    "build_filter",
    "draw_seed",
    "resolve_device",
    "leading_block",
    "plan_for",
    "sub_seed",
]


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


@dataclass
class _Run:
    """What the phases of ``train`` hand on to each other."""

    config: TrainConfig
    out_dir: str
    device: torch.device
    collectives: object = None
    log: object = print
    progress: bool = True
    saved: dict | None = None
    policy: seeds.SeedPolicy | None = None
    data: Dataset | None = None
    plan: object = None
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    step: object = None
    began: float = 0.0

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.out_dir, CHECKPOINT)

    @property
    def where(self) -> str:
        return f"checkpoint {self.checkpoint!r}"

    @property
    def writer(self) -> bool:
        """Whether this process writes the shared files (one process, or rank 0)."""
        return self.collectives is None or self.collectives.rank == 0


def _check_inputs(config, data) -> None:
    """Refuse a config that is not a ``TrainConfig`` and data that are not its data set."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config={config!r} is invalid: must be a TrainConfig")
    if data is not None and not isinstance(data, Dataset):
        raise TypeError(f"data={type(data).__name__} is invalid: must be a dpmf.train.Dataset or None")
    if data is not None and data.name != config.dataset:
        raise ValueError(
            f"data={data.name!r} is invalid for dataset={config.dataset!r}: pass the data set the "
            "config names"
        )


def _processes(config: TrainConfig, out_dir: str, *, distributed: bool, log, progress) -> _Run:
    """The run on this process: its device, and under ``torchrun`` its collectives (noise keys
    ``chunked``; only rank 0 prints and shows progress)."""
    device = resolve_device(config.device)
    if not distributed:
        return _Run(config, out_dir, device, log=log, progress=progress)
    from dpmf.distributed.launch import init_from_env

    collectives, device = init_from_env(device)
    if config.noise_keys != "chunked":
        config = config.replace(noise_keys="chunked")
    if collectives.rank != 0:  # one voice: rank 0 prints and shows progress
        log, progress = (lambda *a, **k: None), False
    return _Run(config, out_dir, device, collectives, log, progress)


def _read_saved(run: _Run) -> None:
    """The checkpoint to resume (all its shards), checked against the config before any work:
    a corrupted, foreign, old-format or other run's checkpoint fails here."""
    saved = run.saved = read_run_state(run.checkpoint)
    saved_keys = saved.get("run_identity", {}).get("noise_keys", "stream")
    if saved.get("door") == "train" and saved_keys != run.config.noise_keys:
        raise ValueError(
            f"checkpoint {run.checkpoint!r} has noise keyed {saved_keys!r} and this run "
            f"{run.config.noise_keys!r}: resume it with --noise-keys {saved_keys}"
            + (" (or --distributed)" if saved_keys == "chunked" else "")
        )
    check_run_state(saved, run.where, door="train", run_identity=run.config.run_identity())


def _key_policy(run: _Run) -> None:
    """The run's key: the given seed (its notice logged), the checkpoint's on resume, else a
    fresh secret one; in a distributed run, rank 0's (sent in memory only)."""
    policy = seeds.SeedPolicy.of(run.config.seed)
    if policy.notice:
        run.log(policy.notice)
    if run.saved is not None:  # resume adopts the checkpoint's key
        policy = resumed_key(run.saved, policy, run.where)
    comm = run.collectives
    if comm is not None and policy.is_secret:  # rank 0's secret key, in memory only
        key = comm.all_gather_object(policy.key if comm.rank == 0 else None)[0]
        policy = seeds.SeedPolicy.adopt(key, given=False)
    run.policy = policy


def _load_data(run: _Run, data: Dataset | None) -> None:
    """The data set (``data``, or ``config.dataset`` loaded, its warnings logged as notices);
    on resume, the same data as the checkpoint's."""
    if data is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = load_dataset(run.config.dataset, run.config.data_dir)
        for w in caught:
            run.log(f"notice: {w.message}")
    run.data = data
    if run.saved is not None:
        check_run_state(run.saved, run.where, door="train", data=data_digest(data))


def _plan(run: _Run) -> None:
    """The calibrated plan (``plan_for``), logged."""
    run.config, run.plan = plan_for(run.config, len(run.data), progress=run.progress, log=run.log)
    plan, privacy, config = run.plan, run.plan.privacy, run.config
    run.log(
        f"privacy: ε = {privacy.epsilon:.4g} at δ = {privacy.delta:g} ({privacy.guarantee}, "
        f"{privacy.accountant}), σ = {plan.noise_multiplier:.4g}, sens = {plan.sensitivity:.4g}, "
        f"scheme {privacy.scheme}, strategy {plan.label}, {plan.steps} steps ({config.epochs} epochs "
        f"× {plan.steps_per_epoch}), N = {len(run.data)} ({run.data.name}), B = {config.batch_size}"
    )


def _shards_model(run: _Run) -> bool:
    """Whether the run's distributed mode is one whose ranks hold shards of the model (``fsdp``)."""
    from dpmf.distributed.step import DISTRIBUTED_MODES

    return run.collectives is not None and not DISTRIBUTED_MODES[run.config.distributed_mode].replicas


def _build_step(run: _Run) -> None:
    """The model (initial weights from the key), the optimizer and the plan's private step."""
    config, key = run.config, run.policy.key
    model = build_model(config.model, run.data.input_shape, run.data.num_classes, seed=sub_seed(key, 0))
    run.model = model.to(run.device)
    if _shards_model(run):  # --fsdp: each rank its shards of the model
        fully_shard_model(run.model)
    run.optimizer = build_optimizer(config, run.model, log=run.log, seed=key)
    run.step = build_step(
        run.plan,
        run.model,
        F.cross_entropy,
        config.execution_flags(),
        run.collectives,
        seed=run.policy,
        optimizer=run.optimizer,
    )


def _header(run: _Run) -> dict:
    """``results.json`` of the running run: config, data, steps, noise, processes, privacy, plan."""
    config, data, plan, comm = run.config, run.data, run.plan, run.collectives
    noise, privatizer = run.step.noise, run.step.privatizer
    numel = noise.documented_state_numel  # the whole run's, whatever the split between ranks
    processes = {"world_size": 1}
    if comm is not None:
        numel = sum(comm.all_gather_object(numel))
        processes = {
            "world_size": comm.world_size,
            "mode": config.distributed_mode,
            "backend": comm.backend,
            "noise_state_numel_per_rank": comm.all_gather_object(noise.state_numel()),
        }
    return {
        "status": "running",
        "config": config.to_dict(),
        "dataset": {
            "name": data.name,
            "source": data.source,
            "train": len(data),
            "test": int(data.test_x.shape[0]),
        },
        "device": str(run.device),
        "steps": plan.steps,
        "steps_per_epoch": plan.steps_per_epoch,
        "expected_batch_size": run.step.sampler.expected_batch_size,
        "noise": {
            "generator": type(noise).__name__,
            "keys": config.noise_keys,
            "state_numel": numel,
            "noise_std_on_sum": privatizer.noise_std,
        },
        "processes": processes,
        "privacy": plan.privacy.to_dict(),
        "seed_given": not run.policy.is_secret,
        "plan": plan.to_dict(),
    }


def _trainer(run: _Run, identity: dict) -> Trainer:
    """The loop over the run's parts (the checkpoint: ``dpmf.train.state``'s run state)."""
    config, plan = run.config, run.plan
    # DiSK's prediction: per-example gradients at θ_t and θ_t + γ(θ_t − θ_{t−1}), combined
    # before clipping (one release per step at the same sensitivity: ε is unchanged).
    filt = build_filter(config)
    lookahead = filt.lookahead() if isinstance(filt, Disk) else None

    def epsilon_at(t: int) -> float:
        res = plan.epsilon_after(t, samples=config.samples, seed=mc_seed(config), progress=False)
        return float(res.epsilon)

    return Trainer(
        model=run.model,
        data=run.data,
        step=run.step,
        optimizer=run.optimizer,
        lr_multipliers=LearningRateSchedule(plan.schedule, plan.steps).multipliers,
        epochs=config.epochs,
        out_dir=run.out_dir,
        device=run.device,
        run_identity=identity,
        secrets={"seed": run.policy.key, "given": not run.policy.is_secret},
        epsilon_at=epsilon_at if config.per_epoch_epsilon else None,
        final_epsilon=plan.privacy.epsilon,
        delta=config.delta,
        eval_batch_size=config.eval_batch_size,
        progress=run.progress,
        title=f"{config.optimizer}, {plan.label}, {run.data.name}",
        lookahead=lookahead,
        log_every=config.log_every,
        collectives=run.collectives,
        plan=plan.to_dict(),
        data_digest=data_digest(run.data),
    )


def _prepare_folder(run: _Run, header: dict, *, overwrite: bool) -> None:
    """The output folder: an earlier run's files removed (``overwrite``), ``results.json`` of a
    new run written before its first step."""
    os.makedirs(run.out_dir, exist_ok=True)
    if overwrite and run.writer:
        clear_run_files(run.out_dir)
    if run.collectives is not None:
        run.collectives.barrier()  # every rank has seen whether a checkpoint exists
    if not os.path.exists(run.checkpoint) and run.writer:
        write_results(run.out_dir, header)


def _loop(run: _Run, trainer: Trainer, header: dict, *, resume: bool, on_epoch_end) -> TrainOutcome:
    """``trainer.run``; every stop leaves ``results.json`` saying how the run ended."""
    run.began = time.perf_counter()
    try:
        outcome = trainer.run(resume=resume, on_epoch_end=on_epoch_end)
    except BaseException as exc:
        if run.writer:
            record_stop(run.out_dir, header, exc, trainer.outcome.metrics, run.checkpoint, run.began)
        raise
    header.update(
        status="complete",
        final=outcome.metrics[-1],
        wall_seconds=round(time.perf_counter() - run.began, 2),
        resumed_from_epoch=outcome.resumed_from_epoch,
    )
    return outcome


def _finish(run: _Run, header: dict, outcome: TrainOutcome) -> TrainResult:
    """The export (``model.pt``, ``privacy.json``) and the final ``results.json`` (rank 0), the
    summary line, and the ``TrainResult``."""
    plan, config = run.plan, run.config
    privacy, last = plan.privacy, outcome.metrics[-1]
    seed_given = not run.policy.is_secret
    ledger = privacy_ledger(
        plan, privacy, steps_taken=outcome.steps, clip_norm=config.clip_norm, seed_given=seed_given
    )
    weights = whole_state(run.model) if _shards_model(run) else None  # every rank gathers its shards
    if run.writer:
        try:
            export(run.out_dir, run.model, ledger, weights=weights)
            write_results(run.out_dir, header)
        except BaseException as exc:  # the export failed (disk full, a stop): not "complete"
            header.pop("final", None)
            record_stop(run.out_dir, header, exc, outcome.metrics, run.checkpoint, run.began)
            raise
    run.log(
        f"test accuracy {100 * float(last['test_accuracy']):.2f} %, "
        f"test loss {float(last['test_loss']):.4f}, "
        f"ε = {privacy.epsilon:.4g} (δ = {privacy.delta:g}); wrote {run.out_dir}/{{{RESULTS}, metrics.csv, "
        "curves.png, checkpoint.pt, model.pt, privacy.json}"
    )
    return TrainResult(
        config, privacy, outcome.metrics, outcome.steps, outcome.empty_batches, run.out_dir, run.model
    )


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
    _check_inputs(config, data)
    run = _processes(config, out_dir, distributed=distributed, log=log, progress=progress)
    check_out_state(out_dir, resume=resume, overwrite=overwrite)
    if resume:
        _read_saved(run)
    _key_policy(run)
    identity = run.config.run_identity()
    _load_data(run, data)
    _plan(run)
    _build_step(run)
    header = _header(run)
    trainer = _trainer(run, identity)
    _prepare_folder(run, header, overwrite=overwrite)
    outcome = _loop(run, trainer, header, resume=resume, on_epoch_end=on_epoch_end)
    return _finish(run, header, outcome)
