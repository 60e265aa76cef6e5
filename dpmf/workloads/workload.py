"""Workload matrices A: what a training run computes from its gradients, Θ = A·G.

Every workload of the toolkit has the form ``A = Toep(a)·diag(d)``: a lower-triangular
Toeplitz matrix with first column ``a`` whose columns are scaled by ``d`` (the learning-rate
schedule χ). It is stored as those two vectors, O(n) memory; ``dense()`` builds the n×n
matrix only on request.

=====================  ====================  ===========
workload               a                     d
=====================  ====================  ===========
prefix sum A₁          1, 1, 1, …            1
scheduled A_χ=A₁·D     1, 1, 1, …            χ
surrogate Toep(χ)      χ                     1
momentum / decay       (α^{k+1}−μ^{k+1})/(α−μ)  1 (or χ)
=====================  ====================  ===========

Sources: A₁ and A_χ = A₁·diag(χ) as in "Learning Rate Scheduling with Matrix Factorization
for Private Training" (eq. 4 and the definition of A_χ^Toep); the momentum/weight-decay
workload of the banded square-root papers (Kalinin & Lampert, "Banded Square Root Matrix
Factorization for Differentially Private Model Training", Sec. 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import toeplitz as _dense_toeplitz

from dpmf._validation import check_int, check_real, check_vector
from dpmf.workloads.schedules import Schedule

__all__ = [
    "Workload",
    "prefix_sum",
    "lr_scheduled",
    "toeplitz_surrogate",
    "momentum",
    "momentum_coefficients",
    "from_schedule",
]


@dataclass(frozen=True, eq=False)
class Workload:
    """The lower-triangular workload ``A = Toep(coeffs)·diag(column_scale)``.

    Attributes:
        coeffs: first column ``a`` of the Toeplitz factor, shape (n,), ``a[0] != 0``.
        column_scale: the diagonal ``d`` (learning-rate multipliers χ), shape (n,), entries > 0,
            or ``None`` for the identity.
        name: a label used in tables and plots.

    Raises:
        ValueError: empty, non-finite, ``a[0] == 0``, or a non-positive/mismatched scale.
    """

    coeffs: np.ndarray
    column_scale: np.ndarray | None = None
    name: str = "toeplitz"

    def __post_init__(self):
        a = check_vector("coeffs", self.coeffs)
        if a[0] == 0:
            raise ValueError("coeffs is invalid: the diagonal coeffs[0] must be non-zero (A invertible)")
        a.setflags(write=False)
        object.__setattr__(self, "coeffs", a)
        if self.column_scale is not None:
            d = check_vector("column_scale", self.column_scale, length=a.shape[0], positive=True)
            d.setflags(write=False)
            object.__setattr__(self, "column_scale", d)

    @property
    def n(self) -> int:
        """Number of steps (the matrix is n×n)."""
        return int(self.coeffs.shape[0])

    @property
    def is_toeplitz(self) -> bool:
        """Whether A itself is Toeplitz (no scale, or a constant one)."""
        d = self.column_scale
        return d is None or bool(np.all(d == d[0]))

    @property
    def scale(self) -> np.ndarray:
        """The column scale d as an array of shape (n,) (ones when there is none)."""
        return np.ones(self.n) if self.column_scale is None else np.asarray(self.column_scale)

    @property
    def toeplitz_coeffs(self) -> np.ndarray:
        """First column of A when A is Toeplitz, shape (n,).

        Raises:
            ValueError: A is not Toeplitz (a non-constant column scale).
        """
        if not self.is_toeplitz:
            raise ValueError(f"workload {self.name!r} is not Toeplitz (its column scale varies)")
        return np.array(self.coeffs) * (1.0 if self.column_scale is None else self.column_scale[0])

    @property
    def schedule_values(self) -> np.ndarray:
        """The learning-rate multipliers χ this workload applies, shape (n,).

        For A_χ = A₁·diag(χ) these are the column scale; for a Toeplitz surrogate Toep(χ) (name
        ``toep(...)``) they are its coefficients; otherwise ones.
        """
        if self.column_scale is not None:
            return np.asarray(self.column_scale)
        if self.name.startswith("toep"):
            return np.asarray(self.coeffs)
        return np.ones(self.n)

    def dense(self) -> np.ndarray:
        """The n×n matrix A (float64). O(n²) memory: use only for small n or on request."""
        a = np.asarray(self.coeffs)
        mat = _dense_toeplitz(a, np.zeros(self.n))
        if self.column_scale is not None:
            mat = mat * self.column_scale[None, :]
        return mat


def prefix_sum(n: int) -> Workload:
    """The prefix-sum workload A₁ = tril(ones(n, n)) (constant learning rate).

    Raises:
        ValueError: n < 1.
    """
    n = check_int("n", n, minimum=1)
    return Workload(np.ones(n), None, name="prefix_sum")


def lr_scheduled(chi) -> Workload:
    """The learning-rate-scheduled workload A_χ = A₁·diag(χ), shape n×n for χ of shape (n,).

    Entry (t, s) is χ_s for s ≤ t: θ_t = θ₀ − η Σ_{s≤t} χ_s g_s.

    Raises:
        ValueError: χ empty, non-finite or with an entry ≤ 0.
    """
    chi = check_vector("chi", chi, positive=True)
    return Workload(np.ones(chi.shape[0]), chi, name="lr_scheduled")


def toeplitz_surrogate(chi) -> Workload:
    """The Toeplitz surrogate A_χ^Toep = Toep(χ) of a learning-rate schedule, shape n×n.

    Raises:
        ValueError: χ empty, non-finite or with an entry ≤ 0.
    """
    chi = check_vector("chi", chi, positive=True)
    return Workload(chi, None, name="toep(chi)")


def momentum_coefficients(n: int, momentum: float = 0.0, weight_decay: float = 1.0) -> np.ndarray:
    """Coefficients a_k = (α^{k+1} − μ^{k+1})/(α − μ), k = 0..n−1, of SGD with momentum μ and
    weight decay α (a_k = (k+1)·α^k when α = μ). Shape (n,).

    Source: the momentum/weight-decay workload of Kalinin & Lampert (BSR, Sec. 2): the model
    after t steps of heavy-ball SGD with multiplicative decay α is Σ_s a_{t−s} g_s.

    Raises:
        ValueError: n < 1, μ outside [0, 1), α outside (0, 1].
    """
    n = check_int("n", n, minimum=1)
    mu = check_real("momentum", momentum, low=0.0, high=1.0, high_inclusive=False)
    alpha = check_real("weight_decay", weight_decay, low=0.0, high=1.0, low_inclusive=False)
    k = np.arange(n, dtype=np.float64)
    if np.isclose(alpha, mu, rtol=0.0, atol=1e-12):
        return (k + 1.0) * alpha**k
    # Σ_{i=0..k} α^{k−i} μ^i, computed by the stable recursion a_k = α·a_{k−1} + μ^k.
    a = np.empty(n)
    a[0] = 1.0
    mu_pow = 1.0
    for i in range(1, n):
        mu_pow *= mu
        a[i] = alpha * a[i - 1] + mu_pow
    return a


def momentum(n: int, momentum: float = 0.0, weight_decay: float = 1.0, chi=None) -> Workload:
    """The momentum / weight-decay Toeplitz workload Toep(a), a from ``momentum_coefficients``;
    with a schedule ``chi`` (shape (n,)) the columns are scaled, A = Toep(a)·diag(χ).

    Raises:
        ValueError: as ``momentum_coefficients``; χ of the wrong length or with entries ≤ 0.
    """
    a = momentum_coefficients(n, momentum, weight_decay)
    scale = None if chi is None else check_vector("chi", chi, length=a.shape[0], positive=True)
    return Workload(a, scale, name=f"momentum(mu={momentum:g},alpha={weight_decay:g})")


def from_schedule(schedule: Schedule, n: int, *, toeplitz: bool = False) -> Workload:
    """A_χ (or, with ``toeplitz=True``, Toep(χ)) for χ = ``schedule.values(n)``.

    A constant schedule gives the prefix sum A₁ either way.
    """
    chi = schedule.values(n)
    if schedule.name == "constant":
        return prefix_sum(n)
    return toeplitz_surrogate(chi) if toeplitz else lr_scheduled(chi)
