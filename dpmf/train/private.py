"""``dpmf.make_private``: the private step of correlated-noise training in any PyTorch loop.

    private = dpmf.make_private(model, optimizer, dataset, loss_fn=F.cross_entropy,
                                batch_size=256, epochs=10, target_epsilon=3.0, target_delta=1e-5)
    for epoch in range(10):
        for x, y in private.data_loader:
            private.backward(x, target=y)      # per-example grads → clip → sum → noise → ÷ B̄
            private.optimizer.step()
            private.optimizer.zero_grad()
        print(private.get_epsilon())

One ``PrivatePlan`` (dataset size, batch size, steps, scheme, strategy, schedule, σ) gives the
sampler behind ``data_loader``, the noise stream and the accounting, so they cannot disagree.
``factorization="auto"`` runs ``pick`` for the run (and ``scheme="auto"`` takes pick's scheme).
The returned optimizer wraps the user's (any ``torch.optim.Optimizer``, or a dpmf DP optimizer):
its ``step()`` refuses gradients that did not come from ``backward`` for this step, and the
user's optimizer itself steps only from it (a step pre-hook refuses a direct call). Everything
after the noise is post-processing. ``export`` writes the weights and the privacy ledger, and
none of the secrets (seed, noise buffers, sampler state); ``state_dict`` (for resuming) holds
them and must stay private.

Inputs may be tensors, or tuples/dicts of tensors batched along dimension 0 (a dict is passed as
``model(**batch)``); a Dataset may return tensors, tuples or dicts. An empty Poisson batch comes
out of the loader as empty tensors, and ``backward`` on it adds the noise only (the step counts).

What ``backward`` accepts: at step t, only the batch ``data_loader`` yielded for step t (the
plan's sampler's draw: same examples, same values, possibly moved to another device or dtype),
once; per-example transformations go into ``make_private(transform=…)``. The model and the
optimizer must stay as they were given (no parameter unfrozen, group or submodule added), and
the forward pass must write no parameter or buffer. Each refusal names what was wrong and the
fix (``dpmf.optim.batches``, ``dpmf.optim.model_guard``).

Keys: with ``seed=None`` the run's key is 256 bits of the operating system's entropy, kept only
in memory and in ``save``/``state_dict`` (``resume`` adopts a saved key); a given seed is the
key: the run is reproducible and its noise predictable to whoever knows it (``dpmf.seeds.NOTICE``
is printed to stderr). ``save``/``resume`` use the run state of ``dpmf.train.state``, the format
``dpmf train`` writes, so ``resume`` also continues a ``dpmf train`` checkpoint of the same plan
and data.

Processes: with a process group every process calls ``make_private`` with the same arguments;
the loader yields this rank's slice of each global batch (``dpmf.distributed.RankSlices``), the
private step is ``dpmf.distributed.DistributedPrivatizer`` (the noise of one process), the
optimizer's step returns the parameters to all ranks and the secret key is rank 0's.
``noise_keys="chunked"`` (default; always with a process group) keys the raw noise by parameter
and chunk, the same at any number of processes; ``"stream"`` is the keying of earlier runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from dpmf import seeds
from dpmf._validation import check_int, check_real
from dpmf.mechanisms.registry import STRATEGIES, parse_factorization
from dpmf.optim.clipping import check_per_example_safe, trainable_parameters
from dpmf.optim.model_guard import OptimizerGroups, check_state_unchanged, state_versions
from dpmf.optim.optimizers import DPOptimizer
from dpmf.optim.privatize import Privatizer
from dpmf.plan.plan import PrivatePlan, steps_per_epoch
from dpmf.plan.schemes import auto_scheme, get_scheme
from dpmf.step import ExecutionFlags
from dpmf.step import build as build_step
from dpmf.train.collate_check import check_collate_independent
from dpmf.train.continuation import Lineage, check_hyperparameters, check_loss, fork_key, loss_identity
from dpmf.train.hf import batch_size_of, split_batch
from dpmf.train.ledger import check_export_folder, privacy_ledger
from dpmf.train.ledger import export as export_files
from dpmf.train.private_loader import PrivateDataLoader, TransformedDataset
from dpmf.train.state import (
    check_run_state,
    dataset_digest,
    hyperparameters,
    read_run_state,
    restore_run_state,
    resumed_key,
    run_state,
    sampled_dataset_digest,
    write_run_state,
)
from dpmf.train.state_versions import StateVersions
from dpmf.workloads.schedules import Schedule

__all__ = ["make_private", "PrivateTraining", "PrivateOptimizer", "EmptySafeCollate"]

#: module → the live ``PrivateTraining`` over it (one per module: a later make_private closes it)
_LIVE_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class EmptySafeCollate:
    """``default_collate`` that turns an empty batch into empty tensors of the data set's shapes
    (from its first example), so an empty Poisson batch is a batch of zero examples.

    Args:
        dataset: the map-style data set (``dataset[0]`` gives the shapes and dtypes).
        collate_fn: the collate function for non-empty batches (default ``default_collate``).
    """

    def __init__(self, dataset, collate_fn=None):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty = None

    def __call__(self, batch):
        if len(batch):
            return self.collate_fn(batch)
        if self._empty is None:
            self._empty = _map(lambda t: t[:0], self.collate_fn([self.dataset[0]]))
        return self._empty


def _map(fn, tree):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map(fn, v) for v in tree)
    return tree


class PrivateOptimizer(seeds.KeyHolder, torch.optim.Optimizer):
    """The user's optimizer behind a guard: ``step()`` runs only on the private gradients of the
    current step (written by ``PrivateTraining.backward``), once.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are
    those of the wrapped optimizer. Learning rates: the step of private step t uses each
    group's ``lr`` times the plan's schedule multiplier χ_t (``lr_multipliers``), and puts the
    group's ``lr`` back afterwards; so a torch learning-rate scheduler on this optimizer works,
    and χ_t is applied on top of the rate it sets (with a constant schedule χ_t = 1).

    Raises (from ``step``):
        RuntimeError: no private gradient for this step, a ``p.grad`` replaced or modified after
            the private step (for instance by a plain ``loss.backward()``), a second ``step``
            on the same private gradient, or a model or parameter group changed since
            ``make_private`` (``ModelChangedError``).

    Pickling or deep-copying it raises TypeError (it holds the privatizer and so the run's
    secret key; ``seeds.KeyHolder``): save the run with ``PrivateTraining.save``, and the
    wrapped optimizer's ``state_dict()`` for its own state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, privatizer: Privatizer, lr_multipliers=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={optimizer!r} is invalid: must be a torch.optim.Optimizer")
        self.original = optimizer
        self.privatizer = privatizer
        self.lr_multipliers = lr_multipliers
        self.on_stepped = None  # called after each step (the run records its model's state)
        # the user still holds the wrapped optimizer: its own step() runs only from this one's
        # (a plain loss.backward() then optimizer.step() would train without clipping or noise);
        # a later make_private with the same optimizer replaces the guard
        self._inside = False
        guard = getattr(optimizer, "_dpmf_step_guard", None)
        if guard is not None:
            guard.remove()
        optimizer._dpmf_step_guard = optimizer.register_step_pre_hook(self._guard)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        # the groups given to make_private (checked at each step); a dpmf DP optimizer reads the
        # fresh-noise std from the privatizer (a one-way binding: the privatizer keeps no optimizer)
        self._groups = OptimizerGroups(optimizer)
        if isinstance(optimizer, DPOptimizer):
            optimizer.bind(privatizer)

    @property
    def param_groups(self):
        return self.original.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original.param_groups = value

    @property
    def state(self):
        return self.original.state

    @state.setter
    def state(self, value):
        self.original.state = value

    @property
    def defaults(self):
        return self.original.defaults

    @defaults.setter
    def defaults(self, value):
        self.original.defaults = value

    def _guard(self, optimizer, args, kwargs) -> None:
        if not self._inside:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() refused: this optimizer was given to make_private, "
                "so nothing shows that p.grad holds private gradients; call private.backward(...) and "
                "private.optimizer.step() instead"
            )

    def step(self, closure=None):
        """The wrapped optimizer's step on this step's private gradients (checked first)."""
        if closure is not None:
            raise ValueError(
                "closure is invalid for a private step: compute the loss with PrivateTraining.backward"
            )
        self._groups.check("optimizer.step()")
        self.privatizer.check_gradients(self._groups.params())
        last = self.privatizer.last_step
        chi = 1.0 if self.lr_multipliers is None or last is None else float(self.lr_multipliers[last.step])
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] * chi
        self._inside = True
        try:
            loss = self.original.step()
        finally:
            self._inside = False
            for g, lr in zip(self.param_groups, lrs, strict=True):
                g["lr"] = lr
        self.privatizer.consume()
        self.privatizer.after_step()  # distributed: every rank gets the owners' parameters
        if self.on_stepped is not None:
            self.on_stepped()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.original.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.original.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        """Refused: the private step covers the parameters given to ``make_private``.

        Raises:
            RuntimeError: always (the fix: call ``make_private`` with the optimizer that has
                the group).
        """
        raise RuntimeError(
            "add_param_group refused after make_private: the noise and clipping cover the trainable "
            "parameters of that time; add the group to the optimizer first, then call make_private"
        )

    def __repr__(self) -> str:
        return f"PrivateOptimizer({self.original!r})"


