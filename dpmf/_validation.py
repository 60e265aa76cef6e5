"""Argument checks shared by every module.

Each check raises ``ValueError`` (or ``TypeError`` for a wrong type) whose message names the
parameter, the value received and the allowed range, so that bad input fails before any work
is done. The checks return the value converted to its canonical type.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np

__all__ = [
    "check_int",
    "check_real",
    "check_choice",
    "check_vector",
]


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as ``int`` if it is an integer within ``[minimum, maximum]``.

    Raises:
        TypeError: ``value`` is not an integer (bools and non-integral floats are refused).
        ValueError: ``value`` is outside the allowed range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            if math.isfinite(value) and float(value).is_integer():
                value = int(value)
            else:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer{_range(minimum, maximum)}")
        else:
            raise TypeError(f"{name}={value!r} is invalid: must be an integer{_range(minimum, maximum)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} is invalid: must be an integer{_range(minimum, maximum)}")
    return value


def check_real(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """Return ``value`` as ``float`` if it is finite and within the stated interval.

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is NaN, infinite, or outside the interval.
    """
    interval = _interval(low, high, low_inclusive, high_inclusive)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} is invalid: must be a real number in {interval}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number in {interval}")
    bad = False
    if low is not None:
        bad |= value < low if low_inclusive else value <= low
    if high is not None:
        bad |= value > high if high_inclusive else value >= high
    if bad:
        raise ValueError(f"{name}={value!r} is invalid: must be in {interval}")
    return value


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``; otherwise raise ``ValueError`` listing them."""
    choices = list(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r} is invalid: must be one of {', '.join(choices)}")
    return value


def check_vector(
    name: str,
    value,
    *,
    length: int | None = None,
    min_length: int = 1,
    positive: bool = False,
    nonnegative: bool = False,
) -> np.ndarray:
    """Return ``value`` as a finite 1-D float64 array, checking its length and sign.

    Raises:
        ValueError: not 1-D, wrong length, NaN/inf entries, or an entry of the wrong sign.
    """
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} is invalid: must be a 1-D array, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name} is invalid: must have length {length}, got {arr.shape[0]}")
    if arr.shape[0] < min_length:
        raise ValueError(f"{name} is invalid: must have length >= {min_length}, got {arr.shape[0]}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} is invalid: contains NaN or infinite entries")
    if positive and np.any(arr <= 0):
        raise ValueError(f"{name} is invalid: all entries must be > 0 (min is {arr.min()!r})")
    if nonnegative and np.any(arr < 0):
        raise ValueError(f"{name} is invalid: all entries must be >= 0 (min is {arr.min()!r})")
    return arr


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def _interval(low, high, low_inclusive, high_inclusive) -> str:
    left = "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
    right = "inf)" if high is None else f"{high:g}" + ("]" if high_inclusive else ")")
    return f"{left}, {right}"
