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
- ``"bk"`` (book-keeping): Σ_i c_i G_iᵀA_i = (c∘G)ᵀA from the recorded activations and
  output gradients, one GEMM per layer and no second backward (Bu et al., "Differentially
  Private Optimization on Large Model at Small Cost", ICML 2023, Algorithm 1).

Every other module with trainable parameters takes its per-example gradients from
``torch.func``: a module called with one tensor (examples along dim 0) and returning one
tensor gets ``vmap(grad(·))`` of that module alone, against its recorded input and output
gradient; anything else — a parameter used outside its own module's forward (e.g. the output
projection of ``nn.MultiheadAttention``, tied weights), a module with several inputs, or a
layer whose dim 0 does not follow the examples (``batch_first=False``) — gets the
whole-model ``vmap(grad(·))`` path for its parameters. Those conditions are checked at run
time (a ``TorchFunctionMode`` watches which parameters each operation reads, and a one-example
probe pass checks that every recorded tensor's leading dimension follows the batch), never
assumed, because a missed use would make a per-example norm too small: the clipping bound —
the sensitivity the noise is calibrated to — would silently fail.

The probe is one forward of the first example under ``torch.no_grad`` (the random state is
restored afterwards), once per model, input shape and set of trainable parameters; a module
that changes its own state in the forward sees it once more.

Mixed precision: under ``torch.autocast`` the recorded activations and output gradients are in
the low precision; every norm, Gram matrix and sum here is computed in float32 (float64 for a
float64 model, and for a layer whose float32 squares overflow) with autocast disabled, and the
per-layer squared norms are combined in float64.

Assumptions, as for any per-example method: the examples do not interact in the forward
(``check_per_example_safe`` refuses BatchNorm), and each layer sees the examples in the
order of the input's dim 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.overrides import TorchFunctionMode

from dpmf.optim.choices import CLIPPING_MODES

__all__ = ["CLIPPING_MODES", "GhostResult", "ghost_clipped_sum", "ghost_layer_kinds"]


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _kind(module: nn.Module) -> str:
    """'linear', 'conv', 'embedding', 'norm' for the layers with closed forms; else 'generic'."""
    t = type(module)
    if isinstance(module, nn.Linear) and t.forward is nn.Linear.forward:
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and t.forward in (nn.Conv1d.forward, nn.Conv2d.forward):
        return "conv"
    if isinstance(module, nn.Embedding) and t.forward is nn.Embedding.forward:
        if not module.sparse and not module.scale_grad_by_freq:  # batch-coupled frequencies
            return "embedding"
        return "generic"
    if isinstance(module, _NORMS) and t.forward in tuple(c.forward for c in _NORMS):
        return "norm"
    return "generic"


def ghost_layer_kinds(model: nn.Module) -> dict[str, str]:
    """How each module owning trainable parameters is handled before any run-time check:
    ``linear``, ``conv``, ``embedding``, ``norm`` (closed forms) or ``generic`` (``torch.func``).

    Module names are those of ``model.named_modules()`` (``""`` for the model itself).
    """
    return {
        name: _kind(m)
        for name, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    }


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
        return g, g.new_zeros(()), None


class _CaptureCopy(_Capture):
    """``_Capture`` for outputs that their producer may have saved (any module's output)."""

    @staticmethod
    def forward(ctx, out, anchor, call):
        ctx.call = call
        return out.clone()


@dataclass(eq=False)
class _Call:
    """One forward call of a recorded module at one evaluation point."""

    point: int
    inputs: tuple
    grad: torch.Tensor | None = None
    params: dict | None = None  # generic modules: the parameter values this call used
    recording: bool = True
    shape: torch.Size | None = None  # the output's shape when the node sits on its base


@dataclass(eq=False)
class _Layer:
    name: str
    module: nn.Module
    kind: str
    params: list[tuple[str, str]]  # (model-level name, attribute name) of its trainable params
    calls: list[_Call] = field(default_factory=list)
    fallback: str | None = None  # why it needs the whole-model torch.func path


class _Watch(TorchFunctionMode):
    """Flags a trainable parameter read by an operation outside its own module's forward."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owners = self.engine.owner_of
        if owners and not self.engine.quiet:
            for a in _tensors(args, kwargs):
                layer = owners.get(id(a))
                if layer is not None and layer.fallback is None:
                    stack = self.engine.stack
                    inside = bool(stack) and (
                        stack[-1] is layer if layer.kind != "generic" else layer in stack
                    )
                    if not inside:
                        layer.fallback = "a trainable parameter is used outside its module's forward"
        return func(*args, **kwargs)


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

    def __init__(self, model: nn.Module, names: list[str]):
        self.model = model
        self.trainable = set(names)
        self.layers: list[_Layer] = []
        by_param: dict[int, list[_Layer]] = {}
        for mname, m in model.named_modules(remove_duplicate=False):
            own = [
                (f"{mname}.{a}" if mname else a, a)
                for a, p in m.named_parameters(recurse=False)
                if p.requires_grad
            ]
            if not own:
                continue
            if any(q in self.trainable for q, _ in own):
                layer = _Layer(mname, m, _kind(m), own)
                self.layers.append(layer)
                for _, a in own:
                    by_param.setdefault(id(getattr(m, a)), []).append(layer)
            else:  # a module reached under another name (shared module): its params are tied
                for _, a in own:
                    by_param.setdefault(id(getattr(m, a)), []).append(None)
        for holders in by_param.values():
            if len(holders) > 1:
                for layer in holders:
                    if layer is not None:
                        layer.fallback = "its parameters are shared with another module"
        self.anchor = None
        self.stack: list[_Layer] = []
        self.owner_of: dict[int, _Layer] = {}
        self.point = 0
        self.mode = "record"  # "record", "probe" or "off"
        self.quiet = False  # the hooks' own operations are not the model's
        self.probe_dims: dict[int, set] = {}
        self.handles = []

    # hooks
    def __enter__(self):
        for layer in self.layers:
            m = layer.module
            self.handles.append(m.register_forward_pre_hook(self._pre(layer)))
            self.handles.append(m.register_forward_hook(self._post(layer), always_call=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()

    def _pre(self, layer):
        def hook(module, args):
            if self.mode != "off":
                self.stack.append(layer)

        return hook

    def _post(self, layer):
        def hook(module, args, out):
            if self.mode == "off":
                return None
            if self.stack and self.stack[-1] is layer:
                self.stack.pop()
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
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                if not isinstance(out, torch.Tensor):
                    layer.fallback = "its output is not one tensor"
                return None
            if layer.kind == "generic" and (len(args) != 1 or not isinstance(args[0], torch.Tensor)):
                layer.fallback = "it is called with other than one tensor"
                return None
            call = _Call(self.point, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
            layer.calls.append(call)
            self.quiet = True
            try:
                if layer.kind == "generic":
                    call.params = {n: _get(module, n).detach() for n, _ in module.named_parameters()}
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


# -- per-layer norms and sums ---------------------------------------------------------------


def _conv_padded(m, x):
    """The input padded as the convolution pads it (any padding mode, 'same' included)."""
    k = len(m.kernel_size)
    if isinstance(m.padding, str):
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


def _shape_of(layer: _Layer, call: _Call) -> tuple[int, int, int]:
    """(T, d, p) of one call: tokens per example, inputs and outputs per group."""
    m, g = layer.module, call.grad
    if layer.kind == "linear":
        return g[0].numel() // g.shape[-1], m.in_features, m.out_features
    k = 1
    for s in m.kernel_size:
        k *= s
    return g[0, 0].numel(), m.in_channels // m.groups * k, m.out_channels // m.groups


def _linear_form(layer: _Layer, call: _Call):
    """(A, G) of one call as (b, groups, T, d), (b, groups, T, p)."""
    m, x, g = layer.module, call.inputs[0], call.grad
    b = x.shape[0]
    if layer.kind == "linear":
        return x.reshape(b, 1, -1, x.shape[-1]), g.reshape(b, 1, -1, g.shape[-1])
    # convolution: unfold the (padded) input; one linear layer per group
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


def _conv_per_example(m, call, dtype) -> torch.Tensor:
    """Per-example conv weight gradients, (b, *weight.shape), by one grouped convolution
    backward with the examples as groups (no unfolded input is formed)."""
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


def _cat_calls(layer, dtype):
    """A, G over all calls (and evaluation points), tokens concatenated (the output gradients
    of a point already carry its weight: the backward was of Σ_j w_j Σ_i ℓ_ij)."""
    calls = [c for c in layer.calls if c.grad is not None]
    parts = [_linear_form(layer, c) for c in calls]
    if len(parts) == 1:
        return parts[0][0].to(dtype), parts[0][1].to(dtype)
    a = torch.cat([a.to(dtype) for a, _ in parts], dim=2)
    g = torch.cat([g.to(dtype) for _, g in parts], dim=2)
    return a, g


def per_example_losses(loss_fn, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ℓ_i = loss_fn(out[i:i+1], targets[i:i+1]) for every i, shape (b,).

    ``F.cross_entropy`` and ``F.nll_loss`` on (b, classes) outputs and integer class targets
    use ``reduction="none"`` (the same numbers, one kernel); any other loss is ``vmap``-ed.
    """
    if (
        loss_fn in (F.cross_entropy, F.nll_loss)
        and out.dim() == 2
        and targets.dim() == 1
        and not targets.is_floating_point()
        and not bool((targets == -100).any())  # ignore_index: a mean over no element
    ):
        return loss_fn(out, targets, reduction="none")
    return vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(out, targets)


def _sq(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ x² along ``dim`` as the square of one fused norm (no squared temporary)."""
    return torch.linalg.vector_norm(x, dim=dim).double().square()


def _total(parts):
    """The sum of an iterable of tensors without a leading 0 + (a copy of the first)."""
    out = None
    for p in parts:
        out = p if out is None else out + p
    return out


def _linear_per_example(call, dtype) -> torch.Tensor:
    """Per-example Linear weight gradients G_iᵀA_i, (b, p, d), by one batched GEMM."""
    x, g = call.inputs[0].to(dtype), call.grad.to(dtype)
    b = x.shape[0]
    return torch.bmm(g.reshape(b, -1, g.shape[-1]).transpose(1, 2), x.reshape(b, -1, x.shape[-1]))


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
    return sq.index_add_(0, rows // vocab, _sq(summed, 1))


def _gram_sq(a, g):
    """Σ_groups ⟨A Aᵀ, G Gᵀ⟩ per example, shape (b,)."""
    if a.shape[2] == 1:
        return (_sq(a, -1) * _sq(g, -1)).sum((1, 2))
    aa = a @ a.transpose(-1, -2)
    gg = g @ g.transpose(-1, -2)
    return (aa * gg).sum((1, 2, 3))


class _Handler:
    """Per-example squared norms of one layer's trainable parameters, then their clipped sum."""

    def __init__(self, layer: _Layer, dtype):
        self.layer = layer
        self.dtype = dtype
        self.stored = {}

    def sq_norms(self) -> dict[str, torch.Tensor]:
        out = self._sq(self.dtype)
        if not all(bool(torch.isfinite(v).all()) for v in out.values()) and self.dtype != torch.float64:
            out = self._sq(torch.float64)  # overflow of a finite gradient's square
        return {k: v.double() for k, v in out.items()}

    def _params(self):
        return {a: q for q, a in self.layer.params}

    def _sq(self, dtype):
        layer, kind, params = self.layer, self.layer.kind, self._params()
        if not any(c.grad is not None for c in layer.calls):
            b = layer.calls[0].inputs[0].shape[0]
            self.stored = {"zero": b}
            return {
                q: torch.zeros(b, dtype=dtype, device=layer.calls[0].inputs[0].device)
                for q, _ in layer.params
            }
        out = {}
        if kind in ("linear", "conv"):
            calls = [c for c in layer.calls if c.grad is not None]
            shapes = [_shape_of(layer, c) for c in calls]
            t, d, p = sum(s[0] for s in shapes), shapes[0][1], shapes[0][2]
            # the mixed rule: ghost when its flops T²(d+p) are below those of instantiating, T·p·d
            ghost = t == 1 or t * (d + p) < p * d
            if "weight" in params:
                if ghost:
                    a, g = _cat_calls(layer, dtype)
                    out[params["weight"]] = _gram_sq(a, g)
                    self.stored["weight"] = ("ghost", a, g)
                else:
                    if kind == "conv":
                        w = _total(_conv_per_example(layer.module, c, dtype) for c in calls)
                    else:
                        w = _total(_linear_per_example(c, dtype) for c in calls)
                    out[params["weight"]] = _sq(w.reshape(w.shape[0], -1), 1)
                    self.stored["weight"] = ("inst", w)
            if "bias" in params:
                b = calls[0].grad.shape[0]
                if kind == "conv":
                    gb = _total(c.grad.to(dtype).reshape(b, c.grad.shape[1], -1).sum(-1) for c in calls)
                else:
                    gb = _total(c.grad.to(dtype).reshape(b, -1, c.grad.shape[-1]).sum(1) for c in calls)
                out[params["bias"]] = _sq(gb, 1)
                self.stored["bias"] = ("inst", gb)
        elif kind == "embedding":
            m = layer.module
            ids, gs = [], []
            for c in layer.calls:
                if c.grad is None:
                    continue
                i = c.inputs[0].reshape(c.inputs[0].shape[0], -1)
                gg = c.grad.reshape(i.shape[0], -1, c.grad.shape[-1]).to(dtype)
                if m.padding_idx is not None:
                    gg = gg * (i != m.padding_idx).unsqueeze(-1).to(dtype)
                ids.append(i)
                gs.append(gg)
            i, gg = torch.cat(ids, 1), torch.cat(gs, 1)
            if i.shape[1] <= _EMBEDDING_GHOST_TOKENS:  # ghost: Σ_{t,u} [x_t = x_u]⟨G_t, G_u⟩
                same = (i.unsqueeze(2) == i.unsqueeze(1)).to(dtype)
                out[params["weight"]] = ((gg @ gg.transpose(1, 2)) * same).sum((1, 2)).double()
            else:  # the sparse per-example gradient: one row per distinct (example, token)
                out[params["weight"]] = _embedding_sq_sparse(i, gg, m.num_embeddings)
            self.stored["weight"] = ("embedding", i, gg)
        elif kind == "norm":
            sums = {}
            for c in layer.calls:
                if c.grad is None:
                    continue
                for attr, v in self._norm_grads(c, dtype).items():
                    sums[attr] = v if attr not in sums else sums[attr] + v
            for attr, q in params.items():
                v = sums[attr]
                out[q] = _sq(v.reshape(v.shape[0], -1), 1)
                self.stored[attr] = ("inst", v)
        else:  # generic: torch.func on the module alone
            sums = {}
            for c in layer.calls:
                if c.grad is None:
                    continue
                for attr, v in self._generic_grads(c).items():
                    sums[attr] = v if attr not in sums else sums[attr] + v
            for attr, q in params.items():
                v = sums[attr].to(dtype)
                out[q] = _sq(v.reshape(v.shape[0], -1), 1)
                self.stored[attr] = ("inst", v)
        return out

    def _norm_grads(self, call, dtype):
        m, x, g = self.layer.module, call.inputs[0].to(dtype), call.grad.to(dtype)
        b = x.shape[0]
        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
            per = {
                "weight": (g * xhat).reshape(b, m.num_channels, -1).sum(-1),
                "bias": g.reshape(b, m.num_channels, -1).sum(-1),
            }
        else:
            shape = tuple(m.normalized_shape)
            if isinstance(m, nn.LayerNorm):
                xhat = F.layer_norm(x, shape, None, None, m.eps)
            else:
                eps = m.eps if m.eps is not None else torch.finfo(call.inputs[0].dtype).eps
                xhat = F.rms_norm(x, shape, None, eps)
            per = {
                "weight": (g * xhat).reshape(b, -1, *shape).sum(1),
                "bias": g.reshape(b, -1, *shape).sum(1),
            }
        return {a: per[a] for a in self._params()}

    def _generic_grads(self, call):
        m = self.layer.module
        own = list(self._params())
        values = dict(call.params)
        trainable = {a: values.pop(a) for a in own}

        def inner(p, x, g):
            out = functional_call(m, ({**p}, values), (x.unsqueeze(0),))
            return (out * g.unsqueeze(0).to(out.dtype)).sum()

        gr = vmap(grad(inner), in_dims=(None, 0, 0), randomness="different")(
            trainable, call.inputs[0], call.grad
        )
        return gr

    def summed(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_i c_i·g_i for each trainable parameter of the layer (book-keeping)."""
        out = {}
        m = self.layer.module
        if "zero" in self.stored:
            return {q: torch.zeros_like(_get(m, a)) for q, a in self.layer.params}
        for attr, q in self._params().items():
            p = _get(m, attr)
            entry = self.stored[attr]
            c = factors.to(self.dtype)
            if entry[0] == "ghost":
                _, a, g = entry
                s = torch.einsum("bgtp,bgtd->gpd", g * c.view(-1, 1, 1, 1), a)
            elif entry[0] == "embedding":
                _, i, g = entry
                s = torch.zeros(p.shape, dtype=self.dtype, device=g.device)
                s.index_add_(0, i.reshape(-1), (g * c.view(-1, 1, 1)).reshape(-1, g.shape[-1]))
            else:
                s = torch.tensordot(c, entry[1], dims=1)
            out[q] = s.reshape(p.shape).to(p.dtype)
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
    """

    grads: dict
    norms: torch.Tensor
    sq_by_param: dict
    fallback: dict


# model → verified layouts (input signature → module names whose dim 0 does not follow the batch)
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe(model, engine, inputs, plan) -> dict[str, str]:
    """Module name → why its recorded tensors do not follow the batch (a one-example pass)."""
    key = (tuple(inputs.shape[1:]), inputs.dtype, tuple(sorted(engine.trainable)), model.training)
    cache = _PROBED.setdefault(model, {})
    if key in cache:
        return cache[key]
    engine.mode = "probe"
    engine.probe_dims = {}
    devices = [inputs.device] if inputs.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model(inputs[:1])
    finally:
        engine.mode = "record"
        engine.stack.clear()
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
    named = dict(model.named_parameters())
    dtype = torch.float64 if named[names[0]].dtype == torch.float64 else torch.float32
    device = inputs.device
    b = int(inputs.shape[0])
    autocast_on = torch.is_autocast_enabled(device.type)
    with torch.enable_grad(), _Engine(model, names) as engine:
        if b > 1:
            bad = _probe(model, engine, inputs, plan)
            for layer in engine.layers:
                if layer.name in bad and layer.fallback is None:
                    layer.fallback = bad[layer.name]
        if not allow_fallback and any(layer.fallback for layer in engine.layers):
            return None
        engine.anchor = torch.zeros((), device=device, requires_grad=True)
        leaves, losses = [], []
        for j, (_, shift) in enumerate(points):
            engine.point = j
            if shift is None:
                values = {n: named[n] for n in names}
                engine.owner_of = {
                    id(getattr(layer.module, a)): layer for layer in engine.layers for _, a in layer.params
                }
                with _Watch(engine):
                    out = model(inputs)
            else:
                values = {n: (named[n].detach() + shift[n]).requires_grad_(True) for n in names}
                engine.owner_of = {
                    id(values[q]): layer for layer in engine.layers for q, _ in layer.params if q in values
                }
                with _Watch(engine):
                    out = functional_call(model, values, (inputs,))
            engine.stack.clear()
            engine.owner_of = {}
            per = per_example_losses(loss_fn, out, targets)
            losses.append(per)
            leaves.append(values)
        # every recorded tensor must have the examples along dim 0
        for layer in engine.layers:
            if layer.fallback is None and any(
                isinstance(c.inputs[0], torch.Tensor) and c.inputs[0].shape[:1] != (b,) for c in layer.calls
            ):
                layer.fallback = "its dim 0 does not follow the examples"
        if not allow_fallback and any(layer.fallback for layer in engine.layers):
            return None
        total = sum(w * ell.sum() for (w, _), ell in zip(points, losses, strict=True))
        keep = method == "ghost"
        if total.requires_grad:
            torch.autograd.grad(total, [engine.anchor], retain_graph=keep, allow_unused=True)
        for layer in engine.layers:
            for c in layer.calls:
                c.recording = False
                if c.grad is not None and c.grad.shape[:1] != (b,):
                    layer.fallback = layer.fallback or "its dim 0 does not follow the examples"
        if not allow_fallback and any(layer.fallback for layer in engine.layers):
            return None
        engine.mode = "off"
        with torch.autocast(device.type, enabled=False) if autocast_on else _null():
            handlers, sq = [], {}
            fallback = {}
            for layer in engine.layers:
                if layer.fallback is not None:
                    fallback[layer.name or "<model>"] = layer.fallback
                    continue
                if not layer.calls:  # not called: its parameters get no gradient
                    for q, _ in layer.params:
                        sq[q] = torch.zeros(b, dtype=torch.float64, device=device)
                    continue
                h = _Handler(layer, dtype)
                sq.update(h.sq_norms())
                handlers.append(h)
            rest = [n for n in names if n not in sq]
            per_example = subset_gradients(rest) if rest else {}
            for n, g in per_example.items():
                flat = g.reshape(b, -1)
                part = torch.linalg.vector_norm(flat, dim=1)
                if not bool(torch.isfinite(part).all()):
                    part = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64)
                sq[n] = part.double() ** 2
            norms = torch.sqrt(sum(sq[n] for n in names))
            result_grads = {}
            if not bool(torch.isfinite(norms).all()):
                return GhostResult({}, norms, sq, fallback)
            factors = norms.new_tensor(clip_norm) / torch.clamp(norms, min=clip_norm)
            for n, g in per_example.items():
                result_grads[n] = torch.tensordot(factors.to(g.dtype), g, dims=1)
            for h in handlers:
                # torch.func gradients (possibly with their own dropout masks) are summed from
                # the same vectors whose norms were taken, in both methods
                if method == "bk" or h.layer.kind == "generic":
                    result_grads.update(h.summed(factors))
            handlers.clear()
            if method == "ghost":
                wanted = [n for n in names if n not in result_grads]
                if wanted:
                    c = factors.to(losses[0].dtype)
                    second = sum(w * (c * ell).sum() for (w, _), ell in zip(points, losses, strict=True))
                    inputs_ = [leaf[n] for leaf in leaves for n in wanted]
                    gs = torch.autograd.grad(second, inputs_, allow_unused=True)
                    k = 0
                    for _ in leaves:
                        for n in wanted:
                            g = gs[k] if gs[k] is not None else torch.zeros_like(named[n])
                            result_grads[n] = g if n not in result_grads else result_grads[n] + g
                            k += 1
    return GhostResult(result_grads, norms, sq, fallback)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
