"""The one constructor of a run's private step: ``build(plan, model, loss_fn, flags, comm)``.

A private step is three things that must agree: the plan's batch sampler, the plan's noise
stream and the privatizer that adds that noise at the plan's σ·ζ·s and divides by the plan's
B̄. They are built here, together, from the plan and nothing else, with the privatizer already
bound to the sampler (``Privatizer.draw_from``: each step accepts only the batch drawn for it,
once), into one frozen ``DPStep`` that also carries the plan's DP event. What is not
privacy-relevant — clipping mode, micro-batches, noise keys, distributed mode — comes in one
``ExecutionFlags``. ``make_private``, ``dpmf train``, torchrun, the federated modes' private
runs and ``dpmf audit`` all build their step here; the plan itself builds no torch part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dpmf import seeds
from dpmf.optim.clipping import trainable_parameters
from dpmf.optim.noise import ChunkedKeys, CorrelatedNoise, noise_for_factorization
from dpmf.optim.optimizers import DPOptimizer
from dpmf.optim.privatize import PrivateStep, Privatizer
from dpmf.step.flags import ExecutionFlags

__all__ = ["DPStep", "build", "noise_stream"]


@dataclass(frozen=True, eq=False)
class DPStep(seeds.KeyHolder):
    """A plan's sampler, noise stream and privatizer, bound together (frozen).

    Attributes:
        plan: the calibrated ``PrivatePlan``.
        sampler: the plan's batch sampler (global batches; keyed by the run's key).
        privatizer: a ``Privatizer`` (a ``DistributedPrivatizer`` with a process group) built
            on the plan, its noise the plan's stream, bound to ``batches``.
        batches: the ``DrawnBatches`` this process draws from: the global batches in one
            process, this rank's slice of each with a process group.
        flags: the ``ExecutionFlags`` it was built with.
        policy: the run's ``dpmf.seeds.SeedPolicy`` (with a process group and a secret key:
            rank 0's key on every rank). Its repr never shows the key.
        collectives: the ``Collectives`` of the process group, or None.
    """

    plan: object
    sampler: object
    privatizer: Privatizer
    batches: object
    flags: ExecutionFlags
    policy: seeds.SeedPolicy = field(repr=False)
    collectives: object = None

    @property
    def noise(self) -> CorrelatedNoise:
        """The plan's noise stream (this process's coordinates of it)."""
        return self.privatizer.noise

    @property
    def event(self):
        """The run's privacy event at the plan's σ (``PrivatePlan.event``: what the accountant
        composes for this step's sampler and noise)."""
        return self.plan.event()

    @property
    def key(self) -> int:
        """The run's key (secret unless given: never print it)."""
        return self.policy.key

    def bind(self, optimizer) -> None:
        """Let ``optimizer`` step on this step's private gradients: a dpmf ``DPOptimizer`` is
        bound to the privatizer (``DPOptimizer.bind``: it checks the gradients it reads and takes
        the fresh-noise std); any other ``torch.optim.Optimizer`` needs nothing (``take`` marks
        its gradients used). The privatizer never refers to the optimizer."""
        if isinstance(optimizer, DPOptimizer):
            optimizer.bind(self.privatizer)

    def take(
        self,
        optimizer,
        batch: Callable,
        *,
        points=None,
        post_process: Callable | None = None,
        before_update: Callable | None = None,
    ) -> PrivateStep:
        """One step of the run, the body of every loop in dpmf: draw the plan's batch for this
        step, privatize it, post-process and step ``optimizer``, zero its gradients.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over the trainable parameters (a
                ``DPOptimizer`` bound with ``bind``).
            batch: ``batch(idx)`` → (x, y, ids): the inputs, targets and example ids (int64,
                shape (b,)) of the drawn indices ``idx`` (numpy int64, shape (b,); this rank's
                slice in a distributed run). ``ids`` are what the privatizer must receive: the
                drawn indices, or another numbering of the same examples (an audit's canaries).
            points: the evaluation plan of this step (``Privatizer.privatize``), or None.
            post_process: ``fn()`` changing the private gradients in place (FedProx's proximal
                term), run through ``Privatizer.post_process``; None: none.
            before_update: ``fn(info)`` called with the ``PrivateStep`` before the optimizer
                steps (the weights are still θ_t; step logging); None: none.

        Returns:
            The step's ``PrivateStep``.

        Raises:
            as ``Privatizer.privatize`` and the optimizer's ``step``.
        """
        drawn_at, idx = self.batches.draw()
        x, y, ids = batch(idx)
        self.batches.record(drawn_at, ids=ids, n=int(ids.shape[0]))  # what privatize must receive
        privatizer = self.privatizer
        info = privatizer.privatize(x, y, example_ids=torch.as_tensor(ids), points=points)
        if post_process is not None:
            privatizer.post_process(post_process)
        if before_update is not None:
            before_update(info)
        optimizer.step()
        if not isinstance(optimizer, DPOptimizer) or optimizer.bound_to is not privatizer:
            privatizer.consume()
        privatizer.after_step()  # distributed: every rank gets the owners' parameters
        # zero_grad(set_to_none=True) without torch's first-call import of torch._dynamo
        for group in optimizer.param_groups:
            for p in group["params"]:
                (p[1] if isinstance(p, tuple) else p).grad = None
        return info


def noise_stream(plan, dim: int, key: int, *, device=None, dtype=None, keys=None) -> CorrelatedNoise:
    """The plan's unit-scale correlated-noise stream (C⁻¹Z)_t on ``dim`` coordinates: the
    cheapest generator of the plan's strategy (``dpmf.optim.noise.noise_for_factorization``).

    Args:
        plan: a ``PrivatePlan``; dim: d ≥ 1 noised coordinates; key: the raw noise's key (secret).
        device, dtype: of the produced noise (default CPU, float32).
        keys: None (one raw stream keyed by step) or ``ChunkedKeys`` (keyed by parameter and
            chunk: the same noise at any number of processes; ``dim`` = ``keys.dim``).

    Raises:
        ValueError: d < 1, a key out of range.
    """
    kwargs = {} if dtype is None else {"dtype": dtype}
    return noise_for_factorization(plan.strategy, dim, seed=key, device=device, keys=keys, **kwargs)


def _collectives(process_group):
    if process_group is None:
        return None
    from dpmf.distributed.collectives import Collectives, TorchCollectives

    return process_group if isinstance(process_group, Collectives) else TorchCollectives(process_group)


def _policy(plan, seed, comm) -> seeds.SeedPolicy:
    if seed is None:
        policy = plan.seed_policy()
    elif isinstance(seed, seeds.SeedPolicy):
        policy = seed
    else:
        raise TypeError(
            f"seed of type {type(seed).__name__} is invalid here: give an integer seed to the plan "
            "(PrivatePlan(..., seed=…)); dpmf.step.build takes None or a dpmf.seeds.SeedPolicy"
        )
    if comm is not None and policy.is_secret:  # rank 0's secret key, sent in memory only
        key = comm.all_gather_object(policy.key if comm.rank == 0 else None)[0]
        policy = seeds.SeedPolicy.adopt(key, given=False)
    return policy


def build(
    plan,
    model: nn.Module,
    loss_fn: Callable,
    flags: ExecutionFlags | None = None,
    comm=None,
    *,
    seed=None,
    optimizer=None,
) -> DPStep:
    """The private step of ``plan`` for ``model``: sampler, noise stream and privatizer.

    Args:
        plan: a ``PrivatePlan`` with its noise multiplier (calibrated or given) and its
            ``clip_norm`` ζ.
        model: the network (its trainable parameters get the noise; device and dtype of the
            noise are those of its first trainable parameter).
        loss_fn: ``loss_fn(output, target)`` → scalar on one example.
        seed: None (the plan's ``seed_policy()``) or a ``dpmf.seeds.SeedPolicy`` that
            replaces it (a resumed run's key).
        flags: ``ExecutionFlags`` (default ``ExecutionFlags()``).
        comm: None (one process), a ``torch.distributed`` process group or a
            ``dpmf.distributed.Collectives``: the step of ``DistributedPrivatizer``, the noise
            of one process split between the ranks (noise keys always ``chunked``).
        optimizer: with a process group, the optimizer whose Newton–Schulz parameters weigh in
            the assignment of owners (optional).

    Returns:
        ``DPStep``.

    Raises:
        ValueError: the plan has no σ or clip norm, the model has nothing trainable, a noise stream that
            does not match, a sampler of another length (``Privatizer.draw_from``), or any
            argument of ``Privatizer`` out of range.
        TypeError: flags not ``ExecutionFlags``, a bad seed or process group.
    """
    flags = ExecutionFlags() if flags is None else flags
    if not isinstance(flags, ExecutionFlags):
        raise TypeError(f"flags={flags!r} is invalid: must be a dpmf.step.ExecutionFlags")
    plan.require_noise_multiplier()
    clip_norm = plan.require_clip_norm()
    comm = _collectives(comm)
    policy = _policy(plan, seed, comm)
    sampler = plan.sampler(policy.key)  # keyed by derive(key, "sampler")
    common = dict(
        plan=plan, clip_norm=clip_norm, micro_batch_size=flags.micro_batch_size, clipping=flags.clipping
    )
    if comm is not None:
        from dpmf.distributed.sharding import RankSlices
        from dpmf.distributed.step import DistributedPrivatizer

        privatizer = DistributedPrivatizer(
            model,
            loss_fn,
            collectives=comm,
            seed=policy.key,
            mode=flags.distributed_mode,
            optimizer=optimizer,
            check_every=flags.check_every,
            **common,
        )
        slices = RankSlices(sampler, comm.rank, comm.world_size, pad=privatizer.shards_parameters)
        batches = privatizer.draw_from(slices)
    else:
        params = [p for _, p in trainable_parameters(model)]
        if not params:
            raise ValueError("model is invalid: it has no trainable parameters")
        sizes = tuple(p.numel() for p in params)
        keys = ChunkedKeys(sizes) if flags.noise_keys == "chunked" else None
        p0 = params[0]
        noise = noise_stream(plan, sum(sizes), policy.key, device=p0.device, dtype=p0.dtype, keys=keys)
        privatizer = Privatizer(model, loss_fn, noise=noise, **common)
        batches = privatizer.draw_from(sampler)
    if flags.noise_generator != "device":
        privatizer.noise.use_generator(flags.noise_generator)
    return DPStep(plan, sampler, privatizer, batches, flags, policy, comm)
