"""dpmf.make_private in a user's own loop: the short path, its accounting against `dpmf epsilon`,
bit-identity with `dpmf train`, the guards against non-private and mismatched use, the real
DataLoader (len, every epoch, empty batches, workers), secure seeds and the export."""

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dpmf
from dpmf.cli import main
from dpmf.optim import DPSGD, Privatizer
from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream
from dpmf.train.build import build_optimizer, sub_seed
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset
from dpmf.train.models import build_model
from dpmf.train.run import train

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _dataset(d):
    return TensorDataset(d.train_x, d.train_y)


def _model(d, seed=3):
    return build_model("mlp", d.input_shape, d.num_classes, seed=sub_seed(seed, 0))


def test_own_loop_in_four_statements_and_epsilon_equals_dpmf_epsilon(digits, capsys):
    model = _model(digits)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    private = dpmf.make_private(  # statement 1
        model,
        opt,
        _dataset(digits),
        loss_fn=F.cross_entropy,
        batch_size=128,
        epochs=2,
        target_epsilon=3.0,
        target_delta=1e-5,
        factorization="bsr:4",
        scheme="cyclic_poisson",
    )
    for _ in range(2):
        for x, y in private.data_loader:
            private.backward(x, target=y)  # statement 2
            private.optimizer.step()  # statement 3
            private.optimizer.zero_grad()  # statement 4
    eps = private.get_epsilon()
    argv = ["epsilon", "--scheme", "cyclic_poisson", "--factorization", "bsr:4", "--dataset-size"]
    argv += [str(len(digits)), "--batch-size", "128", "--epochs", "2", "--delta", "1e-5", "--json"]
    argv += ["--noise-multiplier", repr(private.noise_multiplier)]
    capsys.readouterr()
    assert main(argv) == 0
    assert eps == pytest.approx(json.loads(capsys.readouterr().out)["epsilon"], rel=1e-12)
    assert 2.99 < eps <= 3.0 and private.target_delta == 1e-5
    assert private.steps_taken == private.plan.steps == 2 * len(private.data_loader)


def test_make_private_and_dpmf_train_give_bit_identical_parameters(digits, tmp_path):
    cfg = TrainConfig(
        dataset="digits",
        model="mlp",
        optimizer="dp-sgd",
        factorization="bisr:4",
        scheme="fixed_order",
        epochs=2,
        batch_size=128,
        epsilon=3.0,
        delta=1e-5,
        seed=11,
        device="cpu",
    )
    ref = train(cfg, str(tmp_path / "run"), progress=False, log=lambda *a: None).model
    model = _model(digits, seed=11)
    private = dpmf.make_private(
        model,
        build_optimizer(cfg, model),
        _dataset(digits),
        loss_fn=F.cross_entropy,
        batch_size=128,
        epochs=2,
        target_epsilon=3.0,
        target_delta=1e-5,
        factorization="bisr:4",
        scheme="fixed_order",
        seed=11,
    )
    for _ in range(2):
        for x, y in private.data_loader:
            private.backward(x, target=y)
            private.optimizer.step()
            private.optimizer.zero_grad()
    for (k, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_plain_backward_then_step_is_refused(digits):
    model = _model(digits)
    x, y = digits.train_x[:8], digits.train_y[:8]
    alone = DPSGD(model.parameters(), lr=0.1)  # a DP optimizer without a privatizer
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="make_private"):
        alone.step()
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _dataset(digits),
        loss_fn=F.cross_entropy,
        batch_size=64,
        steps=3,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
    )
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="no private gradient"):
        private.optimizer.step()
    batches = iter(private.data_loader)  # backward accepts only the loader's batches
    x, y = next(batches)
    private.backward(x, target=y)
    F.cross_entropy(model(x), y).backward()  # accumulates into the private gradient
    with pytest.raises(RuntimeError, match="modified"):
        private.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    x, y = next(batches)
    private.backward(x, target=y)
    private.optimizer.step()
    with pytest.raises(RuntimeError, match="no private gradient"):
        private.optimizer.step()  # the same private gradient twice


