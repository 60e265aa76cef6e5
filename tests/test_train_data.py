"""Data loading (IDX, CIFAR pickles, digits fallback), models, and the run configuration."""

import gzip
import json
import os
import pickle

import numpy as np
import pytest
import torch

from dpmf.optim.clipping import check_per_example_safe
from dpmf.train import data as data_mod
from dpmf.train.config import TrainConfig
from dpmf.train.data import NORMALIZATION, DatasetNotFoundError, load_dataset, read_idx
from dpmf.train.models import build_model


def write_idx(path, arr):
    arr = np.asarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + arr.tobytes())


def fake_fmnist(folder, n_train=12, n_test=5, gz=True):
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    ext = ".gz" if gz else ""
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    for name, arr in arrays.items():
        write_idx(os.path.join(folder, name + ext), arr)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_and_fashion_mnist_from_a_folder(tmp_path, gz):
    arrays = fake_fmnist(tmp_path, gz=gz)
    assert np.array_equal(
        read_idx(str(tmp_path / ("t10k-labels-idx1-ubyte" + (".gz" if gz else "")))),
        arrays["t10k-labels-idx1-ubyte"],
    )
    ds = load_dataset("fashion-mnist", str(tmp_path))
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.test_x.shape == (5, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    (m,), (s,) = NORMALIZATION["fashion-mnist"]
    expected = (arrays["train-images-idx3-ubyte"][3, 10, 7] / 255.0 - m) / s
    assert float(ds.train_x[3, 0, 10, 7]) == pytest.approx(expected, rel=1e-5)
    assert ds.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()


def test_read_idx_refuses_a_bad_file(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x02ab")  # float type code
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(str(p))
    write_idx(tmp_path / "short", np.zeros(4))
    raw = (tmp_path / "short").read_bytes()
    (tmp_path / "short").write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="header says"):
        read_idx(str(tmp_path / "short"))


def test_missing_folder_given_explicitly_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="no such folder"):
        load_dataset("fashion-mnist", str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(DatasetNotFoundError, match="missing train-images-idx3-ubyte"):
        load_dataset("fashion-mnist", str(tmp_path / "empty"))
    with pytest.raises(DatasetNotFoundError, match="cifar-10-batches-py"):
        load_dataset("cifar10", str(tmp_path / "empty"))


def test_cifar10_from_the_python_batches(tmp_path):
    base = tmp_path / "cifar-10-batches-py"
    os.makedirs(base)
    rng = np.random.default_rng(1)
    for name, n in [(f"data_batch_{i}", 3) for i in range(1, 6)] + [("test_batch", 2)]:
        with open(base / name, "wb") as f:
            pickle.dump(
                {
                    b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                    b"labels": list(rng.integers(0, 10, n)),
                },
                f,
            )
    ds = load_dataset("cifar10", str(tmp_path))
    assert ds.train_x.shape == (15, 3, 32, 32) and ds.test_x.shape == (2, 3, 32, 32)
    with open(base / "test_batch", "rb") as f:
        raw = pickle.load(f)
    m, s = NORMALIZATION["cifar10"]
    # channel-major layout: the green plane starts at offset 1024
    expected = (raw[b"data"][1, 1024 + 5 * 32 + 6] / 255.0 - m[1]) / s[1]
    assert float(ds.test_x[1, 1, 5, 6]) == pytest.approx(expected, rel=1e-5)


def test_digits_fallback_with_a_notice(monkeypatch, tmp_path):
    monkeypatch.setitem(data_mod.DEFAULT_DIRS, "fashion-mnist", (str(tmp_path / "absent"),))
    with pytest.warns(UserWarning, match="digits"):
        ds = load_dataset("fashion-mnist")
    assert ds.name == "digits" and ds.train_x.shape == (1438, 1, 8, 8) and ds.test_x.shape[0] == 359
    with pytest.raises(DatasetNotFoundError):
        load_dataset("fashion-mnist", fallback=False)


@pytest.mark.skipif(
    not os.path.isdir("/usr/share/datasets/fashion-mnist"), reason="Fashion-MNIST not installed"
)
def test_installed_fashion_mnist():
    ds = load_dataset("fashion-mnist")
    assert ds.name == "fashion-mnist" and len(ds) == 60000 and ds.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.test_y).tolist() == [1000] * 10
    assert abs(float(ds.train_x.mean())) < 1e-3 and float(ds.train_x.std()) == pytest.approx(1.0, abs=1e-3)


