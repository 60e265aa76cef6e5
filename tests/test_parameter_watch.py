"""The engine's watch on trainable parameters (``dpmf.optim.ghost``): a use outside the owning
module's forward sends the layer to torch.func; uses inside it pass through no Python."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim import ghost
from dpmf.optim.clipping import clipped_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ReusesInnerWeight(nn.Module):
    """A generic module (its own parameter ``scale``) whose forward calls a Linear, then reads the
    Linear's weight itself: a use of ``inner.weight`` outside ``inner``'s forward."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inner(x)) * self.scale
        h = F.linear(h, self.inner.weight)  # the same weight, a second time, outside inner
        return self.head(h)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 5, generator=g) * 2, torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_a_weight_reused_outside_its_layer_gives_the_true_norms(clipping):
    torch.manual_seed(0)
    model, (x, y) = ReusesInnerWeight(), _batch()
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="vmap")
    with pytest.warns(UserWarning, match="inner: a trainable parameter is used outside"):
        got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping=clipping)
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # restored after the forward


def test_uses_inside_the_owning_forward_pass_through_no_python(monkeypatch):
    seen = []
    check = ghost._check_use
    monkeypatch.setattr(ghost, "_check_use", lambda e, f, a, k: (seen.append(f), check(e, f, a, k))[1])
    torch.manual_seed(0)
    model, (x, y) = Plain(), _batch()
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="vmap")
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-6)
    assert seen == []  # both Linear layers read their weights only inside their own forward
    seen.clear()
    torch.manual_seed(0)
    reuse = ReusesInnerWeight()
    with pytest.warns(UserWarning):
        clipped_sum(reuse, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    assert F.linear in seen  # the outside use of inner.weight was watched
