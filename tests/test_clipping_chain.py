"""Book-keeping clipping of a plain chain of Linear layers and activations without the ghost
engine's hooks (``dpmf.optim.ghost_chain``): bit for bit the engine's sums and norms, checked
against explicit per-example gradients, and the general engine for every model that is not such
a chain."""

import pytest
import torch
import torch.nn.functional as F
from recorded import assert_recorded, distance, fingerprint
from torch import nn

from dpmf.optim import ghost, ghost_chain
from dpmf.optim.clipping import clipped_sum
from dpmf.train.models import MLP

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(b=12, d=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 1, 1, d, generator=g) * 3, torch.randint(0, classes, (b,), generator=g)


def _model(kind):
    torch.manual_seed(5)
    if kind == "mlp":
        return MLP((1, 1, 10), 3, hidden=(16, 8))
    if kind == "relu-nobias":
        return nn.Sequential(nn.Flatten(), nn.Linear(10, 7, bias=False), nn.ReLU(), nn.Linear(7, 3))
    layers = [nn.Flatten(), nn.Linear(10, 6), nn.GELU(), nn.Identity(), nn.Linear(6, 3), nn.Sigmoid()]
    return nn.Sequential(*layers)


def _count_chain(monkeypatch):
    calls = []
    real = ghost_chain.chain_output_gradients

    def spy(*a, **k):
        got = real(*a, **k)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(ghost, "chain_output_gradients", spy)
    return calls


def _explicit(model, x, y, clip):
    """Σ_i clip(g_i) from one backward per example (float64 sums of the float32 gradients)."""
    total = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = [p.grad.double() for p in model.parameters()]
        c = min(1.0, clip / float(torch.sqrt(sum((t**2).sum() for t in g))))
        total = [s + c * t for s, t in zip(total, g, strict=True)]
    return total


@pytest.mark.parametrize("kind", ["mlp", "relu-nobias", "gelu-sigmoid"])
def test_a_chain_gives_the_engines_sums_and_norms_bit_for_bit(monkeypatch, kind):
    model = _model(kind)
    x, y = _batch()
    calls = _count_chain(monkeypatch)
    fast = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.7, clipping="bk")
    assert calls == [True]
    model.register_forward_hook(lambda *a: None)  # a hook: the engine's path
    slow = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.7, clipping="bk")
    assert calls == [True]  # not asked again
    assert torch.equal(fast.norms, slow.norms)
    for a, b in zip(fast.grads, slow.grads, strict=True):
        assert torch.equal(a, b)
    for s, e in zip(fast.grads, _explicit(model, x, y, 0.7), strict=True):
        torch.testing.assert_close(s.double(), e, rtol=1e-5, atol=1e-6)


def test_the_auto_mode_takes_the_chain_for_dpmfs_mlp(monkeypatch):
    model = _model("mlp")
    x, y = _batch()
    calls = _count_chain(monkeypatch)
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="auto")
    assert got.method == "bk" and calls == [True]


class _DoubledInput(nn.Sequential):
    """A Sequential whose call doubles its input before the children run."""

    def __call__(self, x):
        return super().__call__(2 * x)


def _not_a_chain():
    torch.manual_seed(0)
    replaced = nn.Sequential(nn.Flatten(), nn.Linear(10, 4), nn.Tanh(), nn.Linear(4, 3))
    replaced[2].forward = lambda x: 2 * x  # a forward replaced on the instance
    hooked_child = nn.Sequential(nn.Flatten(), nn.Linear(10, 4), nn.Tanh(), nn.Linear(4, 3))
    hooked_child[2].register_forward_hook(lambda m, a, out: out * 2)  # a hook changes the output
    shared = nn.Linear(10, 10)
    return {
        "a hook on a child": hooked_child,
        "a shared layer": nn.Sequential(nn.Flatten(), shared, nn.Tanh(), shared, nn.Linear(10, 3)),
        "an in-place activation": nn.Sequential(
            nn.Flatten(), nn.Linear(10, 4), nn.ReLU(inplace=True), nn.Linear(4, 3)
        ),
        "a layer with its own state": nn.Sequential(
            nn.Flatten(), nn.Linear(10, 4), nn.Dropout(0.5), nn.Linear(4, 3)
        ),
        "a Flatten over the batch": nn.Sequential(nn.Flatten(0), nn.Linear(120, 3)),
        "a call of its own": _DoubledInput(nn.Flatten(), nn.Linear(10, 4), nn.Tanh(), nn.Linear(4, 3)),
        "a forward replaced on an instance": replaced,
        "a frozen layer": nn.Sequential(
            nn.Flatten(), nn.Linear(10, 4).requires_grad_(False), nn.Tanh(), nn.Linear(4, 3)
        ),
    }