@dataclass(eq=False)
class PrivateTraining:
    """A private run in the user's own loop (see ``make_private``).

    Attributes:
        model: the user's module (trained in place).
        optimizer: the guarded optimizer (``PrivateOptimizer``).
        data_loader: a ``torch.utils.data.DataLoader`` driven by the plan's sampler
            (``PrivateDataLoader``): ``len()`` is the steps per epoch; iterate it once per
            epoch (the plan's steps continue); ``backward`` accepts only its batches, in order.
        plan: the calibrated ``PrivatePlan``.
        privatizer: the private step (clip → sum → noise → ÷ B̄).
        clip_norm: ζ.
        seed_given: whether the noise seed was given (then the noise is predictable to whoever
            knows it); False: the run's key is secret (``dpmf.seeds``).
    """

    model: nn.Module
    optimizer: PrivateOptimizer
    data_loader: DataLoader
    plan: PrivatePlan
    privatizer: Privatizer
    clip_norm: float
    seed_given: bool
    _seed: int = field(repr=False)
    _delta: float | None
    _closed_by_later_run: bool = field(default=False, repr=False)
    _lineage: Lineage = field(default_factory=Lineage, repr=False)
    _own_paths: set = field(default_factory=set, repr=False)  # files this run wrote or continues
    _pinned: list | None = field(default=None, repr=False)  # a continuation's hyperparameters
    _data_digest: str | None = field(default=None, repr=False)
    _versions: StateVersions | None = field(default=None, repr=False)

    def __post_init__(self):
        self._versions = StateVersions(self.model)
        self.optimizer.on_stepped = self._versions.record

    @property
    def noise_multiplier(self) -> float:
        """σ of the plan."""
        return self.plan.noise_multiplier

    @property
    def target_delta(self) -> float | None:
        """δ given to ``make_private`` (``target_delta``), at which ``get_epsilon`` and the ledger
        report ε; None where none was given."""
        return self._delta

    @property
    def sampler(self):
        """The plan's batch sampler behind ``data_loader`` (global batches; in a distributed
        run the loader yields this rank's slice of each)."""
        bs = self.data_loader.batch_sampler
        return getattr(bs, "sampler", bs)

    @property
    def collectives(self):
        """The ``dpmf.distributed.Collectives`` of a run over several processes, else None."""
        return getattr(self.privatizer, "collectives", None)

    @property
    def steps_taken(self) -> int:
        """Private steps taken so far (empty batches included)."""
        return self.privatizer.step

    def backward(self, *inputs, target=None, return_loss: bool = True) -> torch.Tensor | None:
        """The private gradient of one batch into ``p.grad``: per-example gradients, clipping to
        ζ, sum, the step's correlated noise σ·ζ·s·(C⁻¹Z)_t, division by the expected batch size
        B̄. The optimizer's next ``step`` uses each group's lr times χ_t of the plan's schedule.

        Only the batch ``data_loader`` yielded for this step is accepted (its tensors, or the
        same tensors moved to another device or dtype), once: not a batch of another loader,
        the whole data set, a part of the batch (gradient accumulation: one backward per batch;
        ``micro_batch_size`` bounds memory), a batch not yet yielded or already privatized.
        Transform examples with ``make_private(transform=…)``, not in the loop.

        Args:
            inputs: the model's inputs for the batch (one tensor, several tensors, or one dict
                passed as keyword arguments), batched along dimension 0 (size 0: noise only).
            target: the targets, batched along dimension 0; None: taken from a dict batch by
                the loss (``dpmf.train.hf.causal_lm_loss()``: its ``labels``).
            return_loss: return the batch's mean loss (default); False: None.

        Returns:
            The mean of the batch's per-example losses ℓ_i(θ_t) as a detached 0-dim float64
            tensor on the model's device, taken from the private forward itself (no second
            forward pass and no host synchronisation; ``float(loss)`` reads it). 0 for an empty
            batch. It is a non-private statistic of the batch, as any training loss: log it
            only where the batch may be seen.

        Raises:
            RuntimeError: every step of the plan was taken.
            BatchCheckError: not the batch ``data_loader`` yielded for this step, or already
                privatized (nothing is computed).
            ModelChangedError: a parameter unfrozen, frozen or replaced, a submodule or an
                optimizer group added since ``make_private``.
            ModelStateChangedError: the forward pass wrote a parameter or buffer.
            NonFiniteGradientError: a per-example gradient is NaN/inf (nothing is written).
        """
        if self._closed_by_later_run:
            raise RuntimeError(
                "backward refused: a later make_private was called on this model, which closed this "
                "run (two runs stepping one model would each report only their own ε); continue "
                "with the run make_private returned last"
            )
        t = self.privatizer.step
        if t >= self.plan.steps:
            raise RuntimeError(
                f"the plan's {self.plan.steps} steps were all taken: its accounting covers only those "
                "(make a new plan for a longer run)"
            )
        if not inputs:
            raise ValueError(
                "inputs are invalid: give the model's input (a tensor, several tensors or a dict)"
            )
        self._versions.check("backward", t)  # state written between steps (from the data?)
        if self._pinned is not None:  # the first step of a continuation: the run's hyperparameters
            check_hyperparameters(self._pinned, self.optimizer.param_groups, "the resumed run")
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)  # several tensors: model(*inputs)
        handed_out = None
        if target is None:  # a Hugging Face batch: the loss splits it (dpmf.train.hf)
            handed_out = x
            x, target = split_batch(self.privatizer.loss_fn, x)
        info = self.privatizer.privatize(x, target, handed_out=handed_out)
        self._pinned = None
        if not return_loss:
            return None
        n = batch_size_of(target)
        if info.loss_sum is not None:  # the private forward's own losses: no second forward
            return info.loss_sum / n if n else info.loss_sum
        if n == 0:
            return torch.zeros((), dtype=torch.float64)
        before = state_versions(self.model)
        with torch.no_grad():  # still at θ_t: the optimizer has not stepped yet
            if isinstance(x, dict):
                out = self.model(**x)
            elif isinstance(x, tuple):
                out = self.model(*x)
            else:
                out = self.model(x)
            loss = self.privatizer.loss_fn(out, target).detach().to(torch.float64)
        check_state_unchanged(self.model, before, "the loss's forward pass", t)
        return loss

    @contextlib.contextmanager
    def post_processing(self):
        """A block that may write the model's parameters or buffers between steps, as a function
        of the released weights only (a projection, weight averaging of the released iterates,
        loading the exported weights): the writes are accepted afterwards. A write computed from
        the data (a running mean of the batches) must not go here: it would be released without
        noise."""
        try:
            yield self.model
        finally:
            self._versions.record()

    def privacy(self, delta: float | None = None):
        """The ``PrivacyResult`` of the steps taken so far (``PrivatePlan.epsilon_after``).

        Raises:
            ValueError: no δ (give ``delta`` or ``target_delta`` to ``make_private``).
        """
        delta = self._delta if delta is None else delta
        if delta is None:
            raise ValueError("delta is required: give delta= here or target_delta= to make_private")
        plan = self.plan
        if self._lineage.siblings > 1:  # a family of forks: σ/√m (dpmf.train.continuation)
            plan = plan.with_noise(self._lineage.noise_multiplier(plan.require_noise_multiplier()))
        return plan.epsilon_after(max(self.steps_taken, 1), delta=delta)

    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent by the steps taken so far, at ``delta`` (default ``target_delta``); 0 before
        the first step."""
        if self.steps_taken == 0:
            return 0.0
        return float(self.privacy(delta).epsilon)

    def ledger(self, delta: float | None = None) -> dict:
        """The privacy ledger of the steps taken (``dpmf.train.ledger.privacy_ledger``), with
        the run's id and, for a member of a family of forks, its ``siblings``."""
        entry = privacy_ledger(
            self.plan,
            self.privacy(delta),
            steps_taken=self.steps_taken,
            clip_norm=self.clip_norm,
            seed_given=self.seed_given,
        )
        return {**entry, "run_id": self._lineage.run_id, **self._lineage.ledger_entry()}

    def export(self, out_dir: str, delta: float | None = None, *, overwrite: bool = False) -> tuple[str, str]:
        """Write ``out_dir/model.pt`` (weights; ``torch.load(weights_only=True)``) and
        ``out_dir/privacy.json`` (the ledger); no seed, noise buffers or sampler state. The state
        of the model is checked first: a parameter or buffer written since the last optimizer
        step is refused (``StateVersions``).

        Raises:
            ValueError: ``out_dir`` holds another run's export (its ledger's ``run_id`` differs,
                or a ``model.pt`` without this run's ledger), without ``overwrite=True``.
            ModelStateChangedError: a parameter or buffer was written since the last optimizer
                step (outside ``post_processing()``).
        """
        check_export_folder(out_dir, self._lineage.run_id, overwrite=overwrite)
        self._versions.check("export", self.steps_taken)
        return export_files(out_dir, self.model, self.ledger(delta))

    def state_dict(self) -> dict:
        """Everything needed to resume: weights, optimizer, sampler, noise stream and the key,
        in the run-state format of ``dpmf.train.state`` (the one ``dpmf train`` writes). It
        holds the run's secrets: keep it private (``export`` is what can be shared)."""
        return run_state(
            door="make_private",
            plan=self.plan.to_dict(),
            privatizer=self.privatizer,
            model=self.model,
            optimizer=self.optimizer,
            key=self._seed,
            given=self.seed_given,
            run_identity={"run_id": self._lineage.run_id, "loss": loss_identity(self.privatizer.loss_fn)},
            data=self._digest(),
            epoch=self.steps_taken // self.plan.steps_per_epoch,
            siblings=self._lineage.siblings,
        )

    def _digest(self) -> str | None:
        """The data set's digest (every example; computed once per run)."""
        if self._data_digest is None:
            self._data_digest = dataset_digest(self.data_loader.dataset)
        return self._data_digest

    def load_state_dict(self, state: dict, *, fork: bool = False, where: str = "state") -> None:
        """Restore a run state of the same plan and data: ``state_dict()``'s, or a ``dpmf
        train`` checkpoint's (``dpmf.train.state``) with the model and optimizer built as that
        run built them. A continuation (default) must have the state's optimizer
        hyperparameters (checked here and at the first ``backward``); ``fork=True`` draws the
        raw noise of the later steps from a new key (``dpmf.train.continuation``). A run made
        with ``seed=None`` adopts the state's key (secret or given); a run made with a seed
        refuses a state of another key (a fork: the seed is the fork's new key).

        Raises:
            ValueError: another or an old format, another plan or data (every example
                compared), another key than a given seed, other hyperparameters without
                ``fork``, or an inconsistent state (no key is ever shown).
        """
        if not isinstance(state, dict):
            raise ValueError("state is invalid: not a dpmf run state (a dict from state_dict())")
        saved_data = state.get("data")
        legacy = isinstance(saved_data, str) and saved_data.startswith("sample-")
        check_run_state(
            state,
            where,
            door="make_private",
            plan=self.plan.to_dict(),
            data=sampled_dataset_digest(self.data_loader.dataset) if legacy else self._digest(),
            model=self.model,
        )
        if not fork:
            check_hyperparameters(
                state["optimizer"].get("param_groups", []), self.optimizer.param_groups, where
            )
            saved_loss = (state.get("run_identity") or {}).get("loss")
            check_loss(saved_loss, self.privatizer.loss_fn, where)
        secret = state.get("secret") if isinstance(state.get("secret"), dict) else {}
        own = hyperparameters(self.optimizer.param_groups)  # a fork keeps the ones it was built with
        if fork:
            given = self._seed if self.seed_given else None
            base = resumed_key(state, seeds.SeedPolicy.of(None), where)
            new_key = fork_key(base.key, given, secret.get("forks") or [])
            self._adopt_key(base, quiet=given is not None)
        else:
            mine = seeds.SeedPolicy(self._seed if self.seed_given else None, self._seed)
            policy = resumed_key(state, mine, where)
            if not self.seed_given:  # adopt the state's key (secret or given)
                self._adopt_key(policy)
        restore_run_state(
            state,
            model=self.model,
            optimizer=self.optimizer,
            sampler=self.sampler,
            privatizer=self.privatizer,
            where=where,
        )
        self.privatizer.noise.use_forks(secret.get("forks") or [])
        if fork:
            self.privatizer.noise.fork(new_key)
            self.seed_given = given is not None
            for g, values in zip(self.optimizer.param_groups, own, strict=False):
                g.update(values)
        self._pinned = None if fork else hyperparameters(state["optimizer"].get("param_groups", []))
        self._versions.record()

    def _adopt_key(self, policy: seeds.SeedPolicy, quiet: bool = False) -> None:
        if policy.notice and not quiet:
            print(policy.notice, file=sys.stderr)
        self.seed_given, self._seed = not policy.is_secret, policy.key
        self.privatizer.use_key(policy.key)
        self.sampler.use_key(policy.key)

    def __reduce__(self):
        """Refused: a run holds its secret key, and a pickle (``torch.save(run)``, joblib caches)
        would write it with the umask's mode. ``save`` writes the state to a private file.

        Raises:
            TypeError: always.
        """
        raise TypeError(
            "PrivateTraining cannot be pickled: it holds the run's secret noise key; use "
            "save(path) (a private 0600 file) and resume(path), or export(dir) to share the model"
        )

    def save(self, path: str, *, overwrite: bool = False) -> None:
        """``state_dict()`` to ``path``, atomically (a private file: it holds the secrets). In a
        distributed run every rank calls it: each writes its shard next to ``path`` and rank 0
        the manifest ``path`` (``dpmf.train.shards``), resumable at any number of processes.

        Raises:
            ValueError: ``path`` exists and is not a file this run wrote or continues from (a
                fork's parent state included), without ``overwrite=True``.
        """
        key = os.path.realpath(path)
        if os.path.exists(path) and key not in self._own_paths and not overwrite:
            raise ValueError(
                f"path={str(path)!r} is invalid: it holds a file this run did not write (another run's "
                "checkpoint would be lost); choose another path, or pass overwrite=True to replace it"
            )
        write_run_state(path, self.state_dict(), self.privatizer, self.collectives)
        self._own_paths.add(key)

    def resume(self, path: str, *, fork: bool = False) -> None:
        """Load ``save(path)``'s file, or a ``dpmf train`` checkpoint of the same plan and data
        (``torch.load(weights_only=True)``), with its shards if a distributed run wrote it.

        By default the run continues the saved one: the same optimizer hyperparameters and
        data, the same noise (a repeated continuation makes the same release). ``fork=True``
        makes a fork — other hyperparameters allowed, the raw noise of the later steps from a
        new key, the fork counted in ``path`` — whose ε is accounted with its siblings'
        (``dpmf.train.continuation``); one process only.

        Raises:
            ValueError: a corrupted, foreign or old-format file, a missing shard, another run's
                state, other hyperparameters without ``fork``, or ``fork`` in a distributed run.
        """
        if fork and self.collectives is not None:
            raise ValueError(
                "fork=True is invalid in a run over several processes: fork in one process, or resume "
                "as a continuation"
            )
        state = read_run_state(path)
        where = f"checkpoint {str(path)!r}"
        self.load_state_dict(state, fork=fork, where=where)
        self._lineage = Lineage.resumed(state, path, fork=fork)  # a fork counts itself in the file
        if not fork:
            self._own_paths.add(os.path.realpath(path))
        if self.collectives is not None:
            self.privatizer.verify()


