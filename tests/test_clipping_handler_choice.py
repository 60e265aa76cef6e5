"""Which layers keep their closed-form clipping handler and which fall back to torch.func: forward
hooks (on the module, global, added during the forward), legacy backward hooks, tensor hooks on a
parameter, a forward or another method replaced on the instance, and attributes changed around a
layer's call. In every case the norms and sums equal vmap's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim.clipping import clipped_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))


def _mlp():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(shape=(8, 10)):
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g) * 3, torch.randint(0, 3, (shape[0],), generator=g)


def _matches_vmap(model, x, y, clipping, clip_norm=0.5):
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=clip_norm, clipping="vmap")
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=clip_norm, clipping=clipping)
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(ref.norms.max()) > clip_norm  # examples are clipped: a wrong norm shows in the sums


# -- the engine: a Linear's forward replaced on the instance -----------------------------------
# The clipping-layer registry checks the instance as well as the layer's class (its forward, and
# the forward recorded at registration): with ``lin.forward = lambda h: F.linear(h, 2·W, b)`` the
# Linear handler's closed-form per-example gradients (for x·Wᵀ + b) would be half the true ones (bk:
# the sum 0.5× vmap's; ghost: norms 0.85× the true ones, so examples above ζ released unclipped). An
# instance forward has no handler (torch.func on the module alone).
@pytest.mark.parametrize("clipping", ["bk", "ghost", "auto"])
def test_a_forward_replaced_on_the_instance_is_not_taken_for_the_registered_layer(clipping):
    model, (x, y) = _model(), _batch()
    lin = model[2]
    lin.forward = lambda h: F.linear(h, 2 * lin.weight, lin.bias)
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping="vmap")
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping=clipping)
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(ref.norms.min()) > 0.5  # every example is clipped: a wrong norm shows in the sums


def test_the_registry_names_an_instance_forward():
    from dpmf.optim.clipping_layers import clipping_handler

    lin = nn.Linear(3, 2)
    assert clipping_handler(lin)[0] is not None
    lin.forward = lambda h: F.linear(h, lin.weight, lin.bias)
    handler, reason = clipping_handler(lin)
    assert handler is None and "replaced on the instance" in reason


# -- the engine: a forward hook that changes a registered layer's output -------------------------
# The engine records a layer's output gradient after every forward hook that ran before its own (the
# layer's hooks registered earlier, and global ones), while the handler's closed form is for the
# forward's own output (x·Wᵀ + b): with a user's hook returning 2·out the per-example gradients of
# that Linear would be half the true ones — norms 0.58–0.93× vmap's (a global hook on every Linear:
# 0.5×), examples above ζ released unclipped. A layer with a forward hook has no handler (torch.func
# on the module alone), and a hook added during the forward before the engine's, or a global one,
# sends the layer to the whole-model path.
class _HookedInForward(nn.Module):
    """Adds a doubling forward hook in front of its last layer's hooks during its own forward."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        handle = self.net[2].register_forward_hook(lambda m, i, o: 2 * o, prepend=True)
        try:
            return self.net[2](h)
        finally:
            handle.remove()


@pytest.mark.parametrize("where", ["module", "global", "in_forward"])
@pytest.mark.parametrize("clipping", ["bk", "ghost", "auto"])
def test_a_forward_hook_changing_a_layers_output_is_not_taken_for_the_layer(where, clipping):
    x, y = _batch()
    if where == "in_forward":
        _matches_vmap(_HookedInForward(), x, y, clipping)
        return
    model = _mlp()
    if where == "module":
        model[2].register_forward_hook(lambda m, i, o: 2 * o)
        _matches_vmap(model, x, y, clipping)
        return
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: 2 * o if isinstance(m, nn.Linear) else None
    )
    try:
        _matches_vmap(model, x, y, clipping)
    finally:
        handle.remove()


# A legacy backward hook (``register_backward_hook``, not full) sits on the node after the layer's
# output and may change the gradients flowing into the layer's backward — for a Linear, its
# weight's; doubling them would leave the handler's norms at 0.60–0.93× the true ones (a loop of
# per-example backward passes). Full backward hooks act on the recorded output gradient itself and
# stay consistent. A layer with a legacy backward hook has no handler.
@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_a_legacy_backward_hook_is_not_taken_for_the_layer(clipping):
    model, (x, y) = _mlp(), _batch()
    model[2].register_backward_hook(lambda m, gi, go: tuple(None if g is None else 2 * g for g in gi))
    loop = []
    for i in range(x.shape[0]):
        model.zero_grad()
        with pytest.warns(FutureWarning):
            F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        loop.append(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters())).item())
    with pytest.warns(FutureWarning):
        got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.5, clipping=clipping)
    torch.testing.assert_close(got.norms, torch.tensor(loop, dtype=torch.float64), rtol=1e-5, atol=0)


