"""Learning-rate-aware strategies at production scale: factorize + evaluate per schedule.

For each n, schedule (β = 0.1) and strategy the script times ``factorize`` and ``evaluate``
(MaxSE and MeanSE, single participation, no lower bound) once and prints them with the values.
Targets: n = 10⁶ under 10 s and n = 10⁷ under 60 s per (schedule, strategy) on one core.

Usage:
    python benchmarks/bench_lr_scale.py [--n 1000000,10000000]
        [--strategies lr_aware,lr_bsr:64,lr_bisr:64] [--schedules constant,exponential,...]
        [--gamma 1.5]

``--gamma`` sets the power of the polynomial and inverse_power schedules (the others have
none), e.g. ``--schedules polynomial --gamma 1.5`` for a fractional power. The CPU seconds of
the process (user + system) are printed at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpmf.mechanisms import evaluate, factorize  # noqa: E402
from dpmf.workloads import SCHEDULES, Schedule, from_schedule  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="1000000,10000000")
    p.add_argument("--strategies", default="lr_aware,lr_bsr:64,lr_bisr:64")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--gamma", type=float, default=None, help="power of polynomial/inverse_power")
    args = p.parse_args(argv)
    print(
        f"{'n':>9} {'schedule':>14} {'strategy':>12} {'factorize s':>12} {'evaluate s':>11} "
        f"{'total s':>8} {'max_se':>14} {'mean_se':>14}"
    )
    for n in [int(float(x)) for x in args.n.split(",")]:
        for spec in args.strategies.split(","):
            for name in args.schedules.split(","):
                gamma = args.gamma if name in ("polynomial", "inverse_power") else None
                w = from_schedule(Schedule(name, 0.1, gamma), n)
                t0 = time.perf_counter()
                f = factorize(w, spec)
                t1 = time.perf_counter()
                ev = evaluate(f, with_lower_bound=False)
                t2 = time.perf_counter()
                print(
                    f"{n:>9} {name:>14} {spec:>12} {t1 - t0:12.2f} {t2 - t1:11.2f} {t2 - t0:8.2f} "
                    f"{ev.max_se:14.8f} {ev.mean_se:14.8f}",
                    flush=True,
                )
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"process CPU s: user {ru.ru_utime:.1f} system {ru.ru_stime:.1f}; "
        f"peak resident {ru.ru_maxrss / 1024:.0f} MB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
