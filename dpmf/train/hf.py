"""Hugging Face models in ``make_private``: batches, per-example losses, frozen weights.

    from dpmf.train.hf import causal_lm_loss
    model = get_peft_model(GPT2LMHeadModel(config), LoraConfig(target_modules=["c_attn", "c_proj"],
                           fan_in_fan_out=True))
    private = dpmf.make_private(model, opt, dataset, loss_fn=causal_lm_loss(), batch_size=64,
                                epochs=3, target_epsilon=8.0, target_delta=1e-5)
    for batch in private.data_loader:          # dicts of input_ids, attention_mask, labels
        private.backward(batch)                # the loss splits the batch: model(**inputs)
        private.optimizer.step(); private.optimizer.zero_grad()

A Hugging Face batch is a dict of tensors batched along dim 0 (``input_ids``,
``attention_mask``, ``labels``, …). The loss object splits it (``loss_fn.split(batch)``): the
model gets every entry except ``labels`` as keyword arguments (``model(**inputs)``, so the model
never computes its own batch-mean loss), plus ``position_ids`` of shape (B, T) when absent
(transformers otherwise builds them with a batch dimension of 1, which would hide the
examples from a trainable position embedding); the target is ``labels`` with the attention
mask. The model's output may be a ``ModelOutput`` (``.logits``) or the logits tensor.

Per-example losses (``per_example(output, target)`` → (B,), used by ghost clipping and
book-keeping; ``loss_fn(output, target)`` is their mean, used by ``torch.func``):

- causal LM (``causal_lm_loss``): the next-token cross-entropy of example i,
  ℓ_i = (1/|V_i|) Σ_{t ∈ V_i} CE(logits_i[t], labels_i[t+1]), V_i = the positions t whose next
  label is not -100 and whose next token is not padding (``attention_mask`` = 1) — the mean
  over the example's own non-padding tokens (``reduction="sum"``: the sum). An example's loss
  therefore depends only on its own tokens, and padding never enters another example's
  gradient; an example with no token to predict has ℓ_i = 0. With the mean, a long example
  weighs as much as a short one; with the sum, a long example has a larger gradient, so more
  of it is clipped.
- sequence-to-sequence LM (``seq2seq_lm_loss``, T5, BART): the decoder's cross-entropy of
  example i, ℓ_i = (1/|V_i|) Σ_{t ∈ V_i} CE(logits_i[t], labels_i[t]), no shift (position t of
  the decoder predicts label t), V_i = the positions whose label is not -100 (and whose
  ``decoder_attention_mask`` is 1, when the batch has one). The decoder's inputs are the labels
  shifted right, starting with the model's ``decoder_start_token_id``, -100 replaced by its
  ``pad_token_id`` (what transformers' models do with ``labels=``, which would also make the
  model compute its own batch-mean loss); a batch with ``decoder_input_ids`` keeps its own.
  Pad the labels with -100 (transformers' ``DataCollatorForSeq2Seq`` does): a label equal to the
  pad id is a token to predict.
- sequence classification (``sequence_classification_loss``): CE(logits_i, labels_i).

Trainable parameters only: what ``make_private`` clips, noises, counts in the noise state and
checkpoints are the parameters with ``requires_grad`` (LoRA's adapters; the frozen base weights
are never touched). ``trainable_state``/``load_trainable_state`` are the checkpoint's model part:
the trainable parameters and the buffers, plus a SHA-256 digest of the frozen weights, so a
resume into another base model is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HFLoss",
    "causal_lm_loss",
    "seq2seq_lm_loss",
    "sequence_classification_loss",
    "trainable_state",
    "load_trainable_state",
    "frozen_digest",
    "split_batch",
    "batch_size_of",
    "model_state",
    "check_model_state",
    "load_model_state",
]

_REDUCTIONS = ("mean", "sum")
_KINDS = ("causal_lm", "seq2seq_lm", "sequence_classification")


def _logits(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"output={type(output).__name__} is invalid: expected the logits tensor or a model output "
            "with .logits"
        )
    return logits


@dataclass(frozen=True)
class HFLoss:
    """The loss of a Hugging Face model on a dict batch (see the module docstring).

    Attributes:
        kind: ``"causal_lm"``, ``"seq2seq_lm"`` or ``"sequence_classification"``.
        reduction: per example, over its tokens: ``"mean"`` (default) or ``"sum"`` (LMs).
        position_ids: add ``position_ids`` of shape (B, T) to a batch without them (for models
            whose forward takes them, such as GPT-2 and BERT; False for others).
        label_key: the batch entry holding the labels.
        decoder_start_token_id, pad_token_id: a seq2seq model's (its config's), for the
            decoder inputs built from the labels.

    Raises (at construction):
        ValueError: an unknown kind or reduction, or a seq2seq loss without both token ids.
    """

    kind: str = "causal_lm"
    reduction: str = "mean"
    position_ids: bool = True
    label_key: str = "labels"
    decoder_start_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"kind={self.kind!r} is invalid: must be one of {_KINDS}")
        if self.reduction not in _REDUCTIONS:
            raise ValueError(
                f"reduction={self.reduction!r} is invalid: must be 'mean' (over an example's tokens) or 'sum'"
            )
        if self.kind == "seq2seq_lm":
            for name in ("decoder_start_token_id", "pad_token_id"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(
                        f"{name}={v!r} is invalid: a seq2seq loss needs the model's token id (an int "
                        "≥ 0); build it with seq2seq_lm_loss(model), which reads model.config"
                    )

    def split(self, batch: dict) -> tuple[dict, object]:
        """(model inputs, target) of a dict batch: ``labels`` out of the inputs, ``position_ids``
        added; the target is ``{"labels", "attention_mask"}`` (causal LM) or the labels.

        Raises:
            TypeError: ``batch`` is not a dict.
            ValueError: no labels in it.
        """
        if not isinstance(batch, dict):
            raise TypeError(
                f"batch={type(batch).__name__} is invalid: a Hugging Face batch is a dict of tensors"
            )
        if self.label_key not in batch:
            raise ValueError(
                f"batch is invalid: it has no {self.label_key!r} entry (keys: {sorted(batch)}); add the "
                "labels (for a causal LM: input_ids, with -100 where no loss is wanted)"
            )
        inputs = {k: v for k, v in batch.items() if k != self.label_key}
        labels = batch[self.label_key]
        ids = inputs.get("input_ids")
        wants = self.position_ids and "position_ids" not in inputs
        if wants and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            b, t = ids.shape
            inputs["position_ids"] = torch.arange(t, device=ids.device).expand(b, t)
        if self.kind == "sequence_classification":
            return inputs, labels
        if self.kind == "seq2seq_lm":
            return self._seq2seq_split(inputs, labels)
        target = {"labels": labels}
        if isinstance(inputs.get("attention_mask"), torch.Tensor):
            target["attention_mask"] = inputs["attention_mask"]
        return inputs, target

    def _seq2seq_split(self, inputs: dict, labels: torch.Tensor) -> tuple[dict, dict]:
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            raise ValueError(
                f"labels={type(labels).__name__} is invalid: a seq2seq batch's labels are a (B, T) tensor of "
                "token ids (-100 where no loss is wanted)"
            )
        if "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
            start = torch.full_like(labels[:, :1], self.decoder_start_token_id)
            shifted = torch.cat([start, labels[:, :-1]], 1)
            inputs["decoder_input_ids"] = shifted.masked_fill(shifted == -100, self.pad_token_id)
        target = {"labels": labels}
        if isinstance(inputs.get("decoder_attention_mask"), torch.Tensor):
            target["attention_mask"] = inputs["decoder_attention_mask"]
        return inputs, target

    def per_example(self, output, target) -> torch.Tensor:
        """ℓ_i for every example of the batch, shape (B,), float32 (float64 for a float64 model)."""
        logits = _logits(output)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        if self.kind == "sequence_classification":
            labels = target["labels"] if isinstance(target, dict) else target
            with torch.autocast(logits.device.type, enabled=False):
                return F.cross_entropy(logits.to(dtype), labels, reduction="none")
        labels = target["labels"] if isinstance(target, dict) else target
        mask = target.get("attention_mask") if isinstance(target, dict) else None
        if self.kind == "seq2seq_lm":  # position t predicts label t
            nxt, valid = labels, labels != -100
            if mask is not None:
                valid = valid & mask.bool()
        else:  # position t predicts token t+1; the last position predicts nothing (weight 0)
            nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
            valid = nxt != -100
            if mask is not None:
                valid = valid & torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1).bool()
        # the logits are used whole (a view, no copy of the (B, T, V) tensor)
        with torch.autocast(logits.device.type, enabled=False):
            lg = logits.to(dtype)
            ce = F.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), torch.where(valid, nxt, 0).reshape(-1), reduction="none"
            ).reshape(nxt.shape)
            w = valid.to(dtype)
            total = (ce * w).sum(1)
            if self.reduction == "sum":
                return total
            return total / w.sum(1).clamp(min=1.0)

    def __call__(self, output, target) -> torch.Tensor:
        """The batch's mean of the per-example losses (a scalar)."""
        return self.per_example(output, target).mean()


