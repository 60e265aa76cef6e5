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
==================== ====================================== =====================

The last four are optimized for the workload and a participation pattern (``factorize``'s
``participation`` and options; see ``dpmf.mechanisms.dense``, ``banded_opt`` and ``blt``).

r_j = binom(2j, j)/4^j; D = diag(χ) is the workload's learning-rate scale; T, the Toeplitz
matrix a banded strategy is built from, is the workload's Toeplitz factor (A itself when A is
Toeplitz, A₁ for A_χ = A₁·D) for ``bsr``/``bisr`` and Toep(χ) for the ``lr_`` variants.

Sources: "Learning Rate Scheduling with Matrix Factorization for Private Training" (prefix-sum
based, scaled, square-root and learning-rate-aware factorizations, Table 2 and eq. 8);
Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially Private Model
Training" (NeurIPS 2024) for BSR; Kalinin, Lampert et al., "Back to Square Roots: An Optimal
Bound on the Matrix Factorization Error for Multi-Epoch Differentially Private SGD" (2025) for
BISR.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dpmf._validation import check_choice, check_int
from dpmf.mechanisms.structured import DenseLowerTriangular, LowerTriangular, ScaledToeplitz
from dpmf.mechanisms.toeplitz import (
    band,
    binomial_series,
    inverse_sqrt_coefficients,
    sqrt_coefficients,
)
from dpmf.mechanisms.triangular import sqrtm_lower_triangular
from dpmf.workloads.workload import Workload

__all__ = [
    "FACTORIZATIONS",
    "BANDED",
    "OPTIMIZED",
    "Factorization",
    "factorize",
    "parse_factorization",
]

FACTORIZATIONS = (
    "identity",
    "output",
    "sqrt_prefix",
    "sqrt_prefix_scaled",
    "sqrt",
    "lr_aware",
    "bsr",
    "bisr",
    "lr_bsr",
    "lr_bisr",
    "dense",
    "bisr_opt",
    "bsr_opt",
    "blt",
)
# factorize(..., "dense") refuses a solve that stopped further than this (relative) above its
# certified lower bound; optimize_dense returns such runs with converged=False for inspection
DENSE_MAX_GAP = 1e-3
BANDED = ("bsr", "bisr", "lr_bsr", "lr_bisr", "bisr_opt", "bsr_opt")
OPTIMIZED = ("dense", "bisr_opt", "bsr_opt", "blt")


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


def parse_factorization(spec: str, bands: int | None = None) -> tuple[str, int | None]:
    """Split ``"bisr:16"`` into ``("bisr", 16)``; ``bands`` fills in a missing p.

    For ``blt`` the number after the colon is the number of buffers (``"blt:4"``).

    Raises:
        ValueError: unknown name, missing or invalid p for a banded factorization (or buffers
            for ``blt``), or a p given to a factorization that takes none.
    """
    if not isinstance(spec, str):
        raise TypeError(f"factorization={spec!r} is invalid: must be a string such as 'bisr:16'")
    name, _, p = spec.strip().partition(":")
    check_choice("factorization", name, FACTORIZATIONS)
    if p:
        try:
            bands = int(p)
        except ValueError:
            raise ValueError(f"bands={p!r} is invalid in {spec!r}: must be an integer >= 1") from None
    if name == "blt":
        if bands is None:
            raise ValueError(f"factorization={spec!r} is invalid: blt needs buffers, e.g. 'blt:4'")
        return name, check_int("buffers", bands, minimum=1)
    if name in BANDED:
        if bands is None:
            raise ValueError(f"factorization={spec!r} is invalid: {name} needs bands, e.g. '{name}:16'")
        return name, check_int("bands", bands, minimum=1)
    if p:
        raise ValueError(f"factorization={spec!r} is invalid: {name} takes no bands")
    return name, None


