"""Ghost norms and book-keeping against explicit per-example gradients (autograd, one example
at a time), for every layer with a closed form, alone and mixed, clipped and unclipped."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmf.optim.clipping import clipped_sum
from dpmf.optim.ghost import ghost_layer_kinds
from dpmf.optim.lookahead import EvaluationPoint
from dpmf.optim.privatize import Privatizer
from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")

METHODS = ["ghost", "bk", "auto"]


def sum_loss(out, y):
    """A loss that reaches every output entry (y: per-example weights of shape (1, k))."""
    return (out.reshape(1, -1) * y).sum() + 0.1 * (out**2).sum()


class Scale(nn.Module):
    """A module without a closed form: per-channel scale (torch.func for this module alone)."""

    def __init__(self, c):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c))

    def forward(self, x):
        return x * self.scale


class SeqMixed(nn.Module):
    """Embedding → LayerNorm → Linear (3-D, ghost) → RMSNorm → Linear (3-D, instantiated) → Scale."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 16)  # T = 5: 5·(8 + 16) < 8·16, a ghost norm
        self.rms = nn.RMSNorm(16)
        self.down = nn.Linear(16, 3)  # 5·(16 + 3) > 16·3: instantiated
        self.scale = Scale(3)

    def forward(self, x):
        h = self.ln(self.emb(x))
        h = torch.relu_(self.lin(h))  # an in-place op right after a recorded output
        return self.scale(self.down(self.rms(h)))


class ConvMixed(nn.Module):
    """Conv2d (groups, 'same', reflect) → GroupNorm → Conv2d (stride, dilation) → Conv1d → Linear."""

    def __init__(self):
        super().__init__()
        # c1: T = 36 positions, d = 9, p = 2 per group: instantiated
        self.c1 = nn.Conv2d(2, 4, 3, padding="same", padding_mode="reflect", groups=2)
        self.gn = nn.GroupNorm(2, 4)
        # c2: T = 4, d = 36, p = 8: 4·44 < 288, a ghost norm
        self.c2 = nn.Conv2d(4, 8, 3, stride=2, dilation=2, padding=1, bias=False)
        # c3: T = 2, d = 12, p = 4 per group: a ghost norm; c4: T = 3, d = 16, p = 3: instantiated
        self.c3 = nn.Conv1d(8, 8, 3, padding=1, stride=3, groups=2)
        self.c4 = nn.Conv1d(8, 3, 2, padding=1, stride=2, groups=1)
        self.head = nn.Linear(25, 3)

    def forward(self, x):
        h = torch.tanh(self.gn(self.c1(x)))
        h = torch.tanh(self.c2(h)).flatten(2)  # (b, 8, 4)
        return self.head(torch.cat([self.c3(h).flatten(1), self.c4(h).flatten(1)], 1))


class TwoCalls(nn.Module):
    """The same Linear on two inputs (a per-example gradient with two terms)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)) + self.lin(x.flip(-1)))


class Functional(nn.Module):
    """A child's weight read outside the child's forward, and a transposed layout."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):  # x: (b, t, 4); t == b in the tests
        h = self.a(x.transpose(0, 1)).transpose(0, 1)  # self.a sees (t, b, 4)
        return F.linear(h, self.b.weight) + self.b(h)


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (tied weights)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 11)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mix(self.emb(x)))).mean(1)


class Attention(nn.Module):
    """nn.MultiheadAttention (uses its out_proj weight functionally): whole-model torch.func."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        return self.ln(self.attn(x, x, x, need_weights=False)[0] + x)


def inputs_for(name, b, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if name == "tied":
        return torch.randint(0, 11, (b, 3), generator=g), torch.randn(b, 11, generator=g, dtype=dtype)
    if name == "seq":
        x = torch.randint(0, 11, (b, 5), generator=g)
        x[0, :3] = 4  # repeated tokens in one example
        x[1, 1] = 0  # padding
        return x, torch.randn(b, 15, generator=g, dtype=dtype)
    if name == "conv":
        return torch.randn(b, 2, 6, 6, generator=g, dtype=dtype), torch.randn(b, 3, generator=g, dtype=dtype)
    if name in ("functional", "attention"):
        k = 9 if name == "functional" else 12
        return torch.randn(b, 3, 4, generator=g, dtype=dtype), torch.randn(b, k, generator=g, dtype=dtype)
    return torch.randn(b, 4, generator=g, dtype=dtype), torch.randn(b, 3, generator=g, dtype=dtype)


MODELS = {
    "seq": SeqMixed,
    "conv": ConvMixed,
    "twocalls": TwoCalls,
    "functional": Functional,
    "attention": Attention,
    "tied": Tied,
    "linear": lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
}


def build(name, dtype):
    torch.manual_seed(3)
    return MODELS[name]().to(dtype)


def explicit(model, x, y, loss=sum_loss):
    """Per-example gradients by autograd on each example alone: (b, d) flattened, and per tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]), params, allow_unused=True)
        g = [torch.zeros_like(p) if t is None else t for p, t in zip(params, g, strict=True)]
        rows.append(torch.cat([t.flatten() for t in g]))
    return torch.stack(rows)


