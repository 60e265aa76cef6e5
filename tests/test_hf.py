"""Private fine-tuning of Hugging Face models (tiny configs, no weights downloaded)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra hf)")
peft = pytest.importorskip("peft", reason="peft is not installed (extra hf)")

import dpmf  # noqa: E402
from dpmf.optim.clipping import clipped_sum  # noqa: E402
from dpmf.optim.ghost import ghost_layer_kinds  # noqa: E402
from dpmf.train.hf import causal_lm_loss, sequence_classification_loss  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB, T = 97, 8


def gpt2(lora=True, seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    cfg._attn_implementation = attn
    model = transformers.GPT2LMHeadModel(cfg)
    if lora:
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0, fan_in_fan_out=True
        )
        model = peft.get_peft_model(model, config)
    return model.eval()


def bert(lora=True, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=16,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(cfg)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
        model = peft.get_peft_model(model, config)
    return model.eval()


def llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def batch(b=4, seed=0, classes=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, T), generator=g)
    mask = torch.ones(b, T, dtype=torch.long)
    mask[0, 5:] = 0  # right padding
    if b > 2:
        mask[2, 3:] = 0
    ids[mask == 0] = 0
    labels = torch.randint(0, classes, (b,), generator=g) if classes else ids.clone()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loop_reference(model, loss, x, y, zeta):
    """Norms and the clipped sum from one ordinary backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x["input_ids"].shape[0]):
        xi = {k: v[i : i + 1] for k, v in x.items()}
        yi = {k: v[i : i + 1] for k, v in y.items()} if isinstance(y, dict) else y[i : i + 1]
        g = torch.autograd.grad(loss(model(**xi), yi), params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if t is None else t).flatten() for p, t in zip(params, g, strict=True)]
            )
        )
    per = torch.stack(rows)
    norms = per.norm(dim=1)
    return norms, (per * torch.clamp(zeta / norms, max=1.0)[:, None]).sum(0)


def flat(grads):
    return torch.cat([g.flatten() for g in grads])


CASES = {
    "gpt2-lora": (lambda: gpt2(True), causal_lm_loss(), None),
    "gpt2-full": (lambda: gpt2(False), causal_lm_loss(), None),  # tied input/output embeddings
    "bert-lora": (lambda: bert(True), sequence_classification_loss(), 3),
    "bert-full": (lambda: bert(False), sequence_classification_loss(), 3),
    "llama-full": (llama, causal_lm_loss(), None),  # LlamaRMSNorm's handler
}


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_sum_equals_a_loop_of_backward_passes_without_torch_func(name):
    build, loss, classes = CASES[name]
    model = build()
    x, y = loss.split(batch(classes=classes))
    assert "generic" not in ghost_layer_kinds(model).values()  # Conv1D, LoRA, embeddings, norms
    _every_mode_equals_the_loop(model, loss, x, y)


