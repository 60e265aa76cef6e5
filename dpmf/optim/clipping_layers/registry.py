"""The clipping-layer registry: which handler gives a module's per-example norms and sums.

A module is matched by its exact type, else by its nearest registered base class whose
``forward`` (and the ``_conv_forward`` it calls) it does not override; the handler's ``check``
may still decline it. A module with a forward hook (its own or a global one, which may change
the output whose gradient the formulas take), a legacy backward hook, a method or one of its
parameters', buffers' or submodules' names shadowed on the instance (accelerate's hooks replace
``module.forward``), or a subclass defining a property or ``__getattr__`` its forward would read
has none. All of that is seen when the handler is chosen, once per engine; replacing torch's or
dpmf's own code at run time is the trainer's (trusted) code and is not looked for.

Third parties register a handler as dpmf does for its own layers: ``@clipping_layer(MyLayer)``
on a ``ClippingHandler`` subclass, or ``register_clipping_layer(MyLayer, handler)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from torch.nn.modules import module as _module

from dpmf.optim.clipping_layers.norms import _as, _sq, weighted_sum


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
        expand_shared_input: an input whose dim 0 has size 1 while the batch has b > 1
            examples (position ids shared by the batch) is expanded to b rows before the
            layer runs, so that its output, and the output gradient each example's gradient
            is read from, has one row per example (the same values downstream wherever the
            output is broadcast against the batch); False: such a call takes torch.func.
        expand_shared_output: an output whose dim 0 has size 1 while the batch has b > 1
            examples (a lookup shared by the batch, broadcast against it downstream) is expanded
            to b rows, the same values, so that each example's output gradient is its own row
            (with ``copy_output``: the node sits on a copy).
        keyword_inputs: the keyword arguments of the layer's forward the handler reads (from
            ``call.kwargs``); a call with any other keyword argument takes torch.func.
    """

    name: ClassVar[str] = "custom"
    copy_output: ClassVar[bool] = True
    sum_by_backward: ClassVar[bool] = True
    expand_shared_input: ClassVar[bool] = False
    expand_shared_output: ClassVar[bool] = False
    keyword_inputs: ClassVar[tuple[str, ...]] = ()

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

    def sum_needs_float64(self, module, state, factors, attrs) -> torch.Tensor | None:
        """A 0-dim bool tensor: whether ``clipped_sum`` in the state's dtype could move an
        example's share beyond ζ (products below the dtype's normal range), so that the engine
        widens the state to float64 and sums again; None: never. The engine reads every
        layer's flag in one host synchronisation; the default is None."""
        return None


# type (or "module.QualName") → handler
_REGISTRY: dict[object, ClippingHandler] = {}


_BUILTIN: dict[object, ClippingHandler] = {}  # the handlers dpmf registers (``mark_builtin``)


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


# Forward hooks known to leave the output's values unchanged: transformers' input-embedding hook
# of ``enable_input_require_grads`` (gradient checkpointing, adapters), which only marks the
# output as requiring a gradient; and FSDP2's post-forward hook (``fully_shard``), which reshards
# the module's parameters and registers its pre-backward hook on the output (it casts the output
# only under a ``MixedPrecisionPolicy(output_dtype=…)``, which the sharded step refuses).
_VALUE_PRESERVING_HOOKS = {
    (
        "transformers.modeling_utils",
        "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",
    ),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._post_forward"),
}


def value_preserving(hook) -> bool:
    """Whether a forward hook is one known to leave its module's output values unchanged."""
    fn = getattr(hook, "__func__", hook)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) in _VALUE_PRESERVING_HOOKS


