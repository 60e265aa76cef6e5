"""One run state for both doors: recorded model hashes of eight ``dpmf train`` configurations
(the trajectory of a given seed must not change), resume to the same bits, and the checkpoint
format shared by ``dpmf train`` and ``make_private``."""

import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpmf
from dpmf.train import state as run_state
from dpmf.train.build import build_optimizer, sub_seed
from dpmf.train.checkpoint import load_checkpoint, save_checkpoint
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset
from dpmf.train.models import build_model
from dpmf.train.run import train

# the hashes were recorded at one thread (a reduction split between threads rounds differently)
pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread_everywhere")]

BASE = dict(
    dataset="digits", model="mlp", epochs=1, batch_size=256, epsilon=3.0, delta=1e-5, seed=5, device="cpu"
)
# SHA-256 of the final state_dict (names and bytes), recorded with torch 2.13 on CPU.
CONFIGS = {
    "dp-sgd-poisson": (dict(), "f258e616e0a2a616509b54789c101ae12c1bea96fd5ff5d3a5f360fe14580d6a"),
    "bsr-cyclic": (
        dict(factorization="bsr:3", scheme="cyclic_poisson"),
        "89e6e002edb716ed3207383a0a475be7d79f527c5d5c6e3e2b52ec629958f46c",
    ),
    "bisr-fixed-stream": (
        dict(factorization="bisr:4", scheme="fixed_order", noise_keys="stream"),
        "38f86bc9fb908d70e8933732cdd2316c6099dbc2d2a654bdcbd20bcc9efadc9b",
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
        "c3c202b75faa34d62459e89e59321f4aaf65fb7fca37ae8bb123c06fc0b34e7b",
    ),
    "muon-exp": (
        dict(
            optimizer="dp-muon",
            factorization="bsr:3",
            scheme="cyclic_poisson",
            schedule="exponential",
            beta=0.5,
        ),
        "0f7662bc32df40cff64a18faf8ff31507e3adbdcb7d153fb27901f39862cd54b",
    ),
    "adam-doppler": (
        dict(optimizer="dp-adam", filter="doppler", noise_multiplier=1.0, epsilon=None),
        "ec28774721a46d436ab850fd19ce1095d827d93fe07f7e69a0886cbefd0f2106",
    ),
    "sgd-disk-2ep": (
        dict(filter="disk", factorization="bsr:2", scheme="fixed_order", epochs=2),
        "38fe4a9fc8d83bc2252aeeb5a7be60d09243734d46ba3906033556c9ae271ea9",
    ),
    "muon-bc-2ep": (
        dict(optimizer="dp-muon-bc", epochs=2),
        "f339ebaa8b8901f7688adf99c26ddd6c05067d3017bcd04233e97b35ad322f06",
    ),
}


def model_digest(model) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _quiet(*a, **k):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_given_seed_gives_the_recorded_model(name, tmp_path):
    over, expected = CONFIGS[name]
    res = train(TrainConfig(**{**BASE, **over}), str(tmp_path), progress=False, log=_quiet)
    assert model_digest(res.model) == expected


class _Stop(Exception):
    pass


def _stop_after_first_epoch(epoch, row):
    if epoch == 1:
        raise _Stop


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd-disk-2ep", "muon-bc-2ep"])
def test_resume_gives_the_recorded_model(name, tmp_path):
    over, expected = CONFIGS[name]
    cfg = TrainConfig(**{**BASE, **over})
    with pytest.raises(_Stop):
        train(cfg, str(tmp_path), progress=False, log=_quiet, on_epoch_end=[_stop_after_first_epoch])
    res = train(cfg, str(tmp_path), progress=False, log=_quiet, resume=True)
    assert res.metrics[0]["epoch"] == 1 and len(res.metrics) == 2
    assert model_digest(res.model) == expected


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
    assert ours["secret"] == theirs["secret"] == {"seed": 11, "given": True}
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