def _every_mode_equals_the_loop(model, loss, x, y):
    """auto, bk and ghost, without a torch.func fallback, equal the loop of single-example
    backward passes at a ζ that clips half the examples; returns each mode's ``ClippedSum``."""
    ref_norms, _ = loop_reference(model, loss, x, y, 1.0)
    zeta = float(ref_norms.median())
    ref_norms, ref = loop_reference(model, loss, x, y, zeta)
    outs = []
    for mode in ("auto", "bk", "ghost"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*torch.func path")  # no fallback
            out = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping=mode)
        assert out.method == ("bk" if mode == "auto" else mode)
        torch.testing.assert_close(out.norms.float(), ref_norms, rtol=1e-5, atol=0)
        torch.testing.assert_close(flat(out.grads), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        outs.append(out)
    return outs


def test_lora_gpt2_per_example_gradients_equal_vmap():
    # torch.func runs transformers' eager attention (its SDPA mask code has data-dependent branches)
    model = gpt2(True, attn="eager")
    loss = causal_lm_loss()
    x, y = loss.split(batch(b=5, seed=3))
    ref = clipped_sum(model, loss, x, y, clip_norm=1.0, clipping="vmap")
    zeta = float(ref.norms.median())
    ref = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="vmap")
    for i in range(5):  # each example's clipped gradient: a batch of one against vmap's
        one = {k: v[i : i + 1] for k, v in x.items()}, {k: v[i : i + 1] for k, v in y.items()}
        a = clipped_sum(model, loss, *one, clip_norm=zeta, clipping="bk")
        b = clipped_sum(model, loss, *one, clip_norm=zeta, clipping="vmap")
        torch.testing.assert_close(flat(a.grads), flat(b.grads), rtol=1e-5, atol=1e-7)
    out = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="auto")
    assert out.method == "bk"
    torch.testing.assert_close(out.norms, ref.norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(flat(out.grads), flat(ref.grads), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tokens", [8, 20])  # 20: the embedding's sparse norm (> 16 tokens)
def test_tied_embeddings_are_clipped_without_per_example_gradients_equal_to_vmap(monkeypatch, tokens):
    # GPT-2's input embedding is also its output layer: the per-example gradient is the sum of the
    # lookup's scatter and the output projection, whose squared norm has a cross term
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    cfg._attn_implementation = "eager"  # torch.func needs transformers' eager attention
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    for p in model.parameters():  # only the tied weight trains: its norm is the whole norm
        p.requires_grad_(p is model.lm_head.weight)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (4, tokens), generator=g)
    ids[0, : tokens // 2] = 7  # repeated tokens in one example
    mask = torch.ones_like(ids)
    mask[1, tokens - 3 :] = 0
    loss = causal_lm_loss()
    x, y = loss.split({"input_ids": ids * mask, "attention_mask": mask, "labels": ids * mask})
    ref = clipped_sum(model, loss, x, y, clip_norm=1.0, clipping="vmap")
    zeta = float(ref.norms.median())
    ref = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="vmap")

    def instantiated(*args, **kwargs):
        raise AssertionError("a (b, V, d) per-example embedding gradient was instantiated")

    monkeypatch.setattr(dpmf.optim.clipping_layers.embedding.EmbeddingHandler, "per_example", instantiated)
    for mode in ("bk", "ghost"):
        out = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping=mode)
        torch.testing.assert_close(out.norms, ref.norms, rtol=1e-5, atol=0)
        scale = float(flat(ref.grads).abs().max())
        torch.testing.assert_close(flat(out.grads), flat(ref.grads), rtol=1e-5, atol=1e-5 * scale)