def factorize(
    workload: Workload,
    spec: str,
    bands: int | None = None,
    *,
    participation=None,
    **options,
) -> Factorization:
    """Build the factorization ``spec`` (e.g. ``"lr_aware"``, ``"bisr:16"``) of ``workload``.

    Args:
        workload: the n×n workload A.
        spec: a name from ``FACTORIZATIONS``, banded ones with ``:p``, ``blt`` with ``:d``
            buffers.
        bands: p (or d for ``blt``), when not given in ``spec``. p ≥ n keeps every diagonal.
        participation: the ``Participation`` the optimized strategies (``OPTIMIZED``: dense,
            bisr_opt, bsr_opt, blt) are optimized for; default single participation. The
            other strategies do not depend on it.
        **options: keyword options of the optimizer, for the optimized strategies only:
            ``dense.optimize_dense`` (objective, tol, max_iterations, warm_start, …),
            ``banded_opt.optimize_banded`` (objective, start, max_iterations) and
            ``blt.optimize_blt`` (objective, max_iterations, starts).

    Returns:
        ``Factorization`` with structured C and C⁻¹ (O(n) memory for Toeplitz strategies;
        the square root of a non-Toeplitz workload and ``dense`` are dense, O(n²)). Use the
        ``optimize_*`` functions directly for the optimizers' convergence reports.

    Raises:
        TypeError: options given to a strategy that is not optimized, or unknown options.
        ValueError: unknown name or invalid bands (see ``parse_factorization``), invalid
            options (raised by the optimizer), or a ``dense`` solve that stopped more than
            ``DENSE_MAX_GAP`` (relative) above its certified lower bound (seen for steep
            learning-rate decays under min_sep participation).
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    name, p = parse_factorization(spec, bands)
    if name in OPTIMIZED:
        return _optimized(workload, name, p, participation, options)
    if options:
        raise TypeError(
            f"options {sorted(options)} are invalid for factorization={spec!r}: only the "
            f"optimized strategies ({', '.join(OPTIMIZED)}) take options"
        )
    n = workload.n
    chi = workload.schedule_values
    base = workload.toeplitz_coeffs if workload.is_toeplitz else np.asarray(workload.coeffs)
    B_matrix = None
    if name == "identity":
        C = ScaledToeplitz(_unit(n))
    elif name == "output":
        C = ScaledToeplitz(np.asarray(workload.coeffs), None, workload.column_scale)
    elif name == "sqrt_prefix":
        C = ScaledToeplitz(binomial_series(-0.5, n))
    elif name == "sqrt_prefix_scaled":
        C = ScaledToeplitz(binomial_series(-0.5, n), None, workload.column_scale)
    elif name == "sqrt":
        if workload.is_toeplitz:
            C = ScaledToeplitz(sqrt_coefficients(base))
        else:
            X = sqrtm_lower_triangular(workload.dense())
            C, B_matrix = DenseLowerTriangular(X), X
    elif name == "lr_aware":
        C = ScaledToeplitz(sqrt_coefficients(chi))
    else:
        T = chi if name.startswith("lr_") else base
        if name in ("bsr", "lr_bsr"):
            C = ScaledToeplitz(band(sqrt_coefficients(T), p))
        else:
            noise = ScaledToeplitz(band(inverse_sqrt_coefficients(T), p))
            return Factorization(name, p, workload, noise.inverse(), noise)
    return Factorization(name, p, workload, C, None, B_matrix)


def _optimized(workload: Workload, name: str, p: int | None, participation, options: dict):
    """Dispatch to the optimizers (imported here: they build on this module)."""
    if name == "dense":
        from dpmf.mechanisms.dense import optimize_dense

        res = optimize_dense(workload, participation, **options)
        if res.gap > DENSE_MAX_GAP:
            label = "single" if participation is None else participation.label
            raise ValueError(
                f"factorization='dense' is invalid for {workload.name!r} under {label}: the solver "
                f"stopped {res.gap:.3g} (relative) above its certified lower bound "
                f"({res.value:.6g} against {res.lower_bound:.6g}, {res.iterations} iterations); "
                "use a banded-optimized strategy, or optimize_dense(...) to inspect the run"
            )
        return res.factorization
    if name == "blt":
        from dpmf.mechanisms.blt import optimize_blt

        return optimize_blt(workload, p, participation, **options).factorization
    from dpmf.mechanisms.banded_opt import optimize_banded

    return optimize_banded(workload, name, p, participation, **options).factorization


def _unit(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e
