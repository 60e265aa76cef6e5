"""Model kinds a user brings: torch's recurrent layers refused by name with the way out (a
recurrence of nn.Linear layers, clipped exactly), and a torch.compile'd model refused before any
step."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpmf
from dpmf.optim.batch_probe import BatchCouplingError
from dpmf.optim.clipping import clipped_sum

pytestmark = pytest.mark.torch


class _Recurrent(nn.Module):
    def __init__(self, cls, batch_first, bidirectional):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cls(5, 6, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
        self.head = nn.Linear(12 if bidirectional else 6, 3)

    def forward(self, x):  # x: (B, T, 5)
        out = self.rnn(x if self.batch_first else x.transpose(0, 1))[0]
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out[:, -1])


def _reference(model, x, y, zeta):
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        rows.append(torch.cat([t.flatten() for t in g]))
    per = torch.stack(rows)
    norms = per.norm(dim=1)
    return norms, (per * torch.clamp(zeta / norms, max=1.0)[:, None]).sum(0)


class _LinearGRU(nn.Module):
    """A GRU cell written with nn.Linear layers, unrolled over T: the refusal's way out."""

    def __init__(self, d=5, h=6):
        super().__init__()
        self.x_gates, self.h_gates = nn.Linear(d, 3 * h), nn.Linear(h, 3 * h, bias=False)
        self.head = nn.Linear(h, 3)
        self.h = h

    def forward(self, x):  # x: (B, T, d); each Linear called T times
        state = x.new_zeros(x.shape[0], self.h)
        for t in range(x.shape[1]):
            xr, xz, xn = self.x_gates(x[:, t]).chunk(3, dim=1)
            hr, hz, hn = self.h_gates(state).chunk(3, dim=1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            state = (1 - z) * torch.tanh(xn + r * hn) + z * state
        return self.head(state)


def test_a_recurrence_written_with_linear_layers_is_clipped_exactly_per_example():
    torch.manual_seed(0)
    model = _LinearGRU().double()
    x = torch.randn(8, 4, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    norms, _ = _reference(model, x, y, 1.0)
    zeta = float(norms.median())  # half the examples clipped
    ref_norms, ref = _reference(model, x, y, zeta)
    for mode in ("auto", "bk", "ghost"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*torch.func path")  # no fallback
            out = clipped_sum(model, F.cross_entropy, x, y, clip_norm=zeta, clipping=mode)
        torch.testing.assert_close(out.norms, ref_norms, rtol=1e-10, atol=0)
        torch.testing.assert_close(torch.cat([g.flatten() for g in out.grads]), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU])
def test_torchs_recurrent_layers_are_refused_at_make_private_by_name_with_the_way_out(cls):
    model = _Recurrent(cls, True, False)
    data = TensorDataset(torch.randn(64, 4, 5), torch.randint(0, 3, (64,)))
    with pytest.raises(
        ValueError, match=rf"rnn \({cls.__name__}\) has no per-example gradient path.*nn\.Linear"
    ):
        dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
            batch_size=8, steps=2, noise_multiplier=1.0, target_delta=1e-5, factorization="identity",
        )  # fmt: skip
    # frozen, it is only a feature extractor: accepted, and the head is clipped through it
    for p in model.rnn.parameters():
        p.requires_grad_(False)
    x, y = torch.randn(4, 4, 5), torch.randint(0, 3, (4,))
    out = clipped_sum(model, F.cross_entropy, x, y, clip_norm=1e-3, clipping="auto")
    assert out.method == "bk" and torch.all(out.norms > 1e-3)
    assert float(torch.cat([g.flatten() for g in out.grads]).norm()) <= 4 * 1e-3 * (1 + 1e-6)


def test_a_compiled_model_is_refused_before_any_step_naming_compile():
    model = nn.Sequential(nn.Linear(5, 3))
    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    compiled = torch.compile(model)
    with pytest.raises(ValueError, match=r"torch\.compile'd module.*model\._orig_mod"):
        dpmf.make_private(
            compiled, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
            batch_size=8, steps=2, noise_multiplier=1.0, target_delta=1e-5, factorization="identity",
        )  # fmt: skip
    private = dpmf.make_private(  # the module itself: accepted
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
        batch_size=8, steps=2, noise_multiplier=1.0, target_delta=1e-5, factorization="identity",
    )  # fmt: skip
    assert private.steps_taken == 0


class _SharedPositions(nn.Module):
    """Token and position embeddings, the positions (1, T) shared by the batch: broadcast
    (``take=False``, as GPT-2 and BERT do) or indexed (``take=True``)."""

    def __init__(self, take):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(20, 8), nn.Embedding(6, 8), nn.Linear(8, 3)
        self.take = take

    def forward(self, ids):
        p = self.pos(torch.arange(ids.shape[1])[None])
        return self.head((self.tok(ids) + (p[0] if self.take else p)).mean(1))


def test_a_shared_position_input_is_clipped_per_example_and_an_indexed_one_is_refused():
    # book-keeping expands the (1, T) positions to the batch; broadcast, that is each example's
    # own gradient (equal to the per-example loop); indexed ([0]), example 0's copy would take
    # every example's gradient: the first batch's probe refuses it and names clipping='vmap'
    torch.manual_seed(0)
    model = _SharedPositions(take=False).double()
    x, y = torch.randint(0, 20, (8, 6)), torch.randint(0, 3, (8,))
    norms, _ = _reference(model, x, y, 1.0)
    zeta = float(norms.median())
    ref_norms, ref = _reference(model, x, y, zeta)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch.func path")  # no fallback
        out = clipped_sum(model, F.cross_entropy, x, y, clip_norm=zeta, clipping="bk")
    torch.testing.assert_close(out.norms, ref_norms, rtol=1e-10, atol=0)
    torch.testing.assert_close(torch.cat([g.flatten() for g in out.grads]), ref, rtol=1e-10, atol=1e-12)
    indexed = _SharedPositions(take=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 20, (64, 6), generator=g), torch.randint(0, 3, (64,), generator=g))
    private = dpmf.make_private(
        indexed, torch.optim.SGD(indexed.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
        batch_size=16, steps=3, noise_multiplier=1.0, target_delta=1e-5, factorization="identity",
    )  # fmt: skip
    xb, yb = next(iter(private.data_loader))
    with pytest.raises(BatchCouplingError, match="clipping='vmap'"):
        private.backward(xb, target=yb)
    way_out = dpmf.make_private(
        indexed, torch.optim.SGD(indexed.parameters(), lr=0.1), data, loss_fn=F.cross_entropy,
        batch_size=16, steps=3, noise_multiplier=1.0, target_delta=1e-5, factorization="identity",
        clipping="vmap",
    )  # fmt: skip
    xb, yb = next(iter(way_out.data_loader))
    way_out.backward(xb, target=yb)  # each example's gradient alone: accepted
    assert way_out.steps_taken == 1
