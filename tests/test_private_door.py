"""The user's-own-loop door (make_private) and the shared private step refuse what would make the
reported ε false: batches the plan's sampler did not draw for the step (own loader, whole data
set, accumulation, re-use, skipped batches), models whose forward writes parameters or buffers,
and models or optimizers changed after make_private; a mid-epoch checkpoint with prefetching
workers resumes exactly; a torch scheduler on private.optimizer changes the update."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpmf
from dpmf.distributed import simulate
from dpmf.optim import Privatizer
from dpmf.optim.batches import BatchCheckError
from dpmf.optim.model_guard import (
    ModelChangedError,
    ModelStateChangedError,
    check_state_unchanged,
    state_versions,
)
from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

N, D, K = 96, 6, 3


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


def _private(model=None, opt=None, *, data=None, **kw):
    model = _mlp() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if opt is None else opt
    x, y = _data() if data is None else data
    args = dict(
        loss_fn=F.cross_entropy,
        batch_size=16,
        epochs=2,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="fixed_order",
        seed=3,
    )
    args.update(kw)
    return dpmf.make_private(model, opt, TensorDataset(x, y), **args)


def _untouched(private):
    return private.steps_taken == 0 and all(p.grad is None for p in private.model.parameters())


# -- 1. only the batch drawn for step t, once -------------------------------------------------------


def test_own_loader_whole_data_set_and_split_batches_are_refused():
    x, y = _data()
    private = _private()
    own = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    xb, yb = next(iter(own))
    with pytest.raises(BatchCheckError, match="step 0 has not been drawn"):
        private.backward(xb, target=yb)  # before any iteration of the private loader
    with pytest.raises(BatchCheckError, match="step 0 has not been drawn"):
        private.backward(x, target=y)  # the whole data set as one batch
    batches = iter(private.data_loader)
    xs, ys = next(batches)
    with pytest.raises(BatchCheckError, match="not the one the plan's sampler drew for step 0"):
        private.backward(xb, target=yb)  # same size, other examples
    with pytest.raises(BatchCheckError, match="has 8 examples"):
        private.backward(xs[:8], target=ys[:8])  # gradient accumulation: half a batch
    with pytest.raises(BatchCheckError, match="another order or altered values"):
        private.backward(xs.flip(0), target=ys.flip(0))
    with pytest.raises(BatchCheckError, match="altered values"):
        private.backward(xs * 1.001, target=ys)  # a transformation in the loop
    assert _untouched(private)
    private.backward(xs, target=ys)  # the drawn batch is accepted
    with pytest.raises(BatchCheckError, match="already privatized at step 0"):
        private.backward(xs, target=ys)  # a second backward on one batch
    assert private.steps_taken == 1


def test_the_yielded_batch_is_matched_by_identity_and_one_changed_in_place_is_refused():
    private = _private()
    drawn = private.privatizer.drawn
    batches = iter(private.data_loader)
    xb, yb = next(batches)
    drawn.check(0, xb, yb)  # the tensors the loader yielded, unchanged: no value is read
    assert drawn._records[0].leaves is None
    xb.mul_(1.001)  # a transformation in the loop, in place
    with pytest.raises(BatchCheckError, match="altered values"):
        private.backward(xb, target=yb)
    with pytest.raises(BatchCheckError, match="altered values"):
        private.backward(xb.clone(), target=yb)  # a copy of the changed tensor: no match either
    assert _untouched(private)
    x1, y1 = next(batches)
    with pytest.raises(BatchCheckError, match="the batch drawn for step 1"):
        private.backward(x1, target=y1)  # matched by identity against the later record
    private2 = _private()
    xs, ys = next(iter(private2.data_loader))
    private2.backward(xs.double().float(), target=ys)  # a copy: matched by its values
    assert private2.privatizer.drawn._last.leaves is not None


def test_reused_and_skipped_batches_are_refused_under_min_sep():
    # bsr:4 with cyclic Poisson sampling assumes an example is in no two steps closer than 4
    private = _private(batch_size=8, factorization="bsr:4", scheme="cyclic_poisson", epochs=1)
    batches = iter(private.data_loader)
    x0, y0 = next(batches)
    private.backward(x0, target=y0)
    private.optimizer.step()
    with pytest.raises(BatchCheckError, match="already privatized at step 0"):
        private.backward(x0, target=y0)  # the same batch in the adjacent step
    x1, y1 = next(batches)
    x2, y2 = next(batches)
    with pytest.raises(BatchCheckError, match="batch drawn for step 2; the batch of step 1 was skipped"):
        private.backward(x2, target=y2)
    assert private.steps_taken == 1
    private.backward(x1, target=y1)
    private.optimizer.step()
    private.backward(x2, target=y2)
    assert private.steps_taken == 3


def test_another_dtype_shape_or_transform_is_accepted_and_messages_hide_membership():
    x, y = _data()
    private = _private(data=(x, y))
    batches = iter(private.data_loader)
    xb, yb = next(batches)
    private.backward(xb.double().float(), target=yb.to(torch.int32).long())  # round trips
    private.optimizer.step()
    xb, yb = next(batches)
    private.backward(xb.T.contiguous().T, target=yb)  # another memory layout
    private.optimizer.step()
    # the check itself: the batch in a lower precision (the rounding of its dtype) is accepted
    drawn = private.privatizer.drawn
    xb, yb = next(batches)
    drawn.check(2, xb.to(torch.bfloat16), yb)
    drawn.check(2, xb.half(), yb.to(torch.int16))
    with pytest.raises(BatchCheckError, match="altered values"):
        drawn.check(2, xb.to(torch.bfloat16).float(), yb)  # bf16 rounding in a float32 tensor
    # an uint8 data set converted per example by transform=, and a batch reshaped per example
    images = (x.abs() * 40).clamp(max=255).to(torch.uint8).reshape(N, 2, 3)
    model = nn.Sequential(nn.Flatten(), _mlp())
    p2 = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TensorDataset(images, y),
        loss_fn=F.cross_entropy,
        batch_size=16,
        steps=2,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="fixed_order",
        transform=lambda ex: (ex[0].float() / 255, ex[1]),
    )
    xi, yi = next(iter(p2.data_loader))
    assert xi.dtype == torch.float32
    p2.backward(xi.reshape(-1, 6).reshape(-1, 2, 3), target=yi)
    p2.optimizer.step()
    xi, yi = next(iter(p2.data_loader))
    with pytest.raises(BatchCheckError) as err:
        p2.backward(xi * 255, target=yi)  # the transform undone in the loop
    text = str(err.value)
    assert "\n" not in text and "transform=" in text


def test_prefetching_workers_and_resumed_iterations_keep_the_check():
    private = _private(num_workers=2, epochs=1)
    seen = 0
    for xb, yb in private.data_loader:
        private.backward(xb, target=yb, return_loss=False)
        private.optimizer.step()
        seen += 1
        if seen == 2:
            break  # the workers had drawn steps 2.. ahead; a new iteration draws them again
    it = iter(private.data_loader)
    xb, yb = next(it)
    private.backward(xb, target=yb)
    private.optimizer.step()
    assert private.steps_taken == 3
    stale = iter(private.data_loader)  # a newer iteration makes `it` stale
    with pytest.raises(RuntimeError, match="stale"):
        next(it)
    xb, yb = next(stale)
    private.backward(xb, target=yb)
    assert private.steps_taken == 4


def test_the_loop_of_dpmf_train_checks_the_drawn_indices():
    x, y = _data()
    model = _mlp()
    plan = PrivatePlan(N, 16, steps=4, scheme="fixed_order", strategy="identity").with_noise(1.0)
    dim = sum(p.numel() for p in model.parameters())
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(plan, dim, 1))
    drawn = priv.draw_from(plan.sampler(2))
    t, idx = drawn.draw()
    drawn.record(t, ids=idx)
    ids = torch.from_numpy(idx)
    other = torch.from_numpy(np.setdiff1d(np.arange(N), idx)[:16])
    with pytest.raises(BatchCheckError, match="not the one"):
        priv.privatize(x[other], y[other], example_ids=other)
    with pytest.raises(BatchCheckError, match="example_ids is required"):
        priv.privatize(x[ids], y[ids])
    priv.privatize(x[ids], y[ids], example_ids=ids)
    with pytest.raises(BatchCheckError, match="already privatized"):
        priv.privatize(x[ids], y[ids], example_ids=ids)
    with pytest.raises(ValueError, match="it is at step 1 and the noise stream at step 0"):
        Privatizer(
            model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(plan, dim, 1)
        ).draw_from(drawn.sampler)


# -- 2. the forward pass writes no parameter or buffer ----------------------------------------------


class _Counter(nn.Module):
    """A forward that adds the batch's sum to a buffer (a release without noise)."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(x.detach().sum())
        return self.inner(x)


