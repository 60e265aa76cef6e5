"""Timing and memory helpers shared by the benchmark scripts (medians, tracemalloc peaks), and
the set-up of a rank started by torchrun."""

from __future__ import annotations

import statistics
import time
import tracemalloc


def median_seconds(fn, repeat: int = 5) -> float:
    """Median wall time of ``fn()`` over ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_mb(fn) -> float:
    """Peak Python/numpy heap allocation during ``fn()``, in MB (tracemalloc)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 1e6


def init_rank(device_name: str, threads: int):
    """One rank started by ``torchrun``: torch's thread count, the rank's device (its own GPU
    for ``cuda``) and the process group (NCCL on GPUs, gloo on CPU). Returns the device."""
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def add_rank_arguments(ap, *, steps: int, worlds: str) -> None:
    """The options of a benchmark that starts itself under ``torchrun`` once per W: --steps,
    --device, --worlds, --threads, and the hidden --rank-mode/--out of its ranks."""
    import argparse

    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--worlds", default=worlds)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)


def end_rank() -> None:
    """Destroy the process group and leave without the interpreter's teardown: gloo's worker
    threads can abort it (``terminate called without an active exception``, SIGABRT) after
    every result is written, and torchrun then reports the run as failed."""
    import os
    import sys

    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
