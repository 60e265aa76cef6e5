"""Host synchronisations of one private step, counted, against the model's size and Opacus.

A host synchronisation is an aten op that hands a tensor's value to Python: ``.item()``,
``bool(t)`` and ``float(t)`` (``_local_scalar_dense``), ``torch.equal`` and ``nonzero``. On a GPU
each one waits for the stream; on CPU it costs little, so the count, not the time, is what this
script measures. Counted with a ``TorchDispatchMode`` over one ``backward`` + ``optimizer.step()``
of the README's loop (``make_private``, identity strategy, Poisson sampling, book-keeping
clipping and ghost), after two warm-up steps, for MLPs of 3, 10 and 34 linear layers (6, 20 and
68 parameter tensors); Opacus 1.6.0's ``make_private`` (hooks) on the same model and batch as
the baseline.

Usage:
    python benchmarks/bench_host_syncs.py [--layers 3,10,34] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import dpmf  # noqa: E402

SYNC_OPS = ("_local_scalar_dense", "equal", "nonzero", "is_nonzero")


class SyncCounter(TorchDispatchMode):
    """Counts the aten ops that move a tensor's value to the host."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _mlp(layers: int, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Flatten(), nn.Linear(16, width)]
    for _ in range(layers - 2):
        mods += [nn.ReLU(), nn.Linear(width, width)]
    mods += [nn.ReLU(), nn.Linear(width, 10)]
    return nn.Sequential(*mods)


def _data(n: int = 640):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def ours(layers: int, batch_size: int, clipping: str) -> int:
    model = _mlp(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private = dpmf.make_private(
            model, optimizer, data, loss_fn=F.cross_entropy, batch_size=batch_size, epochs=1,
            noise_multiplier=1.0, clip_norm=1.0, factorization="identity", scheme="poisson",
            clipping=clipping, target_delta=1e-5,
        )  # fmt: skip
    batches = iter(private.data_loader)
    for _ in range(2):
        x, y = next(batches)
        private.backward(x, target=y)
        private.optimizer.step()
        private.optimizer.zero_grad()
    x, y = next(batches)
    with SyncCounter() as c:
        private.backward(x, target=y)
        private.optimizer.step()
    return sum(c.counts.values())


def opacus(layers: int, batch_size: int) -> int | None:
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return None
    model = _mlp(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )
    batches = iter(loader)
    for _ in range(2):
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    x, y = next(batches)
    with SyncCounter() as c:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return sum(c.counts.values())


def main(argv=None) -> None:
    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="3,10,34")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    print(f"{'tensors':>8} {'bk':>5} {'ghost':>6} {'opacus':>7}")
    for layers in (int(k) for k in args.layers.split(",")):
        bk, ghost = ours(layers, args.batch_size, "bk"), ours(layers, args.batch_size, "ghost")
        op = opacus(layers, args.batch_size)
        print(f"{2 * layers:>8} {bk:>5} {ghost:>6} {'-' if op is None else op:>7}")


if __name__ == "__main__":
    main()
