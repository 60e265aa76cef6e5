"""The training loop: determinism, kill-and-resume, empty batches, numerical failures."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpmf.optim.clipping import NonFiniteGradientError
from dpmf.plan import PrivatePlan
from dpmf.seeds import SeedPolicy
from dpmf.step import build
from dpmf.train.checkpoint import load_checkpoint
from dpmf.train.data import load_dataset
from dpmf.train.loop import NonFiniteWeightsError, Trainer
from dpmf.train.metrics import read_metrics_csv
from dpmf.train.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def make_trainer(
    data,
    out,
    *,
    epochs=3,
    batch=128,
    scheme="cyclic_poisson",
    spec="bsr:4",
    seed=3,
    lr=0.5,
    sigma=0.8,
    progress=False,
):
    n = len(data)
    spe = -(-n // batch)
    steps = epochs * spe
    model = build_model("mlp", data.input_shape, data.num_classes, seed=seed)
    plan = PrivatePlan(
        n, batch, steps=steps, scheme=scheme, strategy=spec, noise_multiplier=sigma, clip_norm=1.0
    )
    step = build(plan, model, F.cross_entropy, seed=SeedPolicy.adopt(seed + 1, given=True))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    chi = np.linspace(1.0, 0.2, steps)
    return Trainer(
        model=model,
        data=data,
        step=step,
        optimizer=opt,
        lr_multipliers=chi,
        epochs=epochs,
        out_dir=str(out),
        device="cpu",
        run_identity={"seed": seed, "spec": spec},
        epsilon_at=lambda t: 0.01 * t,
        final_epsilon=9.0,
        delta=1e-5,
        progress=progress,
    )


def strip_time(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_same_seed_gives_identical_metrics_and_weights(digits, tmp_path):
    a = make_trainer(digits, tmp_path / "a")
    ra = a.run()
    b = make_trainer(digits, tmp_path / "b")
    b.run()
    ma = read_metrics_csv(tmp_path / "a" / "metrics.csv")
    mb = read_metrics_csv(tmp_path / "b" / "metrics.csv")
    assert len(ma) == 3 and strip_time(ma) == strip_time(mb)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # it learned something (digits: 10 classes), and ε per epoch, final ε as computed up front
    assert float(ma[-1]["test_accuracy"]) > 0.5
    assert [float(r["epsilon"]) for r in ma] == [0.12, 0.24, 9.0]  # 12 steps per epoch
    assert ra.steps == 36 and (tmp_path / "a" / "curves.png").stat().st_size > 1000
    # another seed: another run
    c = make_trainer(digits, tmp_path / "c", seed=4)
    c.run()
    assert strip_time(read_metrics_csv(tmp_path / "c" / "metrics.csv")) != strip_time(ma)


class Kill(Exception):
    pass


@pytest.mark.parametrize("scheme,spec", [("fixed_order", "bisr:4"), ("balls_in_bins", "bsr:3")])
def test_kill_after_epoch_two_and_resume_gives_identical_final_weights(digits, tmp_path, scheme, spec):
    ref = make_trainer(digits, tmp_path / "ref", scheme=scheme, spec=spec)
    ref.run()

    def kill_after_two(epoch, row):
        if epoch == 2:
            raise Kill

    first = make_trainer(digits, tmp_path / "run", scheme=scheme, spec=spec)
    with pytest.raises(Kill):
        first.run(on_epoch_end=[kill_after_two])
    # burn the global RNGs of this process: the resumed run must restore them
    torch.rand(100)
    np.random.rand(100)
    assert load_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))["epoch"] == 2
    second = make_trainer(digits, tmp_path / "run", scheme=scheme, spec=spec)
    out = second.run(resume=True)
    assert out.resumed_from_epoch == 2
    for pa, pb in zip(ref.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert strip_time(read_metrics_csv(tmp_path / "ref" / "metrics.csv")) == strip_time(
        read_metrics_csv(tmp_path / "run" / "metrics.csv")
    )


def test_existing_checkpoint_needs_resume_and_the_same_run(digits, tmp_path):
    make_trainer(digits, tmp_path, epochs=1).run()
    with pytest.raises(ValueError, match="--resume"):
        make_trainer(digits, tmp_path, epochs=1).run()
    with pytest.raises(ValueError, match="another run.*seed"):
        make_trainer(digits, tmp_path, epochs=1, seed=9).run(resume=True)


def test_empty_poisson_batches_are_noise_only_steps_and_counted(digits, tmp_path):
    # q = 1/1437 per example: most steps are empty, each still a step of noise and accounting
    tr = make_trainer(digits, tmp_path, batch=1, epochs=1, spec="identity", lr=0.01)
    w0 = [p.detach().clone() for p in tr.model.parameters()]
    out = tr.run()
    assert out.steps == tr.total_steps == tr.privatizer.noise.step == tr.sampler.step == len(digits)
    assert 0.2 * out.steps < out.empty_batches < 0.5 * out.steps  # (1−1/N)^N ≈ e⁻¹
    # the count of empty batches depends on whether an example is in the data set ((1−q)^N
    # against (1−q)^(N−1)): it stays in the checkpoint and leaves the shareable files
    assert "empty_batches" not in read_metrics_csv(tmp_path / "metrics.csv")[0]
    assert load_checkpoint(str(tmp_path / "checkpoint.pt"))["empty_batches"] == out.empty_batches
    assert any(not torch.equal(a, b) for a, b in zip(w0, tr.model.parameters(), strict=True))


def test_nan_example_stops_at_its_step_with_finite_weights(digits, tmp_path):
    bad = load_dataset("digits")
    bad.train_x[5, 0, 3, 3] = float("nan")
    tr = make_trainer(bad, tmp_path, scheme="fixed_order")
    probe = PrivatePlan(len(bad), 128, steps=tr.total_steps, scheme="fixed_order").sampler(tr.sampler.seed)
    step = next(t for t in range(tr.total_steps) if 5 in probe.next())
    with pytest.raises(NonFiniteGradientError, match=rf"step {step}\b") as info:
        tr.run()
    assert info.value.example_ids == [5] and "[5]" not in str(info.value)
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    assert tr.privatizer.noise.step == step  # the failed step did not consume noise


def test_diverging_optimizer_step_is_undone_and_named(digits, tmp_path):
    tr = make_trainer(digits, tmp_path, lr=3e38, sigma=1000.0)  # lr·noise overflows float32
    with pytest.raises(NonFiniteWeightsError, match="step 0"):
        tr.run()
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_trainer_refuses_a_plan_of_another_length(digits, tmp_path):
    tr = make_trainer(digits, tmp_path, epochs=1)
    # two epochs of 3 steps planned, one trained
    plan = PrivatePlan(384, 128, steps=6, noise_multiplier=1.0, clip_norm=1.0)
    other = build(plan, tr.model, F.cross_entropy, seed=SeedPolicy.adopt(0, given=True))
    with pytest.raises(ValueError, match="sampler.steps=6 is invalid: the run has 3 steps"):
        Trainer(
            model=tr.model,
            data=digits,
            step=other,
            optimizer=tr.optimizer,
            lr_multipliers=np.ones(3),
            epochs=1,
            out_dir=str(tmp_path),
            device="cpu",
            run_identity={},
        )
