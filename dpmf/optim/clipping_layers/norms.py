"""Per-example norms and sums in floating point that does not lie: the numerical kernels every
clipping handler shares.

``row_norms`` takes float32 norms in runs of at most 4096 entries combined in float64 (a long
row's float32 sum of squares loses its low bits), rescaling rows whose squares would underflow;
``PendingNorm``/``squares`` widen and square every layer's norms at once; ``_gram_sq`` is the
ghost norm ⟨AAᵀ, GGᵀ⟩ in float64 with a bound on its rounding (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., Lemma 3.1), so that a norm is never below the norm of the
vector a book-keeping sum adds; ``underflow_flag`` says when a clipped product c·g falls below
float32's normal range (the sum is then taken in float64).
"""

from __future__ import annotations

import math

import torch

# the most entries of one float32 norm in ``row_norms``
_RUN = 4096


_UP = 2.0**100  # a float32 row below 4·10⁻²⁰·√n, scaled by it, has no square below float32's range


def _run_norms(x: torch.Tensor) -> torch.Tensor:
    """‖·‖ along the last dim in float64: float32 norms of runs of at most 4096 entries, combined
    in float64 (a float32 norm of one run: the same bits as before)."""
    n = x.shape[-1]
    if x.dtype == torch.float64 or n <= _RUN:
        return torch.linalg.vector_norm(x, dim=-1).double()
    q = n // _RUN
    part = torch.linalg.vector_norm(x[..., : q * _RUN].unflatten(-1, (q, _RUN)), dim=-1)
    if q * _RUN < n:
        part = torch.cat([part, torch.linalg.vector_norm(x[..., q * _RUN :], dim=-1, keepdim=True)], -1)
    return torch.linalg.vector_norm(part.double(), dim=-1)


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """‖x_i‖ over every dim but 0, float64, shape (b,): float32 norms of runs of at most 4096
    entries of the last dim (of the flattened rows when ``x`` is contiguous), combined in
    float64. One float32 norm of millions of entries accumulates its rounding — 16·10⁶ uniform
    entries came out 5·10⁻⁴ low, 4·10⁶ equal ones 2·10⁻³ (an example's norm understated, its
    clipped gradient 1.002·ζ) — and a float64 norm of a float32 tensor copies it (40× slower);
    the runs' norms are within about 10⁻⁹. Squares below float32's range still vanish (an
    absolute error below 4·10⁻²³ per entry).
    """
    b = x.shape[0]
    flat = _flat_rows(x)
    if flat is not None:
        x = flat
    elif x.dim() < 2 or x.dtype == torch.float64:
        x = x.reshape(b, -1)
    part = _run_norms(x)
    return part if part.dim() == 1 else torch.linalg.vector_norm(part.reshape(b, -1), dim=1)


def _flat_rows(x: torch.Tensor) -> torch.Tensor | None:
    """A (b, n) view of ``x`` whose row i holds the entries of x[i] in memory order — of ``x``
    itself when contiguous, of its transpose when x is the transpose of a contiguous (b, q, r)
    tensor (as ``LinearHandler.weight_per_example`` may return it) — or None (no such view
    without a copy). A norm does not depend on the order of the entries."""
    b = x.shape[0]
    if x.is_contiguous():
        return x.reshape(b, -1)
    if x.dim() == 3 and x.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2).reshape(b, -1)
    return None


def pending_row_norms(x: torch.Tensor) -> PendingNorm:
    """``row_norms(x)`` as a ``PendingNorm``: a row of one run in a float32 view keeps its float32
    norm (widened later with the other layers', the same value), any other the float64 norms."""
    flat = _flat_rows(x)
    if flat is not None and flat.dtype == torch.float32 and flat.shape[1] <= _RUN:
        return PendingNorm(torch.linalg.vector_norm(flat, dim=1))
    return PendingNorm(row_norms(x))


def _last_norms(x: torch.Tensor) -> torch.Tensor:
    """``_run_norms`` without losing the entries whose float32 squares underflow: a row of 4·10⁶
    entries 2·10⁻²³ has a float32 norm of 0 while the one-token ghost norm ‖a‖‖g‖ was 6·ζ — that
    example was released unclipped. A row whose norm is below 4·10⁻²⁰·√n (where lost squares
    could matter) takes the norm of its entries scaled by 2¹⁰⁰ instead (exact: a power of two).
    Branch-free: both norms are taken and ``torch.where`` picks (no host synchronisation; the
    scaled norm of a large row may overflow, and is then not the one picked)."""
    norms = _run_norms(x)
    if x.dtype == torch.float64:
        return norms
    small = norms < 4e-20 * math.sqrt(x.shape[-1])
    return torch.where(small, _run_norms(x * _UP) / _UP, norms)


def _sq(x: torch.Tensor) -> torch.Tensor:
    """‖x_i‖² over every dim but 0, float64 (``row_norms``)."""
    return row_norms(x).square()


class PendingNorm:
    """A per-example norm (shape (b,), in the computation's dtype) whose float64 square is taken
    later, together with the other layers' (``squares``): the same values as ``_sq``, one
    widening and one square for all layers instead of two torch dispatches per layer."""

    __slots__ = ("norm",)

    def __init__(self, norm: torch.Tensor):
        self.norm = norm


