"""Command line for the ablation of temporal and spectral denoising (``dpmf.train.ablation``):
DP-SGD, DP-Muon, DiSK-SGD, DOPPLER-SGD, DiSK-Muon and DOPPLER-Muon at one ε over several batch
sizes and seeds.

Usage (the defaults fit in under an hour on two CPU cores):

    python benchmarks/ablation_filters.py --out runs/ablation

writes OUT/ablation.csv, OUT/ablation_summary.csv, OUT/ablation.md and OUT/ablation.png.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpmf.train.ablation import (  # noqa: E402
    COMPOSITIONS,
    METHODS,
    markdown_table,
    run_ablation,
    summarize,
    write_outputs,
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: must be integers separated by commas"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be non-negative integers")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}"
    )
    p.add_argument("--batch-sizes", type=_ints, default=(256, 1024, 4096))
    p.add_argument("--seeds", type=_ints, default=(0, 1, 2))
    p.add_argument("--epsilon", type=float, default=4.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument(
        "--composition",
        choices=COMPOSITIONS,
        default="replace",
        help="replace: the filter takes the momentum's place; stack: in front of it",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = p.parse_args(argv)
    methods = tuple(m.strip() for m in args.methods.split(","))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: {unknown} are invalid: must be among {', '.join(METHODS)}")
    if not math.isfinite(args.epsilon) or args.epsilon <= 0:
        p.error(f"--epsilon={args.epsilon} is invalid: must be > 0")
    if args.epochs < 1:
        p.error(f"--epochs={args.epochs} is invalid: must be >= 1")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    overrides = {"model": args.model, "dataset": args.dataset, "data_dir": args.data_dir}
    began = time.perf_counter()
    rows = run_ablation(
        args.out,
        methods=methods,
        batch_sizes=args.batch_sizes,
        seeds=args.seeds,
        epsilon=args.epsilon,
        epochs=args.epochs,
        overrides=overrides,
        composition=args.composition,
    )
    write_outputs(
        args.out,
        rows,
        title=f"{args.dataset}, {args.model}, ε = {args.epsilon:g}, "
        f"{args.epochs} epochs, filters {args.composition}",
    )
    print(markdown_table(summarize(rows)))
    print(f"total {time.perf_counter() - began:.0f} s; wrote {args.out}/ablation.{{csv,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
