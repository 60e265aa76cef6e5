"""Speed of ``dpmf pick``, in process (``--jobs 1``) and on worker processes (``--jobs N``).

Setting (default): N = 60000, B = 256, 10 epochs (n = 2350 steps), ε = 3, δ = 1e-5, exponential
learning-rate decay β = 0.1, at most 64 bands: 32 candidates, among them bsr_opt:64,
bisr_opt:64, blt:2, blt:4 and lcgd_opt, and seven PLD calibrations (DP-SGD and cyclic Poisson
sampling with 2 … 64 bands). Target: under 30 s wall on a quiet 2-core machine, with the
recommendation bsr_opt:64 at σ·MeanSE 7.91 (or a better one).

The script times ``dpmf.pick.pick`` (the function behind the command; the interpreter start and
the imports, about a second, are not included) with each ``--jobs`` value, interleaved over
``--repeat`` rounds, and prints per value the median wall time and process CPU time (workers
included), the ratio of the wall time to the in-process baseline (``jobs = 1``) measured in the
same run, and the recommendation. It checks that every run ranked the same candidates with the
same σ and errors (to the last bit).

Usage:
    python benchmarks/bench_pick.py [--repeat 3] [--jobs 1,2] [--epochs 10] [--max-bands 64]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpmf.pick import default_jobs, pick  # noqa: E402
from dpmf.workloads import Schedule  # noqa: E402

TARGET_SECONDS = 30.0
REFERENCE = ("bsr_opt:64", 7.91)  # the recommendation before this speed-up, σ·MeanSE rounded


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _fingerprint(result) -> tuple:
    """Everything in the result except the timings."""
    return tuple(
        (e.factorization, e.scheme, e.noise_multiplier, e.sensitivity, e.max_se, e.mean_se, e.epsilon)
        for e in result.ranking
    ) + tuple(result.skipped)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=_ints, default=None, help="default: 1 and one per core")
    parser.add_argument("--dataset-size", type=int, default=60000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-bands", type=int, default=64)
    args = parser.parse_args(argv)
    jobs = args.jobs or sorted({1, max(2, default_jobs())})
    if 1 not in jobs:
        jobs = [1] + jobs  # the baseline
    N, B = args.dataset_size, args.batch_size
    steps = args.epochs * (-(-N // B))
    run = dict(
        dataset_size=N,
        batch_size=B,
        steps=steps,
        epsilon=3.0,
        delta=1e-5,
        schedule=Schedule("exponential", 0.1),
        max_bands=args.max_bands,
        progress=False,
    )
    print(
        f"cpus={os.cpu_count()} usable={default_jobs()} load_average={os.getloadavg()} "
        f"N={N} B={B} steps={steps} max_bands={args.max_bands} repeat={args.repeat}"
    )
    wall: dict[int, list[float]] = {j: [] for j in jobs}
    cpu: dict[int, list[float]] = {j: [] for j in jobs}
    results = {}
    for r in range(args.repeat):
        order = jobs if r % 2 == 0 else jobs[::-1]  # interleaved, alternating order
        for j in order:
            c0, t0 = _cpu_seconds(), time.perf_counter()
            res = pick(**run, jobs=j)
            wall[j].append(time.perf_counter() - t0)
            cpu[j].append(_cpu_seconds() - c0)
            results.setdefault(j, []).append(res)
            print(f"  round {r + 1} jobs={j}: {wall[j][-1]:.1f} s wall, {cpu[j][-1]:.1f} s CPU", flush=True)
    base = statistics.median(wall[1])
    head = f"{'jobs':>4} {'wall_s':>8} {'cpu_s':>8} {'ratio':>6} {'recommendation':<16} {'sigma':>8}"
    print(f"{head} {'s*MeanSE':>9}")
    prints = {_fingerprint(res) for rs in results.values() for res in rs}
    ok = len(prints) == 1
    for j in jobs:
        rec = results[j][0].recommendation
        med = statistics.median(wall[j])
        print(
            f"{j:>4} {med:>8.2f} {statistics.median(cpu[j]):>8.2f} {med / base:>6.2f} "
            f"{rec.factorization:<16} {rec.noise_multiplier:>8.5f} {rec.noise_mean_se:>9.4f}"
        )
    rec = results[jobs[-1]][0].recommendation
    best = min(statistics.median(wall[j]) for j in jobs)
    print(f"identical results for every jobs and round: {'yes' if ok else 'NO'}")
    same = True
    if (N, B, args.epochs, args.max_bands) == (60000, 256, 10, 64):  # the reference setting
        same = rec.factorization == REFERENCE[0] and round(rec.noise_mean_se, 2) <= REFERENCE[1]
        print(
            f"recommendation {rec.factorization} σ·MeanSE {rec.noise_mean_se:.4f} "
            f"(reference {REFERENCE[0]} {REFERENCE[1]}): {'same or better' if same else 'DIFFERENT'}"
        )
    verdict = "met" if best < TARGET_SECONDS else "MISSED"
    print(f"fastest median {best:.1f} s, target < {TARGET_SECONDS:g} s: {verdict}")
    return 0 if ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
