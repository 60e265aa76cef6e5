"""The private step on a fully_shard (FSDP2) model: memory held per rank, bytes sent per step and
step time at W = 1, 2 and 4 processes (gloo on CPU, NCCL with --device cuda), in one run.

Each W is started with ``torchrun --standalone`` (loopback). The model is an MLP of ``--layers``
Linear layers of width ``--width`` (a LayerNorm before the head), every Linear and the root
``fully_shard``-ed; the strategy a BLT (``--strategy``; its buffers are noise state); DP-SGD
(momentum) and DP-Muon each take ``--steps`` timed steps after two warm-up steps. Printed per
W and optimizer, the slowest rank's figures:

- held/rank: the entries each rank keeps between steps — parameter shards, gradient shards,
  optimizer state and correlated-noise state — and that total against W = 1's (the ideal is
  1/W; the rows of a parameter that does not split evenly make it a little more);
- the clipped sums' transient buffer: the most entries the step's reduce-scatter buckets held
  at once on a rank (``DistributedPrivatizer.release_peak_entries``: the sums are sent bucket
  by bucket, of at most ``--bucket-entries``, as the layers' are computed), against the model's
  d (what a whole-model sum would hold);
- sent/step: bytes each rank sends per step — the reduce-scatters of the clipped sums, counted
  by dpmf's collectives, plus, for DP-Muon, the orthogonalisation by owners (each matrix
  gathered to its owner and its rows scattered back, counted from the shapes and the owners)
  — and that against DP-SGD's;
- the median step time and its ratio to W = 1 (on a machine with fewer cores than W·threads the
  ranks share cores: the ratio then measures the protocol's overhead, not a speed-up).

Usage:
    python benchmarks/bench_fsdp.py [--width 512] [--layers 6] [--batch-size 64]
        [--strategy blt:2] [--steps 10] [--device cpu|cuda] [--worlds 1,2,4]
        [--bucket-entries 8388608]
"""

from __future__ import annotations

import argparse
import json
import math
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


def _model(args, device):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(args.layers - 1)]
    body = [m for lin in layers for m in (lin, nn.Tanh())]
    return nn.Sequential(*body, nn.LayerNorm(args.width), nn.Linear(args.width, 10)).to(device)


def _held(model, opt, priv) -> dict:
    """Entries this rank keeps between steps, by kind."""
    from dpmf.optim.trees import map_tensors

    params = [p for p in model.parameters() if p.requires_grad]
    local = [p.to_local() for p in params]
    state = []
    map_tensors(lambda t: state.append(t.to_local().numel() if hasattr(t, "to_local") else t.numel()) or t,
                list(opt.state.values()))  # fmt: skip
    state = sum(state)
    return {
        "parameters": sum(t.numel() for t in local),
        "gradients": sum(t.numel() for t in local),  # p.grad: a DTensor of the local rows
        "optimizer": state,
        "noise": priv.noise_state_numel(),
    }


