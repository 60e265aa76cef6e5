"""``nn.Embedding``: ‖Σ_t e_{x_t}G_i[t]‖² = Σ_{t,u}[x_t = x_u]⟨G_i[t], G_i[u]⟩, in float64 with a
rounding bound (equal tokens whose gradients cancel); beyond 16 tokens per example the norm of
the sparse per-example gradient, one row per distinct token. Not for ``sparse`` or
``scale_grad_by_freq`` embeddings (their gradients couple the batch's token counts)."""

from __future__ import annotations

import torch
from torch import nn

from dpmf.optim.clipping_layers.norms import _gamma, _sq
from dpmf.optim.clipping_layers.registry import ClippingHandler, clipping_layer


def most_repeated(ids: torch.Tensor) -> int:
    """How often the batch's most repeated token occurs (ids ≥ 0): the most terms an embedding's
    clipped sum adds into one row."""
    return int(torch.bincount(ids.reshape(-1)).max()) if ids.numel() else 0


# Up to this many tokens per example an embedding's norm is a ghost norm (T² pairs); beyond, its
# sparse per-example gradient (a sort of the b·T (example, token) keys and one index_add).
_EMBEDDING_GHOST_TOKENS = 16


def _embedding_sq_sparse(ids: torch.Tensor, g: torch.Tensor, vocab: int) -> torch.Tensor:
    """‖Σ_t e_{x_t} G_i[t]‖² per example from the rows of its sparse gradient, shape (b,)."""
    b, t, d = g.shape
    keys = (ids + vocab * torch.arange(b, device=ids.device).unsqueeze(1)).reshape(-1)
    rows, inverse = torch.unique(keys, return_inverse=True)
    summed = torch.zeros(rows.shape[0], d, dtype=g.dtype, device=g.device)
    summed.index_add_(0, inverse, g.reshape(-1, d))
    sq = torch.zeros(b, dtype=torch.float64, device=g.device)
    return sq.index_add_(0, rows // vocab, _sq(summed))


@clipping_layer(nn.Embedding)
class EmbeddingHandler(ClippingHandler):
    """``nn.Embedding``: ghost norm over equal tokens (or the sparse gradient's rows)."""

    name = "embedding"
    copy_output = False
    expand_shared_input = True  # position ids of shape (1, T): each example its own rows

    def check(self, module):
        if module.sparse or module.scale_grad_by_freq:  # batch-coupled frequencies
            return "a sparse or scale_grad_by_freq embedding"
        return None

    def _ids_grads(self, module, calls, dtype):
        return self._lookup_grads(module, [(c.inputs[0], c.grad) for c in calls], dtype)

    @staticmethod
    def _lookup_grads(module, pairs, dtype):
        """(ids (b, L), output gradients (b, L, d)) of lookups given as (ids, gradient) pairs, the
        padding rows zeroed; one call's ids are any (b, …) shape."""
        ids, gs = [], []
        for x, grad in pairs:
            i = x.reshape(x.shape[0], -1)
            gg = grad.reshape(i.shape[0], -1, grad.shape[-1]).to(dtype)
            if module.padding_idx is not None:
                gg = gg * (i != module.padding_idx).unsqueeze(-1).to(dtype)
            ids.append(i)
            gs.append(gg)
        return torch.cat(ids, 1), torch.cat(gs, 1)

    def per_example(self, module, calls, attrs, dtype):
        i, g = self._ids_grads(module, calls, dtype)
        b, _, d = g.shape
        n = module.num_embeddings
        keys = (i + n * torch.arange(b, device=i.device).unsqueeze(1)).reshape(-1)
        out = torch.zeros(b * n, d, dtype=dtype, device=g.device)
        out.index_add_(0, keys, g.reshape(-1, d))
        return {"weight": out.reshape(b, n, d)}

    def sq_norms(self, module, calls, attrs, dtype):
        """The squared norms in float64, never below those of the vectors ``clipped_sum`` sums.

        The rows of one token's gradient can cancel (G_1 ≈ −G_2 for two equal tokens): in
        float32 an example of norm 8 came out 0. Both forms are therefore taken in float64 from
        the (exact) widened output gradients and bounded from above as in ``_gram_sq``: with
        M_i = Σ_t ‖G_i[t]‖, the float64 rounding is within γ₆₄·M_i² (ghost) or γ₆₄·M_i (the
        sparse rows), and the clipped sum, an index_add of b·T rows in ``dtype`` (at most n of them
        into one row: the batch's most repeated token), moves each example's share by at most
        c_i·γ_{n+1}(u)·M_i."""
        i, gg = self._ids_grads(module, calls, dtype)
        b, t, d = gg.shape
        s, m = self.sq_parts(module, i, gg)
        u64 = 2.0**-53
        slack = _gamma(most_repeated(i) + 1, torch.finfo(dtype).eps / 2) + _gamma(t + d + 2, u64)
        root = torch.sqrt(s + _gamma(d + t * t + 2, u64) * m.square()) + slack * m
        return {"weight": root.square()}, (i, gg)

    @staticmethod
    def sq_parts(module, i, gg):
        """(‖Σ_t e_{x_t}G_i[t]‖² in float64, M_i = Σ_t ‖G_i[t]‖), each (b,), from the ids (b, T)
        and output gradients (b, T, d) of ``_ids_grads``."""
        g64 = gg.double()
        if i.shape[1] <= _EMBEDDING_GHOST_TOKENS:  # ghost: Σ_{t,u} [x_t = x_u]⟨G_t, G_u⟩
            same = (i.unsqueeze(2) == i.unsqueeze(1)).to(torch.float64)
            s = ((g64 @ g64.transpose(1, 2)) * same).sum((1, 2)).clamp(min=0.0)
        else:  # the sparse per-example gradient: one row per distinct (example, token)
            s = _embedding_sq_sparse(i, g64, module.num_embeddings)
        return s, torch.linalg.vector_norm(g64, dim=-1).sum(1)

    def clipped_sum(self, module, state, factors, attrs, dtype):
        i, g = state
        s = torch.zeros(module.weight.shape, dtype=dtype, device=g.device)
        s.index_add_(0, i.reshape(-1), (g * factors.to(dtype).view(-1, 1, 1)).reshape(-1, g.shape[-1]))
        return {"weight": s}
