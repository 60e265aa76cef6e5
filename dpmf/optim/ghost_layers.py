"""The clipping-layer registry: per-example squared norms and clipped sums of one layer kind.

Ghost clipping and book-keeping (``dpmf.optim.ghost``) need, for each module owning trainable
parameters, the squared norm of each example's gradient restricted to those parameters and,
given the clip factors c, the sum Σ_i c_i·g_i — from the module's recorded inputs and output
gradients, without a per-example backward. A **handler** says how for one module type;
``register_clipping_layer(module_type, handler)`` adds one. A module is matched by its exact
type, else by its nearest registered base class whose ``forward`` it does not override (a
subclass that changes the forward, or the ``_conv_forward`` it calls, is not the registered
layer); then the handler's ``check`` may still decline it (for instance a sparse embedding). A
module with a forward hook (its own or a global one: it may change the output whose gradient
the handler's formulas take), or a method of its class shadowed on the instance (accelerate's
hooks replace ``module.forward``) has none. Replacing torch's or dpmf's own code
(``F.linear = …``, ``nn.Linear.forward = …``) is the trainer's code, trusted, and not looked for. During
a recorded forward the engine also checks, at each call of a registered layer, that no hook ran
before its own and that the instance's attributes are those of when the handler was chosen.
Modules without a handler take the ``torch.func`` path of ``dpmf.optim.ghost`` (per module, or
for the whole model).

Built-in handlers (registered below through the same function):

- ``nn.Linear``: s = aWᵀ + b on T tokens; ‖G_iᵀA_i‖² as a ghost norm ⟨A_iA_iᵀ, G_iG_iᵀ⟩ when
  T²(d + p) < T·p·d, else the per-example gradient instantiated (the mixed rule of Bu et al.,
  NeurIPS 2022, §3.2; Li et al., ICLR 2022, §4); the sum (c∘G)ᵀA (Bu et al., ICML 2023, Alg. 1).
- ``nn.Conv1d``/``nn.Conv2d``: the same on the unfolded input, one linear layer per group.
- transformers' ``Conv1D`` (GPT-2; s = aW + b with W of shape (d, p)): the linear rule with
  the weight transposed; registered by its qualified name so that transformers is never
  imported here.
- ``nn.Embedding``: ‖Σ_t e_{x_t}G_i[t]‖² = Σ_{t,u}[x_t = x_u]⟨G_i[t], G_i[u]⟩ (the sparse
  per-example gradient beyond 16 tokens per example); not for ``sparse`` or
  ``scale_grad_by_freq`` embeddings (their gradients couple the batch's token counts).
- ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: the affine gradients Σ_t G∘x̂ and Σ_t G,
  instantiated per example.

A handler implements ``per_example`` (instantiated per-example gradients; the default norms and
sums are taken from them) or, for a cheaper closed form, ``sq_norms`` and ``clipped_sum``.
Every handler that can also instantiate its per-example gradients supports tied parameters
(one parameter used by several registered layers, e.g. GPT-2's input and output embeddings):
the per-example gradient of such a parameter is the sum of its uses, instantiated (a weight
tied between one ``nn.Embedding`` and one ``nn.Linear`` has its own closed form instead,
``dpmf.optim.ghost_tied``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

__all__ = [
    "ClippingHandler",
    "register_clipping_layer",
    "clipping_handler",
    "registered_clipping_layers",
]


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
    could matter) takes the norm of its entries scaled by 2¹⁰⁰ instead (exact: a power of two)."""
    norms = _run_norms(x)
    if x.dtype == torch.float64:
        return norms
    small = norms < 4e-20 * math.sqrt(x.shape[-1])
    if x.device.type == "cpu" and not bool(small.any()):  # the usual case (no sync on a GPU)
        return norms
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


