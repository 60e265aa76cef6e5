"""``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the affine gradients Σ_t G∘x̂ and Σ_t G,
instantiated per example (cheap: one vector per parameter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim.clipping_layers.norms import _total
from dpmf.optim.clipping_layers.registry import ClippingHandler, clipping_layer


def _rms_norm_eps(dtype) -> float:
    """The ε ``F.rms_norm(..., eps=None)`` uses for an input of ``dtype``: that of the type it
    computes in (float32 for float16 and bfloat16 inputs, not their own ε — 0.0078 for bfloat16,
    which once made the handler's norms 18× too small under bfloat16 autocast)."""
    return torch.finfo(torch.float32 if torch.finfo(dtype).bits < 32 else dtype).eps


@clipping_layer(nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
class NormHandler(ClippingHandler):
    """``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: affine gradients per example."""

    name = "norm"
    copy_output = False

    def per_example(self, module, calls, attrs, dtype):
        return {a: _total(self._one(module, c, dtype)[a] for c in calls) for a in attrs}

    def _one(self, module, call, dtype):
        m, x, g = module, call.inputs[0].to(dtype), call.grad.to(dtype)
        b = x.shape[0]
        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
            return {
                "weight": (g * xhat).reshape(b, m.num_channels, -1).sum(-1),
                "bias": g.reshape(b, m.num_channels, -1).sum(-1),
            }
        shape = tuple(m.normalized_shape)
        if isinstance(m, nn.LayerNorm):
            xhat = F.layer_norm(x, shape, None, None, m.eps)
        else:
            eps = m.eps if m.eps is not None else _rms_norm_eps(call.inputs[0].dtype)
            xhat = F.rms_norm(x, shape, None, eps)
        return {
            "weight": (g * xhat).reshape(b, -1, *shape).sum(1),
            "bias": g.reshape(b, -1, *shape).sum(1),
        }
