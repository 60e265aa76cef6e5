"""Federated data: MedMNIST ``.npz`` files, two offline stand-ins, client partitions and the
held-out aggregator split.

=====================  =================================================  ======================
name                   source                                             one example
=====================  =================================================  ======================
``pneumoniamnist``     a MedMNIST file given by path (``--data-file``):   1×S×S, S ∈ {28, 64,
``breastmnist``        ``pneumoniamnist[_S].npz`` / ``breastmnist[_S]``   128, 224}
                       ``.npz``; an official file name is checked against
                       its official MD5 sum (medmnist 3.0.2, ``INFO``)
``medmnist``           any ``.npz`` in the MedMNIST layout (keys          1×H×W or 3×H×W
                       ``{train,val,test}_{images,labels}``), not checked
``breast-cancer``      scikit-learn's bundled Wisconsin breast-cancer     1×1×30 (tabular)
                       data (569 patients, 2 classes)
``fashion-mnist-2``    Fashion-MNIST T-shirt/top (0) against shirt (6),   1×28×28
                       from Debian's dataset-fashion-mnist (the same
                       place ``dpmf train`` reads); absent: an error
                       that says so
=====================  =================================================  ======================

Splits: the MedMNIST files bring theirs (train → clients, val → aggregator, test → test). The
stand-ins are split once with a fixed seed: 20 % test, then ``aggregator_fraction`` of the rest
(default 10 %) held out for the server, the remainder partitioned over the clients.

Pixels are scaled to [0, 1] and standardised with fixed constants; the tabular features with
the mean and standard deviation of the test split (public evaluation data), so no statistic of a
client's or the aggregator's records enters the preprocessing.

Partitions (``partition``): ``iid`` (a uniform random split into near-equal parts),
``dirichlet`` (per class, shares drawn from Dirichlet(α·1_K); Hsu, Qi and Brown, "Measuring
the Effects of Non-Identical Data Distribution for Federated Visual Classification", 2019) and
``shards`` (sorted by label, cut into K·m shards, m shards per client; McMahan et al.,
"Communication-Efficient Learning of Deep Networks from Decentralized Data", 2017).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int, check_real

__all__ = [
    "DATASETS",
    "MEDMNIST_MD5",
    "PARTITIONS",
    "FederatedData",
    "MedMNISTChecksumError",
    "load_federated",
    "load_medmnist",
    "partition",
]

DATASETS = ("breast-cancer", "fashion-mnist-2", "pneumoniamnist", "breastmnist", "medmnist")
PARTITIONS = ("iid", "dirichlet", "shards")

# Official MD5 sums of the MedMNIST v2 files (medmnist 3.0.2, medmnist/info.py, INFO[flag]).
MEDMNIST_MD5 = {
    "pneumoniamnist.npz": "28209eda62fecd6e6a2d98b1501bb15f",
    "pneumoniamnist_64.npz": "8f4eceb4ccffa70c672198ea285246c6",
    "pneumoniamnist_128.npz": "05b46931834c231683c68f40c47b2971",
    "pneumoniamnist_224.npz": "d6a3c71de1b945ea11211b03746c1fe1",
    "breastmnist.npz": "750601b1f35ba3300ea97c75c52ff8f6",
    "breastmnist_64.npz": "742edef2a1fd1524b2efff4bd7ba9364",
    "breastmnist_128.npz": "363e4b3f8d712e9b5de15470a2aaadf1",
    "breastmnist_224.npz": "b56378a6eefa9fed602bb16d192d4c8b",
}
_MEDMNIST_KEYS = tuple(f"{s}_{k}" for s in ("train", "val", "test") for k in ("images", "labels"))
_FMNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FMNIST_CLASSES = (0, 6)  # T-shirt/top, shirt
_FMNIST_MAX_POOL = 4800  # examples of the two classes kept for clients + aggregator (speed)
_FMNIST_MAX_TEST = 2000
_SPLIT_SEED = 20240531


class MedMNISTChecksumError(ValueError):
    """An official MedMNIST file name whose content does not have the official MD5 sum."""


@dataclass(frozen=True, eq=False)
class FederatedData:
    """The data of one federated run (numpy; float32 inputs, int64 labels).

    Attributes:
        name: the data set's name.
        source: where it was read from.
        client_x, client_y: one array per client: shapes (N_k, C, H, W) and (N_k,).
        aggregator_x, aggregator_y: the server's held-out split (server-side DP-SGD).
        test_x, test_y: the evaluation split.
        num_classes: number of labels.
        notes: notices for the run's log (e.g. "no checksum for this file name").
    """

    name: str
    source: str
    client_x: tuple
    client_y: tuple
    aggregator_x: np.ndarray
    aggregator_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    notes: tuple = ()
    eval_x: tuple = ()  # the clients' held-out records (``evaluation.split_held_out``), or ()
    eval_y: tuple = ()

    @property
    def num_clients(self) -> int:
        return len(self.client_x)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.test_x.shape[1:])

    def client_sizes(self) -> list[int]:
        return [int(y.shape[0]) for y in self.client_y]


def _md5(path: str) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _images(a: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W) or (N, H, W, C) → float32 (N, C, H, W) in [0, 1], standardised (0.5, 0.5)."""
    a = np.asarray(a)
    if a.ndim == 3:
        a = a[:, None]
    elif a.ndim == 4:
        a = np.moveaxis(a, -1, 1)
    else:
        raise ValueError(f"images of shape {a.shape} are invalid: expected (N, H, W) or (N, H, W, C)")
    x = a.astype(np.float32) / (255.0 if a.dtype == np.uint8 else 1.0)
    return (x - 0.5) / 0.5