@pytest.mark.parametrize("name", list(_not_a_chain()))
def test_models_that_are_not_plain_chains_take_the_engine(monkeypatch, name):
    model = _not_a_chain()[name]
    x, y = _batch()
    calls = _count_chain(monkeypatch)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert ghost_chain.chain_layers(model, names, dict(model.named_parameters())) is None
    if name == "a Flatten over the batch":
        return  # the engine refuses its layout (every example in one row)
    clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    assert calls == []


def test_a_linear_on_more_than_two_dims_is_refused_at_run_time_and_clipped_by_the_engine(monkeypatch):
    # no Flatten: the first Linear sees (b, 1, 1, d); the chain declines after its forward
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4, 3))
    x, y = _batch()
    calls = _count_chain(monkeypatch)
    fast = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    assert calls == [False]
    for s, e in zip(fast.grads, _explicit(model, x, y, 0.5), strict=True):
        torch.testing.assert_close(s.double(), e, rtol=1e-5, atol=1e-6)


def test_a_non_finite_gradient_is_still_refused(monkeypatch):
    from dpmf.optim.clipping import NonFiniteGradientError

    model = _model("mlp")
    x, y = _batch()
    x[3, 0, 0, 2] = float("nan")
    calls = _count_chain(monkeypatch)
    with pytest.raises(NonFiniteGradientError, match="non-finite per-example gradient"):
        clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="bk")
    assert calls == [True]


# -- a record-mode run, recorded -------------------------------------------------------------

# The final global model and ledger of FLConfig(privacy="record", num_clients=6, rounds=3,
# local_steps=3, local_batch_size=8, seed=7). The ledger was recorded on the code before the chain
# path and before this process trained its participants ahead of the grid's requests (both
# changes kept every bit of the model); the model since, as the fingerprint of its final weights
# (tests/recorded.py, in the order of their names), with torch 2.13 on CPU (AVX2 kernels). Its
# spread between the AVX2 and the scalar kernels (ATEN_CPU_CAPABILITY=default), at one and two
# threads, is 4.2e-8; σ × 1.1 moves it by 6.8e-3, one local step fewer a round by 0.16, seed 8 by
# 0.91: the tolerance is 48× the spread.
RECORDED_MODEL = [3.6281839425607454, -1.6906998752383515, -0.29882740702314275, -0.11849836820400553,
                  0.13264794845824085, 0.1415409248984089]  # fmt: skip
MODEL_TOLERANCE = 2e-6
# Each client's ε, from PLD convolutions in float64: rounded differently by other CPUs' kernels
# (1.2e-11 relative from those recorded, on an AVX2 CPU; the same under ATEN_CPU_CAPABILITY=default
# and at two threads); another σ, sampling rate or step count moves ε by far more than 1e-9.
RECORDED_EPSILONS = [4.161990548514188, 4.001550486698737, 2.2139941067422857, 1.8483915713703802,
                     2.3480023812965913, 1.609489646431317]  # fmt: skip
RECORD_RUN = dict(privacy="record", num_clients=6, rounds=3, local_steps=3, local_batch_size=8, seed=7)


def _record_run(monkeypatch, **change):
    pytest.importorskip("flwr")
    from test_federated_record_speed import _final_model

    from dpmf.federated.run import FLConfig

    weights, result = _final_model(monkeypatch, FLConfig(**{**RECORD_RUN, **change}))
    return fingerprint({k: weights[k] for k in sorted(weights)}), result


@pytest.mark.recorded
def test_a_record_run_keeps_its_recorded_model_and_epsilons(monkeypatch):
    calls = _count_chain(monkeypatch)
    got, result = _record_run(monkeypatch)
    assert [e.epsilon for e in result.ledger] == pytest.approx(RECORDED_EPSILONS, rel=1e-9, abs=0)
    assert calls and all(calls)  # this process's participants took the chain path
    assert_recorded(got, RECORDED_MODEL, MODEL_TOLERANCE)


def test_a_record_run_of_another_seed_is_outside_the_recorded_tolerance(monkeypatch):
    got, _ = _record_run(monkeypatch, seed=8)
    assert distance(got, RECORDED_MODEL) > 1000 * MODEL_TOLERANCE
