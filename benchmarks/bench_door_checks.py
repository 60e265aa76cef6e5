"""Cost of the private step's checks in ``dpmf.make_private``, per step, against the step itself.

Measured inside a real run (``make_private``, fixed-order batches from its data loader, SGD):

- ``record``: the batch's fingerprints as the loader yields it (``DrawnBatches.record``);
- ``check``: the comparison of the batch ``backward`` receives (``DrawnBatches.check``);
- ``draw state``: the sampler state kept per draw (``sampler.state_dict()`` in ``DrawnBatches.draw``);
- ``model guards``: the model/optimizer structure check and the parameter/buffer version
  snapshot and comparison around the forward/backward;
- ``step``: ``backward(return_loss=False)`` + ``optimizer.step()`` (checks included).

Usage:
    python benchmarks/bench_door_checks.py [--models mlp,cnn] [--batch-size 256] [--steps 15]
        [--threads 1]

Prints the medians over the steps (the first step, a warm-up, is left out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dpmf  # noqa: E402
from dpmf.optim import model_guard, privatize  # noqa: E402
from dpmf.train.models import build_model  # noqa: E402

SHAPES = {"cnn": (1, 28, 28), "cnn3": (3, 32, 32), "mlp": (1, 28, 28)}


def _timed(store: list, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store.append(time.perf_counter() - t0)

    return wrapper


def measure(name: str, batch: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = batch * steps
    x = torch.randn(n, *SHAPES[name], generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    model = build_model(name, SHAPES[name], 10, seed=0)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.TensorDataset(x, y),
        loss_fn=F.cross_entropy,
        batch_size=batch,
        steps=steps,
        noise_multiplier=1.0,
        factorization="identity",
        scheme="fixed_order",
        seed=0,
    )
    drawn = private.privatizer.drawn
    times = {k: [] for k in ("record", "check", "draw state", "model guards", "step")}
    drawn.record = _timed(times["record"], drawn.record)
    drawn.check = _timed(times["check"], drawn.check)
    drawn.sampler.state_dict = _timed(times["draw state"], drawn.sampler.state_dict)
    guards: list = []
    structure = private.privatizer.structure
    structure.check = _timed(guards, structure.check)
    privatize.state_versions = _timed(guards, model_guard.state_versions)
    privatize.check_state_unchanged = _timed(guards, model_guard.check_state_unchanged)
    for xb, yb in private.data_loader:
        before = len(guards)
        t0 = time.perf_counter()
        private.backward(xb, target=yb, return_loss=False)
        private.optimizer.step()
        times["step"].append(time.perf_counter() - t0)
        times["model guards"].append(sum(guards[before:]))
        private.optimizer.zero_grad()
    privatize.state_versions = model_guard.state_versions
    privatize.check_state_unchanged = model_guard.check_state_unchanged
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {args.batch_size}, CPU")
    for name in args.models.split(","):
        med = measure(name, args.batch_size, args.steps)
        params = sum(p.numel() for p in build_model(name, SHAPES[name], 10).parameters())
        print(f"model {name} ({params} parameters), medians over {args.steps - 1} steps")
        for k, v in med.items():
            share = "" if k == "step" else f"  ({100 * v / med['step']:.2f}% of the step)"
            print(f"  {k:<13} {1000 * v:9.3f} ms{share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
