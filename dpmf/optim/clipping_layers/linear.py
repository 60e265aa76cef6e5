"""``nn.Linear`` and transformers' ``Conv1D`` (GPT-2).

s = aWᵀ + b on T tokens: ‖G_iᵀA_i‖² as a ghost norm ⟨A_iA_iᵀ, G_iG_iᵀ⟩ when T²(d + p) < T·p·d,
else the per-example gradient instantiated (the mixed rule of Bu et al., "Scalable and Efficient
Training of Large Convolutional Neural Networks with Differential Privacy", NeurIPS 2022, §3.2;
Li et al., "Large Language Models Can Be Strong Differentially Private Learners", ICLR 2022,
§4); the sum (c∘G)ᵀA (Bu et al., "Differentially Private Optimization on Large Model at Small
Cost", ICML 2023, Alg. 1). ``Conv1D`` (s = aW + b with W of shape (d, p)) is the same rule with
the weight transposed, registered by its qualified name so that transformers is never imported.
"""

from __future__ import annotations

import torch
from torch import nn

from dpmf.optim.clipping_layers.norms import (
    PendingNorm,
    _as,
    _gram_sq,
    _sq,
    _total,
    pending_row_norms,
    underflow_flag,
    weighted_sum,
)
from dpmf.optim.clipping_layers.registry import ClippingHandler, clipping_layer


