"""Speed of ``dpmf pick``: in process (``jobs = 1``), on worker processes, and an older version.

Setting (default): N = 60000, B = 256, 10 epochs (n = 2350 steps), ε = 3, δ = 1e-5, exponential
learning-rate decay β = 0.1, at most 64 bands: 32 candidates, among them bsr_opt:64,
bisr_opt:64, blt:2, blt:4 and lcgd_opt, and seven PLD calibrations (DP-SGD and cyclic Poisson
sampling with 2 … 64 bands). Target: under 30 s wall on a quiet 2-core machine, with the
recommendation bsr_opt:64 at σ·MeanSE 7.91 (or a better one).

Every run is ``dpmf.pick.pick`` in a fresh interpreter (as ``dpmf pick`` runs; the start and the
imports, a second or two, are included). Variants: this tree with ``jobs = 1`` (the baseline,
measured in the same run) and with each other ``--jobs`` value, and, with ``--old DIR``, the
``dpmf`` package found in DIR (e.g. ``git archive <commit> dpmf | tar -x -C DIR``; called
without ``jobs`` when it does not take it). The variants are interleaved over ``--repeat``
rounds, in alternating order; the script prints per variant the median wall time and CPU time
(workers included), the ratio of the wall time to the baseline, and the recommendation, and
checks that every run of this tree ranked the same candidates with the same σ and errors (to
the last bit) and how the old version's table compares (to the printed 4 decimals).

Usage:
    python benchmarks/bench_pick.py [--repeat 3] [--jobs 2] [--old DIR] [--epochs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TARGET_SECONDS = 30.0
REFERENCE = ("bsr_opt:64", 7.91)  # the recommendation before the speed-up, σ·MeanSE rounded

SCRIPT = """
import inspect, json, sys
from dpmf.pick import pick
from dpmf.workloads import Schedule
N, B, E, P, jobs = (int(x) for x in sys.argv[1:6])
kw = dict(dataset_size=N, batch_size=B, steps=E * (-(-N // B)), epsilon=3.0, delta=1e-5,
          schedule=Schedule("exponential", 0.1), max_bands=P, progress=False)
if "jobs" in inspect.signature(pick).parameters:
    kw["jobs"] = jobs
res = pick(**kw)
rows = [[e.factorization, e.scheme, e.noise_multiplier, e.sensitivity, e.max_se, e.mean_se,
         e.noise_max_se, e.noise_mean_se, e.epsilon] for e in res.ranking]
print(json.dumps({"rows": rows, "skipped": [list(s) for s in res.skipped]}))
"""


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _children_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def _run(src: str, setting: list[int], jobs: int) -> tuple[float, float, dict]:
    """(wall s, CPU s, result) of one pick in a fresh interpreter importing dpmf from ``src``."""
    env = dict(os.environ, PYTHONPATH=src)
    c0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, setting), str(jobs)],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return time.perf_counter() - t0, _children_cpu() - c0, json.loads(out.strip().splitlines()[-1])


def _printed(rows) -> list:
    """The table as ``dpmf pick`` prints it: σ, sens and errors to 4 decimals."""
    return [[r[0], r[1]] + [f"{x:.4f}" for x in r[2:]] for r in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=_ints, default=[2], help="worker counts besides the baseline 1")
    parser.add_argument("--old", default=None, help="a folder holding an older dpmf package")
    parser.add_argument("--dataset-size", type=int, default=60000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-bands", type=int, default=64)
    args = parser.parse_args(argv)
    setting = [args.dataset_size, args.batch_size, args.epochs, args.max_bands]
    variants = {"jobs=1": (ROOT, 1)}
    variants.update({f"jobs={j}": (ROOT, j) for j in args.jobs if j != 1})
    if args.old:
        variants["old"] = (os.path.abspath(args.old), 1)
    print(
        f"cpus={os.cpu_count()} load_average={os.getloadavg()} N={setting[0]} B={setting[1]} "
        f"epochs={setting[2]} max_bands={setting[3]} repeat={args.repeat}"
    )
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeat):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            src, jobs = variants[name]
            secs, cpu_s, res = _run(src, setting, jobs)
            wall[name].append(secs)
            cpu[name].append(cpu_s)
            results[name].append(res)
            print(f"  round {r + 1} {name}: {secs:.1f} s wall, {cpu_s:.1f} s CPU", flush=True)
    base = statistics.median(wall["jobs=1"])
    head = f"{'variant':<8} {'wall_s':>8} {'cpu_s':>8} {'ratio':>6} {'recommendation':<16} {'sigma':>8}"
    print(f"{head} {'s*MeanSE':>9}")
    for name in variants:
        rec = results[name][0]["rows"][0]
        med = statistics.median(wall[name])
        print(
            f"{name:<8} {med:>8.2f} {statistics.median(cpu[name]):>8.2f} {med / base:>6.2f} "
            f"{rec[0]:<16} {rec[2]:>8.5f} {rec[7]:>9.4f}"
        )
    ours = [json.dumps(res) for name in variants if name != "old" for res in results[name]]
    ok = len(set(ours)) == 1
    print(f"identical results for every jobs value and round: {'yes' if ok else 'NO'}")
    new_rows = results["jobs=1"][0]["rows"]
    if "old" in variants:
        old_rows = results["old"][0]["rows"]
        old_table, new_table = _printed(old_rows), _printed(new_rows)
        same = [row for row in new_table if row in old_table]
        print(f"rows printed identically by the old version: {len(same)} of {len(new_table)}")
        old_by = {row[0]: row for row in old_table}
        for row in new_table:
            if row not in old_table:
                print(f"  differs: {row[0]}: old {old_by.get(row[0])} new {row}")
    rec = new_rows[0]
    good = True
    if setting == [60000, 256, 10, 64]:  # the reference setting
        good = rec[0] == REFERENCE[0] and round(rec[7], 2) <= REFERENCE[1]
        print(
            f"recommendation {rec[0]} σ·MeanSE {rec[7]:.4f} (reference {REFERENCE[0]} {REFERENCE[1]}): "
            f"{'same or better' if good else 'DIFFERENT'}"
        )
    best = min(statistics.median(wall[name]) for name in variants if name != "old")
    verdict = "met" if best < TARGET_SECONDS else "MISSED"
    print(f"fastest median {best:.1f} s, target < {TARGET_SECONDS:g} s: {verdict}")
    return 0 if ok and good else 1


if __name__ == "__main__":
    raise SystemExit(main())
