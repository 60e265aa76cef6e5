"""Speed of ``dpmf curves`` with the nuclear-norm lower bound.

Cases and targets (wall time of the whole command on a quiet 2-core machine):

* ``--schedule exponential --beta 0.1 --n 16384 --factorizations sqrt_prefix,lr_aware``: < 5 s;
* ``--schedule constant --n 100000 --factorizations sqrt_prefix``: < 30 s.

Each case runs as the user runs it, ``python -m dpmf curves … --out DIR`` in a fresh
interpreter (CSV and figure written), with the lower bound and, as the baseline measured in the
same run, with ``--no-lower-bound``; a third command, the interpreter importing what the
command imports (``dpmf.cli``, the sweeps and matplotlib), shows how much of the time is start-up.
The three are interleaved over ``--repeat`` rounds; the script prints medians, the ratio of the
command with the bound to the one without, and whether the target was met.

Usage:
    python benchmarks/bench_curves.py [--repeat 3] [--case exponential|constant|all]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CASES = {
    "exponential": (
        [
            "--schedule",
            "exponential",
            "--beta",
            "0.1",
            "--n",
            "16384",
            "--factorizations",
            "sqrt_prefix,lr_aware",
        ],
        5.0,
    ),
    "constant": (["--schedule", "constant", "--n", "100000", "--factorizations", "sqrt_prefix"], 30.0),
}
IMPORTS = "import dpmf.cli, dpmf.mechanisms.sweeps, dpmf.plots, matplotlib.pyplot"


def _seconds(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--case", choices=("all", *CASES), default="all")
    args = parser.parse_args(argv)
    print(f"cpus={os.cpu_count()} load_average={os.getloadavg()} repeat={args.repeat}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, (flags, target) in CASES.items():
            if args.case not in ("all", name):
                continue
            base = [sys.executable, "-m", "dpmf", "curves", *flags, "--out", tmp, "--no-progress"]
            cmds = {
                "imports only": [sys.executable, "-c", IMPORTS],
                "no bound": base + ["--no-lower-bound"],
                "with bound": base,
            }
            times: dict[str, list[float]] = {k: [] for k in cmds}
            table = ""
            for r in range(args.repeat):
                order = list(cmds) if r % 2 == 0 else list(cmds)[::-1]
                for label in order:
                    secs, out = _seconds(cmds[label])
                    times[label].append(secs)
                    if label == "with bound":
                        table = out
            med = {k: statistics.median(v) for k, v in times.items()}
            met = med["with bound"] < target
            ok &= met
            print(f"case {name}: dpmf curves {' '.join(flags)}")
            for label in cmds:
                runs = ", ".join(f"{t:.2f}" for t in times[label])
                print(f"  {label:<13} median {med[label]:7.2f} s  (runs: {runs})")
            print(
                f"  with bound / no bound = {med['with bound'] / med['no bound']:.2f}; "
                f"target < {target:g} s: {'met' if met else 'MISSED'}"
            )
            print("  " + "\n  ".join(table.strip().splitlines()[:-1]))  # the table, not the paths
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
