"""A private step's host synchronisations do not grow with the model: at most 3 per
``backward`` + ``optimizer.step`` of the README's loop, counted by a dispatch mode over the aten
ops that hand a tensor's value to Python (on a GPU each one stalls the stream)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

import dpmf
from dpmf.optim.ghost import per_example_losses
from dpmf.train.models import build_model

pytestmark = pytest.mark.torch

SYNC_OPS = {"_local_scalar_dense", "equal", "nonzero", "is_nonzero", "item"}


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _mlp(tensors: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(tensors // 2 - 1)]
    mods: list[nn.Module] = []
    for lin in layers:
        mods += [lin, nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(16, 10))


def _syncs_of_a_step(model, shape, clipping, **kw) -> int:
    """Counted ops in the third step of make_private's loop (``kw``: more of its arguments)."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(320, *shape, generator=g), torch.randint(0, 10, (320,), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private = dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
            batch_size=32, epochs=1, noise_multiplier=1.0, clip_norm=1.0, factorization="identity",
            scheme="poisson", clipping=clipping, target_delta=1e-5, seed=3, **kw,
        )  # fmt: skip
    batches = iter(private.data_loader)
    for _ in range(2):  # the first step also probes the batch's independence
        x, y = next(batches)
        private.backward(x, target=y)
        private.optimizer.step()
        private.optimizer.zero_grad()
    x, y = next(batches)
    with _Syncs() as syncs:
        loss = private.backward(x, target=y)
        private.optimizer.step()
    assert torch.isfinite(loss)  # read after the count: the loop decides when to wait
    return syncs.count


@pytest.mark.parametrize("clipping", ["auto", "ghost"])
@pytest.mark.parametrize("tensors", [6, 20, 68, 150])
def test_a_linear_models_step_synchronises_at_most_three_times_at_any_size(tensors, clipping):
    model = _mlp(tensors)
    assert len(list(model.parameters())) == tensors
    assert _syncs_of_a_step(model, (16,), clipping) <= 3


@pytest.mark.parametrize("name, shape", [("cnn", (1, 28, 28)), ("cnn3", (3, 32, 32))])
def test_a_convolutional_models_step_synchronises_at_most_three_times(name, shape):
    # convolutions and GroupNorm: their squares are checked with every layer's, in one read
    assert _syncs_of_a_step(build_model(name, shape, 10, seed=0), shape, "auto") <= 3


def test_per_example_cross_entropy_of_an_ignored_target_is_that_examples_own_loss():
    # branch-free: an ignored target (−100) gives the one-example loss's NaN (a mean over no
    # element) and its gradient, the others their own losses and gradients exactly
    out = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, -100, 2, 1])
    per = per_example_losses(F.cross_entropy, out, targets)
    for i in range(4):
        alone = F.cross_entropy(out[i : i + 1], targets[i : i + 1])
        (g_alone,) = torch.autograd.grad(alone, out)
        (g_per,) = torch.autograd.grad(per[i], out, retain_graph=True)
        if i == 1:
            assert torch.isnan(per[i]) and torch.isnan(alone)
        else:
            assert per[i] == alone
        assert torch.equal(g_per, g_alone)