def test_parts_that_disagree_with_the_plan_are_refused(digits):
    model = _model(digits)
    plan = PrivatePlan(len(digits), 128, epochs=1, scheme="fixed_order", strategy="bsr:4").with_noise(1.0)
    dim = sum(p.numel() for p in model.parameters())
    with pytest.raises(TypeError, match="sensitivity"):  # the plan fixes it: no such argument
        Privatizer(
            model,
            F.cross_entropy,
            plan=plan,
            clip_norm=1.0,
            noise=noise_stream(plan, dim, 0),
            sensitivity=1.0,
        )
    other = PrivatePlan(len(digits), 128, epochs=1, scheme="fixed_order", strategy="bisr:4")
    with pytest.raises(ValueError, match="noise is invalid"):
        Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(other, dim, 0))
    short = PrivatePlan(len(digits), 128, steps=3, scheme="fixed_order", strategy="bsr:4")
    with pytest.raises(ValueError, match="noise is invalid"):
        Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(short, dim, 0))
    # cyclic Poisson: the sampler's groups are the strategy's bands (no example in adjacent steps)
    cyc = PrivatePlan(len(digits), 100, steps=12, scheme="cyclic_poisson", strategy="bsr:4")
    s = cyc.sampler(5)
    last = {}
    for t in range(12):
        for i in s.next().tolist():
            assert t - last.get(i, -99) >= 4
            last[i] = t


def test_data_loader_len_epochs_empty_batches_and_workers(digits):
    ds = TensorDataset(digits.train_x[:40], digits.train_y[:40])
    model = _model(digits)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ds,
        loss_fn=F.cross_entropy,
        batch_size=1,
        epochs=3,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="poisson",
        seed=1,
    )
    loader = private.data_loader
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 40
    sizes = []
    for _ in range(3):
        epoch = list(loader)
        assert len(epoch) == 40
        sizes += [len(y) for _, y in epoch]
    assert 0 in sizes  # q = 1/40: empty Poisson batches occur and come out as empty tensors
    with pytest.raises(RuntimeError, match="exhausted"):
        list(loader)
    # an empty batch adds noise only, and the step counts
    model2 = _model(digits)
    private2 = dpmf.make_private(
        model2,
        torch.optim.SGD(model2.parameters(), lr=0.1),
        ds,
        loss_fn=F.cross_entropy,
        batch_size=1,
        steps=40,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        seed=2,
    )
    taken = 0
    for x0, y0 in private2.data_loader:  # privatize the loader's batches up to an empty one
        loss = private2.backward(x0, target=y0)
        taken += 1
        if y0.shape[0] == 0:
            break
        private2.optimizer.step()
    assert y0.shape == (0,) and loss == 0.0  # P(no empty batch in 40 steps) = 0.37^40
    assert private2.steps_taken == taken
    assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in private2.model.parameters())
    # worker processes
    model3 = _model(digits)
    private3 = dpmf.make_private(
        model3,
        torch.optim.SGD(model3.parameters(), lr=0.1),
        ds,
        loss_fn=F.cross_entropy,
        batch_size=10,
        epochs=1,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="fixed_order",
        num_workers=2,
        seed=4,
    )
    got = torch.cat([y for _, y in private3.data_loader])
    assert sorted(got.tolist()) == sorted(ds.tensors[1].tolist())


class _DictData(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixels": self.x[i], "label": self.y[i]}


def test_a_dataset_of_dicts_is_collated_by_the_loader(digits):
    ds = _DictData(digits.train_x[:30], digits.train_y[:30])
    model = _model(digits)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ds,
        loss_fn=F.cross_entropy,
        batch_size=10,
        epochs=1,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="fixed_order",
    )
    for batch in private.data_loader:
        assert set(batch) == {"pixels", "label"} and batch["pixels"].shape[0] == batch["label"].shape[0]
        private.backward(batch["pixels"], target=batch["label"])
        private.optimizer.step()


