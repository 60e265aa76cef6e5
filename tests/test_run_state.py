"""One run state for both doors: recorded models of eight ``dpmf train`` configurations (the
trajectory of a given seed must not change), resume to the uninterrupted run's bits, and the
checkpoint format shared by ``dpmf train`` and ``make_private``."""

import pytest
import torch
import torch.nn.functional as F
from recorded import assert_recorded, distance, fingerprint
from torch.utils.data import TensorDataset

import dpmf
from dpmf.train import state as run_state
from dpmf.train.build import build_optimizer, sub_seed
from dpmf.train.checkpoint import load_checkpoint, save_checkpoint
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset
from dpmf.train.models import build_model
from dpmf.train.run import train

# one thread, as recorded (a reduction split between threads rounds differently)
pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread_everywhere")]

BASE = dict(
    dataset="digits", model="mlp", epochs=1, batch_size=256, epsilon=3.0, delta=1e-5, seed=5, device="cpu"
)
# name → (settings, the fingerprint of the final state_dict (tests/recorded.py), its tolerance).
# Recorded with torch 2.13 on CPU (AVX2 kernels, one thread). Beside each tolerance, measured with
# ``distance``: the spread of the fingerprint between the AVX2 and the scalar kernels
# (ATEN_CPU_CAPABILITY=default) at one and two threads, and how far a run moves with σ × 1.1, its
# last step skipped, or seed 6. Each tolerance is ≥ 30× its spread and ≥ 18× below the nearest
# perturbed run (Adam's normalised steps hide σ best).
CONFIGS = {
    "dp-sgd-poisson": (
        dict(),
        [9.941470425520572, 17.1383706969209, 0.007873700426094393,
         0.1424760813411761, 0.07744680724723804, 0.002781441783054924],
        5e-6,  # spread 2.0e-8; σ × 1.1: 1.6e-2, a step fewer: 3.0e-2, seed 6: 1.2
    ),
    "bsr-cyclic": (
        dict(factorization="bsr:3", scheme="cyclic_poisson"),
        [9.893292947973007, 16.98599709145492, 0.005144411820941705,
         0.14294664687745154, 0.07842031333167085, 0.002677119063166782],
        5e-6,  # spread 2.7e-8; σ × 1.1: 9.6e-3, a step fewer: 5.1e-2, seed 6: 1.3
    ),
    "bisr-fixed-stream": (
        dict(factorization="bisr:4", scheme="fixed_order", noise_keys="stream"),
        [9.8461725254298, 14.537463410000782, 0.005990500178820351,
         0.12821803980465526, 0.07763610628613864, -0.010911413698893516],
        5e-6,  # spread 3.0e-8; σ × 1.1: 4.6e-2, a step fewer: 1.2e-1, seed 6: 1.0
    ),
    "blt-balls": (
        dict(
            factorization="blt:2",
            scheme="balls_in_bins",
            samples=20000,
            noise_multiplier=1.5,
            epsilon=None,
            delta=1e-3,
            epsilon_each_epoch=False,
        ),
        [9.915728022899872, 17.236256019590655, 0.004486722158179603,
         0.1458983240427533, 0.07823409168711767, 0.0029205441920367083],
        5e-6,  # spread 6.8e-8; σ × 1.1: 9.3e-3, a step fewer: 5.6e-2, seed 6: 1.3
    ),
    "muon-exp": (
        dict(
            optimizer="dp-muon",
            factorization="bsr:3",
            scheme="cyclic_poisson",
            schedule="exponential",
            beta=0.5,
        ),
        [9.659981024415366, 15.355289609645297, 0.016211180151231065,
         0.132679233987866, 0.07357021669325466, -0.02052041463217629],
        5e-6,  # spread 1.6e-7; σ × 1.1: 3.1e-3, a step fewer: 2.6e-2, seed 6: 1.3
    ),
    "adam-doppler": (
        dict(optimizer="dp-adam", filter="doppler", noise_multiplier=1.0, epsilon=None),
        [9.592217297601488, 15.062911204266129, 0.013819022360939938,
         0.13022586597877717, 0.08069898044698369, -0.024204923711917414],
        5e-6,  # spread 1.0e-8; σ × 1.1: 9.3e-5, a step fewer: 7.4e-3, seed 6: 1.2
    ),
    "sgd-disk-2ep": (
        dict(filter="disk", factorization="bsr:2", scheme="fixed_order", epochs=2),
        [13.317853067379998, 19.941272534546442, 0.006479561013538302,
         0.13928436726862625, 0.1421066471032742, 0.09923233761744173],
        5e-6,  # spread 6.1e-8; σ × 1.1: 5.2e-2, a step fewer: 3.9e-2, seed 6: 0.23
    ),
    "muon-bc-2ep": (
        dict(optimizer="dp-muon-bc", epochs=2),
        [11.988136338121803, 16.776906451832474, 0.038005388831400366,
         0.1287819096857642, 0.10886772942462815, 0.04191952559027769],
        3e-5,  # spread 6.4e-7; σ × 1.1: 3.7e-3, a step fewer: 5.4e-2, seed 6: 0.58
    ),
}  # fmt: skip


