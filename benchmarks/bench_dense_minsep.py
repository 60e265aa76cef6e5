"""The dense optimizer under min_sep participation: time, certified gap, independent check.

Cases (``dpmf.mechanisms.optimize_dense(workload, Participation.separated(b, k))``; on the
command line ``dpmf curves --factorizations dense --participation min_sep --min-sep b
--max-participations k``):

* exponential decay β = 0.1, n = 64, b = 16, k = 4: must reach a certified relative gap ≤ 1e-3
  (``DENSE_MAX_GAP``, the guard of ``factorize(..., "dense")``); its certificate is the dual
  bound (cvxpy would need its 57360 (set, sign) constraints: minutes and gigabytes);
* the prefix sum for n = 3 … 9 with min_sep(1, 3) (any steps may be participations: many
  admissible sets for so few steps), each also checked against the cvxpy/Clarabel optimum of
  the same convex program (``dense_cvxpy``);
* exponential decay β = 0.1, n = 128, b = 32, k = 4: under 120 s with the gap reached.

For every case the script also solves the same workload under single participation (no
cutting planes) in the same run and prints the ratio of the min_sep time to it: the price of
the participation constraints.

Usage:
    python benchmarks/bench_dense_minsep.py [--skip-large] [--no-cvxpy]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpmf.mechanisms import optimize_dense  # noqa: E402
from dpmf.mechanisms.participation import Participation  # noqa: E402
from dpmf.mechanisms.registry import DENSE_MAX_GAP  # noqa: E402
from dpmf.workloads import Schedule, from_schedule  # noqa: E402

# (label, schedule, beta, n, b, k, time target in seconds or None, cvxpy check)
CASES = [
    ("exp n=64 b=16 k=4", "exponential", 0.1, 64, 16, 4, None, False),
    *[(f"prefix n={n} b=1 k=3", "constant", 1.0, n, 1, 3, None, True) for n in range(3, 10)],
    ("exp n=128 b=32 k=4", "exponential", 0.1, 128, 32, 4, 120.0, False),
]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skip-large", action="store_true", help="leave out n = 128")
    parser.add_argument("--no-cvxpy", action="store_true", help="skip the cvxpy cross-checks")
    args = parser.parse_args(argv)
    check = not args.no_cvxpy
    if check:
        try:
            from dpmf.mechanisms.dense_cvxpy import dense_cvxpy
        except ImportError:
            check = False
    print(f"cpus={os.cpu_count()} load_average={os.getloadavg()} gap guard={DENSE_MAX_GAP:g}")
    print(
        f"{'case':<20} {'single_s':>8} {'minsep_s':>8} {'ratio':>6} {'outer':>5} {'newton':>6} "
        f"{'mean_se':>11} {'lower':>11} {'gap':>8} {'cvxpy':>11} {'rel_diff':>8} {'verdict':>7}"
    )
    ok = True
    for label, sched, beta, n, b, k, target, cvx in CASES:
        if args.skip_large and n > 64:
            continue
        w = from_schedule(Schedule(sched, beta), n)
        _, base = _timed(lambda w=w: optimize_dense(w))
        res, secs = _timed(lambda w=w, b=b, k=k: optimize_dense(w, Participation.separated(b, k)))
        cvx_value = diff = None
        if check and cvx:
            cvx_value = dense_cvxpy(w, Participation.separated(b, k)).value
            diff = res.value / cvx_value - 1.0
        met = res.gap <= DENSE_MAX_GAP and (target is None or secs < target)
        met &= diff is None or abs(diff) <= 2 * DENSE_MAX_GAP  # within the solvers' tolerances
        ok &= met
        cvx_text = f"{cvx_value:>11.6f} {diff:>8.1e}" if diff is not None else f"{'-':>11} {'-':>8}"
        print(
            f"{label:<20} {base:>8.2f} {secs:>8.2f} {secs / base:>6.1f} {res.outer_iterations:>5} "
            f"{res.iterations:>6} {res.value:>11.6f} {res.lower_bound:>11.6f} {res.gap:>8.1e} "
            f"{cvx_text} {'met' if met else 'MISSED':>7}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
