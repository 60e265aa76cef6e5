"""Linear convolution by FFT on ``scipy.fft`` (a light import; ``scipy.signal`` costs seconds).

``fftconvolve(a, b, axis)`` is the full linear convolution of two real arrays along ``axis``
(other axes broadcast), as ``scipy.signal.fftconvolve(a, b, axes=axis)`` computes it: both
padded to a fast length ≥ len(a) + len(b) − 1, multiplied in the real-FFT domain, transformed
back (Cooley & Tukey 1965; error O(ε·log L·‖a‖‖b‖)).
"""

from __future__ import annotations

import numpy as np
from scipy import fft as sfft

__all__ = ["fftconvolve", "lfilter"]


def fftconvolve(a, b, axis: int = 0) -> np.ndarray:
    """Full linear convolution of real ``a`` and ``b`` along ``axis``; shape along ``axis``:
    len(a) + len(b) − 1 (the other axes broadcast)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim == 1 and b.ndim == 1:
        axis = 0
    n = a.shape[axis] + b.shape[axis] - 1
    size = sfft.next_fast_len(n, real=True)
    out = sfft.irfft(sfft.rfft(a, size, axis=axis) * sfft.rfft(b, size, axis=axis), size, axis=axis)
    return np.take(out, np.arange(n), axis=axis)


def lfilter(b, a, x) -> np.ndarray:
    """``scipy.signal.lfilter(b, a, x)`` along the last axis, imported on first use."""
    from scipy.signal import lfilter as _lfilter

    return _lfilter(b, a, x)