class ClippingHandler:
    """How one kind of layer gives its per-example squared norms and clipped sums.

    Subclass it and register an instance with ``register_clipping_layer``. The methods receive:

    - ``module``: the layer;
    - ``calls``: its forward calls in this micro-batch that received an output gradient, each
      with ``call.inputs`` (the positional inputs, detached; examples along dim 0) and
      ``call.grad`` (∂L/∂output, same shape as the output, L = Σ_i ℓ_i; with an evaluation
      plan of several points, one call per point and use, already weighted);
    - ``attrs``: the attribute names of its trainable parameters (e.g. ``["weight", "bias"]``);
    - ``dtype``: float32 (float64 for a float64 model or after an overflow) — compute in it.

    A layer called several times (shared module, several evaluation points) has the sum of
    its calls' contributions as each example's gradient, so sum over ``calls`` before squaring.

    Class attributes:
        name: a short name of the kind (``ghost_layer_kinds`` reports it).
        copy_output: the recorded output is a copy (True, safe for any layer), or the node sits
            on the output itself (False: only when the layer's own backward does not save its
            output, e.g. Linear, convolutions, embeddings, norms).
        sum_by_backward: with ``clipping="ghost"``, Σ_i c_i·g_i may come from the second
            backward through the model (True) instead of ``clipped_sum`` (False).
    """

    name: ClassVar[str] = "custom"
    copy_output: ClassVar[bool] = True
    sum_by_backward: ClassVar[bool] = True

    def check(self, module: nn.Module) -> str | None:
        """Why this module cannot take this handler (it then takes torch.func), or None."""
        return None

    def per_example(self, module, calls, attrs, dtype) -> dict[str, torch.Tensor]:
        """attr → per-example gradients, shape (b, *parameter.shape)."""
        raise NotImplementedError(
            f"{type(self).__name__}.per_example is not implemented: a handler implements per_example, "
            "or sq_norms and clipped_sum"
        )

    def sq_norms(self, module, calls, attrs, dtype) -> tuple[dict[str, torch.Tensor], object]:
        """(attr → ‖g_i restricted to it‖², shape (b,), state for ``clipped_sum``)."""
        per = self.per_example(module, calls, attrs, dtype)
        return {a: _sq(per[a]) for a in attrs}, per

    def clipped_sum(self, module, state, factors, attrs, dtype) -> dict[str, torch.Tensor]:
        """attr → Σ_i factors_i·g_i (the parameter's shape), from ``sq_norms``'s state."""
        return {a: weighted_sum(_as(factors, state[a].dtype), state[a]) for a in attrs}


# type (or "module.QualName") → handler
_REGISTRY: dict[object, ClippingHandler] = {}
_BUILTIN: dict[object, ClippingHandler] = {}  # the handlers this module registers


def _forward_methods(cls) -> tuple:
    return (cls.forward, getattr(cls, "_conv_forward", None))


_CALLABLES: dict[type, frozenset] = {}  # a type → the names of its callable attributes


def _instance_method(module: nn.Module, own) -> str | None:
    """The name of a method of the module's class (``forward``, ``_conv_forward``,
    ``_call_impl``, …) or of a parameter, buffer or submodule (``own``) that the instance
    shadows with an attribute of its own, or None."""
    t = type(module)
    names = _CALLABLES.get(t)
    if names is None:
        names = _CALLABLES[t] = frozenset(k for k in dir(t) if callable(getattr(t, k, None)))
    hit = module.__dict__.keys() & names or module.__dict__.keys() & own
    return min(hit) if hit else None


def _data_descriptor(v) -> bool:
    return hasattr(type(v), "__set__") or hasattr(type(v), "__delete__")


def _subclass_shadows(t: type, cls: type, own) -> str | None:
    """What a class between the module's type ``t`` and the registered ``cls`` defines that the
    forward's attribute reads would find instead of the registered layer's: a property or other
    data descriptor, ``__getattr__``/``__getattribute__``, or a parameter's, buffer's or
    submodule's name (``own``); None when nothing."""
    for c in t.__mro__:
        if c is cls:
            return None
        for k, v in c.__dict__.items():
            if k in ("__getattr__", "__getattribute__") or k in own:
                return k
            if k not in ("__dict__", "__weakref__") and _data_descriptor(v):
                return k
    return None


def _forward_hooked(module: nn.Module) -> bool:
    """Whether a forward hook (the module's own or a global one) may change the module's output
    before the engine records it — the handler's formulas are for the forward's own output — or
    a legacy (not full) backward hook may change the gradients of the node after it (for a
    Linear, its weight's: ``register_backward_hook`` doubling them made the norms 0.6–0.93× the
    true ones)."""
    if module._forward_hooks or _module._global_forward_hooks:
        return True
    legacy = module._backward_hooks and not module._is_full_backward_hook
    return bool(legacy) or bool(_module._global_backward_hooks and not _module._global_is_full_backward_hook)


