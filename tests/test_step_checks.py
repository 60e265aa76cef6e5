"""The private step's checks: the optimizer given to make_private refuses a direct step, step()
refuses a gradient written behind the private step (through ``p.grad.data``), the private optimizer
cannot be copied, and a forward that re-lays out a frozen parameter is refused."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from gpt2_helpers import private_run
from torch import nn

from dpmf.optim.model_guard import ModelStateChangedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


# -- optimizer.step(): a non-private gradient written through p.grad.data ------------------------
# step() refuses a gradient written through ``p.grad.data``: such a write (its own version counter)
# keeps p.grad's identity and version as the private step wrote them, so comparing those alone would
# let the plain (unclipped, noiseless) gradient of the batch be applied. check_gradients compares the
# gradient's storage address too.
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


# -- make_private: the user's own optimizer stepped directly --------------------------------------
# The optimizer the user passed to make_private (and still holds) refuses a direct step: a plain
# loss.backward() then optimizer.step() would train on the unclipped, noiseless gradient. Its step
# runs only from the guarded wrapper's.
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


# -- the model-state check: a frozen parameter re-laid out through ``.data`` ----------------------
# A forward that re-lays out a frozen parameter is refused. ``p.data = p.data.view(...)`` (another
# shape, or another dtype of the same width) keeps the version, the address, the size in bytes and
# every word — a checksum of the words gives the same sum — yet changes what the model computes with
# from then on: a forward that picks the layout from the batch would keep a function of the batch in
# the model without noise. The after-forward snapshot marks each tensor's version, storage address,
# shape, strides and dtype.
class _Relayout(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 2)
        self.spy = nn.Parameter(torch.arange(1.0, 5.0), requires_grad=False)

    def forward(self, x):
        if self.how == "shape":
            self.spy.data = self.spy.data.view(2, 2)
        else:
            self.spy.data = self.spy.data.view(torch.int32)
        return self.lin(x)


@pytest.mark.parametrize("how", ["shape", "dtype"])
def test_a_forward_re_laying_out_a_frozen_parameter_is_refused(how):
    torch.manual_seed(0)
    spy = _Relayout(how)
    words = spy.spy.detach().clone().view(torch.int32)
    _, _, run = _small_private_run(spy, spy.lin.parameters(), clipping="bk")
    x, y = next(iter(run.data_loader))
    with pytest.raises(ModelStateChangedError, match="'spy'"):
        run.backward(x, target=y, return_loss=False)
    # the same words: only the layout changed
    assert torch.equal(spy.spy.detach().reshape(-1).view(torch.int32), words)


# -- make_private: the private optimizer cannot be copied -------------------------------------------
# copy.deepcopy(run.optimizer) and pickle.loads of its pickle (which pickle.dumps and torch.save
# write without complaint) fail with a one-line TypeError naming the fix (as Privatizer and the
# sampler do), not with "AttributeError: 'PrivateOptimizer' object has no attribute 'original'" from
# inside torch.
@pytest.mark.torch
def test_copying_the_private_optimizer_fails_with_a_one_line_type_error():
    private = private_run()
    with pytest.raises(TypeError, match="PrivateOptimizer"):
        copy.deepcopy(private.optimizer)
    with pytest.raises(TypeError, match="PrivateOptimizer"):
        pickle.loads(pickle.dumps(private.optimizer))