# clipping="ghost": a tensor hook on a trainable parameter (``W.register_hook(lambda g: 10 * g)``) is
# run by the second backward on the clipped sum, never by the norms (the first backward stops at the
# layer outputs; bk and vmap ignore it too): one example's clipped gradient would come out 4.02·ζ.
# Such a layer is summed from its kept state, as under bk.
def test_a_tensor_hook_on_a_parameter_does_not_scale_the_ghost_sum():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 3))
    model[2].weight.register_hook(lambda g: 10 * g)
    x, y = torch.randn(1, 10) * 3, torch.randint(0, 3, (1,))
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.01, clipping="vmap")
    got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.01, clipping="ghost")
    assert float(ref.norms) > 0.01  # clipped
    released = torch.sqrt(sum(g.double().square().sum() for g in got.grads))
    assert float(released) <= 0.01 * (1 + 1e-6)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


# -- the engine: a convolution's method or padding changed on the instance -----------------------
# Every method of the class shadowed on the instance removes the handler, not only ``forward``:
# Conv2d.forward calls ``self._conv_forward``, so ``conv._conv_forward = …`` (here with 2·W) would
# keep the conv handler (norms 0.87–0.91× vmap's). The conv handler pads as its forward does: a
# non-zeros padding mode pads by ``conv._reversed_padding_repeated_twice`` (an instance attribute;
# here asymmetric, same output size), not by ``conv.padding`` (norms 0.99–1.03× vmap's, the bk sum
# off by 0.2). And a parent forward that changes a layer's attribute around its call (here
# ``padding``, giving the same output size) would make the handler compute with the attribute
# restored afterwards: a registered layer whose instance attributes differ at its call from when the
# handler was chosen takes the whole-model path.
def _conv_model(conv, positions):
    torch.manual_seed(3)
    return nn.Sequential(conv, nn.Flatten(), nn.Linear(3 * positions, 3))


class _PaddingSwap(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)  # on 4×6 inputs: 4×6 outputs; with (2, 0): 6×4
        self.head = nn.Linear(3 * 24, 3)

    def forward(self, x):
        self.conv.padding = (2, 0)
        try:
            h = self.conv(x)
        finally:
            self.conv.padding = (1, 1)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("how", ["conv_forward", "reversed_padding", "padding_in_forward"])
@pytest.mark.parametrize("clipping", ["bk", "ghost", "auto"])
def test_a_convolution_changed_on_the_instance_keeps_the_vmap_norms(how, clipping):
    if how == "conv_forward":
        torch.manual_seed(3)
        conv = nn.Conv2d(2, 3, 3)
        model = _conv_model(conv, 16)
        conv._conv_forward = lambda x, w, b: F.conv2d(x, 2 * w, b, conv.stride, conv.padding)
        x, y = _batch((8, 2, 6, 6))
    elif how == "reversed_padding":
        torch.manual_seed(3)
        conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
        model = _conv_model(conv, 36)
        conv._reversed_padding_repeated_twice = [2, 0, 0, 2]  # the same total: the same output size
        x, y = _batch((8, 2, 6, 6))
    else:
        model = _PaddingSwap()
        x, y = _batch((8, 2, 4, 6))
    _matches_vmap(model, x, y, clipping)


# -- the engine: an embedding's padding_idx changed around its call --------------------------------
# clipping="ghost" (the second backward): the embedding handler masks the rows of
# ``module.padding_idx`` as it is after the forward; a forward that clears it around the call would
# have the true gradient (row 5 included) summed by the second backward with clip factors from the
# masked norms — an example above ζ. The norms equal vmap's under bk, ghost and auto.
class _PaddingIdxSwap(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(10, 4, padding_idx=5)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        self.emb.padding_idx = None
        try:
            h = self.emb(x)
        finally:
            self.emb.padding_idx = 5
        return self.head(h.sum(1))


def test_an_embedding_attribute_changed_around_its_call_keeps_each_example_within_zeta():
    model = _PaddingIdxSwap()
    x = torch.full((4, 3), 5)
    x[:, 0] = torch.arange(4)
    y = torch.zeros(4, dtype=torch.long)
    ref = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.01, clipping="vmap")
    for clipping in ["bk", "ghost", "auto"]:
        got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=0.01, clipping=clipping)
        torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-7)
