"""Per-example gradient norms without per-example gradients: ghost norms and book-keeping.

For a layer s = a·Wᵀ + b applied to the T tokens of one example (activations A_i ∈ ℝ^{T×d},
output gradients G_i = ∂ℓ_i/∂s_i ∈ ℝ^{T×p}) the per-example weight gradient is G_iᵀA_i, and

    ‖G_iᵀA_i‖_F² = ⟨A_iA_iᵀ, G_iG_iᵀ⟩                                         (ghost norm)

costs O(T²(d + p)) per example instead of O(T·p·d) and never holds a p×d matrix per example
(Goodfellow, "Efficient Per-Example Gradient Computations", arXiv:1510.01799, 2015, for T = 1:
‖a_i‖²‖g_i‖²; Li et al., "Large Language Models Can Be Strong Differentially Private
Learners", ICLR 2022, §4, for sequences). Per layer the cheaper of the two is taken from the
shapes — ghost when T²(d + p) < T·p·d, else the per-example gradient is instantiated — the
"mixed ghost clipping" rule of Bu et al. ("Scalable and Efficient Training of Large
Convolutional Neural Networks with Differential Privacy", NeurIPS 2022, §3.2, written there as
2T² < pd; here with the flop counts of both sides). Convolutions are the same layer on the
unfolded input (T = output positions, d = C_in/groups·kernel), one such layer per group;
embeddings have ‖Σ_t e_{x_t}G_i[t]‖² = Σ_{t,u} [x_t = x_u]⟨G_i[t], G_i[u]⟩ (beyond 16 tokens
per example, the norm of the sparse per-example gradient, one row per distinct token); the affine
parameters of LayerNorm, GroupNorm and RMSNorm have cheap per-example gradients (Σ_t G∘x̂ and
Σ_t G) that are instantiated.

One pass gives everything: the batch goes forward once, the forward hooks keep each layer's
input and a zero-cost autograd node after its output records ∂(Σ_i ℓ_i)/∂s. That backward is
run only towards those nodes, so no weight gradient is computed in it. The global norm of
example i over all trainable parameters is the square root of the sum of its per-layer squared
norms; c_i = min(1, ζ/‖g_i‖). Then, in one of two ways:

- ``"ghost"``: a second backward of Σ_i c_i·ℓ_i through the kept graph (Li et al. 2022);
  under ``torch.autocast`` the registered layers' sums are taken by book-keeping instead, from
  the float32 copies of the recorded tensors whose norms were taken (a low-precision second
  backward rounds differently, and one example's clipped gradient could exceed ζ);
- ``"bk"`` (book-keeping): Σ_i c_i G_iᵀA_i = (c∘G)ᵀA from the recorded activations and
  output gradients, one GEMM per layer and no second backward (Bu et al., "Differentially
  Private Optimization on Large Model at Small Cost", ICML 2023, Algorithm 1).

Which layers have closed forms is the clipping-layer registry (``dpmf.optim.clipping_layers``:
module type → handler; ``register_clipping_layer`` adds one). A parameter shared by several
registered layers gets the sum of its uses' per-example gradients, instantiated by their
handlers — except a weight tied between one embedding and one linear output layer (GPT-2's
input and output embeddings), whose norm and sum have a closed form with the cross term of
the two uses (``dpmf.optim.ghost_tied``). Every other module with trainable parameters takes
its per-example gradients from ``torch.func``: a module called with one tensor (examples along
dim 0) and returning one tensor gets ``vmap(grad(·))`` of that module alone, against its
recorded input and output gradient; anything else — a parameter used outside its own module's
forward (e.g. the output projection of ``nn.MultiheadAttention``), a parameter shared with a
module without a handler, a module with several inputs, or a layer whose dim 0 does not follow
the examples (``batch_first=False``) — gets the whole-model ``vmap(grad(·))`` path for its
parameters. Those conditions are checked at run time (during the recorded forward the
trainable parameters report every operation that reads them — a ``Parameter`` subclass, or a
``TorchFunctionMode`` for evaluation plans; a parameter is a plain ``nn.Parameter`` only while
its use is inside its own module's forward, the hooks switching its class as modules enter and
leave — and a one-example probe pass checks that every
recorded tensor's leading dimension follows the batch), never assumed, because a missed use
would make a per-example norm too small: the clipping bound — the sensitivity the noise is
calibrated to — would silently fail. Reading a parameter's metadata (dtype, shape, device) is
not a use.

Inputs are one tensor (``model(x)``) or a dict of tensors (``model(**batch)``, e.g. a Hugging
Face batch); a ``loss_fn`` with a ``per_example`` method gives the per-example losses itself
(``dpmf.train.hf``). A layer's norms are taken as soon as all its output gradients have arrived
in the backward, and its recorded tensors dropped then.

The probe is one forward of the first example under ``torch.no_grad`` (the random state is
restored afterwards), once per model, input shape and set of trainable parameters; a module
that changes its own state in the forward sees it once more.

Mixed precision: under ``torch.autocast`` the recorded activations and output gradients are in
the low precision; every norm, Gram matrix and sum here is computed in float32 (float64 for a
float64 model, and for a layer whose float32 squares overflow) with autocast disabled, and the
per-layer squared norms are combined in float64. Linear layers (``nn.Linear``, GPT-2's
``Conv1D``, convolutions) leave their norms pending in the backward: all layers' norms are
widened and squared in one batch at its end, and a norm that is not finite is recomputed in
float64 from what its layer kept (the instantiated per-example gradient, or the recorded
tensors of a ghost norm); when a clip factor ζ/‖g_i‖ is below float32's normal range (a norm
above about 8·10³⁷·ζ), the layers whose state is known take their clipped sums in float64 and
any other the factors rounded towards 0, as does the second backward (never above ζ/‖g_i‖);
an instantiated gradient whose entries themselves overflow float32 is not finite, and the step
raises ``NonFiniteGradientError`` (compute in float64). A ghost norm of several tokens,
⟨AAᵀ, GGᵀ⟩, can cancel: its Gram matrices are taken in float64 and a bound on the rounding
added, so that it is never below the norm of the vector book-keeping sums
(``clipping_layers.norms._gram_sq``); so are an embedding's norm (equal tokens whose gradients cancel)
and a tied embedding's (its two uses cancelling, ``ghost_tied``). Its book-keeping sum (c∘G)ᵀA
is taken in float64 when a product c_i·g is below float32's normal range (rounded there by up to
a third, then multiplied by the activations).

Assumptions, as for any per-example method: the examples do not interact in the forward
(``check_per_example_safe`` refuses BatchNorm), and each layer sees the examples in the
order of the input's dim 0.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

from dpmf.optim.choices import CLIPPING_MODES
from dpmf.optim.clipping_layers import (
    ClippingHandler,
    PendingNorm,
    clipping_handler,
    row_norms,
    squares,
    weighted_sum,
)
from dpmf.optim.clipping_layers.norms import _as, _sq
from dpmf.optim.clipping_layers.registry import batch_adapter, value_preserving
from dpmf.optim.fsdp import is_sharded, reshard, unsharded_aliases, zeros_of
from dpmf.optim.func_call import functional_call
from dpmf.optim.ghost_chain import chain_layers, chain_output_gradients
from dpmf.optim.ghost_tied import TiedEmbeddingLinear, tied_embedding_linear
from dpmf.optim.trees import batched_leaves, map_tensors

__all__ = ["CLIPPING_MODES", "GhostResult", "ghost_clipped_sum", "ghost_layer_kinds"]


def ghost_layer_kinds(model: nn.Module) -> dict[str, str]:
    """How each module owning trainable parameters is handled before any run-time check: the
    name of its registered handler (``linear``, ``conv``, ``conv1d``, ``embedding``, ``norm``,
    or a user's; ``dpmf.optim.clipping_layers``) or ``generic`` (``torch.func``).

    Module names are those of ``model.named_modules()`` (``""`` for the model itself).
    """
    out = {}
    for name, m in model.named_modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            handler, _ = clipping_handler(m)
            out[name] = "generic" if handler is None else handler.name
    return out


# -- recording ------------------------------------------------------------------------------


class _Capture(torch.autograd.Function):
    """Identity on a layer's output whose backward records the output gradient.

    The output is marked as modified in place, so the node sits on the tensor itself (no copy)
    and a later in-place operation (``ReLU(inplace=True)``) sees it as its input; a reshaped
    view (Linear on 3-D inputs) gets the node on its base, then the same view again. The second
    input is a shared scalar ``anchor``: a backward asked only for the anchor's gradient reaches
    every recorded output and stops below the first one, computing no weight gradient.
    """

    @staticmethod
    def forward(ctx, out, anchor, call):
        ctx.call = call
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, g):
        call = ctx.call
        if call.recording:
            h = g if call.shape is None else g.view(call.shape)
            call.grad = h if call.grad is None else call.grad + h
            if call.arrived is not None:
                call.arrived(call)
        return g, None, None  # the anchor only marks the nodes to run; it needs no value


class _CaptureCopy(_Capture):
    """``_Capture`` for outputs that their producer may have saved (any module's output)."""

    @staticmethod
    def forward(ctx, out, anchor, call):
        ctx.call = call
        return out.clone()


@dataclass(eq=False, slots=True)
class _Call:
    """One forward call of a recorded module at one evaluation point."""

    point: int
    inputs: tuple
    grad: torch.Tensor | None = None
    params: dict | None = None  # generic modules: the parameter values this call used
    recording: bool = True
    shape: torch.Size | None = None  # the output's shape when the node sits on its base
    arrived: Callable | None = None  # called when the output gradient is recorded
    kwargs: dict | None = None  # the keyword inputs its handler reads (``keyword_inputs``), detached


@dataclass(eq=False)
class _Layer:
    name: str
    module: nn.Module
    handler: ClippingHandler | None  # None: torch.func on the module alone ("generic")
    params: list[tuple[str, str]]  # (model-level name, attribute name) of its trainable params
    calls: list[_Call] = field(default_factory=list)
    fallback: str | None = None  # why it needs the whole-model torch.func path
    hook_id: int | None = None  # the id of the engine's forward hook on the module
    # a registered layer's instance attributes when the engine was built (names, values): the
    # handler's formulas read them after the forward, so the forward must have run with them
    state: tuple | None = None

    @property
    def kind(self) -> str:
        return "generic" if self.handler is None else self.handler.name


# Reading these attributes of a parameter reads no value: not a use of the parameter.
_METADATA = frozenset(
    ("dtype", "device", "shape", "requires_grad", "is_cuda", "layout", "ndim", "is_leaf", "grad_fn")
)


def _inside(stack: list, layers: list) -> bool:
    """Whether a use of a parameter owned by ``layers`` is inside its own module's forward now:
    a layer with a handler must be the innermost recorded layer running, a generic one (torch.func
    on the module alone) anywhere on the stack."""
    return bool(stack) and any(
        (stack[-1] is layer if layer.handler is not None else layer in stack) for layer in layers
    )


def _check_use(engine, func, args, kwargs) -> None:
    """Flag the layers whose trainable parameter ``func`` reads outside their module's forward."""
    owners = engine.owner_of
    if not owners or engine.quiet or _metadata_only(func):
        return
    for a in _tensors(args, kwargs or {}):
        layers = owners.get(id(a))
        if layers is None:
            continue
        if not _inside(engine.stack, layers):
            for layer in layers:
                if layer.fallback is None:
                    layer.fallback = "a trainable parameter is used outside its module's forward"


class _Watch(TorchFunctionMode):
    """Flags a trainable parameter read by an operation outside its own module's forward (every
    operation passes through it; used when the parameters cannot be watched themselves)."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_use(self.engine, func, args, kwargs)
        return func(*args, **kwargs)


_ACTIVE = threading.local()  # the engine whose forward runs in this thread


class _WatchedParameter(nn.Parameter):
    """A trainable ``nn.Parameter`` during a recorded forward: only the operations that read it
    pass through Python (``_check_use``), not every operation of the model as under ``_Watch``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        engine = getattr(_ACTIVE, "engine", None)
        if engine is not None:
            _check_use(engine, func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class _watching:
    """The parameters turned into ``_WatchedParameter`` for one forward (plain ``nn.Parameter``s
    only), else the ``_Watch`` mode; restored on exit. While a parameter's use is inside its own
    module's forward (``_inside``) it is a plain ``nn.Parameter`` again (the engine's hooks switch
    it, ``_Engine.reclass``): only the uses that could be outside pass through Python."""

    def __init__(self, engine, params):
        self.engine = engine
        self.params = params
        self.swap = params is not None and all(type(p) is nn.Parameter for p in params)
        self.mode = None

    def __enter__(self):
        if not self.swap:
            self.mode = _Watch(self.engine)
            return self.mode.__enter__()
        self.previous = getattr(_ACTIVE, "engine", None)
        _ACTIVE.engine = self.engine
        for p in self.params:
            p.__class__ = _WatchedParameter
        self.engine.switching = True
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            return self.mode.__exit__(*exc)
        self.engine.switching = False
        for p in self.params:
            p.__class__ = nn.Parameter
        _ACTIVE.engine = self.previous
        return False


_SIZE_QUERIES = frozenset(
    (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.stride)
)


def _metadata_only(func) -> bool:
    """An operation that reads a tensor's metadata (dtype, shape, …), never its values."""
    if func in _SIZE_QUERIES:
        return True
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA
    return False


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _get(module: nn.Module, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


class _Engine:
    """Hooks on every module owning trainable parameters, for one clipped sum."""

    def __init__(self, model: nn.Module, names: list[str], named: dict | None = None, modules=None):
        self.model = model
        self.trainable = set(names)
        self.layers: list[_Layer] = []
        named = dict(model.named_parameters()) if named is None else named
        canonical = {id(p): n for n, p in named.items()}  # a tied tensor: its first name
        by_param: dict[str, list[_Layer]] = {}
        modules = model.named_modules() if modules is None else modules  # (name, module), as named_modules()
        for mname, m in modules:  # a shared module once: its uses are its calls
            own = [  # its own parameters, as named_parameters(recurse=False) without the generator
                (canonical[id(p)], a)
                for a, p in m._parameters.items()
                if p is not None and p.requires_grad and canonical[id(p)] in self.trainable
            ]
            if not own:
                continue
            handler, _ = clipping_handler(m)
            layer = _Layer(mname, m, handler, own)
            if handler is not None:
                layer.state = (tuple(m.__dict__), tuple(m.__dict__.values()))
            self.layers.append(layer)
            for q, _ in own:
                by_param.setdefault(q, []).append(layer)
        # a parameter used by several modules (tied weights): the per-example gradient is the sum
        # of the uses, instantiated by each use's handler; torch.func when a use has no handler
        self.tied: dict[str, list[_Layer]] = {}
        for q, holders in by_param.items():
            if len(holders) > 1:
                if all(layer.handler is not None for layer in holders):
                    self.tied[q] = holders
                else:
                    for layer in holders:
                        layer.fallback = "its parameters are shared with another module"
        self.anchor = None
        self.stack: list[_Layer] = []
        self.owner_of: dict[int, list[_Layer]] = {}
        self.params_of: dict[int, list] = {}  # id(layer) → its trainable parameter tensors (watched)
        self.switching = False  # the parameters are watched by their class (``_watching``)
        self.point = 0
        self.mode = "record"  # "record", "probe" or "off"
        self.batch = None  # b, while recording a forward: shared inputs are expanded to it
        self.quiet = False  # the hooks' own operations are not the model's
        self.probe_dims: dict[int, set] = {}
        self.handles = []
        self.early: dict[int, tuple] = {}  # id(layer) → (handler, squared norms) done in the backward
        self._pending: dict[int, int] = {}

    def process_early(self, b: int, dtype, autocast_device: str | None) -> None:
        """Let each layer with a registered handler (untied, recorded) take its norms as soon as
        all its output gradients arrive in the backward, and drop its recorded tensors then,
        so that they do not all stay alive until the end of the backward."""
        self._batch, self._dtype, self._autocast = b, dtype, autocast_device
        for layer in self.layers:
            if layer.fallback is not None or layer.handler is None or not layer.calls:
                continue
            if any(q in self.tied for q, _ in layer.params):
                continue
            self._pending[id(layer)] = len(layer.calls)
            for c in layer.calls:
                c.arrived = self._arrived(layer)

    def _arrived(self, layer):
        def done(call):
            call.arrived = None
            left = self._pending[id(layer)] - 1
            self._pending[id(layer)] = left
            if left or any(c.grad.shape[:1] != (self._batch,) for c in layer.calls):
                return
            h = _Handler(layer, self._dtype)
            if self._autocast is not None:
                with torch.autocast(self._autocast, enabled=False):
                    sq = h.sq_norms()
            else:
                sq = h.sq_norms()
            self.early[id(layer)] = (h, sq)
            for c in layer.calls:  # the handler's state keeps what its sum needs
                c.grad = None
                c.inputs = None
                c.recording = False

        return done

    # hooks
    def __enter__(self):
        for layer in self.layers:
            m = layer.module
            self.handles.append(m.register_forward_pre_hook(self._pre(layer)))
            handle = m.register_forward_hook(self._post(layer), with_kwargs=True, always_call=True)
            layer.hook_id = handle.id
            self.handles.append(handle)
        for m in self.model.modules():  # batch-shared tensors given one row per example
            adapter = batch_adapter(m)
            if adapter is not None:
                self.handles.append(m.register_forward_pre_hook(adapter, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()

    def reclass(self, a: _Layer, b: _Layer | None) -> None:
        """Make the trainable parameters of layers ``a`` and ``b`` plain ``nn.Parameter``s where a
        use of them is now inside an owner's forward (``_inside``), else ``_WatchedParameter``s."""
        stack, owners = self.stack, self.owner_of
        for layer in (a, b):
            if layer is None:
                continue
            for p in self.params_of.get(id(layer), ()):
                p.__class__ = nn.Parameter if _inside(stack, owners[id(p)]) else _WatchedParameter

    def _pre(self, layer):
        expands = layer.handler is not None and getattr(layer.handler, "expand_shared_input", False)

        def hook(module, args):
            if self.mode != "off":
                stack = self.stack
                top = stack[-1] if stack else None
                stack.append(layer)
                if self.switching:
                    self.reclass(layer, top)
                b = self.batch
                if expands and self.mode == "record" and b and b > 1 and args:
                    x = args[0]
                    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
                        return (x.expand(b, *x.shape[1:]), *args[1:])
            return None

        return hook

    def _post(self, layer):
        accepted = frozenset(getattr(layer.handler, "keyword_inputs", ()))
        expands_output = getattr(layer.handler, "expand_shared_output", False)

        def hook(module, args, kwargs, out):
            if self.mode == "off":
                return None
            stack = self.stack
            if stack and stack[-1] is layer:
                stack.pop()
                if self.switching:
                    self.reclass(layer, stack[-1] if stack else None)
            if self.mode == "probe":
                dims = {t.shape[0] if t.dim() else None for t in _tensors(args, {})}
                if isinstance(out, torch.Tensor):
                    dims.add(out.shape[0] if out.dim() else None)
                else:
                    dims.add("not one tensor")
                self.probe_dims.setdefault(id(layer), set()).update(dims)
                return None
            if layer.fallback is not None:
                return None
            if layer.calls and torch._C._current_graph_task_id() != -1:
                # a forward recomputed in the backward (activation checkpointing): its output's
                # gradient reaches the call recorded in the first forward, whose node is the one
                # in the graph; recording it again would count the call twice
                return None
            if layer.handler is not None:
                why = _handler_broken(module, layer)
                if why is not None:
                    layer.fallback = why
                    return None
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                if not isinstance(out, torch.Tensor):
                    layer.fallback = "its output is not one tensor"
                return None
            if layer.handler is None and (len(args) != 1 or not isinstance(args[0], torch.Tensor)):
                layer.fallback = "it is called with other than one tensor"
                return None
            if kwargs and not kwargs.keys() <= accepted:  # its per-layer formulas see args only
                layer.fallback = f"it is called with keyword arguments {sorted(kwargs.keys() - accepted)}"
                return None
            if len(args) == 1 and isinstance(args[0], torch.Tensor):  # the usual call: one tensor
                kept = (args[0].detach(),)
            else:
                kept = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            b = self.batch
            if expands_output and b and b > 1 and out.dim() >= 1 and out.shape[0] == 1:
                out = out.expand(b, *out.shape[1:])  # broadcast downstream: the same values
            call = _Call(self.point, kept)
            if kwargs:
                call.kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            layer.calls.append(call)
            self.quiet = True
            try:
                if layer.handler is None:
                    call.params = {n: _get(module, n).detach() for n, _ in module.named_parameters()}
                    return _CaptureCopy.apply(out, self.anchor, call)
                if layer.handler.copy_output:
                    return _CaptureCopy.apply(out, self.anchor, call)
                base = out._base
                if base is not None and base.numel() == out.numel() and out.is_contiguous():
                    # a reshaped view (Linear on 3-D inputs): the node on its base, so that no
                    # in-place-on-a-view machinery (CopySlices) copies the output gradient
                    if base.is_contiguous() and base.grad_fn is not None:
                        call.shape = out.shape
                        return _Capture.apply(base, self.anchor, call).view(out.shape)
                return _Capture.apply(out, self.anchor, call)
            finally:
                self.quiet = False

        return hook


def _handler_broken(module: nn.Module, layer: _Layer) -> str | None:
    """Why the output a registered layer's call just gave may not be what its handler assumes
    (a hook or attribute added during the forward, after the registry's check), or None."""
    if _module._global_forward_hooks:
        return "a forward hook ran before its output was recorded"
    for key, hook in module._forward_hooks.items():  # ours first, or after value-preserving ones
        if key == layer.hook_id:
            break
        if not value_preserving(hook):
            return "a forward hook ran before its output was recorded"
    if _module._global_backward_hooks and not _module._global_is_full_backward_hook:
        return "a legacy global backward hook may change its gradients"
    keys, values = layer.state
    d = module.__dict__
    if len(d) != len(keys) or not all(map(operator.is_, d.values(), values)) or tuple(d) != keys:
        return "its attributes changed after the clipping handler was chosen"
    return None


# -- per-layer norms and sums ---------------------------------------------------------------


def per_example_losses(loss_fn, out, targets) -> torch.Tensor:
    """ℓ_i = loss_fn(out[i:i+1], targets[i:i+1]) for every i, shape (b,).

    A ``loss_fn`` with a ``per_example(out, targets)`` method (e.g. the losses of
    ``dpmf.train.hf``) gives the (b,) losses itself. ``F.cross_entropy`` and ``F.nll_loss`` on
    (b, classes) outputs and integer class targets use ``reduction="none"`` (the same numbers,
    one kernel); any other loss is ``vmap``-ed.

    Raises:
        ValueError: ``F.cross_entropy``/``F.nll_loss`` given a non-tensor output (a ModelOutput):
            the message names the loss that reads ``.logits``.
    """
    per = getattr(loss_fn, "per_example", None)
    if callable(per):
        return per(out, targets)
    class_loss = loss_fn in (F.cross_entropy, F.nll_loss)
    if class_loss and not isinstance(out, torch.Tensor):
        raise ValueError(
            f"loss_fn={loss_fn.__name__} is invalid for this model: it takes a tensor and the model "
            f"returns {type(out).__name__}; give loss_fn=lambda out, y: F.{loss_fn.__name__}(out.logits, y) "
            "(or a loss of dpmf.train.hf)"
        )
    if class_loss and out.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point():
        # an ignored target (ignore_index −100) is one example's mean over no element: 0/0,
        # NaN with a NaN gradient, as loss_fn on that example alone; any other is divided by 1
        # (exact). Branch-free: the targets are never read back.
        kept = (targets != -100).to(out.dtype)
        return loss_fn(out, targets, reduction="none") / kept
    # only the output's per-example tensors are vmapped; the loss gets the output's own type
    # (a ModelOutput keeps attribute access) with any other entry (a cache) passed through
    b = int(_leaves_of(targets)[0].shape[0])
    leaves, rebuild = batched_leaves(out, b)

    def one(t, *ls):
        return loss_fn(rebuild([v.unsqueeze(0) for v in ls]), map_tensors(_one_row, t))

    return vmap(one)(targets, *leaves)


def _one_row(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0)


def _leaves_of(tree) -> list[torch.Tensor]:
    """The tensors of a (nested) batch, in order."""
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, tree)
    return found


def _widened(entry):
    """A handler's state entry with its tensors in float64."""
    if isinstance(entry, torch.Tensor):
        return entry.double()
    if isinstance(entry, tuple):
        return tuple(v.double() if isinstance(v, torch.Tensor) else v for v in entry)
    return entry


def _factors_down(factors: torch.Tensor, dtype) -> torch.Tensor:
    """The float64 clip factors in ``dtype``, each rounded towards 0 (never above ζ/‖g_i‖): a
    factor of a norm beyond float32's range is a subnormal there, which rounding to nearest can
    raise by a third (an example's clipped gradient above ζ)."""
    c = factors.to(dtype)
    if c.dtype == factors.dtype:
        return c
    return torch.where(c.to(factors.dtype) > factors, torch.nextafter(c, torch.zeros_like(c)), c)


def _subnormal_flag(factors: torch.Tensor) -> torch.Tensor | None:
    """Whether a clip factor ζ/‖g_i‖ (float64) is below float32's smallest normal number (a
    norm above about 8·10³⁷·ζ): in float32 it would be a subnormal, rounded by up to a third.
    A 0-dim bool tensor, not read here (None for an empty batch)."""
    if not factors.numel():
        return None
    return factors.min() < torch.finfo(torch.float32).tiny


def _handler_sums(handlers: list, factors: torch.Tensor, sink=None) -> dict[str, torch.Tensor]:
    """Σ_i c_i·g_i of every handler's parameters (book-keeping), c = ``factors``.

    The flags first, read in one host synchronisation for all layers: a factor that is
    subnormal in float32 (``_subnormal_flag``: a layer whose state is known is widened to
    float64, any other takes the factors rounded towards 0) and a handler's products below its
    dtype's normal range (``sum_needs_float64``: widened); either could move an example beyond
    ζ. Then each sum once, at the precision its flags ask for (the usual step: none, every sum
    in its layer's dtype). With ``sink``, each layer's sums go to ``sink(dict)`` as they are
    computed, in the handlers' order, and are not kept (the result is then empty)."""
    out: dict = {}
    if not handlers:
        return out
    tiny = _subnormal_flag(factors)
    per_layer = [h.sum_needs_float64(factors) for h in handlers]
    checks = [f for f in (tiny, *per_layer) if f is not None]
    raised = bool(checks) and bool(torch.stack(checks).any())  # the one read of every flag
    tiny = raised and tiny is not None and bool(tiny)  # the rare path: each flag read on its own
    cast: dict = {}  # the factors in each handler's dtype, converted once
    for h, flag in zip(handlers, per_layer, strict=True):
        if raised and flag is not None and bool(flag):
            h.widen()
        got = h.summed(_factors_for(h, factors, cast, tiny))
        if sink is None:
            out.update(got)
        else:
            sink(got)
    return out


def _factors_for(h, factors: torch.Tensor, cast: dict, tiny: bool) -> torch.Tensor:
    """The clip factors for handler ``h``'s sum, in its dtype (converted once per dtype in
    ``cast``). With a factor that is subnormal in float32 (``tiny``), a layer whose state is
    known is summed in float64 (exactly its share of ζ); any other takes the factors rounded
    towards 0 (never above ζ/‖g_i‖)."""
    if tiny and h.dtype != factors.dtype:
        if not h.can_widen:
            return _factors_down(factors, h.dtype)
        h.widen()
    c = cast.get(h.dtype)
    if c is None:
        c = cast[h.dtype] = _as(factors, h.dtype)
    return c


def _settled_norms(sq: dict, names: list, handlers) -> tuple[dict, torch.Tensor, bool]:
    """(squared norms with every ``PendingNorm`` squared, ‖g_i‖₂ over ``names``, whether every
    norm is finite), read in one host synchronisation for all layers. When a norm is not
    finite, the non-finite entries of handlers that take pending norms are recomputed in float64
    from their state, and those of the other handlers by widening the layer (a square that
    overflowed a lower dtype); a NaN/inf gradient stays non-finite."""
    sq, block = squares(sq, names)
    stacked = block if block is not None else torch.stack([sq[n] for n in names])
    norms = torch.sqrt(stacked.sum(0))
    if bool(torch.isfinite(norms).all()):
        return sq, norms, True
    redone = False
    for h in handlers:
        if h.zero:
            continue
        if not h.pending:
            own = [h.names[a] for a in h.attrs if h.names[a] in sq]
            if h.dtype != torch.float64 and any(not bool(torch.isfinite(sq[q]).all()) for q in own):
                with torch.no_grad():
                    sq.update(h.sq_norms_widened())
                redone = True
            continue
        for a in h.attrs:
            q = h.names[a]
            if q in sq and not bool(torch.isfinite(sq[q]).all()):
                with torch.no_grad():
                    sq[q] = h.sq_float64(a)
                redone = True
    if redone:
        norms = torch.sqrt(torch.stack([sq[n] for n in names]).sum(0))
    return sq, norms, bool(torch.isfinite(norms).all())


class _Handler:
    """One layer's per-example squared norms, then its clipped sum, through its handler (the
    registry's, or torch.func on the module alone for a layer without one)."""

    def __init__(self, layer: _Layer, dtype, tied=()):
        self.layer = layer
        self.dtype = dtype
        self.tied = set(tied)  # attributes whose parameter is tied: instantiated by the engine
        self.state = None
        self.attrs = [a for _, a in layer.params if a not in self.tied]
        self.names = {a: q for q, a in layer.params}  # attribute → model-level name
        self.zero = False

    @property
    def sum_by_backward(self) -> bool:
        h = self.layer.handler
        return h is not None and h.sum_by_backward

    def calls(self):
        return [c for c in self.layer.calls if c.grad is not None]

    def sq_norms(self) -> dict[str, torch.Tensor]:
        # a handler reading a parameter's value must not put the norms in the graph (in the
        # backward, where most layers are done, grad mode is already off)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._sq_norms()
        return self._sq_norms()

    def _sq_norms(self) -> dict[str, torch.Tensor]:
        layer = self.layer
        calls = self.calls()
        if not calls:
            c0 = layer.calls[0].inputs[0]
            self.zero = True
            zero = torch.zeros(c0.shape[0], dtype=torch.float64, device=c0.device)
            return {q: zero for q, _ in layer.params}
        if not self.attrs:
            return {}
        out = self._sq(self.dtype, calls)
        names = self.names
        if self.pending:  # squared, and checked, with every layer's (_settled_norms)
            return {
                names[a]: v if isinstance(v, PendingNorm) or v.dtype == torch.float64 else v.double()
                for a, v in out.items()
            }
        # checked with every layer's, in one read (_settled_norms: a square that overflowed
        # this dtype is taken again in float64 there, ``sq_norms_widened``)
        return {names[a]: v if v.dtype == torch.float64 else v.double() for a, v in out.items()}

    def sq_norms_widened(self) -> dict[str, torch.Tensor]:
        """Every attribute's squared norms taken again with the layer's dtype widened to float64
        (a finite gradient whose square overflowed the lower dtype); its clipped sum is then
        taken in float64 too. From the recorded calls while they are held; a layer whose norms
        were taken in the backward (its calls released) from its per-example gradients when that
        is what its state holds; else nothing (its norms stay non-finite: refused)."""
        calls = self.calls()
        if calls and all(c.inputs is not None for c in calls):
            self.dtype = torch.float64
            out = self._sq(self.dtype, calls)
            return {self.names[a]: v if v.dtype == torch.float64 else v.double() for a, v in out.items()}
        state, own = self.state, self.layer.module._parameters
        per_example = isinstance(state, dict) and all(
            isinstance(state.get(a), torch.Tensor) and state[a].shape[1:] == own[a].shape for a in self.attrs
        )
        if not per_example:
            return {}
        self.dtype = torch.float64
        self.state = {a: v.double() if isinstance(v, torch.Tensor) else v for a, v in state.items()}
        return {
            self.names[a]: torch.linalg.vector_norm(
                self.state[a].reshape(self.state[a].shape[0], -1), dim=1
            ).square()
            for a in self.attrs
        }

    def _sq(self, dtype, calls):
        h, m = self.layer.handler, self.layer.module
        if h is None:
            sums = {}
            for c in calls:
                for a, v in self._generic_grads(c).items():
                    sums[a] = v if a not in sums else sums[a] + v
            per = {a: sums[a].to(dtype) for a in self.attrs}
            self.state = per
            return {a: _sq(v) for a, v in per.items()}
        if self.pending:
            sq, self.state = h.sq_norms(m, calls, list(self.attrs), dtype, pending=True)
        else:
            sq, self.state = h.sq_norms(m, calls, list(self.attrs), dtype)
        return sq

    @property
    def pending(self) -> bool:
        """Whether the handler gives ``PendingNorm``s (squared and checked with all layers')."""
        h = self.layer.handler
        return h is not None and getattr(h, "takes_pending", False)

    def sq_float64(self, attr) -> torch.Tensor:
        """attr's squared norms recomputed in float64 from the handler's state — which is
        widened to float64 first, with the layer's dtype: its clipped sum is then taken in
        float64 too (factors ζ/‖g_i‖ of a norm above float32's range are float32 subnormals,
        rounded up by as much as a third: an example's clipped gradient above ζ)."""
        self.widen()
        return self.layer.handler.sq_norms_float64(self.layer.module, self.state, attr)

    @property
    def can_widen(self) -> bool:
        """Whether ``widen`` knows this layer's state (the Linear family's, or torch.func's)."""
        return self.pending or self.layer.handler is None

    def widen(self) -> None:
        """Take this layer's clipped sum in float64: its state and dtype widened."""
        if self.dtype != torch.float64:
            self.dtype = torch.float64
            self.state = {a: _widened(e) for a, e in self.state.items()}

    @torch.no_grad()
    def per_example(self, attr) -> torch.Tensor:
        """The instantiated per-example gradient of one (tied) attribute, (b, *shape)."""
        h, m = self.layer.handler, self.layer.module
        if not self.calls():
            p = _get(m, attr)
            b = self.layer.calls[0].inputs[0].shape[0]
            return torch.zeros((b, *p.shape), dtype=self.dtype, device=p.device)
        return h.per_example(m, self.calls(), [attr], self.dtype)[attr]

    def _generic_grads(self, call):
        m = self.layer.module
        own = [a for _, a in self.layer.params]
        values = dict(call.params)
        trainable = {a: values.pop(a) for a in own}

        def inner(p, x, g):
            out = functional_call(m, ({**p}, values), (x.unsqueeze(0),))
            return (out * g.unsqueeze(0).to(out.dtype)).sum()

        return vmap(grad(inner), in_dims=(None, 0, 0), randomness="different")(
            trainable, call.inputs[0], call.grad
        )

    def sum_needs_float64(self, factors: torch.Tensor) -> torch.Tensor | None:
        """The handler's ``sum_needs_float64`` flag for this layer's state (a 0-dim bool
        tensor, not read here), or None (float64 already, a zero layer, or none given)."""
        h = self.layer.handler
        if h is None or self.zero or not self.attrs or self.dtype == torch.float64:
            return None
        return h.sum_needs_float64(self.layer.module, self.state, _as(factors, self.dtype), list(self.attrs))

    def summed(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_i c_i·g_i for each (untied) trainable parameter of the layer (book-keeping)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._summed(factors)
        return self._summed(factors)

    def _summed(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        m = self.layer.module
        names = self.names
        own = m._parameters  # the attributes are the module's own parameters (no dotted path)
        if self.zero:
            return {names[a]: zeros_of(own[a]) for a in self.attrs}
        if not self.attrs:
            return {}
        c = _as(factors, self.dtype)
        h = self.layer.handler
        if h is None:
            got = {a: weighted_sum(c, self.state[a]) for a in self.attrs}
        else:
            got = h.clipped_sum(m, self.state, c, list(self.attrs), self.dtype)
        out = {}
        for a in self.attrs:
            p, g = own[a], got[a]
            if g.shape != p.shape:
                g = g.reshape(p.shape)
            out[names[a]] = _as(g, p.dtype)
        return out


# -- the clipped sum ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GhostResult:
    """What ``ghost_clipped_sum`` computed for one micro-batch.

    Attributes:
        grads: parameter name → Σ_i c_i·g_i (the parameter's shape and dtype).
        norms: ‖g_i‖₂ over all trainable parameters, shape (b,), float64.
        sq_by_param: parameter name → ‖g_i restricted to it‖², shape (b,), float64.
        fallback: module name → why its parameters took the whole-model ``torch.func`` path.
        losses: the (b,) per-example losses ℓ_i(θ) of the recorded forward, detached (None with
            an evaluation plan of other points than θ alone).
    """

    grads: dict
    norms: torch.Tensor
    sq_by_param: dict
    fallback: dict
    losses: torch.Tensor | None = None


# model → verified layouts (input signature → module names whose dim 0 does not follow the batch)
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _input_signature(inputs) -> tuple:
    """Shapes (without the batch dimension) and dtypes of a tensor or a dict of tensors."""
    if isinstance(inputs, dict):
        return tuple((k, *_input_signature(v)) for k, v in inputs.items())
    if isinstance(inputs, torch.Tensor):
        return (tuple(inputs.shape[1:]), inputs.dtype)
    return (repr(inputs),)


def _head(inputs, stop: int):
    """The first ``stop`` examples of a tensor or a dict of tensors (other values as they are)."""
    if isinstance(inputs, dict):
        return {k: _head(v, stop) for k, v in inputs.items()}
    return inputs[:stop] if isinstance(inputs, torch.Tensor) else inputs


def _forward(model, inputs, values=None):
    """model(inputs), or model(**inputs) for a dict; at ``values`` by ``functional_call``."""
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    if values is None:
        return model(*args, **kwargs)
    return functional_call(model, values, args, kwargs)


def _batch_tensor(inputs) -> torch.Tensor:
    """The tensor whose dim 0 gives the batch: the input, or a dict's first tensor."""
    if isinstance(inputs, dict):
        for v in inputs.values():
            if isinstance(v, torch.Tensor):
                return v
        raise ValueError("inputs are invalid: the dict holds no tensor")
    return inputs


def _mark_probed(engine, bad: dict) -> None:
    """Send the layers whose records the probe found not to follow the batch to the fallback."""
    for layer in engine.layers:
        if layer.name in bad and layer.fallback is None:
            layer.fallback = bad[layer.name]


def _probe(model, engine, inputs, plan, sharded: bool = False) -> dict[str, str]:
    """Module name → why its recorded tensors do not follow the batch (a one-example pass),
    remembered per input signature — or, for a fully_shard model (whose forward every rank
    joins, with inputs of its own shapes), once per model."""
    signature = "fully_shard" if sharded else _input_signature(inputs)
    key = (signature, tuple(sorted(engine.trainable)), model.training)
    cache = _PROBED.setdefault(model, {})
    if key in cache:
        return cache[key]
    engine.mode = "probe"
    engine.probe_dims = {}
    device = _batch_tensor(inputs).device
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            _forward(model, _head(inputs, 1))
    finally:
        engine.mode = "record"
        engine.stack.clear()
        reshard(model)  # fully_shard: a forward without a backward leaves the root unsharded
    bad = {}
    for layer in engine.layers:
        dims = engine.probe_dims.get(id(layer), {1})
        if "not one tensor" in dims:
            bad[layer.name] = "its output is not one tensor"
        elif dims != {1}:
            bad[layer.name] = "its dim 0 does not follow the examples"
    cache[key] = bad
    return bad


def ghost_clipped_sum(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    clip_norm: float,
    names: list[str],
    plan,
    method: str,
    subset_gradients: Callable,
    allow_fallback: bool = True,
    walk=None,
    sink=None,
) -> GhostResult | None:
    """Σ_i clip_ζ(g_i) for one micro-batch by ghost norms and ``method`` ("ghost" or "bk").

    Args:
        model, loss_fn, inputs, targets: as in ``dpmf.optim.clipping.clipped_sum``; b ≥ 1.
        clip_norm: ζ > 0.
        names: the trainable parameters' names (``trainable_parameters`` order).
        plan: validated evaluation plan [(weight, shift or None)] or None (one point, weight 1).
        method: "ghost" (second backward of Σ_i c_i ℓ_i) or "bk" (book-keeping).
        subset_gradients: ``f(names) → {name: (b, *shape)}``, the whole-model ``torch.func``
            per-example gradients of those parameters (with the same plan).
        allow_fallback: when False, return None as soon as a parameter needs the whole-model
            path (the caller then uses that path for every parameter).
        walk: a ``dpmf.optim.model_guard.ModelWalk`` of ``model`` taken now (its modules and
            parameters; None: ``named_modules()`` and ``named_parameters()``).
        sink: takes each layer's sums (``sink(dict)``) as they are computed, in ``names``'
            order ("bk"; a fully_shard step's reduce-scatters); ``grads`` then maps to None.

    Returns:
        ``GhostResult``, or None (only with ``allow_fallback=False``). When a norm is not
        finite (NaN/inf in a gradient) its ``grads`` is empty and nothing was summed; the
        caller raises (``sq_by_param`` names the parameters).

    Raises:
        ValueError: ``method`` is not "ghost" or "bk".

    Cost: one forward and one backward that computes activation gradients only, plus per layer
    O(b·T²·(d + p)) (ghost) or O(b·T·p·d) (instantiated) for the norms; "bk" then one GEMM per
    layer, "ghost" a second backward. Memory: the activations and output gradients of the
    recorded layers, plus b·p·d for each instantiated layer.
    """
    if method not in ("ghost", "bk"):
        raise ValueError(f"method={method!r} is invalid: must be 'ghost' or 'bk'")
    points = plan if plan is not None else [(1.0, None)]
    named = dict(model.named_parameters() if walk is None else walk.unique_params)
    dtype = torch.float64 if named[names[0]].dtype == torch.float64 else torch.float32
    lead = _batch_tensor(inputs)
    device = lead.device
    b = int(lead.shape[0])
    autocast_on = torch.is_autocast_enabled(device.type)
    sharded = _sharded_start(model, named[names[0]], method, plan)
    plain = isinstance(inputs, torch.Tensor) and not sharded
    if method == "bk" and plan is None and not autocast_on and plain:
        chain = _chain_clipped_sum(model, loss_fn, inputs, targets, clip_norm, names, named, dtype)
        if chain is not None:  # a plain chain of linear layers: no hooks needed (ghost_chain)
            return chain
    modules = None if walk is None else walk.unique_modules
    with torch.enable_grad(), _Engine(model, names, named, modules) as engine:
        if b > 1 or sharded:  # fully_shard: once per model, on every rank alike (a collective)
            _mark_probed(engine, _probe(model, engine, inputs, plan, sharded))
        if not allow_fallback and any(layer.fallback for layer in engine.layers):
            return None
        engine.anchor = torch.zeros((), device=device, requires_grad=True)
        engine.batch = b
        leaves, losses = _forward_points(engine, model, loss_fn, inputs, targets, points, named, names)
        _check_inputs_follow_examples(engine, b)
        if not allow_fallback and any(layer.fallback for layer in engine.layers):
            return None
        if len(points) == 1 and points[0][0] == 1.0:  # one point of weight 1: no scaling nodes
            total = losses[0].sum()
        else:
            total = sum(w * ell.sum() for (w, _), ell in zip(points, losses, strict=True))
        keep = method == "ghost"
        engine.process_early(b, dtype, device.type if autocast_on else None)
        if total.requires_grad:
            _anchor_backward(total, engine.anchor, keep)
        _close_recording(engine, b, sharded)
        if not allow_fallback and any(layer.fallback for layer in engine.layers):
            return None
        engine.mode = "off"
        with torch.autocast(device.type, enabled=False) if autocast_on else _null():
            handlers, sq, fallback, tied_per, unused, paired, per_example = _layer_norms(
                engine, names, named, b, dtype, device, subset_gradients
            )
            sq, norms, finite = _settled_norms(sq, names, handlers)
            if not finite:
                return GhostResult({}, norms, sq, fallback)
            factors = norms.new_tensor(clip_norm) / torch.clamp(norms, min=clip_norm)
            parts = (handlers, per_example, tied_per, paired, unused)
            result_grads = _clipped_sums(
                method, parts, factors, named, names, points, losses, leaves, autocast_on, sink
            )
    if sharded:
        reshard(model)
    at_theta = losses[0].detach() if len(points) == 1 and points[0][1] is None else None
    return GhostResult(result_grads, norms, sq, fallback, at_theta)


def _sharded_start(model, first, method: str, plan) -> bool:
    """Whether the model is fully_shard's (its first trainable parameter a DTensor); if so, its
    shards are put back on the modules (what the walk and the engine's hooks see).

    Raises:
        ValueError: a fully_shard model with another method than "bk" or with an evaluation plan.
    """
    if not is_sharded(first):
        return False
    if method != "bk" or plan is not None:
        raise ValueError(
            f"clipping={method!r} is invalid for a fully_shard model: its clipped sum is taken by "
            "book-keeping (clipping='bk' or 'auto') at the parameters themselves (no evaluation plan)"
        )
    reshard(model)
    return True


def _refuse_sharded_fallback(engine) -> None:
    """A fully_shard model's layers must all be clipped by their handlers: the whole-model
    torch.func path needs the whole parameters, which no rank holds.

    Raises:
        ValueError: naming the layers and why each has no handler path.
    """
    bad = [
        f"{layer.name or '<model>'} ({layer.fallback or clipping_handler(layer.module)[1]})"
        for layer in engine.layers
        if layer.fallback or layer.handler is None
    ]
    if bad:
        raise ValueError(
            f"model is invalid for the sharded private step: {'; '.join(bad[:4])}: under fully_shard every "
            "trainable layer is clipped by its clipping handler (dpmf.ClippingHandler); register one for "
            "the layer, call it inside its own module, or freeze it"
        )


def _anchor_backward(total: torch.Tensor, anchor: torch.Tensor, keep: bool) -> None:
    """The backward that records every layer's output gradient (only the anchor's gradient is
    asked: no weight gradient is computed).

    Raises:
        RuntimeError: the model uses reentrant activation checkpointing, which torch runs only
            under a plain ``.backward()`` (named, with the fix).
    """
    try:
        torch.autograd.grad(total, [anchor], retain_graph=keep, allow_unused=True)
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise RuntimeError(
            "the model uses reentrant activation checkpointing (use_reentrant=True), which the "
            "private step's backward cannot run through; enable it non-reentrant: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "(transformers) or torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
        ) from err


def _check_inputs_follow_examples(engine, b: int) -> None:
    """Send to torch.func every layer whose recorded input does not have the b examples along
    dim 0 (``batch_first=False``)."""
    for layer in engine.layers:
        if layer.fallback is None and any(
            isinstance(c.inputs[0], torch.Tensor) and c.inputs[0].shape[:1] != (b,) for c in layer.calls
        ):
            layer.fallback = "its dim 0 does not follow the examples"


def _close_recording(engine, b: int, sharded: bool = False) -> None:
    """After the backward: stop recording; an output gradient whose dim 0 is not the b examples,
    or a tied parameter with a use that falls back, sends the layer (all the uses) to torch.func
    (refused for a fully_shard model, ``_refuse_sharded_fallback``)."""
    for layer in engine.layers:
        for c in layer.calls:
            c.recording = False
            c.arrived = None
            if c.grad is not None and c.grad.shape[:1] != (b,):
                layer.fallback = layer.fallback or "its dim 0 does not follow the examples"
    # a tied parameter: every use recorded, else the whole-model path for all its uses
    for holders in engine.tied.values():
        if any(layer.fallback for layer in holders):
            for layer in holders:
                layer.fallback = layer.fallback or "its tied parameter's other use falls back"
    if sharded:
        _refuse_sharded_fallback(engine)


def _forward_points(engine, model, loss_fn, inputs, targets, points, named: dict, names: list):
    """The recorded forward at every evaluation point (the parameters watched for uses outside
    their modules): (the leaves each point's losses depend on, the (b,) per-example losses)."""
    leaves, losses = [], []
    for j, (_, shift) in enumerate(points):
        engine.point = j
        if shift is None:
            values = {n: named[n] for n in names}
            owner_ids = {q: id(named[q]) for q in names}
        else:
            values = {n: (named[n].detach() + shift[n]).requires_grad_(True) for n in names}
            owner_ids = {q: id(values[q]) for q in names}
        engine.owner_of = {}
        # a fully_shard model's forward uses the unsharded parameters FSDP2 registers in place
        # of the shards: a use of those outside their module is watched as the shard's
        aliases = unsharded_aliases(model) if shift is None and is_sharded(named[names[0]]) else {}
        for layer in engine.layers:
            for q, _ in layer.params:
                engine.owner_of.setdefault(owner_ids[q], []).append(layer)
                if owner_ids[q] in aliases:
                    engine.owner_of.setdefault(id(aliases[owner_ids[q]]), []).append(layer)
        if shift is None:  # the parameters themselves: watched through their class
            engine.params_of = {id(lay): [values[q] for q, _ in lay.params] for lay in engine.layers}
        with _watching(engine, list(values.values()) if shift is None else None):
            out = _forward(model, inputs, None if shift is None else values)
        engine.stack.clear()
        engine.owner_of = {}
        engine.params_of = {}
        per = per_example_losses(loss_fn, out, targets)
        del out  # the output (e.g. a language model's logits) is not needed by the backward
        losses.append(per)
        leaves.append(values)
    return leaves, losses


def _layer_norms(engine, names: list, named: dict, b: int, dtype, device, subset_gradients):
    """The per-example squared norms of every trainable parameter, shape (b,) each: from the
    layers' handlers (taken early in the backward or now), tied uses, zero for parameters of
    layers not called, the whole-model torch.func path for the rest. Returns (handlers, sq,
    fallback reasons, tied per-example gradients, unused names, tied embedding/output pairs,
    torch.func per-example gradients)."""
    handlers, sq = [], {}
    fallback = {}
    tied_per: dict[str, torch.Tensor] = {}
    unused: list[str] = []  # parameters of modules the forward did not call
    paired = _tied_pairs(engine, dtype)  # embedding + output layer: no instantiation
    for layer in engine.layers:
        if layer.fallback is not None:
            fallback[layer.name or "<model>"] = layer.fallback
            continue
        if id(layer) in engine.early:  # its norms were taken in the backward
            h, done = engine.early[id(layer)]
            sq.update(done)
            handlers.append(h)
            continue
        tied_attrs = [a for q, a in layer.params if q in engine.tied]
        if not layer.calls:  # not called: its parameters get a zero per-example gradient
            for q, _ in layer.params:
                if q not in engine.tied:
                    sq[q] = torch.zeros(b, dtype=torch.float64, device=device)
                    unused.append(q)
            continue
        h = _Handler(layer, dtype, tied_attrs)
        sq.update(h.sq_norms())
        handlers.append(h)
        for q, a in layer.params:
            if q in engine.tied and q not in paired:  # the sum of the uses' gradients
                g = h.per_example(a)
                tied_per[q] = g if q not in tied_per else tied_per[q] + g
    for q, t in paired.items():
        sq[q] = t.sq_norms()
    for q, g in tied_per.items():
        part = row_norms(g)
        if not bool(torch.isfinite(part).all()):
            part = torch.linalg.vector_norm(g.reshape(b, -1), dim=1, dtype=torch.float64)
        sq[q] = part.double() ** 2
    for q in engine.tied:
        if q not in sq and not any(layer.fallback for layer in engine.tied[q]):
            sq[q] = torch.zeros(b, dtype=torch.float64, device=device)  # no use was called
            tied_per[q] = torch.zeros((b, *named[q].shape), dtype=dtype, device=device)
    rest = [n for n in names if n not in sq]
    per_example = subset_gradients(rest) if rest else {}
    for n, g in per_example.items():
        part = row_norms(g)
        if not bool(torch.isfinite(part).all()):
            part = torch.linalg.vector_norm(g.reshape(b, -1), dim=1, dtype=torch.float64)
        sq[n] = part.double() ** 2
    return handlers, sq, fallback, tied_per, unused, paired, per_example


def _clipped_sums(method: str, parts, factors, named: dict, names: list, points, losses, leaves, autocast_on,
                  sink=None):  # fmt: skip
    """Σ_i c_i·g_i of every trainable parameter, c = ``factors`` (shape (b,)): from the kept
    per-example gradients, the handlers' book-keeping sums, and (``method="ghost"``) a second
    backward of Σ_i c_i·ℓ_i for the rest. With ``sink`` ("bk"): the handlers' sums, in the
    order of ``names``, go to ``sink`` as they are computed, after every other sum; the
    result maps their names to None."""
    handlers, per_example, tied_per, paired, unused = parts
    if sink is not None:
        rank = {n: k for k, n in enumerate(names)}
        handlers.sort(key=lambda h: min((rank.get(q, len(rank)) for q in h.names.values()), default=-1))
    result_grads = {}
    for n, g in per_example.items():
        result_grads[n] = torch.tensordot(_factors_down(factors, g.dtype), g, dims=1)
    for q, g in tied_per.items():
        c = _factors_down(factors, g.dtype)
        result_grads[q] = torch.tensordot(c, g, dims=1).to(named[q].dtype)
    for q, t in paired.items():
        result_grads[q] = t.clipped_sum(factors).to(named[q].dtype)
    # torch.func gradients (possibly with their own dropout masks) are summed from the same
    # vectors whose norms were taken, in both methods; so is every layer under autocast, where a
    # second backward would round differently (low precision) from the float32 vectors whose
    # norms were taken, and an example's clipped gradient could exceed ζ; and a layer whose
    # parameter has a tensor hook (p.register_hook(lambda g: 10 * g)): the second backward
    # would run it on the clipped sum (4·ζ released), the norms never see it
    booked = [
        h for h in handlers if method == "bk" or not h.sum_by_backward or autocast_on or _hooked(h, named)
    ]
    for q in unused:  # a zero sum (the noise is added to it), in both methods
        result_grads[q] = zeros_of(named[q])
    if sink is not None:
        if method != "bk" or len(booked) != len(handlers):
            raise ValueError("a sink takes book-keeping sums only (clipping='bk')")
        sink(result_grads)
        result_grads = {q: None for q in result_grads}
        with torch.no_grad():
            _handler_sums(booked, factors, sink)
        result_grads.update({q: None for h in booked for q in h.names.values()})
        handlers.clear()
        return result_grads
    with torch.no_grad():
        result_grads.update(_handler_sums(booked, factors))
    handlers.clear()
    if method == "ghost":
        wanted = [n for n in names if n not in result_grads]
        if wanted:
            c = _factors_down(factors, losses[0].dtype)
            second = sum(w * (c * ell).sum() for (w, _), ell in zip(points, losses, strict=True))
            inputs_ = [leaf[n] for leaf in leaves for n in wanted]
            gs = torch.autograd.grad(second, inputs_, allow_unused=True)
            k = 0
            for _ in leaves:
                for n in wanted:
                    g = gs[k] if gs[k] is not None else zeros_of(named[n])
                    result_grads[n] = g if n not in result_grads else result_grads[n] + g
                    k += 1
    return result_grads


def _hooked(h: _Handler, named: dict) -> bool:
    """Whether a trainable parameter of the handler's layer has a tensor hook (``register_hook``),
    which a backward through it runs on its gradient."""
    return any(getattr(named[q], "_backward_hooks", None) for q in h.names.values())


def _chain_clipped_sum(model, loss_fn, inputs, targets, clip_norm, names, named, dtype):
    """``ghost_clipped_sum`` ("bk", one point) of a plain chain of Linear layers and elementwise
    activations (``dpmf.optim.ghost_chain``): the same recorded tensors and the same handler
    arithmetic as the engine, without its hooks; None when the model is not such a chain."""
    chain = chain_layers(model, names, named)
    if chain is None:
        return None
    children, linears = chain
    with torch.enable_grad():
        recorded = chain_output_gradients(children, inputs, loss_fn, targets, per_example_losses)
    if recorded is None:
        return None
    recorded, losses = recorded
    handlers, sq = [], {}
    for (m, weight, bias), (a, g) in zip(linears, recorded, strict=True):
        params = [(weight, "weight")] + ([] if bias is None else [(bias, "bias")])
        h = _Handler(_Layer(weight, m, clipping_handler(m)[0], params, [_Call(0, (a,), g)]), dtype)
        sq.update(h.sq_norms())
        handlers.append(h)
    sq, norms, finite = _settled_norms(sq, names, handlers)
    if not finite:
        return GhostResult({}, norms, sq, {})
    factors = norms.new_tensor(clip_norm) / torch.clamp(norms, min=clip_norm)
    return GhostResult(_handler_sums(handlers, factors), norms, sq, {}, losses)


def _tied_pairs(engine, dtype) -> dict[str, TiedEmbeddingLinear]:
    """Tied parameter name → its closed form, for each weight shared by exactly one embedding
    and one linear layer whose uses were both recorded (``dpmf.optim.ghost_tied``)."""
    out = {}
    for q, holders in engine.tied.items():
        if any(layer.fallback for layer in holders):
            continue
        attr = {id(layer): a for layer in holders for qq, a in layer.params if qq == q}
        pair = tied_embedding_linear(holders, lambda layer: attr[id(layer)])  # noqa: B023
        if pair is None:
            continue
        emb, lin = pair
        emb_calls = [c for c in emb.calls if c.grad is not None]
        lin_calls = [c for c in lin.calls if c.grad is not None]
        if emb_calls and lin_calls:  # else one use is not reached: the general rule
            out[q] = TiedEmbeddingLinear(emb.module, emb_calls, lin.module, lin_calls, dtype)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
