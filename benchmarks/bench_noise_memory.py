"""State memory and time per step of the streaming correlated-noise generators.

For each strategy, the generator chosen by ``noise_for_factorization`` (and BLT noise with the
given buffers) runs ``--steps`` steps on d = ``--dim`` coordinates. Printed per generator: the
documented state bound, the state measured from the tensors it holds between steps (after the
last step), both in MB at float32, and the median time of a step relative to independent noise
(DP-SGD, measured in the same run).

Usage:
    python benchmarks/bench_noise_memory.py [--dim 2748890] [--steps 64] [--bands 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpmf.mechanisms import factorize  # noqa: E402
from dpmf.optim.noise import BLTNoise, noise_for_factorization  # noqa: E402
from dpmf.workloads import Schedule, from_schedule, prefix_sum  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=2_748_890, help="noised coordinates (default: WRN-16-4)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--bands", type=int, default=16)
    args = ap.parse_args()
    n, p, d = args.steps, args.bands, args.dim
    chi = from_schedule(Schedule("exponential", 0.1), n)
    makers = {
        "identity": lambda: noise_for_factorization(factorize(prefix_sum(n), "identity"), d, seed=0),
        f"bisr:{p} (buffer)": lambda: noise_for_factorization(
            factorize(prefix_sum(n), f"bisr:{p}"), d, seed=0
        ),
        f"bisr:{p} (regenerate)": lambda: noise_for_factorization(
            factorize(prefix_sum(n), f"bisr:{p}"), d, seed=0, mode="regenerate"
        ),
        f"bsr:{p}": lambda: noise_for_factorization(factorize(prefix_sum(n), f"bsr:{p}"), d, seed=0),
        "lcgd:0.5 (buffer)": lambda: noise_for_factorization(factorize(prefix_sum(n), "lcgd:0.5"), d, seed=0),
        "lcgd:0.5 (regenerate)": lambda: noise_for_factorization(
            factorize(prefix_sum(n), "lcgd:0.5"), d, seed=0, mode="regenerate"
        ),
        "blt, 4 buffers": lambda: BLTNoise(
            [0.3, 0.15, 0.08, 0.04], [0.95, 0.8, 0.5, 0.2], d, seed=0, steps=n
        ),
        "sqrt_prefix (full Toeplitz)": lambda: noise_for_factorization(
            factorize(prefix_sum(n), "sqrt_prefix"), d, seed=0
        ),
        "sqrt of A_chi (dense)": lambda: noise_for_factorization(factorize(chi, "sqrt"), d, seed=0),
    }
    print(f"d = {d} coordinates, n = {n} steps, float32 (4 bytes per entry)")
    print(
        f"{'generator':<30} {'class':<22} {'documented MB':>14} {'measured MB':>12} "
        f"{'ms/step':>9} {'× identity':>11}"
    )
    base = None
    warm = makers["identity"]()
    for _ in range(3):  # warm up the allocator and the random-number kernels
        warm.next()
    for label, make in makers.items():
        gen = make()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            gen.next()
            times.append(time.perf_counter() - t0)
            assert gen.state_numel() <= gen.documented_state_numel
        med = statistics.median(times)
        base = base or med
        print(
            f"{label:<30} {type(gen).__name__:<22} {gen.documented_state_numel * 4 / 1e6:>14.2f} "
            f"{gen.state_bytes() / 1e6:>12.2f} {1000 * med:>9.2f} {med / base:>11.2f}"
        )
    print("(full Toeplitz and dense regenerate all past noises: time grows with t, memory does not)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
