"""Per-example gradients and global ℓ2 clipping, against a loop over single examples."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim.clipping import (
    NonFiniteGradientError,
    check_per_example_safe,
    clip_factors,
    clipped_sum,
    per_example_gradients,
    trainable_parameters,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ChannelScale(nn.Module):
    """A per-channel scale stored as a (C, 1, 1) parameter (not a matrix)."""

    def __init__(self, c):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c).reshape(c, 1, 1))

    def forward(self, x):
        return x * self.scale


def small_cnn(frozen_first=False):
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        ChannelScale(4),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )
    if frozen_first:
        for p in m[0].parameters():
            p.requires_grad_(False)
    return m


def loop_gradients(model, x, y):
    """Independent reference: autograd on each example alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        out.append(torch.autograd.grad(loss, params))
    return [torch.stack([g[k] for g in out]) for k in range(len(params))]


def data(b=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 1, 8, 8, generator=g) * 3, torch.randint(0, 5, (b,), generator=g)


@pytest.mark.parametrize("frozen", [False, True])
def test_per_example_gradients_equal_a_loop_over_single_examples(frozen):
    model = small_cnn(frozen)
    x, y = data()
    got = per_example_gradients(model, F.cross_entropy, x, y)
    ref = loop_gradients(model, x, y)
    assert len(got) == len(ref) == len(trainable_parameters(model))
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("micro", [None, 1, 4])
def test_clipped_sum_equals_clip_then_sum_of_the_loop(micro):
    model = small_cnn(frozen_first=True)
    x, y = data(b=10)
    ref = loop_gradients(model, x, y)
    norms = torch.sqrt(sum((g.reshape(10, -1) ** 2).sum(1) for g in ref))
    zeta = float(norms.sort().values[4:6].mean())  # half the examples are clipped
    assert (norms > zeta).any() and (norms < zeta).any()
    factors = torch.minimum(torch.ones(10), zeta / norms)
    expected = [(g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) for g in ref]
    out = clipped_sum(model, F.cross_entropy, x, y, clip_norm=zeta, micro_batch_size=micro)
    assert out.batch_size == 10
    torch.testing.assert_close(out.norms.float(), norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(out.grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # frozen parameters: no gradient, and not part of the norm
    assert len(out.grads) == len(list(model.parameters())) - 2
    assert out.clipped_fraction == pytest.approx(float((norms > zeta).float().mean()))


def test_each_clipped_gradient_has_norm_at_most_the_clip_norm():
    model = small_cnn()
    x, y = data(b=6)
    zeta = 1e-3  # every example is clipped
    per = per_example_gradients(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum((g.reshape(6, -1).double() ** 2).sum(1) for g in per))
    f = clip_factors(norms, zeta)
    clipped = torch.sqrt(sum(((g.reshape(6, -1).double() * f[:, None]) ** 2).sum(1) for g in per))
    assert torch.all(clipped <= zeta * (1 + 1e-12))
    torch.testing.assert_close(clipped, torch.full_like(clipped, zeta))
    # a gradient inside the ball is left untouched, a zero gradient too
    assert clip_factors(torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64), 1.0).tolist() == [1.0, 1.0, 0.5]


def test_empty_batch_gives_a_zero_sum():
    model = small_cnn()
    out = clipped_sum(
        model, F.cross_entropy, torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long), clip_norm=1.0
    )
    assert out.batch_size == 0 and out.norms.numel() == 0 and out.clipped_fraction == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in out.grads)


@pytest.mark.parametrize(
    "layer,label",
    [
        (nn.BatchNorm2d(4), "BatchNorm2d"),
        (nn.SyncBatchNorm(4), "SyncBatchNorm"),
        (nn.InstanceNorm2d(4, track_running_stats=True), "InstanceNorm2d"),
    ],
)
def test_batch_coupled_model_is_refused_naming_module_and_fix(layer, label):
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Sequential(nn.ReLU(), layer), nn.Flatten())
    with pytest.raises(ValueError, match=rf"1\.1 \({label}.*GroupNorm"):
        check_per_example_safe(model)
    x, y = data(b=2)
    with pytest.raises(ValueError, match="GroupNorm"):
        clipped_sum(model, F.cross_entropy, x, y, clip_norm=1.0)


def test_group_norm_and_layer_norm_models_are_accepted():
    check_per_example_safe(nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.LayerNorm([4, 6, 6])))
    check_per_example_safe(nn.InstanceNorm2d(4))  # no running stats: per-example


@pytest.mark.parametrize("clipping", ["vmap", "ghost", "bk", "auto"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_names_its_step_but_never_the_examples(bad, clipping):
    model = small_cnn()
    x, y = data(b=5)
    x[3, 0, 2, 2] = bad
    ids = torch.tensor([10, 11, 12, 7013, 14])
    with pytest.raises(NonFiniteGradientError, match=r"step 7\b.*parameters \[0\.weight") as info:
        clipped_sum(
            model,
            F.cross_entropy,
            x,
            y,
            clip_norm=1.0,
            micro_batch_size=2,
            step=7,
            example_ids=ids,
            clipping=clipping,
        )
    # batch membership is secret: neither the dataset index nor the position is printed
    message = str(info.value)
    assert "7013" not in message and "[3]" not in message
    assert info.value.example_ids == [7013] and info.value.positions == [3] and info.value.step == 7


def test_finite_huge_gradient_does_not_overflow_the_norm():
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x = torch.full((2, 4), 1e30)  # per-example gradient entries ~1e30: squares overflow float32

    def loss(out, y):
        return out.sum()

    out = clipped_sum(lin, loss, x, torch.zeros(2), clip_norm=1.0)
    assert torch.isfinite(out.norms).all() and out.norms[0] == pytest.approx(2e30)
    torch.testing.assert_close(out.grads[0], torch.full((1, 4), 1.0))  # 2 × (unit vector/2)·… = 1


def test_bad_clip_norm_and_micro_batch_are_refused():
    model = small_cnn()
    x, y = data(b=2)
    with pytest.raises(ValueError, match="clip_norm"):
        clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        clipped_sum(model, F.cross_entropy, x, y, clip_norm=1.0, micro_batch_size=0)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        clipped_sum(
            frozen, F.cross_entropy, torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), clip_norm=1.0
        )


# -- vmap clipping: one layer reachable by two paths ----------------------------------------------
# torch.func.functional_call (torch 2.13) does not put back the parameters of a submodule reachable
# by two paths (nn.Sequential(layer, act, layer)): after clipping="vmap" the layer would hold a stale
# plain tensor instead of its Parameter (the optimizer's parameter no longer in the model), and a
# later "bk"/"ghost" clipping of the model would find no parameter in use and return zero norms and
# sums. dpmf's functional_call restores every submodule's own tensors.
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
