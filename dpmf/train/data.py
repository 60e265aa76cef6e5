"""Data sets held in memory as tensors: Fashion-MNIST, CIFAR-10, and scikit-learn's digits.

=================  ===================================================  ====================
name               source                                               shape of one image
=================  ===================================================  ====================
``fashion-mnist``  the four IDX files (``*-idx[13]-ubyte``, optionally  1×28×28
                   gzipped) in ``data_dir``, default
                   /usr/share/datasets/fashion-mnist (Debian's
                   dataset-fashion-mnist)
``cifar10``        the ``cifar-10-batches-py`` folder (python pickles)  3×32×32
                   in ``data_dir`` or ``data_dir`` itself
``digits``         scikit-learn's bundled 8×8 digits (1797 images);     1×8×8
                   the last 20 % (359 images) are the test set
=================  ===================================================  ====================

Images are float32, scaled to [0, 1] and standardised per channel with fixed constants
(``NORMALIZATION``: the usual published means and standard deviations of these benchmarks),
so no statistic of the private training examples enters the model; labels are int64.

Nothing is downloaded. ``load_dataset`` with no ``data_dir`` falls back to digits (with a
notice) when the requested data set is absent from its default place; a ``data_dir`` given
explicitly must exist and hold the files (digits, bundled with scikit-learn, takes none).

Files are checked when read, so that a bad file fails before the privacy is accounted: a file
that cannot be decompressed or unpickled, images of the wrong shape, a label count different
from the image count, or a label outside [0, classes) is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import gzip
import os
import pickle
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from dpmf._validation import check_choice
from dpmf.train.choices import DATASETS

__all__ = [
    "DATASETS",
    "DEFAULT_DIRS",
    "NORMALIZATION",
    "Dataset",
    "DatasetNotFoundError",
    "load_dataset",
    "read_idx",
]

DEFAULT_DIRS = {
    "fashion-mnist": ("/usr/share/datasets/fashion-mnist",),
    "cifar10": ("/usr/share/datasets/cifar10", "/usr/share/datasets/cifar-10"),
}
NORMALIZATION = {  # per-channel (mean, std) of the pixels in [0, 1]
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "digits": ((0.3054,), (0.3755,)),
}
_FMNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification data set in memory.

    Attributes:
        name: ``fashion-mnist``, ``cifar10`` or ``digits``.
        train_x: shape (N, C, H, W), float32.
        train_y: shape (N,), int64 in [0, num_classes).
        test_x, test_y: the held-out test split, same layout.
        num_classes: number of labels.
        source: where it was read from.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    source: str

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])

    def __len__(self) -> int:
        return int(self.train_x.shape[0])


class DatasetNotFoundError(FileNotFoundError, ValueError):
    """The requested data set is not in the folder given (nothing is downloaded).

    Also a ``ValueError``: a wrong ``data_dir`` is bad input like any other argument."""


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format; gzipped if the name ends in .gz) as a uint8 array.

    Format: two zero bytes, a type byte (0x08 = unsigned byte), the number of dimensions, then
    one big-endian uint32 per dimension and the data (LeCun et al., the MNIST database).

    Raises:
        ValueError: not an unsigned-byte IDX file, or the size does not match the header.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ValueError(f"{path} is invalid: not a readable gzip file ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is invalid: not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path} is invalid: header says {shape}, file holds {data.size} bytes")
    return data.reshape(shape)


def _find(folder: str, stem: str) -> str | None:
    for name in (stem, stem + ".gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    # torchvision writes t10k-images.idx3-ubyte style names as well
    alt = stem.replace("-idx", ".idx")
    for name in (alt, alt + ".gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _fashion_mnist(folder: str) -> Dataset:
    paths = {k: _find(folder, v) for k, v in _FMNIST_FILES.items()}
    missing = [_FMNIST_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise DatasetNotFoundError(
            f"data_dir={folder!r} is invalid for fashion-mnist: missing {', '.join(missing)} "
            "(IDX files, optionally .gz)"
        )
    arrays = {k: read_idx(p) for k, p in paths.items()}
    for split in ("train", "test"):
        x_path, y_path = paths[f"{split}_x"], paths[f"{split}_y"]
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or x.shape[1:] != (28, 28):
            raise ValueError(f"{x_path} is invalid: images must have shape (N, 28, 28), got {x.shape}")
        _check_labels(y_path, y, x.shape[0], x_path, 10)
    x_tr = arrays["train_x"].astype(np.float32)[:, None] / 255.0
    x_te = arrays["test_x"].astype(np.float32)[:, None] / 255.0
    return _standardised("fashion-mnist", x_tr, arrays["train_y"], x_te, arrays["test_y"], 10, folder)


def _check_labels(path: str, labels: np.ndarray, images: int, image_path: str, classes: int) -> None:
    """Labels must be one per image and in [0, classes).

    Raises:
        ValueError: naming ``path`` and what is wrong.
    """
    if labels.ndim != 1:
        raise ValueError(f"{path} is invalid: labels must be one-dimensional, got shape {labels.shape}")
    if labels.shape[0] != images:
        raise ValueError(
            f"{path} is invalid: it holds {labels.shape[0]} labels but {image_path} holds {images} "
            "images (the files must come from the same split)"
        )
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        bad = int(labels.max()) if int(labels.max()) >= classes else int(labels.min())
        raise ValueError(f"{path} is invalid: label {bad} is outside [0, {classes}) ({classes} classes)")


def _cifar10(folder: str) -> Dataset:
    base = folder
    if os.path.isdir(os.path.join(folder, "cifar-10-batches-py")):
        base = os.path.join(folder, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not os.path.isfile(os.path.join(base, n))]
    if missing:
        raise DatasetNotFoundError(
            f"data_dir={folder!r} is invalid for cifar10: missing {', '.join(missing)} "
            "(the cifar-10-batches-py folder of the python version)"
        )

    def load(name):
        path = os.path.join(base, name)
        try:
            with open(path, "rb") as f:
                d = pickle.load(f, encoding="bytes")
            raw, labels = np.asarray(d[b"data"]), np.asarray(d[b"labels"])
        except (pickle.UnpicklingError, EOFError, TypeError, KeyError, AttributeError, ValueError) as exc:
            raise ValueError(
                f"{path} is invalid: not a CIFAR-10 python batch (a pickled dict with b'data' and "
                f"b'labels'): {type(exc).__name__}: {exc}"
            ) from None
        if raw.ndim != 2 or raw.shape[1] != 3 * 32 * 32 or not np.issubdtype(raw.dtype, np.integer):
            raise ValueError(f"{path} is invalid: data must be integers of shape (N, 3072), got {raw.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{path} is invalid: labels must be integers, got {labels.dtype}")
        _check_labels(path, labels, raw.shape[0], path, 10)
        x = raw.astype(np.uint8).reshape(-1, 3, 32, 32)
        return x.astype(np.float32) / 255.0, labels.astype(np.int64)

    parts = [load(n) for n in names[:5]]
    x_tr = np.concatenate([p[0] for p in parts])
    y_tr = np.concatenate([p[1] for p in parts])
    x_te, y_te = load("test_batch")
    return _standardised("cifar10", x_tr, y_tr, x_te, y_te, 10, base)


def _digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DatasetNotFoundError(
            "the digits fallback needs scikit-learn (pip install scikit-learn)"
        ) from exc
    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]
    y = d.target.astype(np.int64)
    split = int(round(0.8 * x.shape[0]))
    return _standardised("digits", x[:split], y[:split], x[split:], y[split:], 10, "scikit-learn")


def _standardised(name, x_tr, y_tr, x_te, y_te, classes, source) -> Dataset:
    mean, std = (np.asarray(v, dtype=np.float32).reshape(1, -1, 1, 1) for v in NORMALIZATION[name])
    return Dataset(
        name,
        torch.from_numpy(((x_tr - mean) / std).astype(np.float32)),
        torch.from_numpy(np.asarray(y_tr, dtype=np.int64)),
        torch.from_numpy(((x_te - mean) / std).astype(np.float32)),
        torch.from_numpy(np.asarray(y_te, dtype=np.int64)),
        classes,
        source,
    )


def load_dataset(name: str, data_dir: str | None = None, *, fallback: bool = True) -> Dataset:
    """Load ``name`` from ``data_dir`` (or its default folder) into memory.

    Args:
        name: one of ``DATASETS``.
        data_dir: folder with the files. When given, it must exist and hold them (no fallback).
        fallback: with no ``data_dir``, load digits (and warn) when the data set is not in
            its default folder; otherwise raise.

    Returns:
        ``Dataset``.

    Raises:
        ValueError: unknown name; a ``data_dir`` with digits; a file that is not what it should
            be (unreadable, wrong shape, label count or label range), named.
        DatasetNotFoundError: an explicit ``data_dir`` that does not exist or lacks the files;
            or the data set absent with ``fallback=False``.
    """
    check_choice("dataset", name, DATASETS)
    if name == "digits":
        if data_dir is not None:
            raise ValueError(
                f"data_dir={data_dir!r} is invalid with dataset='digits': digits is bundled with "
                "scikit-learn and read from no folder; drop --data-dir"
            )
        return _digits()
    loader = _fashion_mnist if name == "fashion-mnist" else _cifar10
    if data_dir is not None:
        if not os.path.isdir(data_dir):
            raise DatasetNotFoundError(
                f"data_dir={data_dir!r} is invalid: no such folder (expected the {name} files there)"
            )
        return loader(data_dir)
    for folder in DEFAULT_DIRS[name]:
        if os.path.isdir(folder):
            try:
                return loader(folder)
            except DatasetNotFoundError:
                continue
    if not fallback:
        raise DatasetNotFoundError(
            f"dataset={name!r} not found in {', '.join(DEFAULT_DIRS[name])}; pass --data-dir"
        )
    warnings.warn(
        f"{name} not found in {', '.join(DEFAULT_DIRS[name])} (pass --data-dir): "
        "using scikit-learn's 8×8 digits instead",
        UserWarning,
        stacklevel=2,
    )
    return _digits()
