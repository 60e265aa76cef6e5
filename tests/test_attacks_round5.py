"""Hostile-user reproducers (round 5): each test names a weakness found in the current code.

Every test asserts what the code should do; a weakness not fixed is marked ``xfail(strict=True)``.
"""

import pytest
import torch
import torch.nn.functional as F
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


# -- the chain path: torch's call machinery or an activation replaced on the class ----------------
# Weakness: ghost_chain checked the instances (no hook, no instance forward) and the Sequential
# subclass, but not torch's own classes and functions: nn.Tanh.forward, nn.Module.__call__ /
# _call_impl, or F.linear replaced after import (here by a batch-coupling variant) were taken as
# the chain, whose per-example sums then assumed an elementwise activation and a plain Linear.
# torch's code is now recorded at import and compared on each call.
def _center(f):
    return lambda *a, **k: (lambda out: out - out.mean(0))(f(*a, **k))


# -- optimizer.step(): a non-private gradient written through p.grad.data ------------------------
# Weakness: check_gradients compared p.grad's identity and version with those the private step
# wrote; a write through ``p.grad.data`` (its own version counter) kept both, so here the plain
# (unclipped, noiseless) gradient of the batch was applied by step(). The gradient's address and
# content checksum are now recorded too.
@pytest.mark.parametrize("how", ["assign"])
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
