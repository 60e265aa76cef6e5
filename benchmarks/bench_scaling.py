"""Cost of every strategy as the steps n and the model size d grow: a table and a log–log plot.

For each strategy and n (10³ … 10⁷) the script measures, once per point (the machine is
shared: single runs, not medians, beyond n = 10⁵):

* factorize: wall time and peak heap (tracemalloc) of ``factorize``;
* evaluate: wall time and peak heap of ``evaluate`` (MaxSE, MeanSE, single participation,
  no lower bound);
* noise per step: the median time of the last steps of the streaming generator
  (``noise_for_factorization``) on ``--dim`` coordinates (the last steps cost the most when past
  noise is regenerated);

and, for the model size d = 10⁴ … 10⁸, the bytes of noise state the generator holds between
steps at float32 (its documented count, checked against the tensors it allocates at d = 10⁴).
A strategy stops growing n once one point took more than ``--budget`` seconds (the larger n
are printed as skipped, with the reason); the dense strategy is capped by its own limit.

Workloads: the prefix sum for identity, sqrt_prefix, bsr, bisr, bisr_opt, lcgd, blt, dense;
the linear learning-rate schedule (β = 0.1) A_χ for lr_aware, lr_bsr, lr_bisr and sqrt.

Usage:
    python benchmarks/bench_scaling.py [--n 1000,10000,100000,1000000,10000000]
        [--strategies identity,sqrt_prefix,...] [--dim 10000] [--budget 60]
        [--csv out/scaling.csv] [--plot docs/scaling.png]
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time
import tracemalloc
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpmf.mechanisms import evaluate, factorize  # noqa: E402
from dpmf.workloads import Schedule, from_schedule, prefix_sum  # noqa: E402

STRATEGIES = (
    "identity",
    "sqrt_prefix",
    "bsr:16",
    "bisr:16",
    "lcgd:0.5",
    "blt:4",
    "bisr_opt:16",
    "lr_aware",
    "lr_bsr:16",
    "lr_bisr:16",
    "sqrt",
    "dense",
)
LR = ("lr_aware", "lr_bsr", "lr_bisr", "sqrt")
# the n beyond which a strategy refuses (its own limit), so the script does not try
CAPS = {"dense": 1024, "sqrt": 8192}
CAP_REASONS = {
    "dense": "not run beyond n = 1024 (O(n³) time; the strategy refuses beyond n = 8192)",
    "sqrt": "refused beyond n = 8192 (a dense n×n square root: O(n²) memory, O(n³) time)",
}
DIMS = (10**4, 10**5, 10**6, 10**7, 10**8)
NOISE_STEPS = 5


def workload_for(spec: str, n: int):
    name = spec.split(":")[0]
    return from_schedule(Schedule("linear", 0.1), n) if name in LR else prefix_sum(n)


def measured(fn):
    """(result, seconds, peak MB) of fn() under tracemalloc."""
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, seconds, peak / 1e6


def noise_point(fact, dim: int):
    """(median seconds of the last steps, state entries per coordinate, kind) of the generator."""
    from dpmf.optim.noise import noise_for_factorization

    gen = noise_for_factorization(fact, dim, seed=0)
    per_coord = gen.documented_state_numel / dim
    assert gen.state_numel() <= gen.documented_state_numel
    gen.step = max(0, fact.n - NOISE_STEPS)  # the costliest steps (regenerated past noise)
    times = []
    while gen.step < fact.n:
        t0 = time.perf_counter()
        gen.next()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), per_coord, type(gen).__name__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="1000,10000,100000,1000000,10000000")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--dim", type=int, default=10_000, help="coordinates for the noise timing")
    p.add_argument("--budget", type=float, default=60.0, help="seconds per point before n stops growing")
    p.add_argument("--noise-budget", type=float, default=1.0, help="seconds per noise step before skipping")
    p.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="NAME=N",
        help="largest n for a strategy (e.g. lr_aware=1000000); repeatable",
    )
    p.add_argument("--csv", default="out/scaling.csv")
    p.add_argument("--plot", default="docs/scaling.png")
    p.add_argument("--replot", metavar="CSV", help="only redraw --plot from a CSV this script wrote")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot, newline="") as fh:
            text = ("strategy", "generator", "skipped")
            rows = [
                {k: (v if k in text else float(v or "nan")) for k, v in r.items()} for r in csv.DictReader(fh)
            ]
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
        return 0
    ns = [int(float(x)) for x in args.n.split(",")]
    caps = dict(CAPS)
    for item in args.cap:
        name, _, value = item.partition("=")
        caps[name] = int(float(value))
    rows = []
    header = (
        f"{'strategy':<12} {'n':>9} {'fact s':>8} {'fact MB':>8} {'eval s':>8} {'eval MB':>8} "
        f"{'noise ms/step':>13} {'state/coord':>11}  generator"
    )
    print(header, flush=True)
    for spec in args.strategies.split(","):
        stop = None
        noise_slow = False
        for n in ns:
            cap = caps.get(spec.split(":")[0])
            if cap is not None and n > cap:
                base = spec.split(":")[0]
                stop = (
                    CAP_REASONS[base]
                    if base in CAPS and cap == CAPS[base]
                    else f"not run beyond n = {cap} (--cap, to keep the run short)"
                )
            if stop:
                print(f"{spec:<12} {n:>9} skipped: {stop}", flush=True)
                rows.append(dict(strategy=spec, n=n, skipped=stop))
                continue
            w = workload_for(spec, n)
            fact, t_f, m_f = measured(partial(factorize, w, spec))
            ev, t_e, m_e = measured(partial(evaluate, fact, with_lower_bound=False))
            t_noise, per_coord, kind = float("nan"), float("nan"), "-"
            if not noise_slow:
                t_noise, per_coord, kind = noise_point(fact, args.dim)
                noise_slow = t_noise > args.noise_budget
            row = dict(
                strategy=spec,
                n=n,
                factorize_s=t_f,
                factorize_mb=m_f,
                evaluate_s=t_e,
                evaluate_mb=m_e,
                noise_step_s=t_noise,
                state_per_coordinate=per_coord,
                generator=kind,
                max_se=ev.max_se,
                mean_se=ev.mean_se,
                skipped="",
            )
            rows.append(row)
            print(
                f"{spec:<12} {n:>9} {t_f:8.2f} {m_f:8.1f} {t_e:8.2f} {m_e:8.1f} {1e3 * t_noise:13.3f} "
                f"{per_coord:11.0f}  {kind}",
                flush=True,
            )
            if max(t_f, t_e) > args.budget:
                stop = f"n = {n} took {max(t_f, t_e):.0f} s > budget {args.budget:.0f} s"
    print("\nnoise state at float32 (bytes) as the model size d grows:")
    seen = {}
    for r in rows:
        if not r.get("skipped") and r["strategy"] not in seen:
            seen[r["strategy"]] = (r["state_per_coordinate"], r["generator"])
    labels = " ".join(f"{f'd=1e{len(str(d)) - 1}':>10}" for d in DIMS)
    print(f"{'strategy':<12} {'generator':<22} {labels}")
    for spec, (per, kind) in seen.items():
        print(f"{spec:<12} {kind:<22} " + " ".join(f"{4 * per * d:10.3g}" for d in DIMS))
    if args.csv:
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)
        print(f"wrote {args.csv}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot(rows, path: str) -> None:
    """Log–log: factorize + evaluate seconds against n, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab20").colors
    for i, spec in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        style = dict(color=colors[i % len(colors)], marker="osD^v<>ph*Xd"[i % 12])
        pts = [r for r in rows if r["strategy"] == spec and not r.get("skipped")]
        if not pts:
            continue
        ns = [r["n"] for r in pts]
        axes[0].loglog(ns, [r["factorize_s"] + r["evaluate_s"] for r in pts], "-", label=spec, **style)
        noise = [(r["n"], r["noise_step_s"]) for r in pts if r["noise_step_s"] == r["noise_step_s"]]
        if noise:
            axes[1].loglog([x for x, _ in noise], [y for _, y in noise], "-", label=spec, **style)
    axes[0].set(xlabel="steps n", ylabel="factorize + evaluate (s)", title="strategy cost")
    axes[1].set(xlabel="steps n", ylabel="noise, last steps (s/step)", title="noise per step (d = 10⁴)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
