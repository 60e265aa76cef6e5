"""The one-walk model guard: ``ModelWalk`` lists exactly what ``named_modules``/``named_parameters``
/``named_buffers`` list; nothing of a walk outlives its step (a parameter, buffer or submodule
added or replaced after earlier steps, directly in the module's dicts or by the forward, is
caught at the next step); a forward that starts writing the model late is caught; the re-keyed
raw-noise generator gives exactly the numbers of a fresh ``raw_generator``; the batch check's
reordered leaf search accepts and refuses what the plain search does."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpmf
from dpmf.optim.batches import _matches, _received, batch_fingerprints
from dpmf.optim.model_guard import (
    ModelChangedError,
    ModelStateChangedError,
    ModelStructure,
    ModelWalk,
    check_state_unchanged,
    state_versions,
)
from dpmf.optim.noise import ChunkedKeys, ToeplitzInverseNoise, raw_generator

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

N, D, K = 64, 5, 3


def _names(pairs):
    return [(n, id(t)) for n, t in pairs]


class _OwnWalk(nn.Module):
    """A container that lists only its first child as a submodule (overrides named_modules)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        yield from self.a.named_modules(memo, prefix + ("." if prefix else "") + "a", remove_duplicate)


def _tangled():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Sequential(shared, shared), shared)
    model.add_module("gap", None)
    model[0].register_parameter("unused", None)
    model[0].register_buffer("nothing", None)
    model.add_module("own", _OwnWalk())
    return model


def test_the_walk_lists_what_named_modules_parameters_and_buffers_list():
    model = _tangled()
    walk = ModelWalk(model)
    assert _names(walk.modules) == _names(model.named_modules(remove_duplicate=False))
    assert _names(walk.unique_modules) == _names(model.named_modules())
    assert _names(walk.params) == _names(model.named_parameters(remove_duplicate=False))
    assert _names(walk.unique_params) == _names(model.named_parameters())
    assert _names(walk.buffers) == _names(model.named_buffers(remove_duplicate=False))
    assert "own.b.weight" not in dict(walk.params)  # the override hides b, as named_parameters does
    assert len(walk.params) > len(walk.unique_params)  # the shared layer is listed under each path
    model[0].weight.requires_grad_(False)
    assert [n for n, _ in walk.trainable()] == [n for n, p in model.named_parameters() if p.requires_grad]


def _private(model, **kw):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)
    args = dict(
        loss_fn=F.cross_entropy,
        batch_size=16,
        epochs=3,
        noise_multiplier=1.0,
        factorization="identity",
        scheme="fixed_order",
        seed=3,
    )
    args.update(kw)
    return dpmf.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y), **args)


def _step(private, batches):
    xb, yb = next(batches)
    private.backward(xb, target=yb, return_loss=False)
    private.optimizer.step()
    private.optimizer.zero_grad()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


def test_changes_made_after_some_steps_bypassing_setattr_are_caught():
    model = _mlp()
    private = _private(model)
    batches = iter(private.data_loader)
    _step(private, batches)
    _step(private, batches)
    xb, yb = next(batches)
    old = model[2]._parameters["weight"]
    model[2]._parameters["weight"] = nn.Parameter(old.detach().clone())  # no __setattr__
    with pytest.raises(ModelChangedError, match=r"parameter '2.weight' was replaced by another tensor"):
        private.backward(xb, target=yb)
    model[2]._parameters["weight"] = old
    model[1]._modules["extra"] = nn.Linear(2, 2)  # a submodule slipped into the dict
    with pytest.raises(ModelChangedError, match=r"parameter '1.extra.weight' was added"):
        private.backward(xb, target=yb)
    del model[1]._modules["extra"]
    model[0].weight.data = torch.zeros(8, D + 1)  # same tensor object, other shape
    with pytest.raises(ModelChangedError, match=r"'0.weight' was replaced \(shape \(8, 5\) → \(8, 6\)\)"):
        private.backward(xb, target=yb)


