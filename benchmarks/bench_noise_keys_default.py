"""What chunked noise keys cost against single-stream keys, in a whole private step.

One private step (per-example gradients, clipping, noise, division) on the CNN (MNIST shapes)
and on a wide MLP (hidden 2048, ~1.6 M parameters), with the plan's noise stream keyed per
step (``stream``) or per (step, parameter, chunk) (``chunked``). Rounds are interleaved (both
keyings once per round), so load on a shared machine hits both alike; medians of thread time.

Usage:
    PYTHONPATH=. python benchmarks/bench_noise_keys_default.py [--batch 128] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from dpmf.step import noise_stream

try:
    import dpmf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpmf.optim.clipping import trainable_parameters  # noqa: E402
from dpmf.optim.noise import ChunkedKeys  # noqa: E402
from dpmf.optim.privatize import Privatizer  # noqa: E402
from dpmf.plan import PrivatePlan  # noqa: E402
from dpmf.train.models import MLP, build_model  # noqa: E402


def _model(name):
    if name == "mlp-wide":
        torch.manual_seed(0)
        return MLP((1, 28, 28), 10, hidden=(2048,))
    return build_model(name, (1, 28, 28), 10, seed=0)


def _privatizer(name, keys, plan):
    model = _model(name)
    sizes = tuple(p.numel() for _, p in trainable_parameters(model))
    noise = noise_stream(plan, sum(sizes), 1, keys=ChunkedKeys(sizes) if keys == "chunked" else None)
    return Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise), sum(sizes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--models", default="cnn,mlp-wide")
    ap.add_argument("--strategy", default="bsr:4")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    plan = PrivatePlan(
        60000,
        args.batch,
        steps=args.reps + 2,
        strategy=args.strategy,
        scheme="fixed_order",
        noise_multiplier=1.0,
    )
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))
    for name in args.models.split(","):
        privs = {k: _privatizer(name, k, plan) for k in ("stream", "chunked")}
        times = {k: [] for k in privs}
        for p, _ in privs.values():  # warm-up
            p.privatize(x, y)
        for _ in range(args.reps):
            for k, (p, _) in privs.items():
                t0 = time.thread_time()
                p.privatize(x, y)
                times[k].append(time.thread_time() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        d = privs["stream"][1]
        print(
            f"{name} d={d}: stream {med['stream']:.2f} ms, chunked {med['chunked']:.2f} ms, "
            f"chunked/stream = {med['chunked'] / med['stream']:.3f}"
        )


if __name__ == "__main__":
    main()
