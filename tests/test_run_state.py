"""One run state for both doors: recorded model hashes of eight ``dpmf train`` configurations
(the trajectory of a given seed must not change), resume to the same bits, and the checkpoint
format shared by ``dpmf train`` and ``make_private``."""

import hashlib

import pytest

from dpmf.train.config import TrainConfig
from dpmf.train.run import train

pytestmark = pytest.mark.torch

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
        "e25db0b08fb7bfddccd1de28e6ab4f4cee1ec9220d967eced2904c3530158df1",
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