def _resolve(
    dataset_size,
    batch_size,
    steps,
    factorization,
    scheme,
    schedule,
    epsilon,
    delta,
    max_bands,
    seed,
    progress,
):
    """(strategy, scheme) for the run: ``pick``'s recommendation for ``auto`` (the
    ``Factorization`` pick built, not its label: nothing is factorized twice), the
    ``auto_scheme`` rule for ``scheme="auto"`` with a given strategy."""
    if factorization == "auto":
        if epsilon is None:
            raise ValueError(
                "factorization='auto' is invalid with noise_multiplier: the choice needs target_epsilon "
                "(or give a strategy such as 'bsr:16' or 'identity')"
            )
        from dpmf.plan.pick import PICK_SCHEMES, pick

        if scheme != "auto" and scheme not in PICK_SCHEMES:
            raise ValueError(
                f"scheme={scheme!r} is invalid with factorization='auto': use one of {PICK_SCHEMES}"
            )
        res = pick(
            dataset_size=dataset_size,
            batch_size=batch_size,
            steps=steps,
            epsilon=epsilon,
            delta=delta,
            schedule=schedule,
            max_bands=max_bands,
            scheme=scheme,
            seed=0,
            progress=progress,
        )
        return res.recommendation.plan.strategy, res.recommendation.scheme  # built once, by pick
    if scheme == "auto":
        name, param = parse_factorization(factorization)
        entry = STRATEGIES[name]
        run = PrivatePlan(dataset_size, batch_size, steps=steps)
        return factorization, auto_scheme(entry, entry.bands_of(param), run).name
    return factorization, get_scheme(scheme).name


