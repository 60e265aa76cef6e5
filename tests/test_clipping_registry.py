"""The clipping-layer registry: a user's layer is clipped by its handler, never by torch.func."""

import warnings

import pytest
import torch
from torch import nn

import dpmf
from dpmf.optim import ClippingHandler, clipped_sum, register_clipping_layer
from dpmf.optim.ghost import ghost_layer_kinds

pytestmark = pytest.mark.torch


class Bilinear(nn.Module):
    """s_t = (x_t ∘ u) Wᵀ: a per-feature scale u, then a matrix W, on T tokens."""

    def __init__(self, d, p):
        super().__init__()
        self.u = nn.Parameter(torch.randn(d))
        self.w = nn.Parameter(torch.randn(p, d) / d**0.5)

    def forward(self, x):
        return (x * self.u) @ self.w.T


class BilinearHandler(ClippingHandler):
    """Per-example gradients of Bilinear from its input X (b,T,d) and output gradient G (b,T,p):
    ∂W = Gᵀ(X∘u), ∂u = Σ_t (G W)_t ∘ x_t."""

    name = "bilinear"

    def __init__(self):
        self.calls = 0

    def per_example(self, module, calls, attrs, dtype):
        self.calls += 1
        out = {}
        for c in calls:
            x, g = c.inputs[0].to(dtype), c.grad.to(dtype)
            parts = {
                "w": torch.einsum("btp,btd->bpd", g, x * module.u.to(dtype)),
                "u": torch.einsum("btp,pd,btd->bd", g, module.w.to(dtype), x),
            }
            for a in attrs:
                out[a] = parts[a] if a not in out else out[a] + parts[a]
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bil = Bilinear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # x: (b, T, 4)
        return self.head(torch.tanh(self.bil(torch.tanh(self.lin(x))))).mean(1)


def loss(out, y):
    return ((out - y) ** 2).sum()


def data(b=6):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, 3, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(b, 3, generator=g, dtype=torch.float64)


