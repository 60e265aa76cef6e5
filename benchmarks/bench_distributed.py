"""The distributed private step: step time, bytes communicated and noise state per rank, at
W = 1 and W = 2 processes (gloo on CPU, NCCL with --device cuda), in one run.

Each W is started with ``torchrun --standalone`` (loopback); every rank times the same steps
of one model (clip → local sum → reduce to owners → owner noise and DP-Muon step →
broadcast), after two warm-up steps. Printed per W: the median step time (over ``--steps``
steps; every rank's median, the slowest rank reported), the bytes each rank sent per step
(sharded mode: about one gradient's worth for the reduce plus one for the broadcast, W = 1
sends nothing), the noise state per rank against the one-process total, and time(W)/time(1).

On one machine with 2 cores, W = 2 processes share the cores of W = 1, so the ratio measures
the overhead of the protocol rather than a speed-up; on W GPUs each rank has its own device.

Usage:
    python benchmarks/bench_distributed.py [--model cnn] [--batch-size 256] [--strategy bsr:16]
        [--steps 20] [--device cpu|cuda] [--worlds 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import add_rank_arguments, end_rank, init_rank  # noqa: E402


def _rank(args) -> None:
    import torch
    import torch.nn.functional as F

    from dpmf.distributed import DistributedPrivatizer, TorchCollectives, rank_slice
    from dpmf.optim import DPMuon, route_parameters
    from dpmf.plan import PrivatePlan
    from dpmf.train.models import build_model

    device = init_rank(args.device, args.threads)
    comm = TorchCollectives()
    shape = (1, 28, 28) if args.model in ("cnn", "mlp") else (3, 32, 32)
    model = build_model(args.model, shape, 10, seed=0).to(device)
    steps = args.steps + 2
    plan = PrivatePlan(60000, args.batch_size, steps=steps, scheme="fixed_order", strategy=args.strategy)
    plan = plan.with_noise(1.0)
    opt = DPMuon(route_parameters(model), lr=0.05)
    priv = DistributedPrivatizer(
        model,
        F.cross_entropy,
        collectives=comm,
        plan=plan,
        clip_norm=1.0,
        seed=1,
        optimizer=opt,
        check_every=0,
    )
    opt.bind(priv)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    idx = torch.arange(args.batch_size).numpy()
    mine = torch.from_numpy(rank_slice(idx, comm.rank, comm.world_size)).to(device)
    times, sent = [], []
    for t in range(steps):
        comm.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        before, began = comm.bytes_sent, time.perf_counter()
        priv.privatize(x[mine], y[mine])
        opt.step()
        priv.after_step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if t >= 2:
            times.append(time.perf_counter() - began)
            sent.append(comm.bytes_sent - before)
    d = sum(p.numel() for p in model.parameters())
    row = {
        "rank": comm.rank,
        "median_s": statistics.median(times),
        "bytes_per_step": statistics.median(sent),
        "noise_state": priv.noise_state_numel(),
        "gradient_bytes": d * next(model.parameters()).element_size(),
    }
    rows = comm.all_gather_object(row)
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    end_rank()  # every result is written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--strategy", default="bsr:16")
    add_rank_arguments(ap, steps=20, worlds="1,2")
    args = ap.parse_args()
    if args.rank_mode:
        _rank(args)
        return
    results = {}
    for w in [int(v) for v in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={w}",
                __file__,
                "--rank-mode",
                "--out",
                out,
                "--model",
                args.model,
                "--batch-size",
                str(args.batch_size),
                "--strategy",
                args.strategy,
                "--steps",
                str(args.steps),
                "--device",
                args.device,
                "--threads",
                str(args.threads),
            ]
            env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
            subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
            with open(out) as f:
                results[w] = json.load(f)
    base = max(r["median_s"] for r in results[min(results)])
    total_state = sum(r["noise_state"] for r in results[min(results)])
    print(
        f"{args.model}, B = {args.batch_size}, {args.strategy}, DP-Muon, sharded, {args.device}, "
        f"{args.steps} timed steps"
    )
    print(
        f"{'W':>2} {'step (ms)':>10} {'vs W=1':>7} {'sent/step (MB)':>15} {'gradients':>10} "
        f"{'noise state/rank':>17} {'share':>6}"
    )
    for w, rows in results.items():
        slow = max(r["median_s"] for r in rows)
        sent = max(r["bytes_per_step"] for r in rows)
        state = max(r["noise_state"] for r in rows)
        print(
            f"{w:>2} {1000 * slow:>10.1f} {slow / base:>7.2f} {sent / 1e6:>15.3f} "
            f"{sent / rows[0]['gradient_bytes']:>10.2f} {state:>17d} {state / max(total_state, 1):>6.2f}"
        )


if __name__ == "__main__":
    main()
