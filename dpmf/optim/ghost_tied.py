"""Tied input/output embeddings in ghost clipping and book-keeping, without per-example gradients.

A weight W ∈ ℝ^{V×d} used both by an ``nn.Embedding`` (input tokens x_i[t], t = 1..T_e, output
gradients E_i[t] ∈ ℝ^d) and by an ``nn.Linear`` output layer (inputs A_i ∈ ℝ^{T_o×d}, output
gradients G_i ∈ ℝ^{T_o×V}) has as per-example gradient the sum of both uses,

    g_i = S_i + L_i,   S_i = Σ_t e_{x_i[t]} E_i[t]ᵀ  (the lookup's scatter),   L_i = G_iᵀA_i,

so that ‖g_i‖² = ‖S_i‖² + ‖L_i‖² + 2⟨S_i, L_i⟩. The first two are the embedding's and the linear
layer's own ghost norms (``dpmf.optim.clipping_layers``); the cross term needs only the rows of L_i
at the example's tokens:

    ⟨S_i, L_i⟩ = Σ_t ⟨E_i[t], L_i[x_i[t]]⟩ = Σ_{s,t} G_i[s, x_i[t]] · (A_i E_iᵀ)[s, t],

O(T_o·T_e·d) per example: a (T_o × T_e) product and a gather of G_i's columns at the tokens.
Nothing of size V×d is formed per example. The clipped sum Σ_i c_i g_i is the sum of the two
uses' book-keeping sums (the embedding's scatter of c∘E, the linear layer's (c∘G)ᵀA). Padding
positions of an embedding with ``padding_idx`` have E_i[t] = 0, as in its own handler. Several
calls of a use (evaluation plans) are concatenated along the tokens, so every cross pair counts.

Only this pair is handled here (one embedding use and one linear use of the same weight, no
other use, both with their registered built-in handlers); any other sharing keeps the general
rule of ``dpmf.optim.ghost``: each use's per-example gradient instantiated, then summed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpmf.optim.clipping_layers import EmbeddingHandler, LinearHandler, most_repeated, row_norms
from dpmf.optim.clipping_layers.norms import _gamma

__all__ = ["TiedEmbeddingLinear", "tied_embedding_linear"]


def tied_embedding_linear(holders, attr_of) -> tuple | None:
    """(embedding use, linear use) when ``holders`` — the layers sharing one parameter — are
    exactly one ``nn.Embedding`` and one ``nn.Linear`` (its ``weight``), each with its built-in
    handler; else None.

    Args:
        holders: the ``dpmf.optim.ghost`` layers (``.module``, ``.handler``) using the parameter.
        attr_of: layer → the attribute name of the shared parameter in that layer's module.
    """
    if len(holders) != 2:
        return None
    emb = [h for h in holders if type(h.handler) is EmbeddingHandler and isinstance(h.module, nn.Embedding)]
    lin = [h for h in holders if type(h.handler) is LinearHandler and isinstance(h.module, nn.Linear)]
    if len(emb) != 1 or len(lin) != 1:
        return None
    if attr_of(emb[0]) != "weight" or attr_of(lin[0]) != "weight":
        return None
    return emb[0], lin[0]


class TiedEmbeddingLinear:
    """Per-example squared norms and the clipped sum of one weight tied between an embedding
    and a linear output layer (see the module).

    Args:
        emb_module, emb_calls: the embedding and its calls that received an output gradient
            (``call.inputs[0]``: token ids (b, T_e); ``call.grad``: (b, T_e, d)).
        lin_module, lin_calls: the linear layer and its calls (inputs (b, …, d), output
            gradients (b, …, V)).
        dtype: float32, or float64 (a float64 model; after a float32 overflow).
    """

    _EMB = EmbeddingHandler()
    _LIN = LinearHandler()

    def __init__(self, emb_module, emb_calls, lin_module, lin_calls, dtype):
        self.emb, self.lin = emb_module, lin_module
        self.emb_calls, self.lin_calls = emb_calls, lin_calls
        self.dtype = dtype
        self.emb_state = self.lin_state = None

    @torch.no_grad()
    def sq_norms(self) -> torch.Tensor:
        """‖S_i + L_i‖² per example, shape (b,), float64 (recomputed in float64 when a float32
        square overflows)."""
        sq = self._sq(self.dtype)
        if not math.isfinite(float(sq.sum())) and self.dtype != torch.float64:
            self.dtype = torch.float64
            sq = self._sq(self.dtype)
        return sq

    def _sq(self, dtype) -> torch.Tensor:
        """‖S_i + L_i‖² in float64, bounded from above: S_i and L_i can nearly cancel (their
        cross term in float32 once made an example of norm 10.7 count 10.4, its clipped gradient
        1.03·ζ), so the three terms are taken in float64 from the exact widened inputs, and, with
        M_i = Σ_t ‖E_i[t]‖ + Σ_s ‖A_i[s]‖‖G_i[s]‖, the float64 rounding (γ₆₄·M_i²) and that of the
        two book-keeping sums and their addition (γ_{n+2}(u)·M_i per example's share, n the most
        terms one entry of a sum adds) are added, as in ``clipping_layers.norms._gram_sq``. An instantiated
        L̂_i (float32) is itself what the sum adds: the norm is then that of S_i + L̂_i, with ‖L̂_i‖
        in M_i."""
        _, self.emb_state = self._EMB.sq_norms(self.emb, self.emb_calls, ["weight"], dtype)
        _, self.lin_state = self._LIN.sq_norms(self.lin, self.lin_calls, ["weight"], dtype)
        ids, e = self.emb_state  # (b, T_e), (b, T_e, d) with padding rows zeroed
        parts = [self._LIN.form(self.lin, c) for c in self.lin_calls]
        a = torch.cat([p[0].to(dtype).flatten(1, 2) for p in parts], 1).double()  # (b, T_o, d)
        g = torch.cat([p[1].to(dtype).flatten(1, 2) for p in parts], 1).double()  # (b, T_o, V)
        sq_e, m_e = self._EMB.sq_parts(self.emb, ids, e)
        entry = self.lin_state["weight"]
        b, t_o, v = g.shape
        t_e, d = e.shape[1], e.shape[2]
        e64 = e.double()
        if entry[0] == "ghost":  # L_i = G_iᵀA_i, summed by (c∘G)ᵀA
            m_l = (torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(g, dim=-1)).sum(1)
            sq_l = ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
            ae = torch.bmm(a, e64.transpose(1, 2))  # (b, T_o, T_e): ⟨A_i[s], E_i[t]⟩
            gx = torch.gather(g, 2, ids.unsqueeze(1).expand(-1, t_o, -1))  # G_i[s, x_i[t]]
            cross = (ae * gx).sum((1, 2))
            rounds = max(most_repeated(ids), b * t_o) + 2  # the terms of each sum, their addition
        else:  # the instantiated L̂_i (b, V, d) is what the sum adds: ‖S_i + L̂_i‖ directly
            w = entry[1]
            sq_l = row_norms(w).square()
            m_l = sq_l.sqrt()
            rows = torch.gather(w, 1, ids.unsqueeze(-1).expand(-1, -1, d)).double()  # L̂_i[x_i[t]]
            cross = (rows * e64).sum((1, 2))
            rounds = max(most_repeated(ids), b) + 2
        m = m_e + m_l
        u, u64 = torch.finfo(dtype).eps / 2, 2.0**-53
        s = (sq_e + sq_l + 2.0 * cross).clamp(min=0.0)
        n64 = d + v + (t_o + t_e) ** 2 + 4
        slack = _gamma(rounds, u) + _gamma(t_e + d + 2, u64)
        return (torch.sqrt(s + _gamma(n64, u64) * m.square()) + slack * m).square()

    @torch.no_grad()
    def clipped_sum(self, factors: torch.Tensor) -> torch.Tensor:
        """Σ_i factors_i (S_i + L_i), the weight's shape, in ``dtype``."""
        c = factors.to(self.dtype)
        s = self._EMB.clipped_sum(self.emb, self.emb_state, c, ["weight"], self.dtype)["weight"]
        s2 = self._LIN.clipped_sum(self.lin, self.lin_state, c, ["weight"], self.dtype)["weight"]
        return s.add_(s2.reshape(s.shape))