def clipped_reference(per, zeta):
    norms = per.norm(dim=1)
    return norms, (per * torch.clamp(zeta / norms, max=1.0)[:, None]).sum(0)


def flat(grads):
    return torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_clipped_sum_and_norms_equal_explicit_per_example_gradients(name, method, dtype, rtol):
    b = 3 if name == "functional" else 6  # functional: t == b, so dim 0 is ambiguous
    model = build(name, dtype)
    x, y = inputs_for(name, b, dtype)
    per = explicit(model, x, y)
    norms = per.norm(dim=1)
    zeta = float(norms.median())  # some examples clipped, some not
    assert (norms > zeta * 1.01).any() and (norms < zeta * 0.99).any()
    ref_norms, ref = clipped_reference(per, zeta)
    out = clipped_sum(model, sum_loss, x, y, clip_norm=zeta, clipping=method)
    torch.testing.assert_close(out.norms.to(dtype), ref_norms, rtol=rtol, atol=0)
    torch.testing.assert_close(flat(out.grads), ref, rtol=rtol, atol=rtol * float(ref.abs().max()))
    # the auto choice: book-keeping unless a parameter needs the whole-model torch.func path
    if method == "auto":
        assert out.method == ("vmap" if name in ("functional", "attention") else "bk")
    else:
        assert out.method == method


def test_explicit_ghost_warns_once_naming_what_falls_back():
    model = build("attention", torch.float64)
    x, y = inputs_for("attention", 4, torch.float64)
    with pytest.warns(
        UserWarning,
        match=r"clipping='bk'.*attn: its output is not one tensor; "
        r"attn.out_proj: a trainable parameter is used outside",
    ):
        clipped_sum(model, sum_loss, x, y, clip_norm=1.0, clipping="bk")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clipped_sum(model, sum_loss, x, y, clip_norm=1.0, clipping="bk")
    assert not any("clipping='bk'" in str(w.message) for w in caught)  # not a second time


@pytest.mark.parametrize("tokens", [5, 40])  # ghost norm, and the sparse per-example gradient
def test_embedding_norms_with_repeated_tokens_and_padding(tokens):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3, padding_idx=1), nn.Flatten(), nn.Linear(3 * tokens, 2)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 7, (5, tokens), generator=g)
    x[0] = 3  # one token repeated throughout an example
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    per = explicit(model, x, y)
    zeta = float(per.norm(dim=1).median())
    ref_norms, ref = clipped_reference(per, zeta)
    for method in ("bk", "ghost"):
        out = clipped_sum(model, sum_loss, x, y, clip_norm=zeta, clipping=method)
        torch.testing.assert_close(out.norms, ref_norms, rtol=1e-10, atol=0)
        torch.testing.assert_close(flat(out.grads), ref, rtol=1e-10, atol=1e-12)


def test_layer_kinds_name_the_closed_forms_and_the_fallbacks():
    kinds = ghost_layer_kinds(SeqMixed())
    assert kinds == {
        "emb": "embedding",
        "ln": "norm",
        "lin": "linear",
        "rms": "norm",
        "down": "linear",
        "scale": "generic",
    }
    assert ghost_layer_kinds(Attention())["attn"] == "generic"


@pytest.mark.parametrize("method", ["ghost", "bk"])
def test_huge_zeta_leaves_the_sum_unclipped_and_tiny_zeta_clips_every_example(method):
    model = build("conv", torch.float64)
    x, y = inputs_for("conv", 5, torch.float64)
    per = explicit(model, x, y)
    big = clipped_sum(model, sum_loss, x, y, clip_norm=1e9, clipping=method)
    torch.testing.assert_close(flat(big.grads), per.sum(0), rtol=1e-10, atol=1e-12)
    tiny = clipped_sum(model, sum_loss, x, y, clip_norm=1e-6, clipping=method)
    unit = per / per.norm(dim=1, keepdim=True)
    torch.testing.assert_close(flat(tiny.grads), 1e-6 * unit.sum(0), rtol=1e-10, atol=1e-18)
    assert tiny.clipped_fraction == 1.0