def _conv(cin, cout, k, bias=True):
    return cin * cout * k * k + (cout if bias else 0)


@pytest.mark.parametrize(
    "name,shape,count",
    [
        ("cnn", (1, 28, 28), _conv(1, 16, 3) + 32 + _conv(16, 32, 3) + 64 + 32 * 49 * 10 + 10),
        ("cnn", (1, 8, 8), _conv(1, 16, 3) + 32 + _conv(16, 32, 3) + 64 + 32 * 4 * 10 + 10),
        (
            "cnn3",
            (3, 32, 32),
            _conv(3, 32, 3)
            + _conv(32, 32, 3)
            + _conv(32, 64, 3)
            + _conv(64, 64, 3)
            + _conv(64, 128, 3)
            + _conv(128, 128, 3)
            + 2 * (2 * 32 + 2 * 64 + 2 * 128)
            + 128 * 16 * 10
            + 10,
        ),
        ("mlp", (1, 28, 28), 784 * 256 + 256 + 2570),
        ("wrn16-4", (3, 32, 32), 2_748_890),  # WRN-16-4: ≈ 2.7 M parameters (Zagoruyko & Komodakis)
    ],
)
def test_models_shapes_parameter_counts_and_per_example_safety(name, shape, count):
    m = build_model(name, shape, 10, seed=0)
    assert sum(p.numel() for p in m.parameters()) == count
    check_per_example_safe(m)
    assert m(torch.zeros(2, *shape)).shape == (2, 10)
    assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())


def test_model_seed_fixes_the_weights_and_leaves_the_global_generator():
    state = torch.get_rng_state()
    a = build_model("cnn", (1, 28, 28), 10, seed=5)
    b = build_model("cnn", (1, 28, 28), 10, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert build_model("cnn", (1, 30, 30), 10)(torch.zeros(1, 1, 30, 30)).shape == (1, 10)
    with pytest.raises(ValueError, match="divisible by 8"):
        build_model("cnn3", (3, 30, 30), 10)
    with pytest.raises(ValueError, match="model"):
        build_model("resnet", (1, 28, 28), 10)


def test_config_from_yaml_and_json_with_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("dataset: digits\nbatch-size: 64\nnoise_multiplier: 1.5\nepochs: 2\n")
    c = TrainConfig.from_file(str(tmp_path / "c.yaml"))
    assert (c.dataset, c.batch_size, c.noise_multiplier, c.epsilon, c.epochs) == ("digits", 64, 1.5, None, 2)
    (tmp_path / "c.json").write_text(json.dumps({"model": "mlp", "lr": 0.5}))
    d = TrainConfig.from_file(str(tmp_path / "c.json")).replace(epsilon=2.0, lr=None, seed=3)
    assert (d.model, d.lr, d.epsilon, d.seed) == ("mlp", 0.5, 2.0, 3)
    assert c.replace(epsilon=1.0).noise_multiplier is None
    # defaults that depend on other fields follow them through overrides
    assert c.per_epoch_epsilon and not c.replace(scheme="balls_in_bins").per_epoch_epsilon
    assert c.base_lr == 0.5 and c.replace(optimizer="dp-muon").base_lr == 0.05


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"noise_multiplier": -1.0, "epsilon": None}, "noise_multiplier"),
        ({"noise_multiplier": 1.0}, "exactly one"),
        ({"epsilon": None}, "exactly one"),
        ({"batch_size": 0}, "batch_size"),
        ({"delta": 1.0}, "delta"),
        ({"factorization": "bisr"}, "needs bands"),
        ({"scheme": "shuffle"}, "scheme"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"momentum": 1.0}, "momentum"),
    ],
)
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_config_refuses_unknown_keys(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"learning_rate": 0.1}))
    with pytest.raises(ValueError, match="'learning_rate' is invalid"):
        TrainConfig.from_file(str(tmp_path / "c.json"))
    with pytest.raises(FileNotFoundError):
        TrainConfig.from_file(str(tmp_path / "none.yaml"))