def causal_lm_loss(reduction: str = "mean", *, position_ids: bool = True) -> HFLoss:
    """Next-token cross-entropy per example, mean (or sum) over its non-padding tokens."""
    return HFLoss("causal_lm", reduction, position_ids)


def seq2seq_lm_loss(
    model=None,
    reduction: str = "mean",
    *,
    decoder_start_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> HFLoss:
    """The decoder's cross-entropy per example (T5, BART), mean (or sum) over its labelled tokens.

    Args:
        model: a transformers encoder–decoder (or its config): its ``decoder_start_token_id``
            and ``pad_token_id`` build the decoder inputs from the labels; the keywords
            override them.

    Raises:
        ValueError: a model that is not an encoder–decoder, or a token id missing from both the
            model's config and the keywords.
    """
    config = getattr(model, "config", model)
    if model is not None and getattr(config, "is_encoder_decoder", None) is False:
        raise ValueError(
            f"model={type(model).__name__} is invalid for seq2seq_lm_loss: it is not an encoder–decoder "
            "(config.is_encoder_decoder is False); use causal_lm_loss() for a decoder-only LM, or a loss "
            "of your own for an encoder"
        )
    start = decoder_start_token_id
    if start is None:
        start = getattr(config, "decoder_start_token_id", None)
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    return HFLoss("seq2seq_lm", reduction, False, "labels", start, pad)


def sequence_classification_loss(*, position_ids: bool = True) -> HFLoss:
    """Cross-entropy of each example's class logits against its label."""
    return HFLoss("sequence_classification", "mean", position_ids)


# -- checkpoints of the trainable part ----------------------------------------------------


def frozen_digest(model: nn.Module) -> str:
    """SHA-256 of the frozen parameters (names, shapes, dtypes and bytes), hex."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def trainable_state(model: nn.Module) -> dict:
    """The trainable parameters and the buffers (copies on the CPU), and the frozen weights'
    digest: a model checkpoint without the frozen base weights."""
    keep = {n for n, p in model.named_parameters() if p.requires_grad}
    keep |= {n for n, _ in model.named_buffers()}
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in keep}
    return {"tensors": state, "frozen_sha256": frozen_digest(model)}


def load_trainable_state(model: nn.Module, state: dict, name: str = "state") -> None:
    """Load ``trainable_state``'s result into ``model`` (the same architecture and frozen weights).

    Raises:
        ValueError: other frozen weights (another base model), or the trainable set differs.
    """
    if state.get("frozen_sha256") != frozen_digest(model):
        raise ValueError(
            f"{name} is invalid: its frozen weights differ from the model's (another base model or "
            "another set of trainable parameters); resume into the model it was saved from"
        )
    tensors = state["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or any(k in trainable for k in missing):
        raise ValueError(
            f"{name} is invalid: its trainable tensors do not match the model's (missing "
            f"{sorted(k for k in missing if k in trainable)[:4]}, unexpected {sorted(unexpected)[:4]})"
        )


def split_batch(loss_fn, batch):
    """(inputs, target) of a batch given without a target: ``loss_fn.split(batch)``.

    Raises:
        ValueError: ``loss_fn`` cannot split batches (then the target must be given).
    """
    split = getattr(loss_fn, "split", None)
    if not callable(split):
        raise ValueError(
            "target is required: give backward(..., target=y), or use a loss that splits a dict batch "
            "with labels (dpmf.train.hf.causal_lm_loss() or sequence_classification_loss())"
        )
    return split(batch)


def batch_size_of(tree) -> int:
    """Dimension 0 of a tensor, or of the first tensor of a dict/tuple of tensors."""
    if isinstance(tree, torch.Tensor):
        return int(tree.shape[0])
    values = tree.values() if isinstance(tree, dict) else tree
    for v in values:
        if isinstance(v, torch.Tensor | dict | list | tuple):
            return batch_size_of(v)
    raise TypeError(f"target={type(tree).__name__} is invalid: it holds no tensor")


def model_state(model: nn.Module) -> dict:
    """The model part of a checkpoint: the whole ``state_dict`` when every parameter trains,
    else ``trainable_state`` (no frozen base weights)."""
    if all(p.requires_grad for p in model.parameters()):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return trainable_state(model)


def check_model_state(model: nn.Module, state: dict, name: str = "state") -> None:
    """Refuse, before anything is loaded, a trainable-only state saved from other frozen weights.

    Raises:
        ValueError: the frozen weights' digest differs from the model's.
    """
    if isinstance(state, dict) and "frozen_sha256" in state and "tensors" in state:
        if state["frozen_sha256"] != frozen_digest(model):
            raise ValueError(
                f"{name} is invalid: its frozen weights differ from the model's (another base model or "
                "another set of trainable parameters); resume into the model it was saved from"
            )


def load_model_state(model: nn.Module, state: dict) -> None:
    """Load ``model_state``'s result (either form)."""
    if "frozen_sha256" in state and "tensors" in state:
        load_trainable_state(model, state)
    else:
        model.load_state_dict(state)
