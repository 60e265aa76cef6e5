"""Private fine-tuning of encoder–decoders (T5, BART; tiny configs, no weights downloaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra hf)")
peft = pytest.importorskip("peft", reason="peft is not installed (extra hf)")

from test_hf import _every_mode_equals_the_loop, flat, loop_reference  # noqa: E402

import dpmf  # noqa: E402
from dpmf.optim.clipping import clipped_sum  # noqa: E402
from dpmf.optim.ghost import ghost_layer_kinds  # noqa: E402
from dpmf.train.hf import seq2seq_lm_loss  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB = 97


def t5(lora, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0)
        )
    return model.eval()


def bart(lora, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        dropout=0.0,
        scale_embedding=True,  # the word embedding's output times √d
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    model = transformers.BartForConditionalGeneration(cfg)
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        )
    return model.eval()


MODELS = {"t5": t5, "bart": bart}


def batch(pad, b=4, seed=0, source=8, target=6):
    """Source sentences right-padded with ``pad``, labels with -100 after an example's end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, source), generator=g)
    mask = torch.ones(b, source, dtype=torch.long)
    mask[0, 5:] = 0
    if b > 2:
        mask[2, 3:] = 0
    ids[mask == 0] = pad
    labels = torch.randint(3, VOCAB, (b, target), generator=g)
    labels[1, 4:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", list(MODELS))
def test_encoder_decoder_clipped_sum_equals_a_loop_of_backward_passes(name, lora):
    # full: T5's RMS norms and relative position bias, BART's scaled and positional embeddings,
    # the word embedding tied to the encoder, the decoder and the output layer
    model = MODELS[name](lora)
    loss = seq2seq_lm_loss(model)
    assert "generic" not in ghost_layer_kinds(model).values()
    x, y = loss.split(batch(loss.pad_token_id))
    _every_mode_equals_the_loop(model, loss, x, y)


def test_t5_relative_position_bias_gets_each_examples_share():
    """The bias embedding's per-example gradient is the example's slice of the broadcast
    gradient: with only the bias trainable, each norm is the loop's, and the batch's norms are
    not all one value (a batch-summed gradient split evenly would make them so)."""
    model = t5(False)
    for n, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" in n)
    loss = seq2seq_lm_loss(model)
    x, y = loss.split(batch(loss.pad_token_id))
    ref_norms, ref = loop_reference(model, loss, x, y, 1e9)
    out = clipped_sum(model, loss, x, y, clip_norm=1e9, clipping="bk")
    # float32 sums over T² = 36 bias positions per example and head in both
    torch.testing.assert_close(out.norms.float(), ref_norms, rtol=1e-4, atol=0)
    torch.testing.assert_close(flat(out.grads), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    assert float(ref_norms.max() - ref_norms.min()) > 0.1 * float(ref_norms.max())


def test_the_t5_batch_adapter_computes_the_models_own_bias():
    from dpmf.optim.clipping_layers.hf_layers import t5_relative_bias

    model = t5(False)
    for stack in (model.encoder, model.decoder):
        attention = stack.block[0].layer[0].SelfAttention
        hidden = torch.randn(3, 7, 32)
        _, kwargs = t5_relative_bias(attention, (hidden,), {"position_bias": None})
        own = attention.compute_bias(7, 7)  # (1, heads, T, T)
        assert kwargs["position_bias"].shape == (3, 4, 7, 7)
        torch.testing.assert_close(kwargs["position_bias"], own.expand(3, -1, -1, -1), rtol=0, atol=0)
    later = model.encoder.block[1].layer[0].SelfAttention  # no bias of its own: nothing to do
    assert t5_relative_bias(later, (torch.randn(3, 7, 32),), {"position_bias": None}) is None


@pytest.mark.parametrize("name", list(MODELS))
def test_seq2seq_loss_is_the_models_own_loss_for_one_example(name):
    """transformers' own loss (``labels=``: decoder inputs from the labels, mean CE over the
    non-ignored labels) equals ``seq2seq_lm_loss``'s for every single example."""
    model = MODELS[name](False)
    loss = seq2seq_lm_loss(model)
    data = batch(loss.pad_token_id)
    x, y = loss.split(data)
    per = loss.per_example(model(**x), y)
    for i in range(4):
        own = model(
            input_ids=data["input_ids"][i : i + 1],
            attention_mask=data["attention_mask"][i : i + 1],
            labels=data["labels"][i : i + 1],
        ).loss
        torch.testing.assert_close(per[i], own, rtol=1e-5, atol=1e-6)
    shifted = x["decoder_input_ids"]
    assert shifted[:, 0].eq(model.config.decoder_start_token_id).all()
    assert shifted[1, 5] == loss.pad_token_id  # the -100 after example 1's end, as padding


def test_seq2seq_loss_needs_the_models_token_ids():
    with pytest.raises(ValueError, match="decoder_start_token_id=None is invalid"):
        seq2seq_lm_loss()
    encoder = transformers.T5EncoderModel(t5(False).config)
    with pytest.raises(ValueError, match="T5EncoderModel is invalid for seq2seq_lm_loss"):
        seq2seq_lm_loss(encoder)
    loss = seq2seq_lm_loss(decoder_start_token_id=0, pad_token_id=0, reduction="sum")
    logits = torch.randn(1, 3, 5)
    labels = torch.tensor([[1, -100, 4]])
    ce = torch.nn.functional.cross_entropy
    both = ce(logits[0, 0], labels[0, 0]) + ce(logits[0, 2], labels[0, 2])  # -100 at 1: not counted
    torch.testing.assert_close(loss.per_example(logits, {"labels": labels}), both[None])


class Pairs(torch.utils.data.Dataset):
    def __init__(self, pad, n=32):
        self.data = batch(pad, n, seed=7)

    def __len__(self):
        return self.data["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_make_private_fine_tunes_an_encoder_decoder(name):
    model = MODELS[name](False)
    loss = seq2seq_lm_loss(model)
    data = Pairs(loss.pad_token_id)
    x, y = loss.split(data.data)
    with torch.no_grad():
        before = float(loss(model(**x), y))
    private = dpmf.make_private(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        data,
        loss_fn=loss,
        batch_size=16,
        steps=6,
        noise_multiplier=0.3,
        target_delta=1e-5,
        factorization="bsr:2",
        seed=0,
    )
    done = 0
    while done < 6:
        for b in private.data_loader:
            private.backward(b)
            private.optimizer.step()
            private.optimizer.zero_grad()
            done += 1
            if done == 6:
                break
    with torch.no_grad():
        after = float(loss(model(**x), y))
    assert after < before - 0.1  # learnt through the noise at σ = 0.3
    assert private.steps_taken == 6
