"""Hostile-user reproducers (round 7): each test names a weakness found in the current code.

Every test asserts what the code should do; a weakness not fixed is marked ``xfail(strict=True)``.
"""

import pytest
import torch
import torch.nn.functional as F
from test_attacks_round5 import _batch, _model
from torch import nn

from dpmf.optim.clipping import clipped_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the engine: a Linear's forward replaced on the instance -----------------------------------
# Weakness: the clipping-layer registry checked the layer's class (its forward, and the forward
# recorded at registration) but not the instance, so ``lin.forward = lambda h: F.linear(h, 2·W, b)``
# kept the Linear handler: its closed-form per-example gradients (for x·Wᵀ + b) were half the
# true ones (bk: the sum 0.5× vmap's; ghost: norms 0.85× the true ones, so examples above ζ were
# released unclipped). An instance forward now has no handler (torch.func on the module alone).
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
    from dpmf.optim.ghost_layers import clipping_handler

    lin = nn.Linear(3, 2)
    assert clipping_handler(lin)[0] is not None
    lin.forward = lambda h: F.linear(h, lin.weight, lin.bias)
    handler, reason = clipping_handler(lin)
    assert handler is None and "replaced on the instance" in reason
