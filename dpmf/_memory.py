"""Up-front memory estimates: refuse work that would not fit before starting it.

``check_memory(what, nbytes, fix)`` raises ``MemoryLimitError`` (a ``ValueError``) with one line
naming the estimate, the budget and the fix when ``nbytes`` exceeds ``memory_budget()``:
min(available memory, 16 GiB), or ``DPMF_MEMORY_LIMIT_GIB`` (GiB, a positive number) when set.
The estimates are the callers' (each says what it counts); they are meant to be within a small
factor of the peak, and on the safe side.
"""

from __future__ import annotations

import os

__all__ = ["MemoryLimitError", "memory_budget", "check_memory", "GIB", "DEFAULT_BUDGET"]

GIB = float(1 << 30)
DEFAULT_BUDGET = 16 * GIB


class MemoryLimitError(ValueError):
    """The estimated memory of a computation exceeds the budget (``memory_budget``)."""


def available_memory() -> float | None:
    """Bytes of available memory (Linux ``MemAvailable``; else physical pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget() -> tuple[float, str]:
    """(bytes, description) of the memory a single computation may use."""
    env = os.environ.get("DPMF_MEMORY_LIMIT_GIB")
    if env:
        try:
            value = float(env)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"DPMF_MEMORY_LIMIT_GIB={env!r} is invalid: must be a positive number of GiB")
        return value * GIB, f"{value:g} GiB (DPMF_MEMORY_LIMIT_GIB)"
    avail = available_memory()
    if avail is None:
        return DEFAULT_BUDGET, "16 GiB"
    budget = min(avail, DEFAULT_BUDGET)
    return budget, f"{budget / GIB:.3g} GiB (min(available {avail / GIB:.3g} GiB, 16 GiB))"


def check_memory(what: str, nbytes: float, fix: str) -> None:
    """Raise ``MemoryLimitError`` when ``nbytes`` exceeds ``memory_budget()``.

    Args:
        what: the computation and its inputs, e.g. ``"steps=10000000000: the strategy"``.
        nbytes: the estimated peak memory in bytes.
        fix: what to do instead (one clause).
    """
    budget, desc = memory_budget()
    if nbytes > budget:
        raise MemoryLimitError(
            f"{what} is invalid here: it needs about {nbytes / GIB:.3g} GiB, more than the "
            f"memory budget of {desc}; {fix}"
        )
