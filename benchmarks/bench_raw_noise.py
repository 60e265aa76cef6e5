"""Raw noise z_t against ``torch.randn(d)`` on the same device, in one run.

For each generator (``device``: torch's generator where the parameters live; ``numpy-philox``:
numpy's, copied to the device) and each keying (one stream per step; by parameter and chunk,
as a distributed run keys it), the median over interleaved repetitions of one
``CorrelatedNoise.raw_noise(t)`` and of ``torch.randn(d)``, and their ratio. Targets: ≤ 1.3× on
a CPU, ≤ 1.5× on CUDA (where the device generator never copies from the host).

Usage:
    python benchmarks/bench_raw_noise.py [--dim 10000000] [--reps 15] [--device cpu|cuda]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

try:
    import dpmf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dpmf.mechanisms import factorize  # noqa: E402
from dpmf.optim.noise import ChunkedKeys, noise_for_factorization  # noqa: E402
from dpmf.workloads import prefix_sum  # noqa: E402


def _timer(device):
    def run(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    d, key = args.dim, 2**200 + 7
    strategy = factorize(prefix_sum(args.reps + 2), "identity")
    sizes = (d // 2, d - d // 2)  # two "parameters", chunked at 65,536 entries
    streams = {}
    for generator in ("device", "numpy-philox"):
        for keying in ("stream", "chunked"):
            keys = ChunkedKeys(sizes) if keying == "chunked" else None
            s = noise_for_factorization(strategy, d, seed=key, device=device, keys=keys)
            if generator != "device":
                s.use_generator(generator)
            streams[f"{s.generator.name} ({keying})"] = s
    time_it = _timer(device)
    times: dict[str, list[float]] = {"torch.randn": [], **{k: [] for k in streams}}
    for i in range(args.reps):  # interleaved
        times["torch.randn"].append(time_it(lambda: torch.randn(d, device=device)))
        for name, s in streams.items():
            times[name].append(time_it(lambda s=s, i=i: s.raw_noise(i)))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"raw noise, d = {d:,} on {device} (median of {args.reps} interleaved, one thread)")
    base = med["torch.randn"]
    print(f"  {'torch.randn':34s} {base:8.2f} ms  1.00×")
    for name in streams:
        print(f"  {name:34s} {med[name]:8.2f} ms  {med[name] / base:.2f}×")
    if args.json:
        out = {
            "dim": d,
            "device": str(device),
            "median_ms": med,
            "ratio": {k: v / base for k, v in med.items()},
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
