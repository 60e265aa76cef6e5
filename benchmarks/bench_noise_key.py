"""What the keyed raw noise costs: one raw noise vector z_t and one private step on the CNN.

Run it in two checkouts to compare noise derivations (the script uses only ``plan.noise`` and
``Privatizer``, which every version has). Printed: the CNN's d, the median CPU time (thread
time, so a loaded machine distorts less) of a private step (CIFAR-10 shapes, batch ``--batch``)
and of one raw noise vector at d = 20 000, 200 000 and the CNN's d.

Usage:
    PYTHONPATH=<checkout> python benchmarks/bench_noise_key.py [--batch 256] [--reps 51]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from dpmf.step import noise_stream

try:  # PYTHONPATH picks the checkout to measure; else this one
    import dpmf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dpmf.optim.privatize import Privatizer  # noqa: E402
from dpmf.plan import PrivatePlan  # noqa: E402
from dpmf.train.models import build_model  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.thread_time()
        fn(i)
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=51)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = (3, 32, 32)
    model = build_model("cnn", shape, 10, seed=1)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = PrivatePlan(50_000, args.batch, steps=args.reps + 1, scheme="cyclic_poisson", strategy="bsr:4")
    plan = plan.with_noise(1.0)
    key = 2**200 + 12345
    priv = Privatizer(model, F.cross_entropy, plan=plan, clip_norm=1.0, noise=noise_stream(plan, d, key))
    x, y = torch.randn(args.batch, *shape), torch.randint(0, 10, (args.batch,))
    step = _median_ms(lambda i: priv.privatize(x, y), 9)
    print(f"CNN d = {d}: private step {step:.1f} ms (CPU, batch {args.batch})")
    for dim in (20_000, 200_000, d):
        gen = noise_stream(plan, dim, key)
        ms = _median_ms(lambda i, g=gen: g.raw_noise(i), args.reps)
        print(f"raw noise d = {dim}: {ms:.3f} ms ({100 * ms / step:.2f} % of the step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