def load_medmnist(path: str) -> tuple[dict[str, np.ndarray], str]:
    """Read a MedMNIST ``.npz`` (keys ``{train,val,test}_{images,labels}``).

    A file named like an official one (``MEDMNIST_MD5``: ``pneumoniamnist.npz``,
    ``breastmnist_64.npz``, …) must have the official MD5 sum; a file with another name is
    read without a check (the returned note says so).

    Returns:
        (arrays, note): ``arrays`` maps the six keys to arrays (labels flattened to (N,), int64);
        ``note`` is "" or the notice about the missing checksum.

    Raises:
        FileNotFoundError: no such file.
        MedMNISTChecksumError: an official name with another MD5 sum.
        ValueError: a file that is not in the MedMNIST layout.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data_file={path!r} is invalid: no such file")
    name = os.path.basename(path)
    note = ""
    if name in MEDMNIST_MD5:
        got = _md5(path)
        if got != MEDMNIST_MD5[name]:
            raise MedMNISTChecksumError(
                f"data_file={path!r} is invalid: MD5 {got} differs from the official {MEDMNIST_MD5[name]} "
                f"of {name} (a corrupt or altered file; download it again)"
            )
    else:
        note = f"{name} is not an official MedMNIST file name: read without a checksum"
    layout = "a .npz archive (numpy.savez) with keys " + ", ".join(_MEDMNIST_KEYS)
    try:
        z = np.load(path, allow_pickle=False)
    except ValueError:  # numpy: "pickled (object) data" for anything it cannot parse
        raise ValueError(f"data_file={path!r} is invalid: not a numpy .npz file; expected {layout}") from None
    except (OSError, EOFError) as exc:
        raise ValueError(f"data_file={path!r} is invalid: not a readable .npz ({exc})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"data_file={path!r} is invalid: a single .npy array; expected {layout}")
    try:
        with z:
            missing = [k for k in _MEDMNIST_KEYS if k not in z.files]
            if missing:
                raise ValueError(
                    f"data_file={path!r} is invalid: not in the MedMNIST layout "
                    f"(missing {', '.join(missing)})"
                )
            arrays = {k: np.asarray(z[k]) for k in _MEDMNIST_KEYS}
    except ValueError as exc:
        if "pickled" not in str(exc):
            raise
        raise ValueError(
            f"data_file={path!r} is invalid: it holds object arrays; expected {layout}"
        ) from None
    except (OSError, EOFError) as exc:
        raise ValueError(f"data_file={path!r} is invalid: not a readable .npz ({exc})") from None
    for split in ("train", "val", "test"):
        y = arrays[f"{split}_labels"].reshape(-1).astype(np.int64)
        if y.shape[0] != arrays[f"{split}_images"].shape[0]:
            raise ValueError(f"data_file={path!r} is invalid: {split} images and labels differ in count")
        arrays[f"{split}_labels"] = y
    return arrays, note


MEDMNIST_SIZES = (28, 64, 128, 224)


def _check_kind(name: str, path: str, arrays) -> None:
    """A file read as ``pneumoniamnist``/``breastmnist`` must look like one: grayscale square
    images (N, S, S) with S in ``MEDMNIST_SIZES`` and binary labels (both have 2 classes).

    Raises:
        ValueError: naming the file, what differs, and ``dataset='medmnist'`` for other files.
    """
    for split in ("train", "val", "test"):
        shape = tuple(arrays[f"{split}_images"].shape)
        if len(shape) != 3 or shape[1] != shape[2] or shape[1] not in MEDMNIST_SIZES:
            raise ValueError(
                f"data_file={path!r} is invalid for dataset={name!r}: {split}_images has shape {shape}, "
                f"expected (N, S, S) grayscale with S in {MEDMNIST_SIZES}; use --dataset medmnist for "
                "other MedMNIST-layout files"
            )
        labels = np.unique(arrays[f"{split}_labels"])
        if not set(labels.tolist()) <= {0, 1}:
            raise ValueError(
                f"data_file={path!r} is invalid for dataset={name!r}: {split}_labels has classes "
                f"{labels.tolist()[:8]}, expected 0 and 1; use --dataset medmnist for other files"
            )


def partition(
    labels, num_clients: int, scheme: str = "iid", *, alpha: float = 0.5, shards: int = 2, seed: int = 0
) -> list[np.ndarray]:
    """Split example indices 0..N−1 over ``num_clients`` clients.

    Args:
        labels: shape (N,), integer labels.
        num_clients: K ≥ 1, at most N.
        scheme: ``iid``, ``dirichlet`` (concentration ``alpha`` > 0) or ``shards`` (``shards``
            per client); see the module docstring.
        seed: the split's seed.

    Returns:
        K sorted int64 index arrays, disjoint, covering 0..N−1, each non-empty.

    Raises:
        ValueError: K outside [1, N], bad α or shard count, or a Dirichlet draw that leaves a
            client empty after 100 tries (raise α).
    """
    y = np.asarray(labels).reshape(-1)
    n = y.shape[0]
    K = check_int("num_clients", num_clients, minimum=1, maximum=max(1, n))
    check_choice("partition", scheme, PARTITIONS)
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    if scheme == "iid":
        return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(n), K)]
    if scheme == "shards":
        m = check_int("shards", shards, minimum=1)
        if K * m > n:
            raise ValueError(f"shards={m} is invalid: {K}·{m} shards exceed the {n} examples")
        order = np.argsort(y, kind="stable")
        pieces = np.array_split(order, K * m)
        perm = rng.permutation(K * m)
        return [np.sort(np.concatenate([pieces[j] for j in perm[k * m : (k + 1) * m]])) for k in range(K)]
    a = check_real("alpha", alpha, low=0.0, low_inclusive=False)
    classes = np.unique(y)
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(K)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            shares = rng.dirichlet(np.full(K, a))
            cuts = (np.cumsum(shares)[:-1] * idx.shape[0]).astype(int)
            for k, piece in enumerate(np.split(idx, cuts)):
                parts[k].append(piece)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if all(o.size for o in out):
            return out
    raise ValueError(f"alpha={a} is invalid: 100 Dirichlet draws left a client without data; raise alpha")


def _split_pool(x, y, x_test, y_test, name, source, num_clients, scheme, alpha, shards, seed, frac, notes):
    rng = np.random.default_rng(_SPLIT_SEED)
    order = rng.permutation(y.shape[0])
    n_agg = max(1, int(round(frac * y.shape[0])))
    agg, rest = order[:n_agg], order[n_agg:]
    parts = partition(y[rest], num_clients, scheme, alpha=alpha, shards=shards, seed=seed)
    return FederatedData(
        name,
        source,
        tuple(x[rest[p]] for p in parts),
        tuple(y[rest[p]] for p in parts),
        x[agg],
        y[agg],
        x_test,
        y_test,
        int(max(y.max(), y_test.max()) + 1),
        tuple(notes),
    )


def _breast_cancer_csv() -> str | None:
    """The path of scikit-learn's bundled ``breast_cancer.csv``, found without importing
    scikit-learn (≈0.7 s of imports), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "breast_cancer.csv")
        if os.path.isfile(path):
            return path
    return None