def _forward_hooked(module: nn.Module) -> bool:
    """Whether a forward hook (the module's own or a global one) may change the module's output
    before the engine records it — the handler's formulas are for the forward's own output — or
    a legacy (not full) backward hook may change the gradients of the node after it (for a
    Linear, its weight's: ``register_backward_hook`` doubling them made the norms 0.6–0.93× the
    true ones)."""
    if _module._global_forward_hooks or not all(map(value_preserving, module._forward_hooks.values())):
        return True
    legacy = module._backward_hooks and not module._is_full_backward_hook
    return bool(legacy) or bool(_module._global_backward_hooks and not _module._global_is_full_backward_hook)


def _key_of(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _type_key(module_type) -> str:
    if isinstance(module_type, str):
        if "." not in module_type:
            raise TypeError(
                f"module_type={module_type!r} is invalid: a name must be qualified, 'package.module.Class'"
            )
        return module_type
    if isinstance(module_type, type) and issubclass(module_type, nn.Module):
        return _key_of(module_type)
    raise TypeError(f"module_type={module_type!r} is invalid: must be an nn.Module subclass or its name")


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

    Example: ``tests/test_clipping_registry.py`` and docs/architecture.md ("Extending").
    """
    key = _type_key(module_type)
    if not isinstance(handler, ClippingHandler):
        raise TypeError(f"handler={handler!r} is invalid: must be an instance of dpmf.optim.ClippingHandler")
    if key in _BUILTIN and not replace:
        raise ValueError(
            f"module_type={key!r} is invalid: dpmf's own {_REGISTRY[key].name!r} handler clips it; "
            "pass replace=True to replace it (the per-example norms decide the clipping)"
        )
    _REGISTRY[key] = handler


def clipping_layer(*module_types, replace: bool = False):
    """Class decorator: register an instance of the decorated ``ClippingHandler`` subclass for
    each of ``module_types`` (types or qualified names, as ``register_clipping_layer``).

    Raises:
        TypeError / ValueError: as ``register_clipping_layer``.
    """

    def register(cls):
        handler = cls()
        for t in module_types:
            register_clipping_layer(t, handler, replace=replace)
        return cls

    return register


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


# type name → batch adapter: a forward pre-hook (module, args, kwargs) → None or (args, kwargs)
_ADAPTERS: dict[str, Callable] = {}
_ADAPTED: dict[type, Callable | None] = {}  # a module type → its adapter (cache of the lookup)


def register_batch_adapter(module_type, adapter: Callable) -> None:
    """Register a **batch adapter** for the modules of ``module_type`` (exact type).

    Some models compute a tensor shared by the batch from a trainable layer and broadcast it
    against the examples later (T5's relative position bias: an embedding of a (T, T) bucket
    matrix, added to every example's attention scores). The layer's output gradient is then the
    sum over the batch, from which no per-example gradient can be read. An adapter is a forward
    pre-hook with keyword arguments, ``adapter(module, args, kwargs) -> None | (args, kwargs)``,
    that computes the shared tensor with one row per example (the same values) and hands it to
    the module's forward, so that the layer it calls sees examples along dim 0 and its handler
    applies; ghost clipping installs it on matching modules for its recorded forward only.

    Args:
        module_type: an ``nn.Module`` subclass or its qualified name ``"package.module.Class"``.
        adapter: the pre-hook; it must leave the module's outputs' values unchanged.

    Raises:
        TypeError: ``module_type`` is not a module type or qualified name, or ``adapter`` is not
            callable.
    """
    key = _type_key(module_type)
    if not callable(adapter):
        raise TypeError(f"adapter={adapter!r} is invalid: must be a callable (module, args, kwargs)")
    _ADAPTERS[key] = adapter
    _ADAPTED.clear()


def batch_adapter(module: nn.Module) -> Callable | None:
    """The batch adapter registered for the module's exact type, or None."""
    t = type(module)
    if t not in _ADAPTED:
        _ADAPTED[t] = _ADAPTERS.get(_key_of(t))
    return _ADAPTED[t]


def mark_builtin() -> None:
    """Record every handler registered so far as dpmf's own (replaced only with ``replace=True``)."""
    _BUILTIN.update(_REGISTRY)
