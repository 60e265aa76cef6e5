"""transformers' Trainer driving the private step (``dpmf.train.hf_trainer.PrivateTrainer``)."""

import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra hf)")
pytest.importorskip("peft", reason="peft is not installed (extra hf)")
dp_accounting = pytest.importorskip("dp_accounting")

from test_hf import Dicts, gpt2, loop_reference, train  # noqa: E402

import dpmf  # noqa: E402
from dpmf.optim.privatize import StepStage  # noqa: E402
from dpmf.train.hf import causal_lm_loss  # noqa: E402
from dpmf.train.hf_trainer import LEDGER_NAME, STATE_NAME, PrivateTrainer  # noqa: E402

pytestmark = pytest.mark.torch

N, B, STEPS, SIGMA, DELTA = 32, 8, 4, 1.0, 1e-5


class Recorder(StepStage):
    """Keeps each step's batch (as the step clips it) and clipped sums (before the noise)."""

    def __init__(self):
        self.batches, self.sums = [], []

    def select(self, step, inputs, targets, example_ids):
        self.batches.append((inputs, targets))
        return inputs, targets, example_ids

    def before_release(self, step, params, sums):
        self.sums.append(torch.cat([s.detach().flatten().clone() for s in sums]))


def tiny_gpt2():
    """GPT-2 + LoRA without dropout (the Trainer trains in train mode; the reference is one)."""
    model = gpt2(True)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def private_run(seed=0, clip_norm=0.05):
    model = tiny_gpt2()
    return dpmf.make_private(
        model,
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        Dicts(N),
        loss_fn=causal_lm_loss(),
        batch_size=B,
        steps=STEPS,
        noise_multiplier=SIGMA,
        clip_norm=clip_norm,
        target_delta=DELTA,
        factorization="identity",
        seed=seed,
    )


def args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        max_grad_norm=0.0,
        logging_steps=1,
        save_steps=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**base, **kw})


def dp_sgd_epsilon(steps):
    """ε of Poisson-sampled Gaussian steps from dp-accounting's PLD accountant."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(SIGMA)), steps
    )
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(DELTA)


def test_trainer_train_runs_the_private_step(tmp_path):
    private = private_run()
    recorder = Recorder()
    private.privatizer.set_stage(recorder)
    trainer = PrivateTrainer(private, args(tmp_path))
    trainer.train()
    assert private.steps_taken == STEPS and trainer.state.global_step == STEPS
    # nothing logged counts the sampled batches' examples or tokens
    assert trainer.state.total_flos == 0 and trainer.state.num_input_tokens_seen == 0
    with pytest.raises(ValueError, match="has taken all its 4 steps"):
        trainer.train()
    # one step's clipped sum: the loop of single-example backward passes on the step's batch
    inputs, targets = recorder.batches[0]
    _, ref = loop_reference(tiny_gpt2(), causal_lm_loss(), inputs, targets, private.clip_norm)
    torch.testing.assert_close(recorder.sums[0], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # ε in the Trainer's logs: dpmf's, and dp-accounting's for these DP-SGD steps
    logged = [e for e in trainer.state.log_history if "epsilon" in e and "loss" in e]
    assert [e["step"] for e in logged] == list(range(1, STEPS + 1))
    assert logged[-1]["epsilon"] == pytest.approx(private.get_epsilon())
    for e in logged:
        assert e["epsilon"] == pytest.approx(dp_sgd_epsilon(e["step"]), rel=2e-3)
        assert e["delta"] == DELTA
    # each checkpoint holds the secret state at 0600 and the ledger
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        mode = stat.S_IMODE(os.stat(folder / STATE_NAME).st_mode)
        assert mode == 0o600, oct(mode)
        ledger = json.loads((folder / LEDGER_NAME).read_text())
        assert ledger["steps_taken"] == step


def test_the_trainer_gives_the_weights_of_dpmfs_own_loop(tmp_path):
    """Same seed, same plan: the Trainer's run and make_private's loop are the same steps."""
    private = private_run(seed=3)
    PrivateTrainer(private, args(tmp_path, save_strategy="no")).train()
    own = private_run(seed=3)
    train(own, STEPS)
    for (n, a), (_, b) in zip(private.model.named_parameters(), own.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_resume_from_a_trainer_checkpoint_continues_the_run(tmp_path):
    whole = private_run(seed=5)
    PrivateTrainer(whole, args(tmp_path / "whole", save_strategy="no")).train()
    first = private_run(seed=5)
    trainer = PrivateTrainer(first, args(tmp_path / "cut"))
    trainer.callback_handler.add_callback(_StopAt(2))
    trainer.train()
    assert first.steps_taken == 2
    second = private_run(seed=5)
    PrivateTrainer(second, args(tmp_path / "cut")).train(resume_from_checkpoint=True)
    assert second.steps_taken == STEPS
    for (n, a), (_, b) in zip(whole.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2 is invalid"),
        ({"max_grad_norm": 1.0}, "max_grad_norm=1.0 is invalid"),
        ({"max_steps": 9}, "max_steps=9 is invalid: the private plan has 4 steps"),
        ({"lr_scheduler_type": "cosine"}, "lr_scheduler_type='cosine'"),
        ({"warmup_steps": 2}, "warmup_steps=2 is invalid: the learning-rate schedule, warm-up included"),
        # the optimizer is make_private's (SGD, lr 0.5): the Trainer's would be ignored
        ({"learning_rate": 1e-3}, r"learning_rate=0.001 is invalid: .* own learning rate \(0.5\)"),
        ({"weight_decay": 0.01}, "weight_decay=0.01 is invalid"),
        ({"include_num_input_tokens_seen": "all"}, "include_num_input_tokens_seen='all' is invalid"),
    ],
)
def test_arguments_that_would_change_the_private_step_are_refused(tmp_path, kw, match):
    private = private_run()
    with pytest.raises(ValueError, match=match):
        PrivateTrainer(private, args(tmp_path, **kw))
    with pytest.raises(TypeError, match="train_dataset is invalid for PrivateTrainer"):
        PrivateTrainer(private, args(tmp_path), train_dataset=Dicts(N))
    assert private.steps_taken == 0


def test_the_optimizers_own_learning_rate_given_to_the_trainer_is_accepted(tmp_path):
    PrivateTrainer(private_run(), args(tmp_path, learning_rate=0.5))


def test_a_checkpoint_without_the_private_state_is_refused(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    trainer = PrivateTrainer(private_run(), args(tmp_path))
    with pytest.raises(ValueError, match=f"holds no {STATE_NAME}"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
