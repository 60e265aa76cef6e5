"""How a strategy's noise (C⁻¹Z)_t is streamed: plain-data layouts, one per generator family.

A ``Factorization`` describes its own generator through ``noise_layout()`` (numpy arrays only);
``dpmf.optim.noise.noise_stream`` turns a layout into a torch generator. The layouts:

=========================  ====================================================  ==============
layout                     step t's noise                                        state (×d)
=========================  ====================================================  ==============
``ToeplitzInverseLayout``  r_t·Σ_{j<p} g_j s_{t−j} z_{t−j} (C⁻¹ = diag(r)Toep(g)   p − 1 (buffer),
                           diag(s), p coefficients)                               0 (regenerate)
``BandedSqrtLayout``       y_t = (z_t/r_t − Σ_{0<j<p} c_j s_{t−j} y_{t−j})/(c_0    p − 1
                           s_t) for a p-banded C = diag(r)Toep(c)diag(s)
``BLTLayout``              a BLT C⁻¹ with d buffers (θ decays, ω output scales)   d
``DenseInverseLayout``     row t of an explicit C⁻¹                              0 (regenerated)
=========================  ====================================================  ==============

Sources: Toeplitz inverse and banded recursions — Kalinin & Lampert (NeurIPS 2024), BISR
(2025); BLT — Dvijotham et al., "Efficient and Near-Optimal Noise Generation for Streaming
Differential Privacy" (FOCS 2024), McKenna (2024).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "NOISE_MODES",
    "NoiseLayout",
    "ToeplitzInverseLayout",
    "BandedSqrtLayout",
    "BLTLayout",
    "DenseInverseLayout",
]

NOISE_MODES = ("buffer", "regenerate")


@dataclass(frozen=True, eq=False)
class NoiseLayout:
    """Common part: the number of steps n."""

    steps: int


@dataclass(frozen=True, eq=False)
class ToeplitzInverseLayout(NoiseLayout):
    """C⁻¹ = diag(row_scale)·Toep(coeffs)·diag(col_scale), ``coeffs`` its p leading
    coefficients (shape (p,)); ``mode`` buffer or regenerate."""

    coeffs: np.ndarray
    row_scale: np.ndarray | None = None
    col_scale: np.ndarray | None = None
    mode: str = "buffer"


@dataclass(frozen=True, eq=False)
class BandedSqrtLayout(NoiseLayout):
    """A p-banded C = diag(row_scale)·Toep(coeffs)·diag(col_scale), ``coeffs`` shape (p,)."""

    coeffs: np.ndarray
    row_scale: np.ndarray | None = None
    col_scale: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class BLTLayout(NoiseLayout):
    """A BLT C⁻¹ with decays ``theta`` and output scales ``omega`` (shape (d,)), optionally
    scaled by diag(row_scale)·…·diag(col_scale)."""

    omega: np.ndarray
    theta: np.ndarray
    row_scale: np.ndarray | None = None
    col_scale: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class DenseInverseLayout(NoiseLayout):
    """An explicit n×n lower-triangular C⁻¹ (``matrix``)."""

    matrix: np.ndarray