@clipping_layer(nn.Linear)
class LinearHandler(ClippingHandler):
    """``nn.Linear``: mixed ghost norm / instantiated gradient; book-keeping sum."""

    name = "linear"
    copy_output = False

    def dims(self, module, call) -> tuple[int, int, int]:
        """(T, d, p): tokens per example, inputs and outputs (per group)."""
        g = call.grad
        return g.numel() // (g.shape[0] * g.shape[-1]), module.in_features, module.out_features

    def form(self, module, call):
        """(A, G) as (b, groups, T, d), (b, groups, T, p)."""
        x, g = call.inputs[0], call.grad
        b = x.shape[0]
        return x.reshape(b, 1, -1, x.shape[-1]), g.reshape(b, 1, -1, g.shape[-1])

    def weight_per_example(self, module, call, dtype):
        """G_iᵀA_i, (b, *weight.shape), by one batched GEMM (with more outputs than inputs, the
        transpose of A_iᵀG_i: the GEMM with the longer rows runs faster)."""
        x, g = _as(call.inputs[0], dtype), _as(call.grad, dtype)
        b = x.shape[0]
        if x.dim() != 3:
            x = x.reshape(b, -1, x.shape[-1])
        if g.dim() != 3:
            g = g.reshape(b, -1, g.shape[-1])
        if g.shape[-1] > x.shape[-1]:
            return torch.bmm(x.transpose(1, 2), g).transpose(1, 2)
        return torch.bmm(g.transpose(1, 2), x)

    def bias_per_example(self, module, call, dtype):
        g = call.grad
        return g.to(dtype).reshape(g.shape[0], -1, g.shape[-1]).sum(1)

    def from_ghost(self, module, s):
        """The weight from Σ_i c_i G_iᵀA_i of shape (groups, p, d)."""
        return s.reshape(module.weight.shape)

    def per_example(self, module, calls, attrs, dtype):
        out = {}
        if "weight" in attrs:
            out["weight"] = _total(self.weight_per_example(module, c, dtype) for c in calls)
        if "bias" in attrs:
            out["bias"] = _total(self.bias_per_example(module, c, dtype) for c in calls)
        return out

    @property
    def takes_pending(self) -> bool:
        """Whether the engine may ask for ``PendingNorm``s (``sq_norms(..., pending=True)`` and
        ``sq_norms_float64``): this class's own methods, not a subclass's override of them."""
        cls, base = type(self), LinearHandler
        return cls.sq_norms is base.sq_norms and cls.sq_norms_float64 is base.sq_norms_float64

    def sq_norms(self, module, calls, attrs, dtype, *, pending: bool = False):
        """As ``ClippingHandler.sq_norms``; with ``pending``, an instantiated gradient's entry is a
        ``PendingNorm`` (squared later by ``squares``) and no entry is checked for overflow here
        (``sq_norms_float64`` recomputes a non-finite one from the state)."""
        out, state = {}, {}
        norm = PendingNorm if pending else None
        if len(calls) == 1:
            t, d, p = self.dims(module, calls[0])
        else:
            shapes = [self.dims(module, c) for c in calls]
            t, d, p = sum(s[0] for s in shapes), shapes[0][1], shapes[0][2]
        # the mixed rule: ghost when its flops T²(d+p) are below those of instantiating, T·p·d
        ghost = t == 1 or t * (d + p) < p * d
        if "weight" in attrs:
            if ghost:
                parts = [self.form(module, c) for c in calls]
                if len(parts) == 1:
                    a, g = parts[0][0].to(dtype), parts[0][1].to(dtype)
                else:
                    a = torch.cat([a.to(dtype) for a, _ in parts], dim=2)
                    g = torch.cat([g.to(dtype) for _, g in parts], dim=2)
                out["weight"] = _gram_sq(a, g)
                state["weight"] = ("ghost", a, g)
            else:
                if len(calls) == 1:
                    w = self.weight_per_example(module, calls[0], dtype)
                else:
                    w = _total(self.weight_per_example(module, c, dtype) for c in calls)
                out["weight"] = pending_row_norms(w) if norm else _sq(w)  # no copy of a transposed view
                state["weight"] = ("inst", w)
        if "bias" in attrs:
            gb = _total(self.bias_per_example(module, c, dtype) for c in calls)
            out["bias"] = pending_row_norms(gb) if norm else _sq(gb)
            state["bias"] = ("inst", gb)
        return out, state

    def sq_norms_float64(self, module, state, attr) -> torch.Tensor:
        """attr's squared norms computed in float64 from ``sq_norms``'s state (for an entry
        whose float32 square overflowed: the per-example gradient itself is finite)."""
        entry = state[attr]
        if entry[0] == "ghost":
            return _gram_sq(entry[1].double(), entry[2].double())
        w = entry[1]
        return torch.linalg.vector_norm(w, dim=tuple(range(1, w.dim())), dtype=torch.float64).square()

    def clipped_sum(self, module, state, factors, attrs, dtype):
        out = {}
        c = _as(factors, dtype)
        for a in attrs:
            entry = state[a]
            if entry[0] == "ghost":
                _, x, g = entry
                cg = g * c.view(-1, 1, 1, 1)
                s = torch.einsum("bgtp,bgtd->gpd", cg, x).to(dtype)
                out[a] = self.from_ghost(module, s)
            else:
                out[a] = weighted_sum(c, entry[1])  # no copy of a transposed w
        return out

    def sum_needs_float64(self, module, state, factors, attrs):
        """Whether a product c_i·g of a ghost entry's sum (c∘G)ᵀA falls below its dtype's
        normal range while g is not 0 (``underflow_flag``): then the engine widens the state
        and sums in float64, where the products of float32 numbers are exact."""
        flags = []
        for a in attrs:
            entry = state[a]
            if entry[0] == "ghost":
                g = entry[2]
                flag = underflow_flag(_as(factors, g.dtype), g)
                if flag is not None:
                    flags.append(flag)
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()


@clipping_layer("transformers.pytorch_utils.Conv1D")
class Conv1DHandler(LinearHandler):
    """transformers' ``Conv1D`` (GPT-2): s = aW + b, W of shape (d, p) — Linear with Wᵀ."""

    name = "conv1d"

    def dims(self, module, call):
        g = call.grad
        return g.numel() // (g.shape[0] * g.shape[-1]), module.weight.shape[0], module.weight.shape[1]

    def weight_per_example(self, module, call, dtype):
        x, g = _as(call.inputs[0], dtype), _as(call.grad, dtype)
        b = x.shape[0]
        return torch.bmm(x.reshape(b, -1, x.shape[-1]).transpose(1, 2), g.reshape(b, -1, g.shape[-1]))

    def from_ghost(self, module, s):
        return s[0].transpose(0, 1)