def _quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """name → the final model of that configuration's uninterrupted run (each trained once)."""
    models = {}

    def model(name):
        if name not in models:
            cfg = TrainConfig(**{**BASE, **CONFIGS[name][0]})
            out = tmp_path_factory.mktemp(name)
            models[name] = train(cfg, str(out), progress=False, log=_quiet).model
        return models[name]

    return model


@pytest.mark.slow
@pytest.mark.recorded
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_given_seed_gives_the_recorded_model(name, finished):
    _, recorded, tolerance = CONFIGS[name]
    assert_recorded(fingerprint(finished(name).state_dict()), recorded, tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("change", [dict(seed=6), dict(noise_multiplier=1.1)])
def test_another_seed_or_noise_scale_is_outside_the_recorded_tolerance(change, tmp_path):
    # adam-doppler (σ = 1 given) is the configuration whose model moves least with σ × 1.1
    over, recorded, tolerance = CONFIGS["adam-doppler"]
    res = train(TrainConfig(**{**BASE, **over, **change}), str(tmp_path), progress=False, log=_quiet)
    assert distance(fingerprint(res.model.state_dict()), recorded) > 10 * tolerance


class _Stop(Exception):
    pass


def _stop_after_first_epoch(epoch, row):
    if epoch == 1:
        raise _Stop


@pytest.mark.slow
@pytest.mark.recorded
@pytest.mark.parametrize("name", ["sgd-disk-2ep", "muon-bc-2ep"])
def test_a_resumed_run_gives_the_uninterrupted_runs_bits_and_the_recorded_model(name, finished, tmp_path):
    over, recorded, tolerance = CONFIGS[name]
    cfg = TrainConfig(**{**BASE, **over})
    with pytest.raises(_Stop):
        train(cfg, str(tmp_path), progress=False, log=_quiet, on_epoch_end=[_stop_after_first_epoch])
    res = train(cfg, str(tmp_path), progress=False, log=_quiet, resume=True)
    assert res.metrics[0]["epoch"] == 1 and len(res.metrics) == 2
    for (k, a), (j, b) in zip(
        finished(name).state_dict().items(), res.model.state_dict().items(), strict=True
    ):
        assert k == j and torch.equal(a, b), k  # the same process: the same bits
    assert_recorded(fingerprint(res.model.state_dict()), recorded, tolerance)


# -- one format for both doors ------------------------------------------------------------------

DOOR = dict(
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


def _private(cfg, data, seed):
    model = build_model("mlp", data.input_shape, data.num_classes, seed=sub_seed(cfg.seed, 0))
    return dpmf.make_private(
        model,
        build_optimizer(cfg, model),
        TensorDataset(data.train_x, data.train_y),
        loss_fn=F.cross_entropy,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        target_epsilon=cfg.epsilon,
        target_delta=cfg.delta,
        factorization=cfg.factorization,
        scheme=cfg.scheme,
        seed=seed,
    )


@pytest.fixture(scope="module")
def stopped_train(tmp_path_factory):
    """A ``dpmf train`` run of DOOR stopped after its first epoch, and the uninterrupted run."""
    cfg = TrainConfig(**DOOR)
    full = train(cfg, str(tmp_path_factory.mktemp("full")), progress=False, log=_quiet)
    out = tmp_path_factory.mktemp("stopped")
    with pytest.raises(_Stop):
        train(cfg, str(out), progress=False, log=_quiet, on_epoch_end=[_stop_after_first_epoch])
    return cfg, full, str(out / "checkpoint.pt")


def test_both_doors_write_the_same_format(stopped_train, tmp_path, capsys):
    cfg, full, path = stopped_train
    private = _private(cfg, load_dataset("digits"), seed=11)
    for x, y in private.data_loader:  # its first epoch, as the train run did
        private.backward(x, target=y, return_loss=False)
        private.optimizer.step()
        private.optimizer.zero_grad()
    private.save(str(tmp_path / "state.pt"))
    ours, theirs = load_checkpoint(str(tmp_path / "state.pt")), load_checkpoint(path)
    assert tuple(ours) == tuple(theirs) == run_state.KEYS  # the same keys, in the same order
    assert ours["format"] == theirs["format"] == run_state.FORMAT == "dpmf.run/2"
    assert (ours["door"], theirs["door"]) == ("make_private", "train")
    assert ours["plan"] == theirs["plan"] and ours["data"] == theirs["data"] is not None
    assert ours["step"] == theirs["step"] == ours["plan"]["steps_per_epoch"] and ours["epoch"] == 1
    assert (
        ours["secret"]
        == theirs["secret"]
        == {"seed": 11, "given": True, "forks": [], "siblings": 1, "children": 0}
    )
    for k, v in theirs["model"].items():  # the same first epoch: the same weights, bit for bit
        assert torch.equal(v, ours["model"][k]), k
    capsys.readouterr()


def test_make_private_resumes_a_dpmf_train_checkpoint_to_the_same_bits(stopped_train, capsys):
    cfg, full, path = stopped_train
    private = _private(cfg, load_dataset("digits"), seed=None)  # adopts the checkpoint's key
    private.resume(path)
    assert private.steps_taken == private.plan.steps_per_epoch and private.seed_given
    for x, y in private.data_loader:  # the second epoch
        private.backward(x, target=y, return_loss=False)
        private.optimizer.step()
        private.optimizer.zero_grad()
    assert private.steps_taken == private.plan.steps
    for (k, a), (_, b) in zip(
        full.model.state_dict().items(), private.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    assert dpmf.seeds.NOTICE in capsys.readouterr().err  # the adopted key was a given seed


def test_dpmf_train_refuses_a_make_private_file_in_one_line(stopped_train, tmp_path):
    cfg, _, _ = stopped_train
    private = _private(cfg, load_dataset("digits"), seed=11)
    private.save(str(tmp_path / "checkpoint.pt"))
    with pytest.raises(ValueError, match=r"written by 'make_private'; resume it with make_private") as err:
        train(cfg, str(tmp_path), resume=True, progress=False, log=_quiet)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("old", [1, "dpmf.make_private/1"])
def test_an_old_format_is_refused_in_one_line_by_both_doors(stopped_train, tmp_path, old):
    cfg, _, path = stopped_train
    state = load_checkpoint(path)
    state["format"] = old
    save_checkpoint(str(tmp_path / "checkpoint.pt"), state)
    private = _private(cfg, load_dataset("digits"), seed=11)
    for resume in (
        lambda: train(cfg, str(tmp_path), resume=True, progress=False, log=_quiet),
        lambda: private.resume(str(tmp_path / "checkpoint.pt")),
    ):
        with pytest.raises(ValueError, match="format .* of an earlier dpmf.*start a new run") as err:
            resume()
        assert "\n" not in str(err.value) and "11" not in str(err.value).replace(str(tmp_path), "")
