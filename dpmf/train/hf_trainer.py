"""transformers' ``Trainer`` driving dpmf's private step: ``PrivateTrainer``.

    private = dpmf.make_private(model, optimizer, dataset, loss_fn=causal_lm_loss(), batch_size=64,
                                epochs=3, target_epsilon=8.0, target_delta=1e-5)
    args = TrainingArguments(output_dir="out", max_grad_norm=0.0, logging_steps=10, save_steps=100)
    PrivateTrainer(private, args).train()

What the Trainer does and what dpmf does:

- **Batches**: the Trainer iterates ``private.data_loader`` (the plan's sampler: Poisson
  batches, not the Trainer's shuffled fixed-size ones); ``train_dataset`` and
  ``data_collator`` are make_private's, not the Trainer's.
- **The step**: ``training_step`` is ``private.backward(batch)`` (per-example clipping, the
  step's correlated noise) and the Trainer's ``optimizer.step()`` is the guarded
  ``private.optimizer``'s. ``compute_loss`` is not used for training (the loss is make_private's
  ``loss_fn``); evaluation is the Trainer's own.
- **Steps**: ``max_steps`` is the plan's step count (left at -1 it is set to it; another value is
  refused). Gradient accumulation is refused (``gradient_accumulation_steps`` must be 1: one
  private step takes the whole sampled batch; bound its memory with make_private's
  ``micro_batch_size``), as is the Trainer's clipping of the summed gradient
  (``max_grad_norm`` must be 0: the clipping that bounds the sensitivity is per example, ζ).
- **Learning rate**: the schedule is the plan's (make_private's ``schedule``, part of the
  workload the strategy was optimised for); the Trainer's scheduler is constant
  (``lr_scheduler_type`` ``"linear"`` — the default — or ``"constant"``, no warm-up; another is
  refused). A scheduler passed as ``lr_scheduler`` is used as given.
- **Logs**: every log entry carries ``epsilon`` (ε spent so far) and ``delta``; each checkpoint
  holds ``dpmf_ledger.json`` (ε with its accountant, guarantee and what it protects). The
  logged ``grad_norm`` is that of the private (noised) gradient; the logged ``loss`` is the
  sampled batches' mean loss, a non-private statistic (as ``backward``'s). What would publish
  the sizes of the sampled batches is off: ``include_num_input_tokens_seen`` is refused and
  ``total_flos`` is 0.
- **Not used**: ``num_train_epochs`` and ``per_device_train_batch_size`` (the plan's steps and
  batches are make_private's ``epochs``/``steps`` and ``batch_size``). The optimizer is
  make_private's: a ``learning_rate`` other than the Trainer's default and the optimizer's own,
  or a ``weight_decay``, is refused rather than ignored.
- **Checkpoints**: each of the Trainer's checkpoints holds ``dpmf_state.pt``, the run's secret
  state (noise key and buffers, sampler position; file mode 0600). ``train(resume_from_checkpoint=…)``
  resumes it (the model's trainable weights included) with the Trainer's own state, optimizer
  and scheduler; a checkpoint without it is refused. The Trainer
  does not skip batches on resume (``ignore_data_skip``): dpmf's sampler resumes its own position.

This module imports transformers; ``dpmf.train.hf`` does not.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from dpmf._io import atomic_write_json
from dpmf.train.private import PrivateTraining

__all__ = ["PrivateTrainer", "STATE_NAME", "LEDGER_NAME"]

STATE_NAME = "dpmf_state.pt"
LEDGER_NAME = "dpmf_ledger.json"
_OWN = (  # the private run's: not the Trainer's to set
    "model",
    "train_dataset",
    "data_collator",
    "optimizers",
    "compute_loss_func",
    "optimizer_cls_and_kwargs",
)
_CONSTANT = ("linear", "constant")


def _trainer_args(args, steps: int, optimizer=None):
    """The Trainer's arguments for a private run of ``steps`` steps (see the module)."""
    if not isinstance(args, transformers.TrainingArguments):
        raise TypeError(f"args={type(args).__name__} is invalid: must be a transformers.TrainingArguments")
    _check_optimizer_settings(args, optimizer)
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} is invalid: must be 1, a "
            "private step takes the whole sampled batch; bound its memory with "
            "make_private(micro_batch_size=…)"
        )
    if args.max_grad_norm:
        raise ValueError(
            f"max_grad_norm={args.max_grad_norm} is invalid: must be 0 with PrivateTrainer (each example is "
            "clipped to make_private's clip norm; clipping the noised sum again changes the step)"
        )
    if args.max_steps not in (-1, steps):
        raise ValueError(
            f"max_steps={args.max_steps} is invalid: the private plan has {steps} steps; leave max_steps at "
            "-1 (it is set to the plan's) or change make_private's steps/epochs"
        )
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if kind not in _CONSTANT:
        raise ValueError(
            f"lr_scheduler_type={kind!r} is invalid: the learning-rate schedule is the plan's, "
            "make_private(schedule=…); leave the Trainer's at its default, or pass lr_scheduler= to "
            "PrivateTrainer"
        )
    for name in ("warmup_steps", "warmup_ratio"):
        if getattr(args, name, 0):
            raise ValueError(
                f"{name}={getattr(args, name)} is invalid: the learning-rate schedule, warm-up included, is "
                "the plan's, make_private(schedule=…) (a warm-up is part of the workload the strategy "
                "is optimised for); leave it at 0, or pass lr_scheduler= to PrivateTrainer"
            )
    tokens = args.include_num_input_tokens_seen
    if tokens not in (False, None, "no"):
        raise ValueError(
            f"include_num_input_tokens_seen={tokens!r} is invalid: the Trainer would log the tokens of "
            "each sampled batch, and a Poisson batch's size depends on who is in the data set (not "
            "covered by ε); leave it at 'no'"
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"n_gpu={args.n_gpu} is invalid: the Trainer would wrap the model in DataParallel; run one "
            "process per GPU with torchrun and make_private(process_group=…), or set CUDA_VISIBLE_DEVICES"
        )
    return dataclasses.replace(args, max_steps=steps, ignore_data_skip=True)


