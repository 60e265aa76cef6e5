"""Factorizations A = B·C of a workload: the strategy C and its noise correlation C⁻¹.

==================== ====================================== =====================
name                 C                                      B
==================== ====================================== =====================
identity             I                                      A
output               A                                      I
sqrt_prefix          A₁^{1/2} = Toep(r)                     A·A₁^{−1/2}
sqrt_prefix_scaled   A₁^{1/2}·D                             A₁^{1/2}
sqrt                 A^{1/2}                                A^{1/2}
lr_aware             Toep(χ)^{1/2}                          A·C⁻¹
bsr:p                band_p(T^{1/2})                        A·C⁻¹
bisr:p               (band_p(T^{−1/2}))⁻¹                   A·band_p(T^{−1/2})
lr_bsr:p, lr_bisr:p  as bsr / bisr with T = Toep(χ)         A·C⁻¹
dense                optimized dense C (``dense.py``)       A·C⁻¹
bisr_opt:p           (Toep(g))⁻¹, p optimized g             A·Toep(g)
bsr_opt:p            Toep(c), p optimized c                 A·C⁻¹
blt:d                (BLT(θ, ω))⁻¹, d optimized buffers     A·BLT(θ, ω)
lcgd:λ               Toep(1, λ, λ², …) = Toep(1, −λ)⁻¹      A·Toep(1, −λ)
lcgd_opt             as lcgd, λ optimized                   A·Toep(1, −λ)
==================== ====================================== =====================

This module holds the ``Factorization`` type and the closed-form strategies (``closed_form``);
the name → builder registry, with the optimized strategies (dense, bisr_opt, bsr_opt, blt,
lcgd_opt: optimized for the workload and a participation pattern), is
``dpmf.mechanisms.registry`` and its ``factorize``.

r_j = binom(2j, j)/4^j; D = diag(χ) is the workload's learning-rate scale; T, the Toeplitz
matrix a banded strategy is built from, is the workload's Toeplitz factor (A itself when A is
Toeplitz, A₁ for A_χ = A₁·D) for ``bsr``/``bisr`` and Toep(χ) for the ``lr_`` variants.

Sources: "Learning Rate Scheduling with Matrix Factorization for Private Training" (prefix-sum
based, scaled, square-root and learning-rate-aware factorizations, Table 2 and eq. 8);
Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially Private Model
Training" (NeurIPS 2024) for BSR; Kalinin, Lampert et al., "Back to Square Roots: An Optimal
Bound on the Matrix Factorization Error for Multi-Epoch Differentially Private SGD" (2025) for
BISR; Kalinin, McKenna, Pagh & Lampert, "DP-λCGD" (ICML 2026, arXiv 2601.22334) for λCGD
(C⁻¹ = Toep(1, −λ): each step's noise is correlated with the previous step's only).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dpmf.mechanisms.streaming import (
    BandedSqrtLayout,
    DenseInverseLayout,
    NoiseLayout,
    ToeplitzInverseLayout,
)
from dpmf.mechanisms.structured import DenseLowerTriangular, LowerTriangular, ScaledToeplitz
from dpmf.mechanisms.toeplitz import (
    binomial_series,
    toeplitz_inverse_root,
    toeplitz_roots,
)
from dpmf.mechanisms.triangular import sqrtm_lower_triangular
from dpmf.workloads.workload import Workload

__all__ = [
    "Factorization",
    "closed_form",
    "CLOSED_FORMS",
]


@dataclass(frozen=True, eq=False)
class Factorization:
    """A factorization A = B·C of ``workload``.

    Attributes:
        name: the factorization's name (see ``FACTORIZATIONS``).
        bands: p for banded factorizations, else None (a BLT's buffer count is not a band
            count: ``blt.BLTFactorization`` keeps it in ``buffers``).
        workload: the workload A.
        C: the strategy matrix (structured: ``ScaledToeplitz`` or ``DenseLowerTriangular``).
        noise: C⁻¹ when it is known when the factorization is built (banded inverse
            strategies); otherwise None and ``C_inverse`` computes it on first use.
        B_matrix: B as an explicit array when it is known directly (square root of a
            non-Toeplitz A); otherwise None and B = A·C⁻¹.
    """

    name: str
    bands: int | None
    workload: Workload
    C: LowerTriangular
    noise: LowerTriangular | None = None
    B_matrix: np.ndarray | None = None

    @cached_property
    def C_inverse(self) -> LowerTriangular:
        """C⁻¹, the noise correlation: step t receives the noise (C⁻¹Z)_t (same structure as C:
        power-series inversion for Toeplitz C, O(n³) triangular inversion for dense C)."""
        return self.noise if self.noise is not None else self.C.inverse()

    @property
    def label(self) -> str:
        """``name`` or ``name:p``, as accepted by ``factorize``."""
        return self.name if self.bands is None else f"{self.name}:{self.bands}"

    @property
    def n(self) -> int:
        return self.workload.n

    @property
    def noise_coefficients(self) -> np.ndarray | None:
        """First column of C⁻¹ when C⁻¹ is Toeplitz (shape (n,)), else None.

        Step t's noise is Σ_{s≤t} g_{t−s} z_s with g these coefficients.
        """
        Ci = self.C_inverse
        if isinstance(Ci, ScaledToeplitz) and Ci.is_toeplitz:
            return Ci.toeplitz_coeffs
        return None

    @property
    def noise_bands(self) -> int | None:
        """Number of non-zero diagonals of C⁻¹ when it is Toeplitz-structured, else None."""
        Ci = self.C_inverse
        return Ci.bandwidth if isinstance(Ci, ScaledToeplitz) else None

    def noise_layout(self, mode: str | None = None) -> NoiseLayout:
        """How (C⁻¹Z)_t is streamed, chosen from the structure of C and C⁻¹ (p(M): the number
        of non-zero diagonals of M); ``dpmf.optim.noise.noise_stream`` builds the generator.

        * C⁻¹ = diag(r)·Toep(g)·diag(s) with p(C⁻¹) ≤ p(C) (identity, BISR, banded-optimized,
          λCGD, ``output`` of the prefix sum): ``ToeplitzInverseLayout`` with p(C⁻¹)
          coefficients — buffered (p(C⁻¹) − 1 past raw vectors) when banded, regenerated
          (O(d) memory, O(t·d) work at step t) when full (square roots, learning-rate aware);
        * otherwise C = diag(r)·Toep(c)·diag(s) banded (BSR): ``BandedSqrtLayout``;
        * a dense C⁻¹: ``DenseInverseLayout``.

        Strategies with a cheaper generator of their own override this (BLT).

        Args:
            mode: ``"buffer"`` or ``"regenerate"`` to force the Toeplitz-inverse layout's mode;
                None chooses as above.

        Raises:
            ValueError: an unknown mode.
        """
        Ci, C, n = self.C_inverse, self.C, self.n
        if isinstance(Ci, ScaledToeplitz):
            p_inv = Ci.bandwidth
            p_c = C.bandwidth if isinstance(C, ScaledToeplitz) else n
            if p_inv <= p_c or p_c >= n:
                chosen = mode or ("buffer" if p_inv < n else "regenerate")
                return ToeplitzInverseLayout(n, Ci.coeffs[:p_inv], Ci.row_scale, Ci.col_scale, chosen)
            return BandedSqrtLayout(n, C.coeffs[:p_c], C.row_scale, C.col_scale)
        return DenseInverseLayout(n, Ci.dense())

    def C_dense(self) -> np.ndarray:
        """C as an n×n array."""
        return self.C.dense()

    def B_dense(self) -> np.ndarray:
        """B as an n×n array (A·C⁻¹ unless known explicitly)."""
        if self.B_matrix is not None:
            return self.B_matrix
        return self.workload.dense() @ self.C_inverse.dense()

    def residual(self) -> float:
        """max|B·C − A| / max|A| (dense; for checks on moderate n)."""
        A = self.workload.dense()
        return float(np.max(np.abs(self.B_dense() @ self.C_dense() - A)) / np.max(np.abs(A)))


def _identity(workload: Workload, p) -> Factorization:
    return Factorization("identity", None, workload, ScaledToeplitz(_unit(workload.n)))


def _output(workload: Workload, p) -> Factorization:
    C = ScaledToeplitz(np.asarray(workload.coeffs), None, workload.column_scale)
    return Factorization("output", None, workload, C)


def _sqrt_prefix(workload: Workload, p) -> Factorization:
    n = workload.n  # A₁^{±1/2} = Toep((1 − x)^{∓1/2}): both in closed form
    return Factorization(
        "sqrt_prefix",
        None,
        workload,
        ScaledToeplitz(binomial_series(-0.5, n)),
        ScaledToeplitz(binomial_series(0.5, n)),
    )


def _sqrt_prefix_scaled(workload: Workload, p) -> Factorization:
    C = ScaledToeplitz(binomial_series(-0.5, workload.n), None, workload.column_scale)
    return Factorization("sqrt_prefix_scaled", None, workload, C)


#: the largest n for which ``sqrt`` of a non-Toeplitz workload (a dense square root) is built
DENSE_SQRT_MAX_STEPS = 8192


def _sqrt(workload: Workload, p) -> Factorization:
    if workload.is_toeplitz:  # both roots at once (closed forms or structured Newton when they apply)
        root, inv_root = toeplitz_roots(workload.toeplitz_coeffs)
        return Factorization("sqrt", None, workload, ScaledToeplitz(root), ScaledToeplitz(inv_root))
    n = workload.n
    if n > DENSE_SQRT_MAX_STEPS:
        raise ValueError(
            f"n={n} is invalid for factorization='sqrt' of the non-Toeplitz workload "
            f"{workload.name!r}: its square root is a dense n×n matrix (O(n³) time, "
            f"{8 * n * n / 1e9:.3g} GB per array), allowed up to n = {DENSE_SQRT_MAX_STEPS}; "
            "use lr_aware, sqrt_prefix_scaled or a banded strategy (Toeplitz, O(n log n))"
        )
    X = sqrtm_lower_triangular(workload.dense())
    return Factorization("sqrt", None, workload, DenseLowerTriangular(X), None, X)


def _lr_aware(workload: Workload, p) -> Factorization:
    root, inv_root = toeplitz_roots(workload.schedule_values)
    return Factorization("lr_aware", None, workload, ScaledToeplitz(root), ScaledToeplitz(inv_root))


def _banded_base(workload: Workload, lr: bool) -> np.ndarray:
    """T's coefficients: Toep(χ) for the ``lr_`` variants, else the workload's Toeplitz factor."""
    if lr:
        return workload.schedule_values
    return workload.toeplitz_coeffs if workload.is_toeplitz else np.asarray(workload.coeffs)


def _padded(head: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[: head.shape[0]] = head
    return out


def _bsr(name: str, lr: bool):
    def build(workload: Workload, p: int) -> Factorization:
        p = min(p, workload.n)  # more bands than steps: all of them (the label says how many)
        # the first p coefficients of T^{1/2} depend only on T's first p: O(p log p), not O(n log n)
        head = toeplitz_roots(_banded_base(workload, lr)[:p])[0]
        C = ScaledToeplitz(_padded(head, workload.n))
        return Factorization(name, p, workload, C)

    return build


def _bisr(name: str, lr: bool):
    def build(workload: Workload, p: int) -> Factorization:
        p = min(p, workload.n)
        head = toeplitz_inverse_root(_banded_base(workload, lr)[:p])
        noise = ScaledToeplitz(_padded(head, workload.n))
        return Factorization(name, p, workload, noise.inverse(), noise)

    return build


#: name → builder(workload, p) of the closed-form strategies (p: bands, or None)
CLOSED_FORMS = {
    "identity": _identity,
    "output": _output,
    "sqrt_prefix": _sqrt_prefix,
    "sqrt_prefix_scaled": _sqrt_prefix_scaled,
    "sqrt": _sqrt,
    "lr_aware": _lr_aware,
    "bsr": _bsr("bsr", False),
    "bisr": _bisr("bisr", False),
    "lr_bsr": _bsr("lr_bsr", True),
    "lr_bisr": _bisr("lr_bisr", True),
}


def closed_form(workload: Workload, name: str, p: int | None = None) -> Factorization:
    """The closed-form strategy ``name`` (a key of ``CLOSED_FORMS``) of ``workload``, p bands
    for the banded ones (validated by the caller: ``dpmf.mechanisms.registry.factorize``)."""
    return CLOSED_FORMS[name](workload, p)


def _unit(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e