class _Shrink(nn.Module):
    """A forward that rescales a parameter in place from the batch."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        with torch.no_grad():
            self.inner[0].weight.mul_(1.0 - 1e-3 * x.abs().mean())
        return self.inner(x)


class _CounterData(nn.Module):
    """A forward that writes the batch's mean into a buffer through ``.data`` (which keeps the
    buffer's version counter: only its values show the write)."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp()
        self.register_buffer("seen", torch.zeros(D))

    def forward(self, x):
        self.seen.data.copy_(x.detach().mean(0) if x.dim() > 1 else x.detach())
        return self.inner(x)


class _Tokens(nn.Module):
    def __init__(self, max_norm):
        super().__init__()
        self.emb = nn.Embedding(20, 4, max_norm=max_norm)
        self.out = nn.Linear(4, K)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


def test_in_place_modules_are_refused_before_any_work():
    with pytest.raises(ValueError, match=r"emb \(Embedding with max_norm=1.0\)"):
        _private(_Tokens(1.0), target_epsilon=2.0, noise_multiplier=None, factorization="auto")
    bn = nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.Linear(8, K)).train()
    with pytest.raises(ValueError, match="BatchNorm1d"):
        _private(bn)


@pytest.mark.parametrize("clipping", ["auto", "vmap", "bk"])
@pytest.mark.parametrize("module", [_Counter, _Shrink, _CounterData])
def test_a_forward_that_writes_the_model_is_refused(module, clipping):
    private = _private(module(), clipping=clipping)
    xb, yb = next(iter(private.data_loader))
    with pytest.raises(ModelStateChangedError, match="private step refused at step 0") as err:
        private.backward(xb, target=yb)
    assert "\n" not in str(err.value)
    assert _untouched(private)  # nothing released, the step not taken


