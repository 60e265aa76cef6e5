"""The light FFT convolution equals scipy.signal's, and ``dpmf curves`` stays off scipy.signal."""

import subprocess
import sys

import numpy as np
import pytest
from scipy.signal import fftconvolve as scipy_fftconvolve
from scipy.signal import lfilter as scipy_lfilter

from dpmf.mechanisms._fft import fftconvolve, lfilter


@pytest.mark.parametrize("n,m", [(1, 1), (3, 1), (5, 7), (1000, 999), (4097, 3)])
def test_fftconvolve_equals_scipy_signal(n, m):
    rng = np.random.default_rng(n + m)
    a, b = rng.normal(size=n), rng.normal(size=m)
    ref = scipy_fftconvolve(a, b)
    assert fftconvolve(a, b).shape == (n + m - 1,)
    np.testing.assert_allclose(fftconvolve(a, b), ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    np.testing.assert_allclose(fftconvolve(a, b), np.convolve(a, b), rtol=0, atol=1e-12 * np.abs(ref).max())
    A, B = rng.normal(size=(n, 1)), rng.normal(size=(m, 3))
    np.testing.assert_allclose(fftconvolve(A, B, axis=0), scipy_fftconvolve(A, B, axes=0), atol=1e-11)
    assert np.array_equal(lfilter([1.0], [1.0, -0.5], a), scipy_lfilter([1.0], [1.0, -0.5], a))


def test_error_curves_do_not_import_scipy_signal():
    code = "import sys, dpmf.mechanisms.sweeps, dpmf.cli; print('scipy.signal' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