def _gathered_bytes(model, world: int, rank: int) -> int:
    """Bytes this rank sends per step in DP-Muon's orthogonalisation by owners
    (``dpmf.optim.fsdp.orthogonalized_by_owners``, every weight matrix of ``route_parameters``'
    "matrix" group): its padded row block of each matrix another rank owns (the gather), and
    W − 1 blocks of each matrix it owns (the scatter)."""
    from dpmf.optim import route_parameters
    from dpmf.optim.fsdp import owners_by_cost

    shapes = [
        (tuple(p.shape), p.element_size())
        for group in route_parameters(model)
        if group.get("rule") == "matrix"
        for _, p in group["params"]
    ]
    owners = owners_by_cost([shape for shape, _ in shapes], world)
    total = 0
    for (shape, size), owner in zip(shapes, owners, strict=True):
        block = -(-shape[0] // world) * (math.prod(shape) // shape[0]) * size
        total += (world - 1) * block if owner == rank else block
    return total if world > 1 else 0


def _rank(args) -> None:
    import torch
    import torch.nn.functional as F

    from dpmf.distributed import DistributedPrivatizer, TorchCollectives, rank_slice
    from dpmf.optim import DPSGD, DPMuon, route_parameters
    from dpmf.plan import PrivatePlan

    device = init_rank(args.device, args.threads)
    from torch.distributed.fsdp import fully_shard

    comm = TorchCollectives()
    steps = args.steps + 2
    plan = PrivatePlan(60000, args.batch_size, steps=steps, scheme="fixed_order", strategy=args.strategy)
    plan = plan.with_noise(1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, args.width, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    mine = torch.from_numpy(rank_slice(torch.arange(args.batch_size).numpy(), comm.rank, comm.world_size))
    rows = {}
    for kind in ("dp-sgd", "dp-muon"):
        whole = _model(args, device)
        gathered = _gathered_bytes(whole, comm.world_size, comm.rank) if kind == "dp-muon" else 0
        model = whole
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        if kind == "dp-sgd":
            opt = DPSGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = DPMuon(route_parameters(model), lr=0.05)
        priv = DistributedPrivatizer(
            model, F.cross_entropy, collectives=comm, plan=plan, clip_norm=1.0, seed=1, optimizer=opt,
            check_every=0, bucket_entries=args.bucket_entries,
        )  # fmt: skip
        opt.bind(priv)
        times, sent = [], []
        for t in range(steps):
            comm.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            before, began = comm.bytes_sent, time.perf_counter()
            priv.privatize(x[mine.to(device)], y[mine.to(device)])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if t >= 2:
                times.append(time.perf_counter() - began)
                sent.append(comm.bytes_sent - before + gathered)
        d = sum(p.numel() for p in model.parameters())
        rows[kind] = {
            "median_s": statistics.median(times),
            "bytes_per_step": statistics.median(sent),
            "held": _held(model, opt, priv),
            "transient": priv.release_peak_entries,  # the step's clipped sums held at once
            "d": d,
            "entry_bytes": next(model.parameters()).element_size(),
        }
    gathered = comm.all_gather_object(rows)
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    end_rank()  # every result is written


def _launch(args, world: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        flags = ["--width", str(args.width), "--layers", str(args.layers)]
        flags += ["--batch-size", str(args.batch_size)]
        flags += ["--strategy", args.strategy, "--steps", str(args.steps), "--device", args.device]
        flags += ["--threads", str(args.threads), "--bucket-entries", str(args.bucket_entries)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        cmd += [__file__, "--rank-mode", "--out", out, *flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=1800)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--strategy", default="blt:2")
    ap.add_argument("--bucket-entries", type=int, default=1 << 23, help="the release bucket size (entries)")
    add_rank_arguments(ap, steps=10, worlds="1,2,4")
    args = ap.parse_args()
    if args.rank_mode:
        _rank(args)
        return
    results = {w: _launch(args, w) for w in [int(v) for v in args.worlds.split(",")]}
    first = min(results)
    print(
        f"fully_shard MLP {args.layers}×{args.width}, B = {args.batch_size}, {args.strategy}, {args.device}, "
        f"{args.steps} timed steps (slowest rank)"
    )
    print(
        f"{'W':>2} {'optimizer':>9} {'held/rank (M entries)':>22} {'vs W=' + str(first):>7} "
        f"{'param':>7} {'grad':>7} {'optim':>7} {'noise':>7} {'transient (M)':>14} {'vs d':>6} "
        f"{'sent/step (MB)':>15} {'vs DP-SGD':>10} {'step (ms)':>10} {'vs W=' + str(first):>7}"
    )
    for kind in ("dp-sgd", "dp-muon"):
        base = results[first]
        base_held = max(sum(r[kind]["held"].values()) for r in base)
        base_time = max(r[kind]["median_s"] for r in base)
        for w, rows in results.items():
            held = [r[kind]["held"] for r in rows]
            top = max(held, key=lambda h: sum(h.values()))
            total = sum(top.values())
            sent = max(r[kind]["bytes_per_step"] for r in rows)
            sgd_sent = max(r["dp-sgd"]["bytes_per_step"] for r in rows)
            step = max(r[kind]["median_s"] for r in rows)
            transient = max(r[kind]["transient"] for r in rows)
            ratio = f"{sent / sgd_sent:>10.2f}" if sgd_sent else f"{'—':>10}"
            print(
                f"{w:>2} {kind:>9} {total / 1e6:>22.3f} {total / base_held:>7.3f} "
                f"{top['parameters'] / 1e6:>7.3f} {top['gradients'] / 1e6:>7.3f} "
                f"{top['optimizer'] / 1e6:>7.3f} "
                f"{top['noise'] / 1e6:>7.3f} {transient / 1e6:>14.3f} {transient / rows[0][kind]['d']:>6.3f} "
                f"{sent / 1e6:>15.3f} {ratio} {1000 * step:>10.1f} {step / base_time:>7.2f}"
            )


if __name__ == "__main__":
    main()
