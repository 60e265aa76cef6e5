"""Clipping numerics: every example's clipped gradient stays within ζ and no per-example norm falls
below the truth under float32 cancellation (Gram, embedding, tied weights), norms beyond float32's
range, subnormal products, bf16 autocast (ghost sums, RMSNorm's ε) and long float32 rows."""

import pytest
import torch
import torch.nn.functional as F
from gpt2_helpers import DictData, gpt2
from torch import nn

from dpmf.optim.clipping import clipped_sum
from dpmf.train.hf import causal_lm_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- clipping: ghost mode under bf16 autocast stays within ζ ------------------------------------------
# clipped_sum's docstring says "the clipping bound is exact for the vectors whose norms are taken, so
# the sensitivity is ζ whatever the precision"; this must hold for clipping="ghost" under bf16
# autocast too: a sum taken by a second backward whose bf16 rounding differs from the vectors whose
# norms were taken gave one example's clipped gradient a norm ≈ 1.001·ζ (bk: 1 + 6e-8).
@pytest.mark.torch
def test_ghost_clipping_under_bf16_autocast_keeps_each_example_within_zeta():
    model, loss, zeta = gpt2(), causal_lm_loss(), 1e-3
    data = DictData(8)
    worst = 0.0
    for i in range(6):
        x, y = loss.split(
            {k: v.unsqueeze(0) for k, v in data[i].items()}
        )  # one example: sum = its clipped grad
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="ghost")
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in out.grads)))
        worst = max(worst, norm / zeta)
    assert worst <= 1 + 1e-5  # float32 rounding of the sum, not bf16's


# -- bk/auto/ghost clipping: a per-example norm beyond float32's range --------------------------
# A Linear layer whose float32 Gram norm overflows has its squared norms recomputed in float64, and
# its clipped sum is taken in float64 too: in float32 the factor ζ/‖g_i‖ (≈ 2.2e-45 here) is a
# subnormal rounded to nearest — up to 2.8e-45 — which gave the example's clipped gradient a norm of
# 1.27·ζ (bk, auto; ghost: the same through the factors of its second backward). The layer is widened
# to float64 with its norms, and factors cast to a lower precision are rounded towards 0.
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
# A Linear layer's ghost norm ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} ⟨a_t, a_s⟩⟨g_t, g_s⟩ stays at or above the
# truth under cancellation: two tokens with nearly equal activations (1e4 and 1e4+1) and opposite
# output gradients make the terms ~1e10 cancel to ~68; summed in float32 that is 0, the example
# counted as unclipped and its whole gradient released (norm 4.5·ζ as float32 sums it; exactly
# 8.24·ζ). The Gram matrices are taken in float64 and the rounding bound added
# (``clipping_layers.norms._gram_sq``): the norm is never below the truth, and a little above.
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


# -- bk/ghost clipping: cancellation in an embedding's ghost norm -----------------------------------
# The Linear Gram cancellation above, in the embedding handler: the ghost norm
# Σ_{t,u}[x_t = x_u]⟨G_t, G_u⟩ summed in float32, with two equal tokens of output gradients
# 10⁴·v + w and −10⁴·v (terms ~10⁹) that cancel to ‖w‖² ≈ 70, is 0: the example counted as
# unclipped, its whole gradient released (8.35·ζ; other seeds: NaN, or 1.28·ζ). Beyond 16 tokens the
# sparse rows summed in float32 lose it as well. Both are taken in float64, with a bound on the
# rounding added (as ``_gram_sq``).
@pytest.mark.parametrize("tokens", [2, 20])  # the ghost form; the sparse rows
@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_an_embedding_norm_that_cancels_in_float32_still_clips_the_example(tokens, clipping):
    emb = nn.Embedding(10, 8)
    x = torch.zeros(1, tokens, dtype=torch.long)
    x[0, :2] = 3  # two equal tokens; any others are token 0 with a zero gradient
    bad = []
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        v, w = torch.randn(8, generator=g), torch.randn(8, generator=g) * 3
        big = 1e4 if tokens <= 16 else 1e6
        k = torch.zeros(tokens, 8)
        k[0], k[1] = big * v + w, -big * v

        def loss(out, y, k=k):
            return (out[0] * k).sum()

        true = (k[0].double() + k[1].double()).norm().item()
        got = clipped_sum(emb, loss, x, torch.zeros(1), clip_norm=1.0, clipping=clipping)
        released = got.grads[0].double().norm().item()
        if not (got.norms.item() >= true * (1 - 1e-6) and released <= 1.0 + 1e-6):
            bad.append((seed, true, got.norms.item(), released))
    assert not bad