def test_the_runtime_guard_sees_embedding_renorm_and_batch_norm_statistics():
    tokens = torch.randint(0, 20, (5, 3))
    for model, x in [
        (_Tokens(0.5), tokens),
        (nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8)).train(), torch.randn(5, D)),
    ]:
        before = state_versions(model)
        model(x)
        with pytest.raises(ModelStateChangedError, match="in place"):
            check_state_unchanged(model, before, "the forward")
    plain = _Tokens(None)
    before = state_versions(plain)
    plain(tokens)
    check_state_unchanged(plain, before, "the forward")


@pytest.mark.parametrize("clipping", ["auto", "vmap", "ghost", "bk"])
def test_a_plain_model_passes_every_clipping_mode(clipping):
    model = nn.Sequential(nn.Linear(D, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, K))
    private = _private(model, clipping=clipping, epochs=1)
    for xb, yb in private.data_loader:
        private.backward(xb, target=yb)
        private.optimizer.step()
    assert private.steps_taken == 6


def test_the_distributed_step_has_the_same_guards():
    def rank(comm):
        out = []
        for model in (_mlp(), _Counter()):
            run = _private(model, process_group=comm, batch_size=8)
            xb, yb = next(iter(run.data_loader))
            try:
                run.backward(xb, target=yb, return_loss=False)
                run.optimizer.step()
                run.backward(xb, target=yb)
            except (BatchCheckError, ModelStateChangedError) as err:
                out.append(type(err).__name__)
        return out

    assert simulate(2, rank) == [["BatchCheckError", "ModelStateChangedError"]] * 2


