"""Batch independence is probed on the first batch: models whose examples influence each other
through plain tensor ops or a layer built for another layout are refused by name before any
release; correct models (dropout included) pass, and the probe leaves the trajectory unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpmf
from dpmf.optim.batch_probe import BatchCouplingError

pytestmark = pytest.mark.torch

N, B = 64, 32


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, 10, generator=g), torch.randint(0, 3, (N,), generator=g))


class Centre(nn.Module):
    """Feature centring over the batch: every example moves the others' activations."""

    def forward(self, x):
        return x - x.mean(0)


class HandBatchNorm(nn.Module):
    """A batch norm written by hand (no BatchNorm class to refuse)."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.gain * (x - x.mean(0)) / (x.std(0) + 1e-5)


class Encoder(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.embed = nn.Linear(2, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, 5 tokens, 2) whatever the layer's layout
        return self.head(self.layer(self.embed(x.view(x.shape[0], 5, 2))).mean(1))


def _private(model, clipping="auto", seed=1):
    torch.manual_seed(0)
    return dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _data(),
        loss_fn=F.cross_entropy,
        batch_size=B,
        epochs=1,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="poisson",
        clipping=clipping,
        seed=seed,
    )


def _train(private):
    for x, y in private.data_loader:
        private.backward(x, target=y, return_loss=False)
        private.optimizer.step()
        private.optimizer.zero_grad()


def _sensitivity_of_one_example(model, x, y):
    """‖Σ_i clip(g_i)(batch with x_0) − Σ_i clip(g_i)(batch without it)‖ / ζ, per-example
    gradients taken by torch.autograd on the model as it evaluates the batch (the truth a
    coupled model breaks)."""

    def clipped_sum(xb, yb):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for i in range(len(xb)):
            model.zero_grad()
            out = model(xb)
            F.cross_entropy(out[i : i + 1], yb[i : i + 1]).backward()
            g = [p.grad.clone() for p in model.parameters()]
            n = torch.sqrt(sum((t**2).sum() for t in g))
            for t, s in zip(g, total, strict=True):
                s += t * min(1.0, 1.0 / float(n))
        return total

    a, b = clipped_sum(x, y), clipped_sum(x[1:], y[1:])
    return float(torch.sqrt(sum(((u - v) ** 2).sum() for u, v in zip(a, b, strict=True))))


def test_the_centring_module_has_a_sensitivity_far_above_the_clip_norm():
    # why the probe exists: the independent per-example truth says one example moves the sum by ≫ ζ
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), Centre(), nn.Tanh(), nn.Linear(8, 3))
    x, y = _data().tensors
    x = x.clone()
    x[0] *= 30  # an outlier: removing it moves every other example's clipped gradient
    assert _sensitivity_of_one_example(model, x[:B], y[:B]) > 1.5  # ζ = 1


@pytest.mark.parametrize("clipping", ["auto", "ghost", "bk", "vmap"])
def test_a_centring_module_is_refused_by_name_before_the_first_release(clipping):
    model = nn.Sequential(nn.Linear(10, 8), Centre(), nn.ReLU(), nn.Linear(8, 3))
    private = _private(model, clipping)
    w0 = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(private.data_loader))
    with pytest.raises(
        BatchCouplingError, match=r"module '1' \(Centre\).*compute it from each example alone"
    ):
        private.backward(x, target=y)
    assert private.steps_taken == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(w0, model.parameters(), strict=True))


@pytest.mark.parametrize("clipping", ["auto", "ghost", "vmap"])
def test_an_encoder_without_batch_first_is_refused_with_the_fix(clipping):
    private = _private(Encoder(batch_first=False), clipping)
    x, y = next(iter(private.data_loader))
    with pytest.raises(
        BatchCouplingError, match=r"'layer.self_attn' \(MultiheadAttention\).*batch_first=True"
    ):
        private.backward(x, target=y)


def test_a_hand_written_batch_norm_is_refused():
    private = _private(nn.Sequential(nn.Linear(10, 8), HandBatchNorm(8), nn.Linear(8, 3)))
    x, y = next(iter(private.data_loader))
    with pytest.raises(BatchCouplingError, match=r"module '1' \(HandBatchNorm\)"):
        private.backward(x, target=y)


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Sequential(nn.Linear(10, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3)),
        lambda: Encoder(batch_first=True),
        lambda: nn.Sequential(nn.Linear(10, 8), nn.LayerNorm(8), nn.Linear(8, 3)),
        lambda: nn.Sequential(nn.Unflatten(1, (2, 5)), nn.GroupNorm(1, 2), nn.Flatten(), nn.Linear(10, 3)),
    ],
    ids=["dropout", "batch-first-encoder", "layernorm", "groupnorm"],
)
def test_models_that_treat_examples_alone_pass_and_train(build):
    private = _private(build())
    _train(private)
    assert private.steps_taken == private.plan.steps


def test_the_probe_leaves_the_trajectory_of_a_dropout_model_unchanged():
    # the probe runs under forked random generators: the same weights as two steps without it
    def run(probe):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(10, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
        private = _private(model)
        private.privatizer._probed = not probe  # True: as if probed already
        _train(private)
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(True), run(False)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_a_model_coupling_examples_only_in_backward_is_refused_by_its_norms():
    class MixGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g + g.mean(0, keepdim=True)  # one example's output gradient reaches all rows

    class Mix(nn.Module):
        def forward(self, x):
            return MixGrad.apply(x)

    private = _private(nn.Sequential(nn.Linear(10, 8), Mix(), nn.Tanh(), nn.Linear(8, 3)), clipping="bk")
    x, y = next(iter(private.data_loader))
    with pytest.raises(BatchCouplingError, match="per-example gradient norm changes"):
        private.backward(x, target=y)