def _check_optimizer_settings(args, optimizer) -> None:
    """Refuse the Trainer's optimizer settings that make_private's optimizer would silently
    override: a ``learning_rate`` other than both the Trainer's default and the optimizer's
    learning rate, and any ``weight_decay`` (the optimizer's own is what steps)."""
    default = transformers.TrainingArguments.__dataclass_fields__["learning_rate"].default
    lrs = sorted({g["lr"] for g in getattr(optimizer, "param_groups", ())})
    if args.learning_rate != default and args.learning_rate not in lrs:
        raise ValueError(
            f"learning_rate={args.learning_rate} is invalid: the optimizer is make_private's and steps "
            f"with its own learning rate ({', '.join(map(str, lrs)) or 'unknown'}); set lr on the optimizer "
            "given to make_private, and leave learning_rate at its default"
        )
    if args.weight_decay:
        raise ValueError(
            f"weight_decay={args.weight_decay} is invalid: the optimizer is make_private's and its own "
            "weight decay is what steps; give it to that optimizer (e.g. DPAdam(…, weight_decay=…)) and "
            "leave weight_decay at 0"
        )


class PrivateTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose training steps are ``private``'s (see the module).

    Args:
        private: the run, from ``dpmf.make_private`` (its model, optimizer, data and loss).
        args: the ``TrainingArguments`` (``max_grad_norm=0``; see the module for the rest).
        lr_scheduler: a torch scheduler on ``private.optimizer``; default constant.
        **kwargs: the Trainer's other arguments (``eval_dataset``, ``callbacks``,
            ``compute_metrics``, …).

    Raises:
        TypeError: ``private`` is not a ``PrivateTraining``, or an argument that is make_private's
            (``model``, ``train_dataset``, ``data_collator``, ``optimizers``, …) is given.
        ValueError: arguments that would change the private step (see the module).
    """

    def __init__(self, private: PrivateTraining, args, *, lr_scheduler=None, **kwargs):
        if not isinstance(private, PrivateTraining):
            raise TypeError(
                f"private={type(private).__name__} is invalid: must be the result of dpmf.make_private"
            )
        given = sorted(k for k in _OWN if k in kwargs)
        if given:
            raise TypeError(
                f"{given[0]} is invalid for PrivateTrainer: make_private's run sets it (model, data, "
                "loss and optimizer come from the private run)"
            )
        args = _trainer_args(args, private.plan.steps, private.optimizer)
        if lr_scheduler is None:
            lr_scheduler = torch.optim.lr_scheduler.LambdaLR(private.optimizer, lambda step: 1.0)
        self.private = private
        optimizers = (private.optimizer, lr_scheduler)
        super().__init__(model=private.model, args=args, optimizers=optimizers, **kwargs)

    def floating_point_ops(self, inputs) -> int:
        """0: the Trainer's FLOP count (``total_flos``) adds the tokens of every sampled batch,
        whose sizes depend on who is in the data set."""
        return 0

    def get_train_dataloader(self):
        """The plan's loader (``private.data_loader``)."""
        return self.private.data_loader

    def training_step(self, model, inputs, num_items_in_batch=None):
        """``private.backward`` on the sampled batch; the batch's mean loss (detached)."""
        model.train()
        loss = self.private.backward(self._prepare_inputs(inputs))
        return loss.to(self.args.device, torch.float32)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """The Trainer's log entry with ``epsilon`` (spent so far) and ``delta``."""
        delta = self.private.target_delta
        if delta is not None:
            logs = {**logs, "epsilon": self.private.get_epsilon(), "delta": delta}
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder the Trainer wrote
        folder = os.path.join(self._get_output_dir(trial=trial), name)
        self.private.save(os.path.join(folder, STATE_NAME), overwrite=True)
        if self.private.target_delta is not None:
            atomic_write_json(os.path.join(folder, LEDGER_NAME), self.private.ledger())

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Nothing: the model's trainable weights come from the private state (``train``), which
        checks them against the run; the Trainer loads its own state, optimizer and scheduler."""

    def train(self, resume_from_checkpoint=None, **kwargs):
        """The Trainer's ``train``; a resume first restores the private run's state.

        Raises:
            ValueError: the checkpoint holds no ``dpmf_state.pt`` (not saved by PrivateTrainer), or
            the run has taken all its steps.
        """
        if resume_from_checkpoint is True or resume_from_checkpoint == "last":
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint is invalid: no checkpoint in {self.args.output_dir!r}"
                )
        if not resume_from_checkpoint and self.private.steps_taken >= self.private.plan.steps:
            raise ValueError(
                f"train() is invalid here: the private run has taken all its {self.private.plan.steps} "
                "steps (ε is spent as planned); build a new run with make_private to train again"
            )
        if resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, STATE_NAME)
            if not os.path.isfile(path):
                raise ValueError(
                    f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is invalid: it holds no "
                    f"{STATE_NAME} (the private run's state); resume from a checkpoint PrivateTrainer saved"
                )
            self.private.resume(path)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
