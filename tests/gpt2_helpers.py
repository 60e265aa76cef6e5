"""A tiny GPT-2 (LoRA adapters through peft), a Hugging Face-style dict data set of token ids, and
make_private over them: shared by the tests of private runs on dict data."""

import pytest
import torch

import dpmf
from dpmf.train.hf import causal_lm_loss

VOCAB, T = 100, 8


def gpt2(lora=True):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra hf)")
    peft = pytest.importorskip("peft", reason="peft is not installed (extra hf)")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    if lora:
        config = peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True
        )
        model = peft.get_peft_model(model, config)
    return model.eval()


class DictData(torch.utils.data.Dataset):
    """A Hugging Face-style map-style data set of dicts (not a TensorDataset)."""

    def __init__(self, n=32, order=None):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (n, T), generator=g)
        self.order = list(range(n)) if order is None else list(order)

    def __len__(self):
        return len(self.order)

    def __getitem__(self, i):
        ids = self.ids[self.order[i]]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def private_run(model=None, data=None, **kw):
    model = gpt2() if model is None else model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    args = dict(
        loss_fn=causal_lm_loss(),
        batch_size=8,
        steps=4,
        noise_multiplier=1.0,
        factorization="identity",
        scheme="poisson",
        seed=3,
    )
    args.update(kw)
    return dpmf.make_private(model, opt, DictData() if data is None else data, **args)