def squares(entries: dict, order: list) -> tuple[dict, torch.Tensor | None]:
    """(``entries`` — name → float64 squared norms or ``PendingNorm`` — with every pending norm
    squared in float64, and the (len(order), b) block of the squares in ``order`` when every
    entry in ``order`` was pending, in one dtype and device, else None). One stack, widening
    and square per dtype and device: bit for bit ``norm.double().square()`` of each."""
    groups: dict = {}
    for k in order:  # the names to combine first, then any other pending entry
        v = entries[k]
        if isinstance(v, PendingNorm):
            groups.setdefault((v.norm.dtype, v.norm.device, v.norm.shape), []).append(k)
    listed = set(order)
    for k, v in entries.items():
        if k not in listed and isinstance(v, PendingNorm):
            groups.setdefault((v.norm.dtype, v.norm.device, v.norm.shape), []).append(k)
    if not groups:
        return entries, None
    out = dict(entries)
    block = None
    for keys in groups.values():
        stacked = torch.stack([entries[k].norm for k in keys]).double().square()
        out.update(zip(keys, stacked.unbind(0), strict=True))
        if keys == order:
            block = stacked
    return out, block


def _as(x: torch.Tensor, dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is: no dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def weighted_sum(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_i c_i·w_i over dim 0 of ``w`` (b, …), shape ``w.shape[1:]``: one matrix–vector
    product, without a copy of ``w`` (also when ``w`` is the transpose of a contiguous
    (b, q, r) tensor, as ``LinearHandler.weight_per_example`` may return it)."""
    b = w.shape[0]
    if w.is_contiguous():
        return torch.mv(w.view(b, -1).t(), c).view(w.shape[1:])
    if w.dim() == 3:
        wt = w.transpose(1, 2)
        if wt.is_contiguous():
            return torch.mv(wt.view(b, -1).t(), c).view(wt.shape[1:]).t()
    return torch.tensordot(c, w, dims=1)


def _total(parts):
    """The sum of an iterable of tensors without a leading 0 + (a copy of the first)."""
    out = None
    for p in parts:
        out = p if out is None else out + p
    return out


def _gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u): the relative bound on the rounding error of a sum or dot product
    of n terms in any order, unit roundoff u (Higham, "Accuracy and Stability of Numerical
    Algorithms", 2nd ed., Lemma 3.1 and §3.1)."""
    return n * u / (1.0 - n * u)


def _gram_sq(a, g):
    """Σ_groups ‖G_iᵀA_i‖² per example, shape (b,), float64, never below the squared norm of
    the per-example gradient that book-keeping sums (up to rounding at the level of that norm).

    a, g: (b, groups, T, d) and (b, groups, T, p) recorded inputs and output gradients.

    One token (T = 1): ‖a‖²‖g‖², no cancellation. Several: the ghost norm ⟨AAᵀ, GGᵀ⟩, whose T²
    terms (a_t·a_s)(g_t·g_s) can cancel — in float32 an example of norm 8 came out 0 and was
    released unclipped. The Gram matrices are therefore taken in float64 (the float32 products
    are exact there) and the result bounded from above (Higham, Lemma 3.1 / eq. 3.5): with
    M_i = Σ_groups Σ_t ‖a_t‖‖g_t‖, ‖W_i‖² ≤ S_i + γ_{d+p+T²+2}(u₆₄)·M_i² for the computed S_i,
    and the clipped sum Σ_i c_i W_i, taken by one contraction over b·T terms in a's dtype, moves
    each example's share by at most c_i·γ_{bT+1}(u)·M_i; the returned value is
    (√(S_i + γ₆₄M_i²) + γ_{bT+1}(u)·M_i)², so that c_i = ζ / max(ζ, its root) keeps each
    example's share within ζ. For ordinary data M_i ≈ √T‖W_i‖ and the second term is a relative
    10⁻⁴–10⁻³ at T = 128 (float32).
    """
    if a.shape[2] == 1:
        return (_last_norms(a) * _last_norms(g)).square().sum((1, 2))
    b, _, t, d = a.shape
    p = g.shape[-1]
    u = torch.finfo(a.dtype).eps / 2
    s, m = _gram_parts(a, g)
    root = torch.sqrt(s + _gamma(d + p + t * t + 2, 2.0**-53) * m.square()) + _gamma(b * t + 1, u) * m
    return root.square()


def _gram_parts(a, g):
    """(the float64 ghost norm Σ_groups ⟨A_iA_iᵀ, G_iG_iᵀ⟩ clamped at 0, M_i = Σ_groups Σ_t
    ‖a_t‖‖g_t‖), each of shape (b,), for ``_gram_sq``'s shapes."""
    a64, g64 = a.double(), g.double()
    aa = a64 @ a64.transpose(-1, -2)
    gg = g64 @ g64.transpose(-1, -2)
    s = (aa * gg).sum((1, 2, 3)).clamp(min=0.0)
    m = (torch.linalg.vector_norm(a64, dim=-1) * torch.linalg.vector_norm(g64, dim=-1)).sum((1, 2))
    return s, m


def underflow_flag(c: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """Whether a product c_i·g of the clipped sum (c∘G)ᵀA is below ``cg``'s normal range while g
    is not 0 (float32 and lower). There the rounding is absolute (up to 2⁻¹⁵⁰ in float32) rather
    than relative — a product 1.5·2⁻¹⁴⁹ became 2·2⁻¹⁴⁹, a third more — and the activation it then
    multiplies can be 10³⁸: tokens with such output gradients moved an example's clipped
    gradient to 1.0015·ζ, beyond the relative bound of ``_gram_sq``. In float64 the products
    of float32 numbers are exact.

    Args:
        c: the clip factors in g's dtype, shape (b,); g: output gradients (b, groups, T, p).

    Returns:
        a 0-dim bool tensor (not read here: no host synchronisation), or None for float64 or
        an empty g.
    """
    if g.dtype == torch.float64 or g.numel() == 0:
        return None
    cg = g * c.view(-1, *([1] * (g.dim() - 1)))
    return ((cg.abs() < torch.finfo(g.dtype).tiny) & (g != 0)).any()