def _key_of(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_clipping_layer(module_type, handler: ClippingHandler, *, replace: bool = False) -> None:
    """Register ``handler`` for the layers of ``module_type`` (ghost clipping and book-keeping).

    Args:
        module_type: an ``nn.Module`` subclass, or its qualified name ``"package.module.Class"``
            (matched without importing the package). Subclasses that keep its ``forward`` are
            matched too; registering a type again replaces its handler.
        handler: a ``ClippingHandler`` instance.
        replace: needed to replace the handler of a layer dpmf itself registers (Linear,
            Conv, Embedding, the norms, Conv1D): the per-example norms decide the clipping,
            so an import must not silently swap them.

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass or a dotted name, or
            ``handler`` is not a ``ClippingHandler``.
        ValueError: a layer with a built-in handler, without ``replace=True``.

    Example: ``tests/test_clipping_registry.py`` and docs/architecture.md ("Add a clipping layer").
    """
    if isinstance(module_type, str):
        if "." not in module_type:
            raise TypeError(
                f"module_type={module_type!r} is invalid: a name must be qualified, 'package.module.Class'"
            )
        key = module_type
    elif isinstance(module_type, type) and issubclass(module_type, nn.Module):
        key = _key_of(module_type)
    else:
        raise TypeError(f"module_type={module_type!r} is invalid: must be an nn.Module subclass or its name")
    if not isinstance(handler, ClippingHandler):
        raise TypeError(f"handler={handler!r} is invalid: must be an instance of dpmf.optim.ClippingHandler")
    if key in _BUILTIN and not replace:
        raise ValueError(
            f"module_type={key!r} is invalid: dpmf's own {_REGISTRY[key].name!r} handler clips it; "
            "pass replace=True to replace it (the per-example norms decide the clipping)"
        )
    _REGISTRY[key] = handler


def registered_clipping_layers() -> dict[str, str]:
    """Qualified module type name → handler kind name, for every registered layer type."""
    return {k: h.name for k, h in _REGISTRY.items()}


def clipping_handler(module: nn.Module) -> tuple[ClippingHandler | None, str | None]:
    """(handler, None) for a registered layer; (None, reason) otherwise."""
    t = type(module)
    own = module._parameters.keys() | module._buffers.keys() | module._modules.keys()
    shadowed = _instance_method(module, own)  # module._conv_forward = …, module._call_impl = …
    if shadowed is not None:
        return None, f"its method {shadowed!r} is replaced on the instance"
    if _forward_hooked(module):
        return None, "a hook may change its output or gradients (the handler knows the forward's own)"
    for cls in t.__mro__:
        if cls is nn.Module or cls is object:
            break
        key = _key_of(cls)
        handler = _REGISTRY.get(key)
        if handler is None:
            continue
        if _forward_methods(t) != _forward_methods(cls):  # forward, or the _conv_forward it calls
            return None, f"{t.__name__} overrides the forward of the registered {cls.__name__}"
        shadow = None if t is cls else _subclass_shadows(t, cls, own)
        if shadow is not None:
            return None, f"{t.__name__} defines {shadow!r}, which the forward of {cls.__name__} would read"
        reason = handler.check(module)
        if reason is not None:
            return None, reason
        return handler, None
    return None, f"no clipping handler is registered for {t.__name__}"


# -- built-in handlers ----------------------------------------------------------------------


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


def _underflows(cg: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether a product c_i·g of the clipped sum (c∘G)ᵀA is below ``cg``'s normal range while g
    is not 0 (float32 and lower). There the rounding is absolute (up to 2⁻¹⁵⁰ in float32) rather
    than relative — a product 1.5·2⁻¹⁴⁹ became 2·2⁻¹⁴⁹, a third more — and the activation it then
    multiplies can be 10³⁸: tokens with such output gradients moved an example's clipped
    gradient to 1.0015·ζ, beyond the relative bound of ``_gram_sq``. In float64 the products
    of float32 numbers are exact."""
    if cg.dtype == torch.float64 or cg.numel() == 0:
        return False
    return bool(((cg.abs() < torch.finfo(cg.dtype).tiny) & (g != 0)).any())


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
                if _underflows(cg, g):  # float64: c_i·g exactly (see _underflows)
                    cg, x = g.double() * c.double().view(-1, 1, 1, 1), x.double()
                s = torch.einsum("bgtp,bgtd->gpd", cg, x).to(dtype)
                out[a] = self.from_ghost(module, s)
            else:
                out[a] = weighted_sum(c, entry[1])  # no copy of a transposed w
        return out


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


def _conv_padded(m, x):
    """The input padded as the convolution pads it (any padding mode, 'same' included)."""
    k = len(m.kernel_size)
    if m.padding_mode != "zeros":  # the forward pads by this list, kept on the instance
        pads = list(m._reversed_padding_repeated_twice)
    elif isinstance(m.padding, str):
        pads = [0] * (2 * k)
        if m.padding == "same":  # PyTorch puts the odd element on the right / bottom
            for i in range(k):
                total = m.dilation[i] * (m.kernel_size[i] - 1)
                j = 2 * (k - 1 - i)
                pads[j], pads[j + 1] = total // 2, total - total // 2
    else:
        pads = [q for p in reversed(m.padding) for q in (p, p)]
    if not any(pads):
        return x
    return F.pad(x, pads, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)


class ConvHandler(LinearHandler):
    """``nn.Conv1d``/``nn.Conv2d``: the linear rule on the unfolded input, per group."""

    name = "conv"

    def dims(self, module, call):
        k = 1
        for s in module.kernel_size:
            k *= s
        m = module
        return call.grad[0, 0].numel(), m.in_channels // m.groups * k, m.out_channels // m.groups

    def form(self, module, call):
        m, x, g = module, call.inputs[0], call.grad
        b = x.shape[0]
        x = _conv_padded(m, x)
        if isinstance(m, nn.Conv1d):
            x, g = x.unsqueeze(-2), g.unsqueeze(-2)
            kernel, stride, dilation = (1, *m.kernel_size), (1, *m.stride), (1, *m.dilation)
        else:
            kernel, stride, dilation = m.kernel_size, m.stride, m.dilation
        cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (b, C_in·k, L)
        grp = m.groups
        a = cols.reshape(b, grp, -1, cols.shape[-1]).transpose(2, 3)  # (b, g, L, d)
        gg = g.reshape(b, grp, g.shape[1] // grp, -1).transpose(2, 3)  # (b, g, L, p)
        return a, gg

    def weight_per_example(self, module, call, dtype):
        """Per-example weight gradients by one grouped convolution backward with the examples
        as groups (no unfolded input is formed)."""
        m = module
        x, g = _conv_padded(m, call.inputs[0].to(dtype)), call.grad.to(dtype)
        b = x.shape[0]
        xi = x.reshape(1, b * x.shape[1], *x.shape[2:])
        gi = g.reshape(1, b * g.shape[1], *g.shape[2:])
        shape = (b * m.out_channels, m.in_channels // m.groups, *m.kernel_size)
        w = torch.ops.aten.convolution_backward(
            gi,
            xi,
            torch.empty(shape, dtype=dtype, device=x.device),
            None,
            list(m.stride),
            [0] * len(m.kernel_size),
            list(m.dilation),
            False,
            [0] * len(m.kernel_size),
            b * m.groups,
            [False, True, False],
        )[1]
        return w.reshape(b, *m.weight.shape)

    def bias_per_example(self, module, call, dtype):
        g = call.grad
        return g.to(dtype).reshape(g.shape[0], g.shape[1], -1).sum(-1)


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


class EmbeddingHandler(ClippingHandler):
    """``nn.Embedding``: ghost norm over equal tokens (or the sparse gradient's rows)."""

    name = "embedding"
    copy_output = False

    def check(self, module):
        if module.sparse or module.scale_grad_by_freq:  # batch-coupled frequencies
            return "a sparse or scale_grad_by_freq embedding"
        return None

    def _ids_grads(self, module, calls, dtype):
        ids, gs = [], []
        for c in calls:
            i = c.inputs[0].reshape(c.inputs[0].shape[0], -1)
            gg = c.grad.reshape(i.shape[0], -1, c.grad.shape[-1]).to(dtype)
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


def _rms_norm_eps(dtype) -> float:
    """The ε ``F.rms_norm(..., eps=None)`` uses for an input of ``dtype``: that of the type it
    computes in (float32 for float16 and bfloat16 inputs, not their own ε — 0.0078 for bfloat16,
    which once made the handler's norms 18× too small under bfloat16 autocast)."""
    return torch.finfo(torch.float32 if torch.finfo(dtype).bits < 32 else dtype).eps


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


_LINEAR = LinearHandler()
register_clipping_layer(nn.Linear, _LINEAR)
register_clipping_layer(nn.Conv1d, ConvHandler())
register_clipping_layer(nn.Conv2d, ConvHandler())
register_clipping_layer(nn.Embedding, EmbeddingHandler())
for _norm in (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm):
    register_clipping_layer(_norm, NormHandler())
register_clipping_layer("transformers.pytorch_utils.Conv1D", Conv1DHandler())
_BUILTIN.update(_REGISTRY)  # replaced only with replace=True
