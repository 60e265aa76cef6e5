"""Timing and memory helpers shared by the benchmark scripts (medians, tracemalloc peaks)."""

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
