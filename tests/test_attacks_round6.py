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
    # the same words: only the layout changed
    assert torch.equal(spy.spy.detach().reshape(-1).view(torch.int32), words)


# -- bk/auto/ghost clipping: a per-example norm beyond float32's range --------------------------
# Weakness (bk, auto: new with the pending norms): a Linear layer whose float32 Gram norm
# overflowed had its squared norms recomputed in float64, but its clipped sum was still taken in
# float32, where the factor ζ/‖g_i‖ (≈ 2.2e-45 here) is a subnormal rounded to nearest — up to
# 2.8e-45: the example's clipped gradient had norm 1.27·ζ. (ghost: the same through the factors
# of its second backward, already before.) The layer is now widened to float64 with its norms,
# and factors cast to a lower precision are rounded towards 0.
def _huge_norm_case(norm):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    a = 1e22  # one example of two tokens: per-example gradient 2·k·a·1 (8×8), norm 16·k·a
    k = norm / (16 * a)
    return lin, (lambda out, y: (out * k).sum()), torch.full((1, 2, 8), a), torch.zeros(1)


@pytest.mark.parametrize("clipping", ["bk", "auto", "ghost"])
@pytest.mark.parametrize("norm", [4.545e44, 3e44])
def test_a_clipped_example_beyond_float32_range_stays_within_the_clip_norm(clipping, norm):
    from dpmf.optim.clipping import clipped_sum

    lin, loss, x, y = _huge_norm_case(norm)
    got = clipped_sum(lin, loss, x, y, clip_norm=1.0, clipping=clipping)
    assert got.norms.item() == pytest.approx(norm, rel=1e-6)
    (g,) = got.grads
    assert g.double().norm().item() <= 1.0 + 1e-6  # one example: its clipped gradient
    if clipping != "ghost":  # taken in float64: ζ itself, all entries equal
        assert g.double().norm().item() == pytest.approx(1.0, rel=1e-6)
        torch.testing.assert_close(g, torch.full_like(g, 1 / 8))


# -- bk/ghost clipping: cancellation in a float32 Gram ghost norm ---------------------------------
# Weakness (older than the pending norms; fixed): a Linear layer's ghost norm ‖Σ_t g_t a_tᵀ‖² was
# computed in float32 as Σ_{t,s} ⟨a_t, a_s⟩⟨g_t, g_s⟩. Two tokens with nearly equal activations
# (1e4 and 1e4+1) and opposite output gradients make the terms ~1e10 cancel to ~68: the float32 sum
# was 0, the example counted as unclipped, and its whole gradient was released (norm 4.5·ζ as
# float32 sums it; exactly 8.24·ζ). The Gram matrices are now taken in float64 and the rounding
# bound added (``ghost_layers._gram_sq``): the norm is never below the truth, and a little above.
@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_a_ghost_norm_that_cancels_in_float32_still_clips_the_example(clipping):
    from dpmf.optim.clipping import clipped_sum

    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    x = torch.zeros(1, 2, 8)
    x[0, 0, 0], x[0, 1, 0] = 1e4, 1e4 + 1  # two tokens, T(d+p) < dp: the ghost (Gram) norm
    gdir = torch.randn(8) * 3
    y = torch.zeros(1)

    def loss(out, y):
        return (out[:, 0] * gdir).sum() - (out[:, 1] * gdir).sum()  # g_1 = -g_2

    true = gdir.double().norm().item()  # the per-example gradient is -gdir·e₀ᵀ
    got = clipped_sum(lin, loss, x, y, clip_norm=1.0, clipping=clipping)
    assert true * (1 - 1e-9) <= got.norms.item() <= true * 1.01  # 8.27: the bound on rounding added
    assert got.grads[0].double().norm().item() <= 1.0 + 1e-6