def test_default_seed_is_secret_and_differs_between_runs(digits, tmp_path):
    seeds = []
    for i in range(2):
        model = _model(digits)
        private = dpmf.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            _dataset(digits),
            loss_fn=F.cross_entropy,
            batch_size=128,
            steps=2,
            noise_multiplier=1.0,
            target_delta=1e-5,
            factorization="identity",
        )
        seeds.append(private.state_dict()["secret"]["seed"])
        x, y = next(iter(private.data_loader))
        private.backward(x, target=y)
        private.optimizer.step()
        paths = private.export(str(tmp_path / f"export{i}"))
        text = open(paths[1]).read()
        assert str(seeds[-1]) not in text and not private.seed_given
        ledger = json.loads(text)
        assert ledger["steps_taken"] == 1 and ledger["accountant"] == "pld" and "protects" in ledger
        weights = torch.load(paths[0], weights_only=True)
        assert set(weights) == set(model.state_dict())
    assert seeds[0] != seeds[1]
    cfg = TrainConfig(
        dataset="digits",
        model="mlp",
        epochs=1,
        batch_size=256,
        epsilon=None,
        noise_multiplier=1.0,
        device="cpu",
    )
    res = train(cfg, str(tmp_path / "t"), progress=False, log=lambda *a: None)
    drawn = torch.load(os.path.join(res.out_dir, "checkpoint.pt"), weights_only=True)["secret"]["seed"]
    for name in ("results.json", "privacy.json", "metrics.csv"):
        text = open(os.path.join(res.out_dir, name)).read()
        assert str(drawn) not in text, name
    assert json.load(open(os.path.join(res.out_dir, "results.json")))["seed_given"] is False
    assert set(torch.load(os.path.join(res.out_dir, "model.pt"), weights_only=True)) == set(
        res.model.state_dict()
    )


def test_state_dict_resumes_the_run_exactly(digits, tmp_path):
    def run(split):
        model = _model(digits)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        private = dpmf.make_private(
            model,
            opt,
            _dataset(digits),
            loss_fn=F.cross_entropy,
            batch_size=128,
            steps=6,
            noise_multiplier=1.0,
            target_delta=1e-5,
            factorization="bsr:2",
            scheme="cyclic_poisson",
            seed=8,
        )
        it = iter(private.data_loader)
        for t in range(6):
            if t == split:
                private.save(str(tmp_path / "state.pt"))
                model = _model(digits)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                private = dpmf.make_private(
                    model,
                    opt,
                    _dataset(digits),
                    loss_fn=F.cross_entropy,
                    batch_size=128,
                    steps=6,
                    noise_multiplier=1.0,
                    target_delta=1e-5,
                    factorization="bsr:2",
                    scheme="cyclic_poisson",
                    seed=8,
                )
                private.resume(str(tmp_path / "state.pt"))
                it = iter(private.data_loader)
            x, y = next(it)
            private.backward(x, target=y)
            private.optimizer.step()
            private.optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(None), run(3), strict=True):
        assert torch.equal(a, b)
    (tmp_path / "bad.pt").write_bytes(b"\x80\x02not a checkpoint")
    model = _model(digits)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _dataset(digits),
        loss_fn=F.cross_entropy,
        batch_size=128,
        steps=6,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
    )
    with pytest.raises(ValueError, match="corrupted"):
        private.resume(str(tmp_path / "bad.pt"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(epochs=1, steps=2), "epochs/steps"),
        (dict(epochs=1), "target_epsilon/noise_multiplier"),
        (dict(epochs=1, target_epsilon=1.0), "target_delta"),
        (dict(epochs=1, noise_multiplier=1.0), "factorization='auto'"),
        (dict(epochs=1, noise_multiplier=1.0, factorization="bsr:4", scheme="poisson"), "DP-SGD"),
        (dict(epochs=1, noise_multiplier=1.0, factorization="identity", clip_norm=0.0), "clip_norm"),
        (dict(epochs=1, noise_multiplier=1.0, factorization="identity", batch_size=10**6), "batch_size"),
    ],
)
def test_bad_arguments_are_refused_before_work(digits, kwargs, match):
    model = _model(digits)
    base = dict(loss_fn=F.cross_entropy, batch_size=128)
    with pytest.raises((ValueError, TypeError), match=match):
        dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), _dataset(digits), **{**base, **kwargs}
        )


def test_learning_rate_schedule_multiplies_the_base_rate(digits):
    from dpmf.workloads import Schedule

    model = _model(digits)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    private = dpmf.make_private(
        model,
        opt,
        _dataset(digits),
        loss_fn=F.cross_entropy,
        batch_size=128,
        steps=5,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        schedule=Schedule("exponential", 0.1),
        seed=0,
    )
    lrs = []
    # the lr in force inside the wrapped optimizer's step; the group shows 0.2 outside it
    opt.register_step_pre_hook(lambda o, args, kwargs: lrs.append(o.param_groups[0]["lr"]))
    it = iter(private.data_loader)
    for _ in range(5):
        x, y = next(it)
        private.backward(x, target=y)
        private.optimizer.step()
        assert opt.param_groups[0]["lr"] == 0.2
    assert np.allclose(lrs, 0.2 * 0.1 ** (np.arange(5) / 4))
    assert isinstance(nn.Module, type)