def _check_module(module, optimizer, loss_fn, sharded: bool = False) -> None:
    """Refuse a module, optimizer or loss of the wrong type, a module that couples examples or
    writes the batch into itself, and an optimizer that does not hold the module's trainable
    parameters (and only the module's); ``sharded``: a process group is given, so fully_shard's
    DTensor parameters are the sharded step's to check."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={module!r} is invalid: must be a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={optimizer!r} is invalid: must be a torch.optim.Optimizer")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is invalid: must be callable(output, target)")
    check_per_example_safe(module, sharded=sharded)
    params = {id(p) for _, p in trainable_parameters(module)}
    opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not opt_params <= {id(p) for p in module.parameters()}:
        raise ValueError("optimizer is invalid: it holds parameters that are not the module's")
    if not params <= opt_params:
        raise ValueError("optimizer is invalid: some trainable parameters of the module are not in it")


def _check_run(dataset, batch_size, epochs, steps, target_epsilon, target_delta, noise_multiplier):
    """(N, n, target_epsilon, target_delta) of the run, validated: a map-style data set, exactly
    one of epochs/steps and of target_epsilon/noise_multiplier, δ with a target ε."""
    if isinstance(dataset, DataLoader):
        raise TypeError(
            "dataset is invalid: a DataLoader was given; give its map-style Dataset (loader.dataset) "
            "and the batch size: make_private builds the loader from the plan's sampler "
            "(PrivateTraining.data_loader)"
        )
    try:
        N = len(dataset)
    except TypeError:
        raise TypeError(f"dataset={dataset!r} is invalid: must be a map-style Dataset with len()") from None
    spe = steps_per_epoch(N, batch_size)
    if (epochs is None) == (steps is None):
        raise ValueError("epochs/steps is invalid: give exactly one of epochs or steps")
    n = (
        check_int("epochs", epochs, minimum=1) * spe
        if steps is None
        else check_int("steps", steps, minimum=1)
    )
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("target_epsilon/noise_multiplier is invalid: give exactly one")
    if target_epsilon is not None:
        target_epsilon = check_real("target_epsilon", target_epsilon, low=0.0, low_inclusive=False)
        if target_delta is None:
            raise ValueError("target_delta is required with target_epsilon (e.g. 1e-5, below 1/N)")
    if target_delta is not None:
        target_delta = check_real(
            "target_delta", target_delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
        )
    return N, n, target_epsilon, target_delta


def _process_group(process_group):
    """The ``Collectives`` of ``process_group`` (None: one process, refused under torchrun)."""
    if process_group is not None:
        from dpmf.distributed import Collectives, TorchCollectives

        return process_group if isinstance(process_group, Collectives) else TorchCollectives(process_group)
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        raise ValueError(
            f"process_group=None is invalid with WORLD_SIZE={world} (started by torchrun?): each "
            "process would train its own copy; call torch.distributed.init_process_group() and "
            "pass process_group=torch.distributed.group.WORLD"
        )
    return None


def make_private(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Dataset,
    *,
    loss_fn,
    batch_size: int,
    epochs: int | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    noise_multiplier: float | None = None,
    factorization: str = "auto",
    scheme: str = "auto",
    schedule: Schedule | None = None,
    clip_norm: float = 1.0,
    accountant: str | None = None,
    seed: int | None = None,
    max_bands: int = 64,
    micro_batch_size: int | None = None,
    clipping: str = "auto",
    num_workers: int = 0,
    collate_fn=None,
    transform=None,
    progress: bool = False,
    process_group=None,
    distributed_mode: str = "sharded",
    noise_keys: str = "chunked",
) -> PrivateTraining:
    """Make ``module``, ``optimizer`` and ``dataset`` a private run with correlated noise; the
    loop and what ``backward`` and ``optimizer.step`` accept are in this module's docstring.

    Args:
        module: the model; no layer that couples examples (no BatchNorm: GroupNorm/LayerNorm).
        optimizer: any ``torch.optim.Optimizer`` over its parameters (SGD, Adam, Muon on 2-D
            weights, …) or a dpmf DP optimizer; private step t uses each group's ``lr`` × χ_t.
        dataset: a map-style Dataset of N examples returning tensors, tuples or dicts.
        loss_fn: ``loss_fn(output, target)`` → mean loss of a batch.
        batch_size: B, the expected batch size, in [1, N].
        epochs, steps: the length, exactly one: n = epochs·⌈N/B⌉ or n = steps.
        target_epsilon, target_delta, noise_multiplier: (ε, δ) to calibrate σ for, or σ > 0
            given (with ``target_delta`` for ``get_epsilon``).
        factorization: ``"auto"`` (``pick``'s choice; needs ``target_epsilon``) or a strategy
            (``identity``, ``bsr:16``, ``bisr:8``, ``blt:4``, …); scheme: ``"auto"`` (pick's, or
            ``dpmf.plan.schemes.auto_scheme``'s for a given strategy) or a scheme name.
        schedule: χ (``dpmf.workloads.Schedule``; the strategy is built for A_χ); clip_norm:
            ζ > 0; accountant: None (the scheme's) or a name.
        seed: None: a secret key (``dpmf.seeds``; in memory and in ``save``, adopted by
            ``resume``); an integer ≥ 0 is the key (reproducible, noise predictable: a notice).
        max_bands: the memory budget of ``"auto"``; micro_batch_size, clipping: as
            ``dpmf.optim.clipping.clipped_sum`` (per-example gradients held at once; method).
        num_workers, collate_fn: the DataLoader's (draws stay in the main process); a
            ``collate_fn`` must treat the examples independently (checked on three examples,
            ``dpmf.train.collate_check``: row j of a collated batch equals example j collated
            alone, up to padding); transform:
            None or ``transform(dataset[i])`` per example as fetched; progress: pick's bars.
        process_group, distributed_mode, noise_keys: one process (None) or a torch.distributed
            group / ``Collectives`` (every rank calls alike; its loader yields its slice of each
            global batch), see ``dpmf.step.ExecutionFlags``.

    Returns:
        ``PrivateTraining``; an earlier run over ``module`` is closed (a notice if it took steps).

    Raises:
        ValueError / TypeError: an invalid argument (named, before any work), a strategy the
            scheme cannot account, a module that couples examples or writes the batch, a
            ``collate_fn`` that couples examples.
    """
    _check_module(module, optimizer, loss_fn, process_group is not None)  # before pick and calibration
    run = _RunArgs.check(
        dataset, batch_size, epochs, steps, target_epsilon, target_delta, noise_multiplier, clip_norm, seed
    )
    loading = _Loading.check(num_workers, transform, collate_fn, dataset)
    schedule = _check_schedule(schedule)
    flags = _flags(clipping, micro_batch_size, noise_keys, distributed_mode)
    comm = _process_group(process_group)  # a bad group fails here, before pick and calibration
    plan = _calibrated_plan(run, factorization, scheme, schedule, accountant, max_bands, progress)
    step = _private_step(plan, module, loss_fn, optimizer, run, comm, flags)
    return _open(module, _private_training(module, optimizer, dataset, plan, step, run, loading))


def _open(module: nn.Module, private: PrivateTraining) -> PrivateTraining:
    """``private`` as the live run over ``module`` (an earlier one closed)."""
    _close_earlier_run(module)
    _LIVE_RUNS[module] = weakref.ref(private)
    return private


@dataclass(frozen=True)
class _RunArgs:
    """The run's validated numbers: N, n, (ε, δ) or σ, ζ and the key policy."""

    dataset_size: int
    steps: int
    batch_size: int
    target_epsilon: float | None
    target_delta: float | None
    noise_multiplier: float | None
    clip_norm: float
    seed: int | None
    policy: seeds.SeedPolicy = field(repr=False)

    @classmethod
    def check(
        cls,
        dataset,
        batch_size,
        epochs,
        steps,
        target_epsilon,
        target_delta,
        noise_multiplier,
        clip_norm,
        seed,
    ):
        N, n, target_epsilon, target_delta = _check_run(
            dataset, batch_size, epochs, steps, target_epsilon, target_delta, noise_multiplier
        )
        clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_inclusive=False)
        policy = seeds.SeedPolicy.of(seed)
        return cls(N, n, batch_size, target_epsilon, target_delta, noise_multiplier, clip_norm, seed, policy)


@dataclass(frozen=True)
class _Loading:
    """How the loader fetches: worker processes, the per-example transform, the collate function."""

    num_workers: int
    transform: object
    collate_fn: object

    @classmethod
    def check(cls, num_workers, transform, collate_fn, dataset):
        num_workers = check_int("num_workers", num_workers, minimum=0)
        if transform is not None and not callable(transform):
            raise TypeError(
                f"transform={transform!r} is invalid: must be callable(example) -> example, or None"
            )
        if collate_fn is not None:  # once, before any work: its rows must not couple the examples
            fetched = dataset if transform is None else TransformedDataset(dataset, transform)
            check_collate_independent(fetched, collate_fn)
        return cls(num_workers, transform, collate_fn)


def _flags(clipping, micro_batch_size, noise_keys, distributed_mode) -> ExecutionFlags:
    """The step's execution flags (checked by ``ExecutionFlags``)."""
    return ExecutionFlags(
        clipping=clipping,
        micro_batch_size=micro_batch_size,
        noise_keys=noise_keys,
        distributed_mode=distributed_mode,
    )


def _check_schedule(schedule) -> Schedule:
    """``schedule``, or the constant one for None."""
    schedule = schedule if schedule is not None else Schedule("constant")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule={schedule!r} is invalid: must be a dpmf.workloads.Schedule or None")
    return schedule


def _calibrated_plan(run: _RunArgs, factorization, scheme, schedule, accountant, max_bands, progress):
    """The run's ``PrivatePlan``: the strategy and scheme resolved (``_resolve``), σ calibrated for
    (ε, δ) or given (its ε accounted when δ is)."""
    spec, scheme_name = _resolve(
        run.dataset_size,
        run.batch_size,
        run.steps,
        factorization,
        scheme,
        schedule,
        run.target_epsilon,
        run.target_delta,
        max_bands,
        run.seed,
        progress,
    )
    plan = PrivatePlan(
        run.dataset_size,
        run.batch_size,
        steps=run.steps,
        scheme=scheme_name,
        strategy=spec,
        schedule=schedule,
        clip_norm=run.clip_norm,
        accountant=accountant,
        seed=run.seed,
    ).with_accountant(seed=0 if run.seed is None else run.seed, progress=progress)
    sigma, delta = run.noise_multiplier, run.target_delta
    if sigma is not None:
        res = plan.account(sigma, delta=delta) if delta is not None else None
        return plan.with_noise(sigma, privacy=res)
    return plan.calibrate(run.target_epsilon, delta)


def _private_step(plan, module, loss_fn, optimizer, run: _RunArgs, comm, flags):
    """The plan's private step over ``module`` (the notice of a given seed first)."""
    if run.policy.notice:
        print(run.policy.notice, file=sys.stderr)
    step = build_step(plan, module, loss_fn, flags, comm, seed=run.policy, optimizer=optimizer)
    for g in optimizer.param_groups:
        check_real("lr", g["lr"], low=0.0)
    return step


def _private_training(module, optimizer, dataset, plan, step, run: _RunArgs, loading: _Loading):
    """The ``PrivateTraining`` over the step: the loader of its batches and the guarded optimizer."""
    from dpmf.optim.schedules import LearningRateSchedule

    if loading.transform is not None:
        dataset = TransformedDataset(dataset, loading.transform)
    loader = PrivateDataLoader(
        dataset,
        step.batches,
        collate_fn=EmptySafeCollate(dataset, loading.collate_fn),
        num_workers=loading.num_workers,
    )
    multipliers = LearningRateSchedule(plan.schedule, plan.steps).multipliers
    return PrivateTraining(
        model=module,
        optimizer=PrivateOptimizer(optimizer, step.privatizer, multipliers),
        data_loader=loader,
        plan=plan,
        privatizer=step.privatizer,
        clip_norm=run.clip_norm,
        seed_given=not step.policy.is_secret,
        _seed=step.key,
        _delta=run.target_delta,
    )


def _close_earlier_run(module: nn.Module) -> None:
    """Close the live run an earlier ``make_private`` made over ``module`` (its ``backward``
    refuses from now on) and, when it took steps, say that the weights carry both runs'
    privacy loss: each run's ledger covers only its own steps, the model's is their
    composition (ε adds up at most, basic composition; Dwork & Roth 2014, Thm 3.16)."""
    ref = _LIVE_RUNS.get(module)
    earlier = None if ref is None else ref()
    if earlier is None or earlier._closed_by_later_run:
        return
    earlier._closed_by_later_run = True
    k = earlier.steps_taken
    if k == 0:
        return
    eps = ""
    if earlier._delta is not None:
        eps = f", ε = {earlier.get_epsilon():.4g} at δ = {earlier._delta:g}"
    print(
        f"notice: this model was already trained by an earlier make_private run ({k} private "
        f"step{'s' if k != 1 else ''}{eps}), now closed: its weights carry the privacy loss of "
        "both runs (composed: the ε add up at most), while this run's ledger covers only its own "
        "steps",
        file=sys.stderr,
    )