def test_padding_never_changes_an_examples_clipped_gradient():
    model = gpt2(True)
    loss = causal_lm_loss()
    data = batch(b=2)  # example 0 (A) is padded after 5 tokens, example 1 (B) is not
    x, y = loss.split(data)
    changed = {k: v.clone() for k, v in data.items()}
    changed["input_ids"][0, 6] = 42  # a padded position of A
    changed["labels"][0, 6] = 42
    x2, y2 = loss.split(changed)
    zeta = 1e-3  # both clipped: the sum is ζ·(unit A + unit B)
    one = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="bk")
    two = clipped_sum(model, loss, x2, y2, clip_norm=zeta, clipping="bk")
    torch.testing.assert_close(one.norms, two.norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(flat(one.grads), flat(two.grads), rtol=1e-5, atol=1e-9)
    # A's gradient is that of its 5 real tokens alone, B's that of B alone
    short = {k: v[:1, :5] for k, v in data.items()}
    alone_a = clipped_sum(model, loss, *loss.split(short), clip_norm=zeta, clipping="bk")
    alone_b = clipped_sum(model, loss, *loss.split({k: v[1:] for k, v in data.items()}), clip_norm=zeta)
    torch.testing.assert_close(
        two.norms.float(), torch.cat([alone_a.norms, alone_b.norms]).float(), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        flat(two.grads), flat(alone_a.grads) + flat(alone_b.grads), rtol=1e-4, atol=1e-9
    )


def test_token_mean_and_sum_losses_per_example():
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[1, 2, 3, 4], [0, 1, -100, 2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    target = {"labels": labels, "attention_mask": mask}
    ce = torch.nn.functional.cross_entropy
    a = [ce(logits[0, t], labels[0, t + 1]) for t in (0, 1)]  # position 3 is padding
    b = [ce(logits[1, t], labels[1, t + 1]) for t in (0, 2)]  # label -100 at 2
    mean = causal_lm_loss().per_example(logits, target)
    total = causal_lm_loss("sum").per_example(logits, target)
    torch.testing.assert_close(mean, torch.stack([sum(a) / 2, sum(b) / 2]))
    torch.testing.assert_close(total, torch.stack([sum(a), sum(b)]))
    with pytest.raises(ValueError, match="reduction='max' is invalid"):
        causal_lm_loss("max")


class Dicts(torch.utils.data.Dataset):
    def __init__(self, n=32, classes=None):
        self.data = batch(n, seed=7, classes=classes)

    def __len__(self):
        return self.data["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


def private_run(model, loss, steps, seed=0, classes=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return dpmf.make_private(
        model,
        opt,
        Dicts(classes=classes),
        loss_fn=loss,
        batch_size=8,
        steps=steps,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="bsr:2",
        seed=seed,
    )


def train(private, steps):
    done = 0
    while done < steps:
        for data in private.data_loader:
            private.backward(data)
            private.optimizer.step()
            private.optimizer.zero_grad()
            done += 1
            if done == steps:  # before the loader draws the next batch
                break


@pytest.mark.parametrize("which", ["gpt2", "bert", "gpt2-full"])
def test_make_private_trains_only_the_adapter(which, tmp_path):
    model = {"gpt2": lambda: gpt2(True), "bert": lambda: bert(True), "gpt2-full": lambda: gpt2(False)}[
        which
    ]()
    loss = sequence_classification_loss() if which == "bert" else causal_lm_loss()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    private = private_run(model, loss, 3, classes=3 if which == "bert" else None)
    assert private.privatizer.noise.dim == sum(p.numel() for p in trainable.values())
    train(private, 3)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # bit-identical
    assert all(not torch.equal(p, trainable[n]) for n, p in model.named_parameters() if n in trainable)
    state = private.state_dict()["model"]
    if frozen:  # the trainable tensors only, with the frozen weights' digest
        assert set(state["tensors"]) >= set(trainable) and not set(state["tensors"]) & set(frozen)
    else:  # full fine-tuning (tied embeddings included): the whole state_dict
        assert set(state) == set(model.state_dict())
    assert private.privatizer.last_step is not None


def test_resume_gives_the_weights_of_an_uninterrupted_run(tmp_path):
    loss = causal_lm_loss()
    whole = private_run(gpt2(True), loss, 4, seed=5)
    train(whole, 4)
    first = private_run(gpt2(True), loss, 4, seed=5)
    train(first, 2)
    first.save(str(tmp_path / "ck.pt"))
    second = private_run(gpt2(True), loss, 4, seed=5)
    second.resume(str(tmp_path / "ck.pt"))
    train(second, 2)
    for (n, a), (_, b) in zip(whole.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    other = private_run(gpt2(True, seed=1), loss, 4, seed=5)  # another base model: refused
    with pytest.raises(ValueError, match="frozen weights differ"):
        other.resume(str(tmp_path / "ck.pt"))
    assert other.steps_taken == 0  # refused before anything was loaded


def test_bf16_autocast_on_cpu():
    model = gpt2(True)
    loss = causal_lm_loss()
    x, y = loss.split(batch())
    ref = clipped_sum(model, loss, x, y, clip_norm=1e6, clipping="bk")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = clipped_sum(model, loss, x, y, clip_norm=1e6, clipping="auto")
    assert out.method == "bk" and all(g.dtype == torch.float32 for g in out.grads)
    torch.testing.assert_close(out.norms, ref.norms, rtol=5e-2, atol=0)  # bf16 rounding
    cos = torch.nn.functional.cosine_similarity(flat(out.grads), flat(ref.grads), dim=0)
    assert float(cos) > 0.99


def test_example_lora_finetune_lowers_the_loss_at_epsilon_8():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "hf_lora_finetune.py"
    spec = importlib.util.spec_from_file_location("hf_lora_finetune", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = "--records 400 --batch-size 50 --epochs 2 --seed 0 --factorization bsr:4 --epsilon 8"
    out = example.main(args.split())
    assert out["strategy"] == "bsr:4"
    assert out["epsilon"][-1] == pytest.approx(8.0, rel=1e-2)  # the calibrated target, spent
    assert out["loss"][-1] < out["loss"][0] - 0.1  # from ≈ log(vocabulary) = 4.1 (3.90 recorded)


def test_vmap_on_transformers_sdpa_code_names_the_way_out():
    model = gpt2(True)  # SDPA attention: transformers' mask code branches on the data
    loss = causal_lm_loss()
    x, y = loss.split(batch())
    with pytest.raises(RuntimeError, match=r"clipping='vmap'.*cannot run this model.*clipping='auto'"):
        clipped_sum(model, loss, x, y, clip_norm=1.0, clipping="vmap")


def test_a_hugging_face_batch_is_checked_as_the_loader_yielded_it():
    # the loss splits a dict batch into model inputs and labels; the batch check is made on the
    # dict as yielded, so the loader's batch passes and a foreign or repeated one is refused
    from dpmf.optim.batches import BatchCheckError

    private = private_run(gpt2(True), causal_lm_loss(), 3)
    it = iter(private.data_loader)
    first = next(it)
    private.backward(first)
    private.optimizer.step()
    private.optimizer.zero_grad()
    with pytest.raises(BatchCheckError, match="already privatized"):
        private.backward(first)
    foreign = {k: v.clone() for k, v in first.items()}
    foreign["input_ids"] = (foreign["input_ids"] + 1) % 97
    with pytest.raises(BatchCheckError):
        private.backward(foreign)
    private.backward(next(it))  # the loader's next batch is accepted
    assert private.privatizer.step == 2


def _user_loss_by_attribute(outputs, labels):
    # the usual hand-written causal LM loss: next-token cross-entropy over the non-padding tokens
    logits = outputs.logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _user_loss_by_key(outputs, labels):
    logits = outputs["logits"][:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("loss", [_user_loss_by_attribute, _user_loss_by_key], ids=["attribute", "key"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_users_own_loss_reads_the_models_output_type_under_its_default_config(lora, loss):
    # GPT-2 as configured (SDPA, use_cache=True: the output holds a cache object), inputs
    # without position ids (a (1, T) position embedding input shared by the batch): every
    # clipping mode equals the loop of single-example backward passes, without torch.func
    model = gpt2(lora)
    assert model.config.use_cache
    b = batch()
    x = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    y = b["labels"].masked_fill(b["attention_mask"] == 0, -100)
    outs = _every_mode_equals_the_loop(model, loss, x, y)
    # the loss of the same forward, one forward pass (dpmf.make_private's backward returns it)
    with torch.no_grad():
        per = [float(loss(model(**{k: v[i : i + 1] for k, v in x.items()}), y[i : i + 1])) for i in range(4)]
    for out in outs:
        assert float(out.loss_sum) == pytest.approx(sum(per), rel=1e-5)


def _checkpointed(lora, reentrant):
    model = gpt2(lora)
    base = model.get_base_model() if lora else model
    kwargs = {"use_reentrant": reentrant}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' rename notice
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return _no_dropout(model)


def _no_dropout(model):
    """``model`` in training mode (checkpointing runs there) with every dropout at p = 0."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_gradient_checkpointing_is_clipped_as_without_it(lora):
    # the forward recomputed in the backward runs every layer's hooks again: not recorded twice,
    # and transformers' input-embedding hook (it only sets requires_grad) keeps the tied
    # embeddings on their closed form; every mode equals the per-example loop
    model = _checkpointed(lora, reentrant=False)
    assert model.get_base_model().is_gradient_checkpointing if lora else model.is_gradient_checkpointing
    loss = causal_lm_loss()
    x, y = loss.split(batch())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_cache=True.*")
        outs = _every_mode_equals_the_loop(model, loss, x, y)
    plain = gpt2(lora)  # the same weights without checkpointing: the same clipped sum
    plain_out = clipped_sum(_no_dropout(plain), loss, x, y, clip_norm=float(outs[0].clip_norm), clipping="bk")
    torch.testing.assert_close(flat(outs[1].grads), flat(plain_out.grads), rtol=1e-5, atol=1e-7)


def test_reentrant_gradient_checkpointing_is_refused_with_the_fix():
    model = _checkpointed(False, reentrant=True)
    loss = causal_lm_loss()
    x, y = loss.split(batch())
    with pytest.raises(RuntimeError, match=r"reentrant activation checkpointing.*'use_reentrant': False"):
        clipped_sum(model, loss, x, y, clip_norm=1.0, clipping="bk")


@pytest.mark.parametrize("clipping", ["auto", "bk", "ghost"])
def test_a_tensor_loss_on_a_model_output_is_refused_in_one_line_naming_logits(clipping):
    """``loss_fn=F.cross_entropy`` on a model that returns a ModelOutput: one line with the fix
    (read ``.logits``), not an AttributeError deep in the step; the fix then trains."""
    model = bert(True)
    x, y = sequence_classification_loss().split(batch(classes=3))
    with pytest.raises(
        ValueError,
        match=r"loss_fn=cross_entropy is invalid for this model: .* returns SequenceClassifierOutput;"
        r" give loss_fn=lambda out, y: F\.cross_entropy\(out\.logits, y\)",
    ):
        clipped_sum(model, torch.nn.functional.cross_entropy, x, y, clip_norm=1.0, clipping=clipping)
    fixed = clipped_sum(model, lambda out, t: torch.nn.functional.cross_entropy(out.logits, t), x, y,
                        clip_norm=1.0, clipping=clipping)  # fmt: skip
    assert fixed.norms.shape == (4,) and bool((fixed.norms > 0).all())
