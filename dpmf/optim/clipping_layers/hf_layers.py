"""Layers of Hugging Face transformers models, registered by qualified name (transformers is
never imported here):

- ``T5LayerNorm`` and ``LlamaRMSNorm``: y = w ∘ x̂, x̂ = x · (mean(x²) + ε)^{-1/2} (the mean of
  squares in float32, no bias); the per-example weight gradient is Σ_t G[t] ∘ x̂[t].
- BART's ``BartScaledWordEmbedding``: y = s · W[x] (s = ``embed_scale``), an embedding whose
  output gradient is scaled by s; and ``BartLearnedPositionalEmbedding``: W[p + 2] at the
  positions p = c, …, c + T − 1 (c the cache length; T from its input's shape), one row of
  positions per example. A call with ``position_ids`` gives a (1, T) lookup shared by the batch
  and takes torch.func.
- T5's relative position bias: ``T5Attention.relative_attention_bias`` is an embedding of a
  (T, T) bucket matrix computed once per stack, broadcast against every example's attention
  scores, so the gradient reaching it is the batch's sum. A batch adapter on ``T5Attention``
  (the layer that computes it) computes the bias from the buckets expanded to (b, T, T) — the
  same values, one row per example — and hands it to the forward as ``position_bias``; the
  embedding then sees examples along dim 0 and takes its own handler, and each example's
  gradient is its slice of what was the broadcast gradient.
"""

from __future__ import annotations

import torch

from dpmf.optim.clipping_layers.embedding import EmbeddingHandler
from dpmf.optim.clipping_layers.norms import _total
from dpmf.optim.clipping_layers.registry import ClippingHandler, clipping_layer, register_batch_adapter

_T5 = "transformers.models.t5.modeling_t5"
_BART = "transformers.models.bart.modeling_bart"


@clipping_layer(f"{_T5}.T5LayerNorm", "transformers.models.llama.modeling_llama.LlamaRMSNorm")
class ScaleRMSNormHandler(ClippingHandler):
    """RMS norms with a weight and no bias, their ε in ``variance_epsilon`` (T5, Llama)."""

    name = "norm"
    copy_output = False

    def per_example(self, module, calls, attrs, dtype):
        return {"weight": _total(self._one(module, c, dtype) for c in calls)}

    @staticmethod
    def _one(module, call, dtype):
        x, g = call.inputs[0], call.grad.to(dtype)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)  # as the forward: in float32
        xhat = x.to(dtype) * torch.rsqrt(variance + module.variance_epsilon).to(dtype)
        return (g * xhat).reshape(x.shape[0], -1, x.shape[-1]).sum(1)


@clipping_layer(f"{_BART}.BartScaledWordEmbedding")
class ScaledEmbeddingHandler(EmbeddingHandler):
    """``s · W[x]``: the embedding's rule on the output gradient times s."""

    def _ids_grads(self, module, calls, dtype):
        ids, grads = super()._ids_grads(module, calls, dtype)
        scale = module.embed_scale
        return ids, grads if scale is None or scale == 1.0 else grads * float(scale)


@clipping_layer(f"{_BART}.BartLearnedPositionalEmbedding")
class LearnedPositionHandler(EmbeddingHandler):
    """``W[p + offset]`` at its positions p: the embedding's rule at those ids, one row per example."""

    keyword_inputs = ("cache_length", "position_ids")
    copy_output = True  # the output may be an expanded (1, T, d) lookup
    expand_shared_output = True

    def _ids_grads(self, module, calls, dtype):
        pairs = []
        for c in calls:
            kw = c.kwargs or {}
            b = c.grad.shape[0]
            positions = kw.get("position_ids")
            if positions is None:  # as the forward: c, …, c + T − 1 for every example
                t = c.inputs[0].shape[1]
                start = int(c.inputs[1] if len(c.inputs) > 1 else kw.get("cache_length", 0))
                positions = torch.arange(start, start + t, device=c.grad.device).expand(b, t)
            else:  # the forward's (1, …) lookup, expanded with its output
                positions = positions.unsqueeze(0).expand(b, *positions.shape)
            pairs.append((positions + module.offset, c.grad))
        return self._lookup_grads(module, pairs, dtype)


def t5_relative_bias(module, args, kwargs):
    """The batch adapter of ``T5Attention``: its relative position bias with one row per example.

    Where the layer would compute the bias (the first self-attention of a stack, no bias given,
    no tokens cached), compute it as ``T5Attention.compute_bias`` does from the buckets expanded
    to (b, T, T), shape (b, heads, T, T), and pass it as ``position_bias``; the stack hands the
    returned bias to its later layers, so every use of it sees the examples. Else None."""
    if not module.has_relative_attention_bias or kwargs.get("position_bias") is not None:
        return None
    if kwargs.get("key_value_states") is not None:
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and int(cache.get_seq_length(module.layer_idx)) != 0:
        return None
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return None
    b, t = hidden.shape[:2]
    position = torch.arange(t, dtype=torch.long, device=hidden.device)
    bucket = module._relative_position_bucket(
        position[None, :] - position[:, None],  # memory − context, (T, T)
        bidirectional=not module.is_decoder,
        num_buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
    )
    values = module.relative_attention_bias(bucket.expand(b, t, t))  # (b, T, T, heads)
    return args, {**kwargs, "position_bias": values.permute(0, 3, 1, 2)}


register_batch_adapter(f"{_T5}.T5Attention", t5_relative_bias)