@pytest.mark.parametrize("method", ["ghost", "bk", "auto"])
def test_two_point_plan_micro_batches_and_frozen_parameters_match_vmap(method):
    model = build("seq", torch.float64)
    model.ln.weight.requires_grad_(False)
    for p in model.lin.parameters():
        p.requires_grad_(False)
    x, y = inputs_for("seq", 7, torch.float64)
    g = torch.Generator().manual_seed(5)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shift = {
        n: 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in model.named_parameters()
        if n in names
    }
    plan = (EvaluationPoint(0.4), EvaluationPoint(0.6, shift))
    ref = clipped_sum(model, sum_loss, x, y, clip_norm=12.0, points=plan, clipping="vmap", micro_batch_size=3)
    out = clipped_sum(model, sum_loss, x, y, clip_norm=12.0, points=plan, clipping=method, micro_batch_size=3)
    assert len(out.grads) == len(names) == len(ref.grads)
    assert 0 < ref.clipped_fraction < 1
    torch.testing.assert_close(out.norms, ref.norms, rtol=1e-10, atol=0)
    for a, r in zip(out.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    # the plan really has two points: its vector is not the gradient at θ
    plain = clipped_sum(model, sum_loss, x, y, clip_norm=12.0, clipping=method)
    assert not torch.allclose(plain.norms, out.norms)


@pytest.mark.parametrize("method", ["ghost", "bk", "auto"])
def test_empty_batch_and_non_finite_overflow_under_ghost(method):
    model = build("linear", torch.float32)
    out = clipped_sum(model, sum_loss, torch.zeros(0, 4), torch.zeros(0, 3), clip_norm=1.0, clipping=method)
    assert out.batch_size == 0 and all(torch.count_nonzero(g) == 0 for g in out.grads)
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x = torch.full((2, 4), 1e30)  # ‖a‖²·‖g‖² = 4e60 overflows float32: recomputed in float64
    out = clipped_sum(lin, lambda o, t: o.sum(), x, torch.zeros(2), clip_norm=1.0, clipping=method)
    assert out.norms[0] == pytest.approx(2e30)
    torch.testing.assert_close(out.grads[0], torch.full((1, 4), 1.0))


@pytest.mark.parametrize("method", ["ghost", "bk"])
@pytest.mark.parametrize(("d", "p", "t", "scale"), [(2, 2, 4, 1e30), (64, 64, 2, 1e20)])
def test_finite_gradients_whose_float32_squares_overflow_get_float64_norms(method, d, p, t, scale):
    # (2, 2, 4): the gradient is instantiated (T·(d+p) ≥ p·d), its float32 norm overflows;
    # (64, 64, 2): ghost norms, whose float32 Gram products overflow. Both are recomputed in
    # float64 from what the layer kept, and equal the float64 per-example gradients' norms.
    torch.manual_seed(0)
    lin = nn.Linear(d, p, bias=False)
    x = torch.randn(3, t, d) * scale
    out = clipped_sum(lin, lambda o, y: o.sum(), x, torch.zeros(3), clip_norm=1.0, clipping=method)
    ref = nn.Linear(d, p, bias=False).double()
    with torch.no_grad():
        ref.weight.copy_(lin.weight.double())
    per = torch.stack(
        [
            torch.func.grad(lambda w, xi: torch.func.functional_call(ref, {"weight": w}, (xi,)).sum())(
                ref.weight, xi
            )
            for xi in x.double()
        ]
    )
    norms = per.reshape(3, -1).norm(dim=1)
    assert bool(torch.isfinite(out.norms).all())
    torch.testing.assert_close(out.norms, norms, rtol=1e-5, atol=0)
    want = (per / norms.view(-1, 1, 1)).sum(0).float()  # every example clipped to ζ = 1
    torch.testing.assert_close(out.grads[0], want, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_takes_norms_and_sums_in_float32():
    model = build("seq", torch.float32)
    x, y = inputs_for("seq", 8, torch.float32)
    per = explicit(model, x, y)
    zeta = float(per.norm(dim=1).median())
    ref_norms, ref = clipped_reference(per, zeta)
    for method in ("bk", "ghost", "vmap"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = clipped_sum(model, sum_loss, x, y, clip_norm=zeta, clipping=method)
        assert out.norms.dtype == torch.float64 and all(g.dtype == torch.float32 for g in out.grads)
        # bf16 has 8 significant bits: agreement to a few per cent, not to rounding
        torch.testing.assert_close(out.norms.float(), ref_norms, rtol=5e-2, atol=0)
        assert float((flat(out.grads) - ref).norm() / ref.norm()) < 5e-2
        # the clipping bound holds exactly for the vectors whose norms were taken
        assert torch.all(torch.clamp(zeta / out.norms, max=1.0) * out.norms <= zeta * (1 + 1e-12))


@pytest.mark.parametrize("spec", ["identity", "bsr:3", "bisr:3"])
def test_privatizer_gives_the_same_noisy_gradient_with_every_clipping(spec):
    model = build("conv", torch.float64)
    x, y = inputs_for("conv", 6, torch.float64)
    d = sum(p.numel() for p in model.parameters())
    plan = PrivatePlan(6, 6, steps=4, scheme="fixed_order", strategy=spec, noise_multiplier=1.3)
    out = {}
    for method in ("vmap", "ghost", "bk", "auto"):
        priv = Privatizer(
            model,
            lambda o, t: sum_loss(o, t),
            plan=plan,
            clip_norm=0.5,
            noise=noise_stream(plan, d, 2, dtype=torch.float64),
            clipping=method,
        )
        steps = []
        for t in range(3):
            xb = x[: 6 - 2 * t]  # the last one has 2 examples
            priv.privatize(xb, y[: xb.shape[0]])
            steps.append(flat([p.grad for p in model.parameters()]).clone())
        priv.privatize(x[:0], y[:0])  # an empty batch: noise only
        steps.append(flat([p.grad for p in model.parameters()]).clone())
        out[method] = torch.stack(steps)
        for p in model.parameters():
            p.grad = None
    for method in ("ghost", "bk", "auto"):
        torch.testing.assert_close(out[method], out["vmap"], rtol=1e-10, atol=1e-12)


def test_unknown_clipping_is_refused_by_name():
    model = build("linear", torch.float32)
    with pytest.raises(ValueError, match="clipping='fast' is invalid: must be one of auto, vmap, ghost, bk"):
        clipped_sum(model, sum_loss, torch.zeros(2, 4), torch.zeros(2, 3), clip_norm=1.0, clipping="fast")
    with pytest.raises(ValueError, match="clipping="):
        plan = PrivatePlan(4, 2, steps=2, scheme="fixed_order", noise_multiplier=1.0)
        Privatizer(
            model, sum_loss, plan=plan, clip_norm=1.0, noise=noise_stream(plan, 23, 0), clipping="ghosts"
        )


def test_train_config_and_cli_take_the_clipping_mode(tmp_path, capsys):
    from dpmf.cli import main
    from dpmf.train.config import TrainConfig

    assert TrainConfig().clipping == "auto" and "clipping" not in TrainConfig().run_identity()
    with pytest.raises(ValueError, match="clipping='fast' is invalid: must be one of auto, vmap, ghost, bk"):
        TrainConfig(clipping="fast")
    args = ["train", "--dataset", "digits", "--epochs", "1", "--no-progress", "--out", str(tmp_path / "o")]
    assert main([*args, "--clipping", "fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert "clipping='fast' is invalid" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_training_run_is_the_same_with_book_keeping_and_with_vmap(tmp_path):
    from dpmf.train.config import TrainConfig
    from dpmf.train.run import train

    weights = {}
    for method in ("bk", "vmap"):
        config = TrainConfig(
            dataset="digits",
            epochs=1,
            batch_size=512,
            noise_multiplier=1.0,
            epsilon=None,
            clipping=method,
            epsilon_each_epoch=False,
            device="cpu",
            seed=0,
        )
        out = train(config, str(tmp_path / method), progress=False, log=lambda *a: None)
        weights[method] = torch.cat([p.detach().flatten() for p in out.model.parameters()])
    torch.testing.assert_close(weights["bk"], weights["vmap"], rtol=1e-4, atol=1e-5)


def test_a_linear_handler_subclass_with_its_own_sq_norms_keeps_the_old_contract():
    # a registered subclass overriding sq_norms(module, calls, attrs, dtype) is called without
    # the engine's pending keyword, and its squares are used as they are
    from dpmf.optim.clipping_layers import LinearHandler, register_clipping_layer

    calls = []

    class Doubled(nn.Linear):
        pass

    class Own(LinearHandler):
        def sq_norms(self, module, calls_, attrs, dtype):
            calls.append(len(attrs))
            return super().sq_norms(module, calls_, attrs, dtype)

    register_clipping_layer(Doubled, Own())
    torch.manual_seed(0)
    model = nn.Sequential(Doubled(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(5, 2, 4), torch.zeros(5)
    got = clipped_sum(model, lambda o, t: o.sum(), x, y, clip_norm=0.5, clipping="bk")
    ref = clipped_sum(model, lambda o, t: o.sum(), x, y, clip_norm=0.5, clipping="vmap")
    assert calls and not Own().takes_pending and LinearHandler().takes_pending
    torch.testing.assert_close(got.norms, ref.norms, rtol=1e-5, atol=1e-7)
    for a, b in zip(got.grads, ref.grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
