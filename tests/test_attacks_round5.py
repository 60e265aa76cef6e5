"""Hostile-user reproducers (round 5): each test names a weakness found in the current code.

Every test asserts what the code should do; a weakness not fixed is marked ``xfail(strict=True)``.
"""

import pytest
import torch
import torch.nn.functional as F
from test_clipping_chain import _count_chain
from torch import nn

from dpmf.optim.clipping import clipped_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 10, generator=g) * 3, torch.randint(0, 3, (8,), generator=g)


def _small_private_run(model=None, params=None, **kw):
    """(model, the optimizer given, the private run) of ``model`` (default: a small MLP) through
    make_private, the optimizer over ``params`` (default: all of the model's)."""
    import dpmf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)) if model is None else model
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    opt = torch.optim.SGD(model.parameters() if params is None else params, lr=0.1)
    run = dpmf.make_private(
        model,
        opt,
        ds,
        loss_fn=F.cross_entropy,
        batch_size=8,
        steps=2,
        noise_multiplier=1.0,
        factorization="identity",
        scheme="poisson",
        **kw,
    )
    return model, opt, run


# -- bk clipping: nn.Linear's forward replaced on the class --------------------------------------
# Weakness: the Linear handler (chain path and engine alike) checked that a layer's type keeps the
# forward of the registered class — compared with the class's forward as it is NOW, so a forward
# replaced on nn.Linear itself (here using 2·W) passed, and the closed-form per-example gradients
# (for x·Wᵀ + b) were off by a factor 2 (relative error 0.98 against vmap); the norms were half the
# true ones, so examples above ζ were released unclipped. The forward of each registered class is
# now recorded at registration.
def test_bk_matches_vmap_when_linears_forward_is_replaced_on_the_class(monkeypatch):
    model, (x, y) = _model(), _batch()
    monkeypatch.setattr(nn.Linear, "forward", lambda self, h: F.linear(h, 2 * self.weight, self.bias))
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="vmap")
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- the chain path: torch's call machinery or an activation replaced on the class ----------------
# Weakness: ghost_chain checked the instances (no hook, no instance forward) and the Sequential
# subclass, but not torch's own classes and functions: nn.Tanh.forward, nn.Module.__call__ /
# _call_impl, or F.linear replaced after import (here by a batch-coupling variant) were taken as
# the chain, whose per-example sums then assumed an elementwise activation and a plain Linear.
# torch's code is now recorded at import and compared on each call.
def _center(f):
    return lambda *a, **k: (lambda out: out - out.mean(0))(f(*a, **k))


@pytest.mark.parametrize(
    "where", ["Tanh.forward", "Tanh.__call__", "Module.__call__", "Module._call_impl", "F.linear"]
)
def test_the_chain_is_refused_when_torchs_code_is_replaced(monkeypatch, where):
    model, (x, y) = _model(), _batch()
    calls = _count_chain(monkeypatch)
    clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    assert calls == [True]  # the plain model is a chain
    owner, name = {
        "Tanh.forward": (nn.Tanh, "forward"),
        "Tanh.__call__": (nn.Tanh, "__call__"),
        "Module.__call__": (nn.Module, "__call__"),
        "Module._call_impl": (nn.Module, "_call_impl"),
        "F.linear": (F, "linear"),
    }[where]
    monkeypatch.setattr(owner, name, _center(getattr(owner, name)), raising=False)
    calls.clear()
    clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    assert calls == []  # not a chain: the general engine decides


# -- optimizer.step(): a non-private gradient written through p.grad.data ------------------------
# Weakness: check_gradients compared p.grad's identity and version with those the private step
# wrote; a write through ``p.grad.data`` (its own version counter) kept both, so here the plain
# (unclipped, noiseless) gradient of the batch was applied by step(). The gradient's address and
# content checksum are now recorded too.
@pytest.mark.parametrize("how", ["copy", "assign"])
def test_step_refuses_a_gradient_written_through_data(how):
    import copy

    model, opt, run = _small_private_run()
    x, y = next(iter(run.data_loader))
    run.backward(x, target=y, return_loss=False)
    plain = copy.deepcopy(model)
    F.cross_entropy(plain(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        if how == "copy":
            p.grad.data.copy_(q.grad)
        else:
            p.grad.data = q.grad.clone()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="p.grad was replaced or modified"):
        run.optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# -- the model-state check: a frozen integer, bool or complex parameter written by the forward ------
# Weakness: state_versions summed only floating-point parameters; a frozen parameter of another
# dtype written through ``.data`` during the private forward (its version unchanged) — here the
# count of the batch's examples with x₀ > 0 — was not seen, and the step went on: a function of
# the batch kept in the model without noise. Every parameter's content is now summed.
class _Spy(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.spy = nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.spy.data[0] = ((x[:, 0] > 0).sum() + 1).to(self.spy.dtype)  # never 0: always a change
        return self.lin(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_a_forward_writing_a_non_float_parameter_is_refused(dtype):
    from dpmf.optim.model_guard import ModelStateChangedError

    torch.manual_seed(0)
    spy = _Spy(dtype)
    model, _, run = _small_private_run(spy, spy.lin.parameters(), clipping="bk")
    x, y = next(iter(run.data_loader))
    with pytest.raises(ModelStateChangedError, match="'spy'"):
        run.backward(x, target=y, return_loss=False)


# -- vmap clipping: one layer reachable by two paths ----------------------------------------------
# Weakness: torch.func.functional_call (torch 2.13) does not put back the parameters of a submodule
# reachable by two paths (nn.Sequential(layer, act, layer)): after clipping="vmap" the layer held a
# stale plain tensor instead of its Parameter (the optimizer's parameter no longer in the model),
# and a later "bk"/"ghost" clipping of the model found no parameter in use and returned zero norms
# and sums. dpmf's functional_call now restores every submodule's own tensors.
def test_vmap_leaves_a_layer_used_twice_with_its_parameters():
    torch.manual_seed(5)
    layer = nn.Linear(6, 6)
    model = nn.Sequential(layer, nn.Tanh(), layer)
    weight, bias = layer.weight, layer.bias
    x, y = torch.randn(8, 6), torch.randint(0, 6, (8,))
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="vmap")
    assert layer.weight is weight and layer.bias is bias
    norms = []
    for i in range(8):  # explicit per-example gradient norms
        g = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), [weight, bias])
        norms.append(float(torch.sqrt(sum((t**2).sum() for t in g))))
    torch.testing.assert_close(
        ref.norms.double(), torch.tensor(norms, dtype=torch.float64), rtol=1e-5, atol=0
    )
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- make_private: the user's own optimizer stepped directly --------------------------------------
# Weakness: make_private returned a guarded wrapper, but the optimizer the user passed in (and
# still holds) stepped on anything: a plain loss.backward() then optimizer.step() trained on the
# unclipped, noiseless gradient. Its step now runs only from the wrapper's.
def test_the_wrapped_optimizer_refuses_a_direct_step():
    model, opt, run = _small_private_run()
    x, y = next(iter(run.data_loader))
    F.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="SGD.step\\(\\) refused"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    run.backward(x, target=y, return_loss=False)
    run.optimizer.step()  # the private step still steps the wrapped optimizer
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
