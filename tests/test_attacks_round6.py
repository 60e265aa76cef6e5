"""Hostile-user reproducers (round 6): each test names a weakness found in the current code, or
pins a defence that held up with a value a wrong implementation would miss.

Every test asserts what the code should do; a weakness not fixed is marked ``xfail(strict=True)``.
"""

import pytest
import torch
from test_attacks_round5 import _small_private_run
from torch import nn

from dpmf.optim.model_guard import ModelStateChangedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the model-state check: a frozen parameter re-laid out through ``.data`` ----------------------
# Weakness: the after-forward check compared each tensor's (version, address) and a checksum of
# its words. ``p.data = p.data.view(...)`` (another shape, or another dtype of the same width)
# keeps the version, the address, the size in bytes and every word — the kept word view was
# reused and gave the same sum — yet changes what the model computes with from then on: a forward
# that picks the layout from the batch keeps a function of the batch in the model without noise.
# The snapshot now marks each tensor's shape, strides and dtype as well.
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
    assert torch.equal(spy.spy.detach().reshape(-1).view(torch.int32), words)  # same words: only the layout changed