# -- bk/ghost clipping: cancellation between the two uses of a tied embedding ----------------------
# A weight tied between an embedding and a linear output layer has ‖S_i + L_i‖² =
# ‖S_i‖² + ‖L_i‖² + 2⟨S_i, L_i⟩; with the cross term in float32, uses that nearly cancel (S ≈ −L,
# each ~10⁵) make the norm come out below the truth: released clipped gradients of 1.09–1.49·ζ (and
# 1.03·ζ with the embedding's own norm in float64). The three terms are taken in float64 with a bound
# on the rounding (``ghost_tied``).
class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 10, bias=False)
        self.lin.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        return torch.cat([self.lin(h), h], -1)


@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_tied_uses_that_cancel_in_float32_still_clip_the_example(clipping):
    bad = []
    for seed in [1, 4, 6, 8, 10, 53]:
        torch.manual_seed(seed)
        model = _Tied()
        w3 = model.emb.weight.detach()[3].clone()
        k = torch.zeros(10)
        k[3] = 1e4
        j = -2e4 * w3 + torch.randn(8) * 3  # S + L = the small random vector, in row 3

        def loss(out, y, k=k, j=j):
            return (out[..., :10] * k).sum() + (out[..., 10:] * j).sum()

        x = torch.tensor([[3]])
        ref = clipped_sum(model, loss, x, torch.zeros(1), clip_norm=1.0, clipping="vmap")
        got = clipped_sum(model, loss, x, torch.zeros(1), clip_norm=1.0, clipping=clipping)
        released = got.grads[0].double().norm().item()
        if not (got.norms.item() >= ref.norms.item() * (1 - 1e-5) and released <= 1.0 + 1e-6):
            bad.append((seed, ref.norms.item(), got.norms.item(), released))
    assert not bad


# -- bk/ghost clipping: clipped products below float32's normal range -------------------------------
# The Linear ghost sum (c∘G)ᵀA multiplies each output gradient by its clip factor first. An output
# gradient of 3·2⁻¹⁴⁹ (a float32 subnormal) times c ≈ 0.5 is 1.5·2⁻¹⁴⁹, rounded to 2·2⁻¹⁴⁹ — a third
# more — and then multiplied by an activation of 3·10³⁸: in float32, 39 such tokens move one
# example's clipped gradient to 1.0015·ζ, beyond the relative rounding bound of ``_gram_sq`` (which
# assumes normal numbers). bk takes such a sum in float64 (products of float32 numbers are exact
# there). The second backward of clipping="ghost" rounds c·∂ℓ/∂s the same way inside autograd, where
# the engine cannot widen it: still open (xfail).
def _subnormal_case():
    d, p, t = 512, 64, 40
    torch.manual_seed(0)
    lin = nn.Linear(d, p, bias=False)  # t(d + p) < p·d: the ghost (Gram) norm
    x, k = torch.zeros(1, t, d), torch.zeros(1, t, p)
    x[0, 0], k[0, 0] = 1.0 / d**0.5, 1.99 / p**0.5  # one token: the norm ≈ 1.99
    x[0, 1:], k[0, 1:] = 3e38, 3 * 2.0**-149  # products c·k = 1.5·2⁻¹⁴⁹ (c ≈ 1/1.999)
    return lin, (lambda out, y: (out * k).sum()), x, torch.zeros(1)


@pytest.mark.parametrize(
    "clipping",
    [
        "bk",
        "auto",
        pytest.param(
            "ghost",
            marks=pytest.mark.xfail(
                strict=True,
                reason="the second backward rounds c·∂ℓ/∂s to float32 subnormals before the weight "
                "gradient multiplies them by the activations",
            ),
        ),
    ],
)
def test_clipped_products_below_float32s_normal_range_keep_the_example_within_zeta(clipping):
    lin, loss, x, y = _subnormal_case()
    got = clipped_sum(lin, loss, x, y, clip_norm=1.0, clipping=clipping)
    assert got.norms.item() == pytest.approx(1.999, rel=1e-3)
    assert got.grads[0].double().norm().item() <= 1.0 + 1e-6


# -- clipping="ghost": the second backward against the first backward's norms ---------------------
# Still open (xfail): the second backward recomputes each layer's gradient from c_i·ℓ_i with its own
# rounding, while the norms came from the first backward's recorded tensors. For an instantiated
# Linear (here T(d + p) = p·d) two tokens of activations ±10⁵·u (+ w) cancel to w; the first
# backward's float32 per-example gradient (whose norm decides c) and the second backward's product
# of c·G and A round that cancellation differently: one example's clipped gradient 1.006·ζ (bk,
# which sums the very vectors whose norms were taken: 1 + 1e-7). Fixing it means summing the
# registered layers from their kept state under "ghost" as well (as under autocast).
@pytest.mark.xfail(
    strict=True,
    reason="the second backward's rounding differs from the first backward's whose norms set c",
)
def test_the_ghost_second_backward_keeps_an_instantiated_layers_example_within_zeta():
    worst = 0.0
    for seed in range(30):
        torch.manual_seed(seed)
        lin = nn.Linear(4, 4, bias=False)
        u, w, v = torch.randn(4), torch.randn(4), torch.randn(4)
        x = torch.stack([1e5 * u + w, -1e5 * u])[None]  # one example of two tokens

        def loss(out, y, v=v):
            return (out * v).sum()

        zeta = 0.1 * float(torch.outer(v.double(), w.double()).norm())
        got = clipped_sum(lin, loss, x, torch.zeros(1), clip_norm=zeta, clipping="ghost")
        worst = max(worst, got.grads[0].double().norm().item() / zeta)
    assert worst <= 1.0 + 1e-5


