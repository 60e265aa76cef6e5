"""The compliance-aware FL experiment grid from the command line (aggregator mode, Flower).

Five strategies × Experiment 1 (16 clients, 4 compliant and 12 lower-compliance) vs
Experiment 4 (the 4 compliant ones only) × weighted vs uniform noise at equal mean, on the
offline stand-ins, several seeds; then the paired differences, the first round's noise cost and
each privacy mode's ε with its unit. Writes ``OUT/grid.csv``, ``OUT/first_round.csv`` and
``OUT/epsilons.csv`` and prints the tables.

    python benchmarks/fl_compliance.py --rounds 15 --seeds 0-4 --out out/fl_grid
    python benchmarks/fl_compliance.py --datasets pneumoniamnist --data-file pneumoniamnist.npz ...
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dpmf._io import atomic_write_csv  # noqa: E402
from dpmf.federated.experiment import (  # noqa: E402
    compliance_grid,
    first_round_cost,
    mode_epsilons,
    paired_differences,
    summary_table,
)
from dpmf.federated.ledger import format_entry  # noqa: E402
from dpmf.federated.report import mean_sd, parse_seeds  # noqa: E402
from dpmf.federated.strategies import STRATEGIES  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="breast-cancer,fashion-mnist-2")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seeds", default="0-4")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--data-file", default=None, help="the .npz for pneumoniamnist|breastmnist|medmnist")
    p.add_argument("--out", default="out/fl_grid")
    a = p.parse_args(argv)
    from dpmf.federated.run import FLConfig

    base = FLConfig(data_file=a.data_file) if a.data_file else None
    import torch

    torch.set_num_threads(1)
    datasets, strategies, seeds = a.datasets.split(","), a.strategies.split(","), parse_seeds(a.seeds)
    began = time.perf_counter()

    def progress(done, total, row):
        if done % 10 == 0 or done == total:
            print(f"  {done}/{total} cells, {time.perf_counter() - began:.0f} s", flush=True)

    rows = compliance_grid(
        datasets,
        strategies,
        rounds=a.rounds,
        seeds=seeds,
        num_clients=a.clients,
        progress=progress,
        base=base,
    )
    cols = list(rows[0])
    atomic_write_csv(os.path.join(a.out, "grid.csv"), cols, [[r[c] for c in cols] for r in rows])
    print(f"\ntest accuracy after {a.rounds} rounds, mean ± sd over {len(seeds)} seeds (aggregator mode)")
    for r in summary_table(rows):
        print(f"  {r['dataset']:<16} {r['strategy']:<10} exp {r['experiment']} {r['allocation']:<9} "
              f"{100 * r['mean']:6.2f} ± {100 * r['sd']:5.2f} %")  # fmt: skip
    for title, factor, x, y in (
        ("Experiment 1 − Experiment 4 (weighted)", "experiment", 1, 4),
        ("weighted − uniform (Experiment 1)", "allocation", "weighted", "uniform"),
    ):
        print(f"\n{title}, percentage points, paired by seed")
        sub = [r for r in rows if (factor == "experiment" and r["allocation"] == "weighted")
               or (factor == "allocation" and r["experiment"] == 1)]  # fmt: skip
        for d in paired_differences(sub, factor, x, y):
            print(f"  {d['dataset']:<16} {d['strategy']:<10} {100 * d['mean']:+6.2f} ± {100 * d['sd']:5.2f} "
                  f"(n={d['n']}, range {100 * d['min']:+.1f} … {100 * d['max']:+.1f})")  # fmt: skip
    cost = first_round_cost(datasets, seeds=seeds, num_clients=a.clients, base=base)
    atomic_write_csv(os.path.join(a.out, "first_round.csv"), list(cost[0]), [list(r.values()) for r in cost])
    print("\nfirst-round noise cost (FedAvg, Experiment 1): round-1 accuracy without − with server noise")
    for d in datasets:
        m, s = mean_sd([r["cost"] for r in cost if r["dataset"] == d])
        print(f"  {d:<16} {100 * m:+.2f} ± {100 * s:.2f} pp")
    print(f"\nε of each privacy mode (FedAvg, {a.rounds} rounds, seed {seeds[0]})")
    erows = []
    for d in datasets:
        for m in mode_epsilons(d, rounds=a.rounds, num_clients=a.clients, seed=seeds[0], base=base):
            e = m["entry"]
            erows.append([d, m["mode"], e.subject, e.protects, "inf" if math.isinf(e.epsilon) else e.epsilon,
                          e.delta, e.vacuous])  # fmt: skip
            print(f"  {d:<16} {m['mode']:<10} {format_entry(e)}")
    atomic_write_csv(
        os.path.join(a.out, "epsilons.csv"),
        ("dataset", "mode", "subject", "protects", "epsilon", "delta", "vacuous"),
        erows,
    )
    print(f"\n{time.perf_counter() - began:.0f} s in all; wrote {a.out}/{{grid,first_round,epsilons}}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