class _KeywordModel(nn.Module):
    """model(pixels=…, scale=…): an MLP that takes its inputs by keyword."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, pixels, scale):
        return self.inner(pixels * scale.unsqueeze(-1).unsqueeze(-1).unsqueeze(-1))


def test_dict_inputs_give_the_private_gradient_of_model_kwargs(digits):
    ds = TensorDataset(digits.train_x[:64], digits.train_y[:64])
    grads = []
    for as_dict in (False, True):
        inner = _model(digits, seed=5)
        model = _KeywordModel(inner) if as_dict else inner
        private = dpmf.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            ds,
            loss_fn=F.cross_entropy,
            batch_size=16,
            steps=1,
            noise_multiplier=1.0,
            target_delta=1e-5,
            factorization="identity",
            scheme="fixed_order",
            seed=9,
            # the dict of keyword inputs is built per example by the loader (a batch built in
            # the loop would be refused)
            transform=(lambda ex: ({"pixels": ex[0], "scale": torch.tensor(1.0)}, ex[1]))
            if as_dict
            else None,
        )
        batch, y = next(iter(private.data_loader))
        x = batch["pixels"] if as_dict else batch
        loss = private.backward(batch, target=y)
        assert loss == pytest.approx(float(F.cross_entropy(inner(x), y).detach()), rel=1e-6)
        grads.append([p.grad.clone() for p in inner.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# -- make_private: a trainable parameter the forward does not use, under the default clipping -----------
# With clipping="auto" (the default) or "bk", a trainable parameter that the forward never uses (an
# unused head, a LoRA adapter after peft's merge_adapter()) gets a zero per-example gradient (then
# noise), as under "ghost" and "vmap", instead of making backward crash inside clipped_sum with a bare
# "KeyError: 'unused.weight'" (a one-line refusal up front would do as well).
@pytest.mark.parametrize("clipping", ["auto", "bk"])
def test_an_unused_trainable_parameter_gets_noise_only_under_bk(clipping):
    import torch.nn.functional as F
    from torch import nn

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    torch.manual_seed(0)
    model = TwoHeads()
    private = dpmf.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy, batch_size=8,
        steps=2, noise_multiplier=1.0, factorization="identity", scheme="poisson", seed=1, clipping=clipping,
    )  # fmt: skip
    x, y = next(iter(private.data_loader))
    private.backward(x, target=y, return_loss=False)
    grad = model.unused.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and float(grad.abs().max()) > 0  # the noise


# -- make_private: backward's loss comes from the private forward (one forward pass) ----------------
@pytest.mark.parametrize("clipping", ["auto", "bk", "ghost", "vmap"])
def test_backward_returns_the_private_forwards_mean_loss_without_a_second_forward(digits, clipping):
    model = _model(digits)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _dataset(digits),
        loss_fn=F.cross_entropy,
        batch_size=32,
        steps=4,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        seed=5,
        clipping=clipping,
    )
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    batches = iter(private.data_loader)
    for k, (x, y) in enumerate(batches):
        with torch.no_grad():  # the reference at θ_t, before the step, outside the counted calls
            expected = float(F.cross_entropy(model(x).double(), y))
        calls.clear()
        loss = private.backward(x, target=y, return_loss=k % 2 == 0)
        if k % 2 == 0:  # the mean of ℓ_i(θ_t), detached, 0-dim, float64
            assert isinstance(loss, torch.Tensor) and loss.shape == () and not loss.requires_grad
            assert float(loss) == pytest.approx(expected, rel=1e-6)
            with_loss = len(calls)
        else:
            assert loss is None
            if k == 3:  # the same forwards with or without it (step 0 also probes the batch)
                assert len(calls) == with_loss
        private.optimizer.step()
        private.optimizer.zero_grad()
        if k == 3:
            break


def test_subpackages_are_attributes_of_a_plain_import_and_are_imported_on_first_use():
    """``import dpmf`` then ``dpmf.optim.DPMuon`` (the README's line) works, and the import
    alone loads no subpackage; an unknown name is refused."""
    import subprocess
    import sys

    code = (
        "import sys, dpmf; assert 'dpmf.optim' not in sys.modules; "
        "print(dpmf.optim.DPMuon.__name__, dpmf.distributed.DistributedPrivatizer.__name__); "
        "getattr(dpmf, 'nothing', None) is None or sys.exit(3)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["DPMuon", "DistributedPrivatizer"]
