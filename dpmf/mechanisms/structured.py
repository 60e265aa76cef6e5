"""Lower-triangular matrices stored by their structure.

Two representations share one small interface (``n``, ``dense()``, ``inverse()``,
``column_norms()``, ``columns(idx)``, ``matmul(x)``):

* ``ScaledToeplitz`` — M = diag(r)·Toep(c)·diag(s), stored as three vectors (O(n) memory). It
  covers every Toeplitz strategy and its inverse, the learning-rate workloads A₁·diag(χ), and
  column-scaled strategies such as A₁^{1/2}·diag(χ). Its inverse is again of this form:
  (diag(r)·Toep(c)·diag(s))⁻¹ = diag(1/s)·Toep(c⁻¹)·diag(1/r).
* ``DenseLowerTriangular`` — an explicit n×n lower-triangular array, for strategies with no
  Toeplitz structure (the square root of A_χ, optimized dense strategies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import toeplitz as _dense_toeplitz
from scipy.linalg.lapack import dtrtri

from dpmf._validation import check_vector
from dpmf.mechanisms._fft import fftconvolve
from dpmf.mechanisms.toeplitz import inverse_coefficients

__all__ = ["ScaledToeplitz", "DenseLowerTriangular", "as_structured", "LowerTriangular"]


@dataclass(frozen=True, eq=False)
class ScaledToeplitz:
    """The lower-triangular matrix diag(row_scale)·Toep(coeffs)·diag(col_scale).

    Attributes:
        coeffs: first column c of the Toeplitz factor, shape (n,), c[0] ≠ 0.
        row_scale: r, shape (n,), entries ≠ 0, or None (ones).
        col_scale: s, shape (n,), entries ≠ 0, or None (ones).
    """

    coeffs: np.ndarray
    row_scale: np.ndarray | None = None
    col_scale: np.ndarray | None = None

    def __post_init__(self):
        c = check_vector("coeffs", self.coeffs)
        if c[0] == 0:
            raise ValueError("coeffs is invalid: coeffs[0] must be non-zero (invertible matrix)")
        object.__setattr__(self, "coeffs", c)
        for name in ("row_scale", "col_scale"):
            v = getattr(self, name)
            if v is not None:
                v = check_vector(name, v, length=c.shape[0])
                if np.any(v == 0):
                    raise ValueError(f"{name} is invalid: entries must be non-zero")
                object.__setattr__(self, name, None if np.all(v == 1.0) else v)

    @property
    def n(self) -> int:
        return int(self.coeffs.shape[0])

    @property
    def is_toeplitz(self) -> bool:
        """Whether the matrix is Toeplitz (no scales, or constant ones)."""
        return all(v is None or bool(np.all(v == v[0])) for v in (self.row_scale, self.col_scale))

    @property
    def toeplitz_coeffs(self) -> np.ndarray:
        """First column when ``is_toeplitz``; raises ``ValueError`` otherwise."""
        if not self.is_toeplitz:
            raise ValueError("matrix is not Toeplitz (it has non-constant row or column scales)")
        k = 1.0
        for v in (self.row_scale, self.col_scale):
            if v is not None:
                k *= v[0]
        return self.coeffs * k

    @property
    def bandwidth(self) -> int:
        """Number of non-zero diagonals: 1 + index of the last non-zero coefficient."""
        nz = np.flatnonzero(self.coeffs)
        return int(nz[-1]) + 1

    def rows(self) -> np.ndarray:
        return np.ones(self.n) if self.row_scale is None else self.row_scale

    def cols(self) -> np.ndarray:
        return np.ones(self.n) if self.col_scale is None else self.col_scale

    def dense(self) -> np.ndarray:
        """The n×n array (O(n²) memory)."""
        mat = _dense_toeplitz(self.coeffs, np.zeros(self.n))
        return self.rows()[:, None] * mat * self.cols()[None, :]

    def inverse(self) -> ScaledToeplitz:
        """diag(1/s)·Toep(c⁻¹)·diag(1/r), computed by power-series inversion (no n×n array)."""
        inv_row = None if self.col_scale is None else 1.0 / self.col_scale
        inv_col = None if self.row_scale is None else 1.0 / self.row_scale
        return ScaledToeplitz(inverse_coefficients(self.coeffs), inv_row, inv_col)

    def column_norms(self) -> np.ndarray:
        """ℓ2 norm of every column, shape (n,), in O(n) (O(n log n) with a row scale)."""
        c2 = self.coeffs**2
        if self.row_scale is None:
            # column j holds c_0..c_{n-1-j}
            norms2 = np.cumsum(c2)[::-1]
        else:
            # ||col_j||^2 = sum_{t>=j} r_t^2 c_{t-j}^2: a correlation of r^2 with c^2
            r2 = self.row_scale**2
            norms2 = fftconvolve(r2[::-1], c2)[: self.n][::-1]
        return np.sqrt(np.maximum(norms2, 0.0)) * np.abs(self.cols())

    def columns(self, idx) -> np.ndarray:
        """The columns ``idx`` as a dense (n, len(idx)) array, O(n·len(idx)) memory."""
        idx = np.asarray(idx, dtype=int)
        out = np.zeros((self.n, idx.shape[0]))
        for k, j in enumerate(idx):
            out[j:, k] = self.coeffs[: self.n - j]
        return self.rows()[:, None] * out * self.cols()[idx][None, :]

    def matmul(self, x) -> np.ndarray:
        """M @ x for x of shape (n,) or (n, m), by convolution (no n×n array)."""
        x = np.asarray(x, dtype=np.float64)
        vec = x.ndim == 1
        x2 = (x[:, None] if vec else x) * self.cols()[:, None]
        y = fftconvolve(self.coeffs[:, None], x2, axis=0)[: self.n] * self.rows()[:, None]
        return y[:, 0] if vec else y


@dataclass(frozen=True, eq=False)
class DenseLowerTriangular:
    """An explicit n×n lower-triangular matrix with a non-zero diagonal.

    Raises:
        ValueError: not square, not lower-triangular, non-finite, or a zero on the diagonal.
    """

    matrix: np.ndarray

    def __post_init__(self):
        m = np.asarray(self.matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
            raise ValueError(f"matrix is invalid: must be square n×n, got shape {m.shape}")
        if not np.all(np.isfinite(m)):
            raise ValueError("matrix is invalid: contains NaN or infinite entries")
        if np.any(np.triu(m, 1) != 0):
            raise ValueError("matrix is invalid: must be lower-triangular")
        if np.any(np.diag(m) == 0):
            raise ValueError("matrix is invalid: has a zero on the diagonal (singular)")
        object.__setattr__(self, "matrix", m)

    @property
    def n(self) -> int:
        return int(self.matrix.shape[0])

    is_toeplitz = False

    def dense(self) -> np.ndarray:
        return self.matrix

    def inverse(self) -> DenseLowerTriangular:
        """The inverse, by LAPACK's blocked triangular inversion ``dtrtri`` (O(n³/3))."""
        inv, info = dtrtri(self.matrix, lower=1)
        if info != 0:
            raise ValueError(f"matrix is invalid: triangular inversion failed (info={info})")
        return DenseLowerTriangular(np.tril(inv))

    def column_norms(self) -> np.ndarray:
        return np.linalg.norm(self.matrix, axis=0)

    def columns(self, idx) -> np.ndarray:
        return self.matrix[:, np.asarray(idx, dtype=int)]

    def matmul(self, x) -> np.ndarray:
        return self.matrix @ np.asarray(x, dtype=np.float64)


LowerTriangular = ScaledToeplitz | DenseLowerTriangular


def as_structured(matrix) -> LowerTriangular:
    """Wrap an n×n array as ``DenseLowerTriangular``; pass structured matrices through."""
    if isinstance(matrix, ScaledToeplitz | DenseLowerTriangular):
        return matrix
    return DenseLowerTriangular(np.asarray(matrix, dtype=np.float64))