# -- bk/ghost under bfloat16 autocast: RMSNorm with eps=None ---------------------------------------
# The norm handler recomputes x̂ with the ε of the computation type, as F.rms_norm(eps=None) does
# (float32's ε, the type it computes in), not with finfo(input dtype).eps — 0.0078 for the bfloat16
# input autocast gives it, with which activations of mean square 3·10⁻⁵ had per-example norms 18×
# too small (0.020 against 0.358): every example released unclipped.
@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_rms_norm_without_eps_under_bf16_autocast_keeps_the_true_norms(clipping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].weight.mul_(1e-2)  # small activations: ε decides x̂
        model[0].bias.zero_()
    for p in model.parameters():
        p.requires_grad_(p is model[1].weight)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    loop = []  # the reference: one autograd backward per example, under the same autocast
    for i in range(6):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(x[i : i + 1]).float(), y[i : i + 1]).backward()
        loop.append(model[1].weight.grad.double().norm().item())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = clipped_sum(model, F.cross_entropy, x, y, clip_norm=1e-3, clipping=clipping)
    torch.testing.assert_close(got.norms, torch.tensor(loop, dtype=torch.float64), rtol=1e-4, atol=0)


# -- every method: per-example norms of long float32 rows ----------------------------------------
# A per-example norm is not one float32 ``vector_norm`` over the row: (1) the one-token ghost norm
# ‖a‖·‖g‖ of activations 2·10⁻²³ (squares below float32's range: ‖a‖ = 0) and output gradients
# 1.5·10¹⁹ is then 0 while the gradient's entries are 3·10⁻⁴ — the example released unclipped, 6·ζ
# (bk, ghost); (2) a float32 norm of 4·10⁶ entries accumulates its rounding: the vmap path's norm
# came out 2·10⁻³ low, its clipped gradient 1.0019·ζ. Norms are combined in float64 from float32
# norms of runs of 4096 entries, and a one-token row small enough to have lost squares is normed
# scaled by 2¹⁰⁰.
@pytest.mark.parametrize("case", ["underflow", "accumulation"])
@pytest.mark.parametrize("clipping", ["bk", "ghost", "vmap"])
def test_long_float32_rows_keep_each_example_within_zeta(case, clipping):
    d = 4_000_000
    lin = nn.Linear(d, 1, bias=False)
    a, k = (2e-23, 1.5e19) if case == "underflow" else (0.3, 1e-3)
    x = torch.full((1, d), a)

    def loss(out, y):
        return (out * k).sum()

    true = float(torch.tensor(a).double() * torch.tensor(k).double()) * d**0.5  # 0.6
    got = clipped_sum(lin, loss, x, torch.zeros(1), clip_norm=0.1, clipping=clipping)
    assert got.norms.item() == pytest.approx(true, rel=1e-5)
    assert got.grads[0].double().norm().item() <= 0.1 * (1 + 1e-5)


@pytest.mark.parametrize("kind", ["groupnorm", "layernorm", "embedding"])
@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_finite_gradients_of_layers_normed_in_the_backward_whose_squares_overflow_get_float64_norms(
    kind, clipping
):
    # their norms are taken while the backward runs and checked with every layer's at the end:
    # a float32 square that overflowed is taken again in float64 from what the layer kept
    torch.manual_seed(0)
    if kind == "groupnorm":
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(144, 3))
        x = torch.randn(4, 1, 8, 8)
    elif kind == "layernorm":
        model, x = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)), torch.randn(4, 5)
    else:
        model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(24, 3))
        x = torch.randint(0, 10, (4, 3))
    y = torch.randint(0, 3, (4,))

    def loss(out, t):  # per-example gradients ~1e25: their float32 squares overflow
        return F.cross_entropy(out, t) * 1e25

    ref = []
    for i in range(4):
        g = torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        ref.append(torch.sqrt(sum((t.double() ** 2).sum() for t in g)))
    out = clipped_sum(model, loss, x, y, clip_norm=1.0, clipping=clipping)
    torch.testing.assert_close(out.norms, torch.stack(ref), rtol=1e-6, atol=0)
