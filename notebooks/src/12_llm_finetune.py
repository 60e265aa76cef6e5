# %% [markdown]
# # 12 · Private LoRA fine-tuning of a language model
#
# **Question.** How do I fine-tune a Hugging Face language model with differential privacy —
# LoRA adapters, correlated noise, DP-Adam or DP-Muon — and what does privacy cost in held-out
# loss at ε = 8 and ε = 2?
#
# The model is a small GPT-2 built from a local config (no download), with peft's LoRA adapters on
# its attention and projection layers: only the adapters train. The data are records generated
# here, one per person ("<name> lives in <city> and works as a <job> ."), so (ε, δ) protects
# whether a person's record was used. `dpmf.make_private` takes the peft model as it is; the
# loss `dpmf.train.hf.causal_lm_loss()` splits each batch (a dict of `input_ids`,
# `attention_mask`, `labels`) and gives each sentence's loss as the mean over its own tokens, so
# padding never enters another example's gradient. The code is that of
# `examples/hf_lora_finetune.py`, whose functions are imported here.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DPMF_NOTEBOOK_SIZE", "full")
RECORDS = 200 if SIZE == "small" else 2000
EPOCHS = 1 if SIZE == "small" else 3
BATCH = 50 if SIZE == "small" else 100
FACTORIZATION = "bsr:2" if SIZE == "small" else "auto"  # auto: pick chooses per run
SEED = 0  # a given seed makes the run reproducible (and its noise predictable); omit it in production

# %%
import importlib.util
import sys
import warnings
from pathlib import Path

# two warnings from the libraries, not from dpmf: tqdm in a kernel without ipywidgets, and peft
# calling a transformers method deprecated in 5.x
warnings.filterwarnings("ignore", message="IProgress not found")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)

import matplotlib.pyplot as plt
import torch

import dpmf
from dpmf.train.hf import causal_lm_loss

path = Path("..") / "examples" / "hf_lora_finetune.py"
spec = importlib.util.spec_from_file_location("hf_lora_finetune", path)
example = importlib.util.module_from_spec(spec)
sys.modules["hf_lora_finetune"] = example
spec.loader.exec_module(example)
print(example.make_records(3, seed=1))

# %% [markdown]
# ## One run, step by step
#
# Four statements beyond a plain loop: `make_private`, `backward(batch)` (per-example gradients
# of the adapters by ghost norms and book-keeping, clipping, sum, the step's correlated noise),
# the guarded `step`, and `get_epsilon`. The frozen base weights are checked to be bit-identical
# afterwards.

# %%
model, encode, length = example.build("local", seed=0, rank=8)
texts = example.make_records(RECORDS + 300, seed=1)
train_set = example.Records(texts[:RECORDS], encode, length)
test_set = example.Records(texts[RECORDS:], encode, length)
frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
print(
    f"trainable {sum(p.numel() for p in model.parameters() if p.requires_grad)} of "
    f"{sum(p.numel() for p in model.parameters())} parameters"
)

loss_fn = causal_lm_loss()


def private_run(model):
    """DP-Adam on the adapters, at ε = 8."""
    optimizer = dpmf.optim.DPAdam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    return dpmf.make_private(
        model,
        optimizer,
        train_set,
        loss_fn=loss_fn,
        batch_size=BATCH,
        epochs=EPOCHS,
        target_epsilon=8.0,
        target_delta=1e-5,
        factorization="bsr:4",
        seed=SEED,
    )


private = private_run(model)
for epoch in range(EPOCHS):
    model.train()
    for batch in private.data_loader:
        private.backward(batch, return_loss=False)
        private.optimizer.step()
        private.optimizer.zero_grad()
    print(
        f"epoch {epoch + 1}: held-out loss {example.held_out_loss(model, test_set, loss_fn):.3f}, "
        f"ε = {private.get_epsilon():.2f}"
    )
assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
print("frozen base weights unchanged:", len(frozen), "tensors")

# %% [markdown]
# ## The same run with transformers' `Trainer`
#
# `PrivateTrainer` runs `Trainer.train()` on a `make_private` run: the Trainer iterates the
# plan's loader, its training step is `private.backward`, its optimizer the guarded one, and
# each log entry carries ε. What would change the private step is refused before training
# (gradient accumulation, the Trainer's clipping of the summed gradient — hence
# `max_grad_norm=0` —, a schedule or step count of its own). With the same seed and plan, it
# takes exactly the steps of the loop above: the weights come out equal.

# %%
import tempfile

from transformers import TrainingArguments

from dpmf.train.hf_trainer import PrivateTrainer

looped = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
model, encode, length = example.build("local", seed=0, rank=8)
private = private_run(model)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(
        output_dir=out,
        max_grad_norm=0.0,
        logging_steps=private.plan.steps_per_epoch,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = PrivateTrainer(private, args)
    trainer.train()
for entry in trainer.state.log_history:
    if "loss" in entry:
        print(f"step {entry['step']}: training loss {entry['loss']:.3f}, ε = {entry['epsilon']:.2f}")
print(f"held-out loss {example.held_out_loss(model, test_set, loss_fn):.3f}")
same = all(torch.equal(p, looped[n]) for n, p in model.named_parameters() if p.requires_grad)
print("the Trainer's adapters equal the loop's:", same)

# %% [markdown]
# ## DP-Adam and DP-Muon at two privacy levels
#
# `--factorization auto` lets `pick` choose the strategy and the batch-sampling scheme for each
# run; the held-out loss (next-token cross-entropy, mean per sentence) is recorded each epoch.

# %%
results = {}
for optimizer_name in ("dp-adam", "dp-muon"):
    for epsilon in (2.0, 8.0):
        args = (
            f"--optimizer {optimizer_name} --epsilon {epsilon} --records {RECORDS} "
            f"--batch-size {BATCH} --epochs {EPOCHS} --seed {SEED} --factorization {FACTORIZATION}"
        )
        results[(optimizer_name, epsilon)] = example.main(args.split())

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for (name, eps), out in results.items():
    ax.plot(
        range(len(out["loss"])),
        out["loss"],
        marker="o",
        label=f"{name}, ε = {eps:g} ({out['strategy']}, σ = {out['noise_multiplier']:.2f})",
    )
ax.set_xlabel("epoch")
ax.set_ylabel("held-out loss")
ax.set_title("LoRA fine-tuning of a small GPT-2")
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Reading.** Training only the adapters, every run lowers the held-out loss from about
# log(vocabulary) ≈ 4.1 — the untrained model's — and a larger ε (less noise) lowers it further.
# In this run DP-Muon ends lower than DP-Adam at both privacy levels, and `pick` chose a banded
# strategy with cyclic Poisson sampling at ε = 2 and a dense one at ε = 8.
# The base model here is random, so what the adapters learn is limited; with pretrained weights
# (`python examples/hf_lora_finetune.py --model gpt2`, which needs the Hugging Face hub) the same
# code fine-tunes GPT-2 itself. Numbers at this size are from one seed: compare curves, not
# digits.