class _LateWriter(nn.Module):
    """Once ``armed``, writes the batch into a buffer through ``.data`` (no version bump), or
    replaces its buffer or a parameter, in the forward."""

    def __init__(self, how):
        super().__init__()
        self.inner = _mlp()
        self.register_buffer("seen", torch.zeros(D))
        self.how, self.armed = how, False

    def forward(self, x):
        if self.armed:
            if self.how == "buffer .data":
                self.seen.data.copy_(x.detach().mean(0))
            elif self.how == "new buffer":
                self._buffers["seen"] = x.detach().mean(0)
            elif self.how == "new parameter":
                lin = self.inner[2]
                lin._parameters["bias"] = nn.Parameter(lin.bias.detach() + x.detach().mean())
        return self.inner(x)


@pytest.mark.parametrize(
    "how, clipping",
    # (under vmap the forward runs in functional_call, which puts the module's own tensors back
    # afterwards: a replaced buffer or parameter never reaches the model there)
    [("buffer .data", "auto"), ("buffer .data", "vmap"), ("new buffer", "auto"), ("new parameter", "auto")],
)
def test_a_forward_that_starts_writing_after_some_steps_is_caught(how, clipping):
    model = _LateWriter(how)
    private = _private(model, clipping=clipping)
    batches = iter(private.data_loader)
    _step(private, batches)
    _step(private, batches)
    xb, yb = next(batches)
    model.armed = True
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(ModelStateChangedError, match="private step refused at step 2"):
        private.backward(xb, target=yb, return_loss=False)
    assert private.steps_taken == 2 and grads == [p.grad for p in model.parameters()]


def test_the_structure_check_reads_a_given_walk_only():
    model = _mlp()
    structure = ModelStructure(model)
    walk = ModelWalk(model)
    model.add_module("late", nn.Linear(2, 2))
    structure.check("step", walk)  # the walk was taken before the change
    with pytest.raises(ModelChangedError, match="parameter 'late.weight' was added"):
        structure.check("step")
    before = state_versions(model, ModelWalk(model))
    with torch.no_grad():
        model.late.weight.mul_(2.0)  # an in-place write: the version counter moves
    with pytest.raises(ModelStateChangedError, match="'late.weight'"):
        check_state_unchanged(model, before, "the forward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunked", [False, True])
def test_re_keyed_raw_noise_equals_fresh_generators(dtype, chunked):
    sizes = (3, 70_000, 1, 5)  # odd lengths: float32 draws leave a half-used 64-bit word
    keys = ChunkedKeys(sizes, chunk=65_536) if chunked else None
    key = 2**200 + 11
    noise = ToeplitzInverseNoise([1.0], sum(sizes), seed=key, steps=4, dtype=dtype, keys=keys)
    noise.use_generator("numpy-philox")  # the generator of earlier versions, numpy's own numbers
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    for step in (0, 3, 1):
        ref = np.empty(sum(sizes), dtype=np_dtype)
        if keys is None:
            raw_generator(key, step).standard_normal(out=ref, dtype=np_dtype)
        else:
            for j, (start, stop) in keys.offsets().items():
                for c, a in enumerate(range(start, stop, keys.chunk)):
                    out = ref[a : min(a + keys.chunk, stop)]
                    raw_generator(key, step, j, c).standard_normal(out=out, dtype=np_dtype)
        np.testing.assert_array_equal(noise.raw_noise(step).numpy(), ref)


def test_the_batch_check_matches_leaves_in_any_order_and_refuses_altered_values():
    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(0, 50, (8, 6), generator=g),
        "mask": torch.randint(0, 2, (8, 6), generator=g),
        "labels": torch.randint(0, 50, (8, 6), generator=g),
    }
    leaves = batch_fingerprints(batch)
    order = [batch["labels"], batch["input_ids"], batch["mask"]]
    assert _matches(_received(order, 8), leaves)
    assert _matches(_received(list(batch.values()), 8), leaves)
    altered = batch["mask"].clone()
    altered[3, 2] = 1 - altered[3, 2]
    assert not _matches(_received([batch["input_ids"], altered, batch["labels"]], 8), leaves)
    floats = torch.randn(8, 4, generator=g)
    floats[2, 1] = float("nan")
    assert _matches(_received([floats], 8), batch_fingerprints(floats))  # NaN matches NaN