def test_a_registered_layer_is_clipped_by_its_handler_and_equals_vmap():
    torch.manual_seed(0)
    model = Net().double()
    x, y = data()
    assert ghost_layer_kinds(model)["bil"] == "generic"  # before registration: torch.func
    handler = BilinearHandler()
    register_clipping_layer(Bilinear, handler)
    assert ghost_layer_kinds(model)["bil"] == "bilinear"
    ref = clipped_sum(model, loss, x, y, clip_norm=1.0, clipping="vmap")
    zeta = float(ref.norms.median())  # some examples clipped, some not
    ref = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="vmap")
    for mode in ("auto", "bk", "ghost"):
        before = handler.calls
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a torch.func fallback warns under ghost/bk
            out = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping=mode)
        assert out.method == ("bk" if mode == "auto" else mode)
        assert handler.calls == before + 1  # the handler, not torch.func
        torch.testing.assert_close(out.norms, ref.norms, rtol=1e-6, atol=0)
        for a, b in zip(out.grads, ref.grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_a_subclass_that_changes_the_forward_is_not_the_registered_layer():
    register_clipping_layer(Bilinear, BilinearHandler())

    class Squared(Bilinear):
        def forward(self, x):
            return super().forward(x) ** 2

    class Same(Bilinear):
        pass

    model = nn.Sequential(Squared(3, 3), Same(3, 3))
    assert ghost_layer_kinds(model) == {"0": "generic", "1": "bilinear"}


def test_builtin_layers_go_through_the_registry():
    kinds = dpmf.optim.registered_clipping_layers()
    assert kinds["torch.nn.modules.linear.Linear"] == "linear"
    assert kinds["torch.nn.modules.sparse.Embedding"] == "embedding"
    assert kinds["transformers.pytorch_utils.Conv1D"] == "conv1d"  # by name: transformers not imported
    assert ghost_layer_kinds(nn.Embedding(5, 2, sparse=True)) == {"": "generic"}  # the handler's check


def test_bad_registrations_are_refused():
    with pytest.raises(TypeError, match="module_type=.*nn.Module subclass"):
        register_clipping_layer(int, BilinearHandler())
    with pytest.raises(TypeError, match="module_type='Conv1D'.*qualified"):
        register_clipping_layer("Conv1D", BilinearHandler())
    with pytest.raises(TypeError, match="handler=.*ClippingHandler"):
        register_clipping_layer(Bilinear, lambda m: None)
    assert dpmf.register_clipping_layer is register_clipping_layer


class Bilinear2(Bilinear):
    """The same layer, another type (the registry is keyed by type)."""


def test_the_decorator_registers_a_handler_as_dpmfs_own_layers_are():
    from dpmf.optim import clipping_layer
    from dpmf.optim.clipping_layers import registered_clipping_layers

    @clipping_layer(Bilinear2)
    class Handler2(BilinearHandler):
        name = "bilinear2"

    assert registered_clipping_layers()[f"{__name__}.Bilinear2"] == "bilinear2"
    torch.manual_seed(0)
    model = Net().double()
    model.bil = Bilinear2(6, 5).double()
    x, y = data()
    assert ghost_layer_kinds(model)["bil"] == "bilinear2"
    ref = clipped_sum(model, loss, x, y, clip_norm=1.0, clipping="vmap")
    for mode in ("bk", "ghost"):
        out = clipped_sum(model, loss, x, y, clip_norm=1.0, clipping=mode)
        torch.testing.assert_close(out.norms, ref.norms, rtol=1e-10, atol=0)
        for a, b in zip(out.grads, ref.grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # dpmf's own layers are registered through the same decorator, and are not silently replaced
    with pytest.raises(ValueError, match="replace=True"):
        clipping_layer(nn.Linear)(type("Other", (ClippingHandler,), {}))


def test_the_built_in_linear_handler_is_not_silently_replaced():
    import torch

    from dpmf.optim import clipped_sum, register_clipping_layer
    from dpmf.optim.clipping_layers import LinearHandler
    from dpmf.optim.clipping_layers.registry import _REGISTRY

    class Unclipped(LinearHandler):
        """Reports every example's norm as 0: nothing would ever be clipped."""

        name = "unclipped"

        def sq_norms(self, module, calls, attrs, dtype):
            norms, state = super().sq_norms(module, calls, attrs, dtype)
            return {a: torch.zeros_like(v) for a, v in norms.items()}, state

    key = "torch.nn.modules.linear.Linear"
    own = _REGISTRY[key]
    try:
        _refuse_and_replace(key, own, Unclipped, register_clipping_layer, clipped_sum)
    finally:
        _REGISTRY[key] = own  # whatever happened, the next tests clip with the built-in handler


def _refuse_and_replace(key, own, Unclipped, register_clipping_layer, clipped_sum):
    import torch
    from torch import nn

    from dpmf.optim.clipping_layers.registry import _REGISTRY

    with pytest.raises(ValueError, match=rf"^module_type='{key}' is invalid: dpmf's own 'linear' handler"):
        register_clipping_layer(nn.Linear, Unclipped())
    with pytest.raises(ValueError, match="pass replace=True"):
        register_clipping_layer(key, Unclipped())
    assert _REGISTRY[key] is own
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = (
        torch.randn(6, 4, generator=g, dtype=torch.float64),
        torch.randn(6, 3, generator=g, dtype=torch.float64),
    )
    loss = lambda out, t: ((out - t) ** 2).sum()  # noqa: E731
    ref = clipped_sum(model, loss, x, y, clip_norm=0.1, clipping="vmap")  # torch.func, no handler
    out = clipped_sum(model, loss, x, y, clip_norm=0.1, clipping="ghost")
    assert float(ref.norms.min()) > 0.1  # every example is clipped
    torch.testing.assert_close(out.norms, ref.norms, rtol=1e-9, atol=0)
    # an explicit replacement is still possible (and undone here)
    register_clipping_layer(nn.Linear, Unclipped(), replace=True)
    try:
        assert float(clipped_sum(model, loss, x, y, clip_norm=0.1, clipping="ghost").norms.max()) == 0.0
    finally:
        register_clipping_layer(nn.Linear, own, replace=True)