# -- 3. a mid-epoch checkpoint with prefetching workers resumes ----------------------------------------


def test_mid_epoch_save_with_workers_resumes_to_the_same_weights(tmp_path):
    def run(split):
        kw = dict(batch_size=8, epochs=1, factorization="bsr:2", scheme="cyclic_poisson", num_workers=2)
        private = _private(_mlp(), **kw)
        it = iter(private.data_loader)
        for t in range(6):
            if t == split:
                private.save(str(tmp_path / "mid.pt"))  # the workers have drawn ahead here
                del it
                model = _mlp(seed=9)  # other weights: all must come from the checkpoint
                private = _private(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
                private.resume(str(tmp_path / "mid.pt"))
                it = iter(private.data_loader)
            xb, yb = next(it)
            private.backward(xb, target=yb)
            private.optimizer.step()
            private.optimizer.zero_grad()
        return [p.detach().clone() for p in private.model.parameters()]

    for a, b in zip(run(None), run(3), strict=True):
        assert torch.equal(a, b)


# -- 4. a torch scheduler on private.optimizer -----------------------------------------------------


def test_a_step_lr_scheduler_changes_the_update_and_the_plan_schedule_multiplies_it():
    from dpmf.workloads import Schedule

    model = _mlp()
    private = _private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.4),
        schedule=Schedule("exponential", 0.5),
        steps=6,
        epochs=None,
    )
    sched = torch.optim.lr_scheduler.StepLR(private.optimizer, step_size=2, gamma=0.1)
    chi = 0.5 ** (np.arange(6) / 5)
    it = iter(private.data_loader)
    for t in range(6):
        xb, yb = next(it)
        private.backward(xb, target=yb)
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
        private.optimizer.step()
        lr = 0.4 * 0.1 ** (t // 2) * chi[t]  # SGD: θ ← θ − lr·g̃
        for p, b, g in zip(model.parameters(), before, grads, strict=True):
            torch.testing.assert_close(p.detach(), b - lr * g, rtol=0, atol=1e-7)
        assert private.optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 0.1 ** (t // 2))
        sched.step()


# -- 5. the model or optimizer changed after make_private ------------------------------------------


def test_changes_to_the_model_or_optimizer_are_named():
    model = _mlp()
    model[0].bias.requires_grad_(False)
    private = _private(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    it = iter(private.data_loader)
    xb, yb = next(it)
    model[0].bias.requires_grad_(True)
    with pytest.raises(
        ModelChangedError, match=r"parameter '0.bias' changed frozen → trainable.*make_private"
    ):
        private.backward(xb, target=yb)
    model[0].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="add_param_group refused"):
        private.optimizer.add_param_group({"params": [model[0].bias]})
    private.backward(xb, target=yb)
    private.optimizer.original.add_param_group({"params": [model[0].bias]})
    with pytest.raises(ModelChangedError, match="2 parameter groups, 1 when it was bound"):
        private.optimizer.step()
    private.optimizer.original.param_groups.pop()
    private.optimizer.step()
    model.add_module("extra", nn.Identity())
    xb, yb = next(it)
    with pytest.raises(ModelChangedError, match="submodule 'extra' was added"):
        private.backward(xb, target=yb)
    del model.extra
    model[2] = nn.Linear(8, K)
    with pytest.raises(ModelChangedError, match=r"parameter '2.weight' was replaced"):
        private.backward(xb, target=yb)


def test_a_gradient_the_private_step_did_not_write_is_refused_by_the_optimizer_step():
    # the optimizer holds every parameter, one of them frozen; a gradient set on it after the
    # private backward (frozen or unfrozen meanwhile) would be applied without noise
    for unfreeze in (False, True):
        model = _mlp()
        model[0].bias.requires_grad_(False)
        private = _private(model, torch.optim.SGD(model.parameters(), lr=0.1))
        xb, yb = next(iter(private.data_loader))
        private.backward(xb, target=yb)
        model[0].bias.requires_grad_(unfreeze)
        model[0].bias.grad = torch.ones_like(model[0].bias)
        before = model[0].bias.detach().clone()
        with pytest.raises(RuntimeError, match=r"shape \(8,\) has a gradient the private step did not write"):
            private.optimizer.step()
        assert torch.equal(model[0].bias.detach(), before)
        model[0].bias.grad = None
        model[0].bias.requires_grad_(False)
        private.optimizer.step()  # the private gradients alone: accepted


# -- 4. one live run per model ----------------------------------------------------------------------


def test_a_later_make_private_on_the_model_closes_the_earlier_run_and_says_they_compose(capsys):
    model = _mlp()
    first = _private(model)
    for x, y in first.data_loader:  # two private steps
        first.backward(x, target=y, return_loss=False)
        first.optimizer.step()
        first.optimizer.zero_grad()
        if first.steps_taken == 2:
            break
    eps = first.get_epsilon()
    capsys.readouterr()
    later = _private(model, torch.optim.SGD(model.parameters(), lr=0.1))
    err = capsys.readouterr().err
    assert f"earlier make_private run (2 private steps, ε = {eps:.4g} at δ = 1e-05), now closed" in err
    assert "ε add up" in err  # the weights' privacy loss is both runs' (basic composition)
    x, y = next(iter(first.data_loader))
    with pytest.raises(RuntimeError, match="closed this run"):
        first.backward(x, target=y)  # the two runs cannot interleave on one model
    assert first.steps_taken == 2
    x, y = next(iter(later.data_loader))
    later.backward(x, target=y)
    assert later.steps_taken == 1
    capsys.readouterr()
    _private(_mlp(1))  # another model: nothing to close
    assert "earlier" not in capsys.readouterr().err
    _private(model)  # closes `later` (one step)
    assert "(1 private step, ε = " in capsys.readouterr().err
    _private(model)  # closes a run that took no step: nothing to say
    assert "earlier" not in capsys.readouterr().err


def test_a_run_cannot_be_pickled_with_its_key():
    # torch.save(run) or a joblib cache would write the secret key with the umask's mode
    import pickle

    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    model = torch.nn.Linear(4, 2)
    private = dpmf.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
        loss_fn=torch.nn.functional.cross_entropy, batch_size=16, epochs=1, noise_multiplier=1.0,
        target_delta=1e-5, factorization="identity",
    )  # fmt: skip
    with pytest.raises(TypeError, match="cannot be pickled: it holds the run's secret noise key"):
        pickle.dumps(private)


def test_a_resume_on_other_data_is_refused(tmp_path):
    # the same key and noise on a data set with one record changed would make the two released
    # models' difference noiseless
    x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.randint(0, 2, (64,))

    def run(data_x):
        model = torch.nn.Linear(4, 2)
        return dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(data_x, y),
            loss_fn=torch.nn.functional.cross_entropy, batch_size=16, epochs=1, noise_multiplier=1.0,
            target_delta=1e-5, factorization="identity",
        )  # fmt: skip

    first = run(x)
    for xb, yb in first.data_loader:
        first.backward(xb, target=yb)
        first.optimizer.step()
        first.optimizer.zero_grad()
        break
    first.save(str(tmp_path / "s.pt"))
    other = x.clone()
    other[5, 0] += 1.0
    with pytest.raises(ValueError, match="is invalid for this data set"):
        run(other).resume(str(tmp_path / "s.pt"))
    run(x.clone()).resume(str(tmp_path / "s.pt"))  # the same data resumes


def test_an_example_holding_nan_reaches_the_non_finite_check_not_the_batch_check():
    # NaN ≠ NaN: the loader's own batch must still be recognised, and the step must name the cause
    from dpmf.optim.clipping import NonFiniteGradientError

    x, y = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)), torch.randint(0, 2, (32,))
    x[:, 0] = float("nan")  # every example: whichever batch is drawn holds one
    model = torch.nn.Linear(4, 2)
    private = dpmf.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
        loss_fn=torch.nn.functional.cross_entropy, batch_size=8, epochs=1, noise_multiplier=1.0,
        target_delta=1e-5, factorization="identity",
    )  # fmt: skip
    xb, yb = next(iter(private.data_loader))
    with pytest.raises(NonFiniteGradientError):
        private.backward(xb, target=yb)
