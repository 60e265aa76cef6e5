"""Private LoRA fine-tuning of a GPT-2 language model with correlated noise (offline).

    python examples/hf_lora_finetune.py --optimizer dp-adam --epsilon 8 --factorization auto
    python examples/hf_lora_finetune.py --optimizer dp-muon --factorization blt:4
    python examples/hf_lora_finetune.py --model gpt2      # pretrained weights (needs the hub)

The text task is generated here: one record per person, written as a templated sentence with
private attributes ("<name> lives in <city> and works as a <job> ."), tokenized word by word.
Each record is one example, so (ε, δ) protects whether a person's record was in the training
set. The model is a small GPT-2 built from a local config (2 layers, width 64, the task's
vocabulary: no download); ``--model gpt2`` instead loads the pretrained GPT-2 and its tokenizer
with ``from_pretrained`` (it needs the Hugging Face hub or its cache; not run in the tests).

LoRA adapters (peft) on the attention and projection layers are the only trainable
parameters: ``dpmf.make_private`` clips each example's gradient of the adapters (ghost norms and
book-keeping, ``clipping="auto"``), adds the strategy's correlated noise and leaves the base
weights bit-identical. ``--factorization auto`` lets ``pick`` choose the strategy (banded, BLT,
…) and the batch-sampling scheme for the run; ``bsr:k``/``blt:k`` fix it. Each epoch prints the
held-out loss (next-token cross-entropy, mean over each sentence's tokens) and the ε spent.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

WORDS = {
    "name": "alice bob carol dave erin frank grace heidi ivan judy mallory niaj olivia peggy rupert "
    "sybil trent victor walter xena yusuf zoe".split(),
    "city": "paris london berlin madrid rome vienna prague lisbon dublin oslo warsaw athens".split(),
    "job": "doctor teacher baker pilot nurse farmer lawyer painter chef clerk".split(),
}
TEMPLATES = [
    "{name} lives in {city} and works as a {job} .",
    "the {job} {name} was born in {city} .",
    "{name} , a {job} from {city} , called today .",
]
SPECIAL = ["<pad>", "<bos>", "<eos>"]


def vocabulary() -> list[str]:
    """The word vocabulary of the task (special tokens first)."""
    words = set()
    for t in TEMPLATES:
        words.update(w for w in t.split() if not w.startswith("{"))
    for values in WORDS.values():
        words.update(values)
    return SPECIAL + sorted(words)


def make_records(n: int, seed: int) -> list[str]:
    """``n`` sentences, each a person's record with random private attributes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        fields = {k: rng.choice(v) for k, v in WORDS.items()}
        out.append(rng.choice(TEMPLATES).format(**fields))
    return out


class Records(torch.utils.data.Dataset):
    """Tokenized records: dicts of input_ids, attention_mask, labels (-100 on padding)."""

    def __init__(self, texts: list[str], encode, length: int):
        self.items = []
        for text in texts:
            ids = encode(text)[:length]
            pad = length - len(ids)
            input_ids = torch.tensor(ids + [0] * pad)
            mask = torch.tensor([1] * len(ids) + [0] * pad)
            labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, -100))
            self.items.append({"input_ids": input_ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def build(model_name: str, seed: int, rank: int):
    """(peft model, encode function, sequence length)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    if model_name == "gpt2":  # pretrained weights and tokenizer (hub or local cache)
        tok = transformers.AutoTokenizer.from_pretrained("gpt2")
        base = transformers.GPT2LMHeadModel.from_pretrained("gpt2")

        def encode(text):
            return [tok.bos_token_id] + tok(text)["input_ids"] + [tok.eos_token_id]

        length = 24
    else:
        vocab = vocabulary()
        index = {w: i for i, w in enumerate(vocab)}
        config = transformers.GPT2Config(
            vocab_size=len(vocab),
            n_positions=16,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=1,
            eos_token_id=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        base = transformers.GPT2LMHeadModel(config)

        def encode(text):
            return [1] + [index[w] for w in text.split()] + [2]

        length = 13
    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["c_attn", "c_proj"],
        lora_dropout=0.0,
        fan_in_fan_out=True,
    )
    return peft.get_peft_model(base, lora), encode, length


def make_optimizer(name: str, model, lr: float | None):
    from dpmf.optim import DPAdam, DPMuon, route_parameters

    if name == "dp-adam":
        return DPAdam([p for p in model.parameters() if p.requires_grad], lr=lr or 3e-3)
    return DPMuon(route_parameters(model), lr=lr or 0.02, vector_lr=lr or 0.02)


@torch.no_grad()
def held_out_loss(model, data, loss_fn) -> float:
    """The mean per-sentence loss on held-out records (never the training data)."""
    model.eval()
    batch = {k: torch.stack([d[k] for d in data.items]) for k in data.items[0]}
    x, y = loss_fn.split(batch)
    return float(loss_fn(model(**x), y))


def main(argv=None) -> dict:
    """Run the example; returns {"loss": [held-out loss before and after each epoch],
    "epsilon": [ε after each epoch], "strategy", "scheme", "noise_multiplier"}."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="local", choices=["local", "gpt2"])
    p.add_argument("--optimizer", default="dp-adam", choices=["dp-adam", "dp-muon"])
    p.add_argument("--factorization", default="auto", help="auto (pick), bsr:k, blt:k, identity, …")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--seed", type=int, default=None, help="noise and sampling seed (default: secret)")
    args = p.parse_args(argv)

    import dpmf
    from dpmf.train.hf import causal_lm_loss

    model, encode, length = build(args.model, 0, args.rank)
    texts = make_records(args.records + 500, seed=1)
    train_set = Records(texts[: args.records], encode, length)
    test_set = Records(texts[args.records :], encode, length)
    loss_fn = causal_lm_loss()
    optimizer = make_optimizer(args.optimizer, model, args.lr)
    private = dpmf.make_private(
        model,
        optimizer,
        train_set,
        loss_fn=loss_fn,
        batch_size=args.batch_size,
        epochs=args.epochs,
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        factorization=args.factorization,
        clip_norm=args.clip_norm,
        seed=args.seed,
    )
    plan = private.plan
    sigma = plan.noise_multiplier
    print(f"strategy {plan.label}, scheme {plan.scheme.name}, σ = {sigma:.3f}, {plan.steps} steps")
    losses = [held_out_loss(model, test_set, loss_fn)]
    epsilons = []
    print(f"epoch 0: held-out loss {losses[0]:.3f}")
    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch in private.data_loader:
            private.backward(batch, return_loss=False)
            private.optimizer.step()
            private.optimizer.zero_grad()
        losses.append(held_out_loss(model, test_set, loss_fn))
        epsilons.append(private.get_epsilon())
        print(f"epoch {epoch}: held-out loss {losses[-1]:.3f}, ε = {epsilons[-1]:.2f} (δ = {args.delta:g})")
    return {
        "loss": losses,
        "epsilon": epsilons,
        "strategy": plan.label,
        "scheme": plan.scheme.name,
        "noise_multiplier": plan.noise_multiplier,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
