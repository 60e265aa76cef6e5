"""Bad data files are one-line errors naming the file: gzipped garbage, labels out of range or
miscounted, bad CIFAR-10 batches, a data_dir given for digits; ``dpmf train`` on bad labels fails
before accounting and writes nothing."""

import numpy as np
import pytest
from cli_helpers import _one_line_error

from dpmf import cli

# --- bad data files ------------------------------------------------------------------------


def _write_idx(path, arr):
    import gzip

    arr = np.asarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + arr.tobytes())


def _fmnist(folder, *, train_labels=None, n_train=12):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, n_train) if train_labels is None else train_labels,
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (5, 28, 28)),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, 5),
    }
    for name, arr in arrays.items():
        _write_idx(folder / name, arr)


def test_gzipped_garbage_is_a_one_line_error_naming_the_file(tmp_path):
    from dpmf.train.data import load_dataset

    _fmnist(tmp_path)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    bad.write_bytes(b"this is not gzip at all")
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz is invalid: not a readable gzip"):
        load_dataset("fashion-mnist", str(tmp_path))


@pytest.mark.parametrize(
    "labels, match",
    [
        (np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]), r"label 10 is outside \[0, 10\)"),
        (np.arange(11) % 10, r"it holds 11 labels but .*train-images-idx3-ubyte\.gz holds 12 images"),
    ],
)
def test_labels_are_checked_when_loading(labels, match, tmp_path):
    from dpmf.train.data import load_dataset

    _fmnist(tmp_path, train_labels=labels)
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz is invalid: " + match):
        load_dataset("fashion-mnist", str(tmp_path))


def test_cifar_batch_with_bad_labels_is_refused(tmp_path):
    import pickle

    from dpmf.train.data import load_dataset

    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        labels = [int(v) for v in rng.integers(0, 10, 4)]
        if i == 2:
            labels[1] = -1
        d = {b"data": rng.integers(0, 256, (4, 3072)).astype(np.uint8), b"labels": labels}
        (base / name).write_bytes(pickle.dumps(d))
    with pytest.raises(ValueError, match=r"data_batch_3 is invalid: label -1 is outside \[0, 10\)"):
        load_dataset("cifar10", str(tmp_path))
    (base / "test_batch").write_bytes(b"garbage")
    (base / "data_batch_3").write_bytes(
        pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]})
    )
    with pytest.raises(ValueError, match=r"test_batch is invalid: not a CIFAR-10 python batch"):
        load_dataset("cifar10", str(tmp_path))


def test_digits_refuses_a_data_dir():
    from dpmf.train.data import load_dataset

    with pytest.raises(ValueError, match=r"data_dir='/nonexistent' is invalid with dataset='digits'"):
        load_dataset("digits", "/nonexistent")


def test_train_with_bad_labels_fails_before_accounting_and_writes_nothing(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    _fmnist(data, train_labels=np.full(12, 12))
    out = tmp_path / "run"
    argv = ["train", "--dataset", "fashion-mnist", "--data-dir", str(data), "--epochs", "1"]
    argv += ["--batch-size", "4", "--noise-multiplier", "1", "--device", "cpu", "--out", str(out)]
    assert cli.main(argv) == 2
    line = _one_line_error(capsys, "train")
    assert "label 12 is outside [0, 10)" in line
    assert not (out / "results.json").exists()