def load_breast_cancer_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The Wisconsin breast-cancer data of scikit-learn: features (569, 30) float64 and labels
    (569,) int64, the values of ``sklearn.datasets.load_breast_cancer()``.

    Read from scikit-learn's bundled CSV (header: samples, features, class names; then one row
    per patient, the label last) as its loader reads it; scikit-learn's loader when the file is
    not where it installs it.

    Raises:
        ImportError: scikit-learn is not installed.
    """
    path = _breast_cancer_csv()
    if path is None:
        from sklearn.datasets import load_breast_cancer

        d = load_breast_cancer()
        return d.data.astype(np.float64), d.target.astype(np.int64)
    import csv

    with open(path, encoding="utf-8") as f:
        rows = csv.reader(f)
        head = next(rows)
        n, d = int(head[0]), int(head[1])
        body = [row for row in rows if row]
    if len(body) != n or any(len(row) != d + 1 for row in body):
        raise ValueError(f"{path} is invalid: {len(body)} rows, its header says {n} of {d} features")
    x = np.array([row[:-1] for row in body], dtype=np.float64)
    y = np.array([int(row[-1]) for row in body], dtype=np.int64)
    return x, y


def load_federated(
    name: str,
    num_clients: int,
    *,
    data_file: str | None = None,
    partition_scheme: str = "iid",
    alpha: float = 0.5,
    shards: int = 2,
    seed: int = 0,
    aggregator_fraction: float = 0.1,
) -> FederatedData:
    """The data of a federated run: K client partitions, the aggregator split and the test split.

    Args:
        name: one of ``DATASETS``.
        num_clients: K ≥ 1.
        data_file: the ``.npz`` for the MedMNIST names (required there, refused otherwise).
        partition_scheme, alpha, shards: see ``partition``; ``seed`` seeds it.
        aggregator_fraction: share in (0, 0.5] of the stand-ins' training pool held out for the
            server (the MedMNIST files use their ``val`` split).

    Raises:
        ValueError: unknown name, a missing or superfluous ``data_file``, a checksum mismatch
            (``MedMNISTChecksumError``), bad partition arguments.
        FileNotFoundError: the data file, or Fashion-MNIST's folder, is absent.
    """
    check_choice("dataset", name, DATASETS)
    K = check_int("num_clients", num_clients, minimum=1)
    frac = check_real("aggregator_fraction", aggregator_fraction, low=0.0, high=0.5, low_inclusive=False)
    medmnist = name in ("pneumoniamnist", "breastmnist", "medmnist")
    if medmnist and data_file is None:
        raise ValueError(f"dataset={name!r} needs data_file (the .npz; it cannot be downloaded here)")
    if not medmnist and data_file is not None:
        raise ValueError(
            f"data_file is invalid with dataset={name!r}: only the MedMNIST data sets read a file"
        )
    check_choice("partition", partition_scheme, PARTITIONS)
    if medmnist:
        base = os.path.basename(data_file)
        if name != "medmnist" and not re.fullmatch(rf"{name}(_\d+)?\.npz", base) and base in MEDMNIST_MD5:
            raise ValueError(
                f"data_file={data_file!r} is invalid for dataset={name!r}: it is another data set"
            )
        arrays, note = load_medmnist(data_file)
        if name != "medmnist":
            _check_kind(name, data_file, arrays)
        x_tr, y_tr = _images(arrays["train_images"]), arrays["train_labels"]
        parts = partition(y_tr, K, partition_scheme, alpha=alpha, shards=shards, seed=seed)
        x_te, y_te = _images(arrays["test_images"]), arrays["test_labels"]
        return FederatedData(
            name,
            data_file,
            tuple(x_tr[p] for p in parts),
            tuple(y_tr[p] for p in parts),
            _images(arrays["val_images"]),
            arrays["val_labels"],
            x_te,
            y_te,
            int(max(y_tr.max(), y_te.max()) + 1),
            (note,) if note else (),
        )
    if name == "breast-cancer":
        x_all, y_all = load_breast_cancer_arrays()
        order = np.random.default_rng(_SPLIT_SEED).permutation(y_all.shape[0])
        n_test = int(round(0.2 * y_all.shape[0]))
        te, pool = order[:n_test], order[n_test:]
        mean, std = x_all[te].mean(axis=0), x_all[te].std(axis=0) + 1e-12
        x = ((x_all - mean) / std).astype(np.float32)[:, None, None, :]
        return _split_pool(
            x[pool], y_all[pool], x[te], y_all[te], name, "scikit-learn load_breast_cancer",
            K, partition_scheme, alpha, shards, seed, frac, (),
        )  # fmt: skip
    return _fashion_mnist_two(K, partition_scheme, alpha, shards, seed, frac)


def _fashion_mnist_two(K, scheme, alpha, shards, seed, frac) -> FederatedData:
    from dpmf.train.data import DatasetNotFoundError, load_dataset

    try:
        d = load_dataset("fashion-mnist", fallback=False)
    except DatasetNotFoundError:
        raise FileNotFoundError(
            f"dataset='fashion-mnist-2' needs Fashion-MNIST in {_FMNIST_DIR} (Debian's "
            "dataset-fashion-mnist; scripts/setup.sh installs it); use --dataset breast-cancer instead"
        ) from None
    a, b = _FMNIST_CLASSES

    def pick(x, y, limit):
        y = y.numpy()
        keep = np.flatnonzero((y == a) | (y == b))
        keep = np.sort(np.random.default_rng(_SPLIT_SEED).permutation(keep)[:limit])
        return x.numpy()[keep], (y[keep] == b).astype(np.int64)

    x, y = pick(d.train_x, d.train_y, _FMNIST_MAX_POOL)
    x_te, y_te = pick(d.test_x, d.test_y, _FMNIST_MAX_TEST)
    src = f"{d.source} (classes T-shirt/top=0, shirt=1; {y.shape[0]} + {y_te.shape[0]} examples)"
    return _split_pool(x, y, x_te, y_te, "fashion-mnist-2", src, K, scheme, alpha, shards, seed, frac, ())
