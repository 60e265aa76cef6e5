"""Batch-sampling schemes: from a training run's description to a privacy event.

A run has N examples (``dataset_size``), batch size B, n steps (``steps``), noise multiplier σ
and a strategy C (a ``dpmf.mechanisms.Factorization``, or None for DP-SGD, C = I). The noise
added to C·G (G: the sums of clipped gradients, clip norm ζ) has std σ·ζ·s per entry, where the
*sensitivity* s below depends on the scheme. b = ⌈N/B⌉ is the number of steps per epoch.

==========================  ==================================================  =================
scheme                      what is accounted                                    s
==========================  ==================================================  =================
``poisson``                 DP-SGD (C = I): n Poisson steps at q = B/N            1
``single_release``          one Gaussian release, each example used at most      max column norm
                            once (n ≤ b): μ = 1/σ
``fixed_order``             shuffled once, then cyclic fixed batches, k = ⌈n/b⌉   sens(C) under
                            epochs, no amplification: μ = 1/σ                     fixed_epochs(b, k)
``cyclic_poisson``          p-banded C, p ≤ b' (b' = ``min_sep``, default p);     max column norm
                            data in b' groups, step t samples group t mod b' at
                            q = B·b'/N: DP-SGD with ⌈n/b'⌉ steps at that q
``balls_in_bins``           each example in one of b fixed bins for the run,      max column norm
                            step t uses bin t mod b; any lower-triangular C with
                            CᵀC ≥ 0; Monte Carlo over the mixture of
                            N(C·x_j/s, σ²I) against N(0, σ²I)
``epoch_balls_in_bins``     DP-SGD (C = I), a fresh uniform bin per example       1
                            every epoch; Monte Carlo, epochs composed
==========================  ==================================================  =================

Sources: Choquette-Choo et al., "Amplified Banded Matrix Factorization: A Unified Approach to
Private Training" (NeurIPS 2023), Theorem 4 (cyclic Poisson sampling of a b-banded strategy
equals DP-SGD with ⌈n/b⌉ steps at rate B·b/N when C's columns have norm ≤ 1); Chua et al.,
"Balls-and-Bins Sampling for DP-SGD" (AISTATS 2025) for the per-epoch dominating pair;
Choquette-Choo et al. (2025), balls-in-bins for matrix mechanisms, for the fixed-bins pair and
its condition CᵀC ≥ 0.

Notes on two choices:

* ``fixed_order`` uses the ``fixed_epochs(b, k)`` pattern: once the data are shuffled and the
  batches fixed, an example sits at one position s of the cycle and participates exactly at
  s, s+b, …; ``min_sep(b, k)`` would also allow other positions in later epochs, which this
  scheme never produces (it would be a valid but looser bound).
* ``cyclic_poisson`` normalizes by the largest column norm of C: with p ≤ b' the columns an
  example touches (t, t+b', …) have disjoint row supports, so each participation is a
  subsampled Gaussian with sensitivity ≤ 1 in units of σ·ζ·s, and the noise on different
  rows is independent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.events import (
    ComposedEvent,
    GaussianEvent,
    MixtureGaussianEvent,
    PoissonGaussianEvent,
)
from dpmf.mechanisms import Factorization, Participation, ScaledToeplitz, sensitivity
from dpmf.mechanisms.structured import DenseLowerTriangular

__all__ = [
    "SCHEMES",
    "MONTE_CARLO_SCHEMES",
    "Run",
    "check_run",
    "build_event",
    "strategy_bandwidth",
]

SCHEMES = (
    "poisson",
    "cyclic_poisson",
    "balls_in_bins",
    "epoch_balls_in_bins",
    "fixed_order",
    "single_release",
)
MONTE_CARLO_SCHEMES = ("balls_in_bins", "epoch_balls_in_bins")
_DPSGD_ONLY = ("poisson", "epoch_balls_in_bins")
_GRAM_CHECK_MAX_N = 8192
MAX_BINS = 4096  # the Monte Carlo sampler works with b×b matrices


@dataclass(frozen=True)
class Run:
    """A validated description of a training run (everything but σ and the accountant).

    Attributes:
        scheme: one of ``SCHEMES``.
        dataset_size: N ≥ 1.
        batch_size: B in [1, N] (expected batch size for the random schemes).
        steps: n ≥ 1.
        factorization: the strategy, or None for C = I.
        min_sep: b' for ``cyclic_poisson`` (None: the bands of C).
    """

    scheme: str
    dataset_size: int
    batch_size: int
    steps: int
    factorization: Factorization | None = None
    min_sep: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        """b = ⌈N/B⌉."""
        return -(-self.dataset_size // self.batch_size)

    @property
    def label(self) -> str:
        return "identity" if self.factorization is None else self.factorization.label


def check_run(scheme, dataset_size, batch_size, steps, factorization=None, min_sep=None) -> Run:
    """Validate the run's parameters (before any work) and return a ``Run``.

    Raises:
        ValueError: unknown scheme; N < 1; B outside [1, N]; n < 1; a factorization whose n
            differs from ``steps``; a strategy other than the identity for a DP-SGD scheme;
            min_sep < 1.
        TypeError: a factorization that is not a ``dpmf.mechanisms.Factorization``.
    """
    check_choice("scheme", scheme, SCHEMES)
    dataset_size = check_int("dataset_size", dataset_size, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if batch_size > dataset_size:
        raise ValueError(f"batch_size={batch_size} is invalid: must be in [1, dataset_size={dataset_size}]")
    steps = check_int("steps", steps, minimum=1)
    if factorization is not None:
        if not isinstance(factorization, Factorization):
            raise TypeError(
                f"factorization={factorization!r} is invalid: must be a dpmf.mechanisms.Factorization or None"
            )
        if factorization.n != steps:
            raise ValueError(
                f"factorization is invalid: its strategy is {factorization.n}×{factorization.n} "
                f"but steps={steps}"
            )
        if factorization.name == "identity":
            factorization = None
    if scheme in _DPSGD_ONLY and factorization is not None:
        raise ValueError(
            f"factorization={factorization.label!r} is invalid for scheme={scheme!r}: it accounts "
            "DP-SGD (C = I) only; use cyclic_poisson, balls_in_bins, fixed_order or single_release "
            "for a matrix mechanism"
        )
    if min_sep is not None:
        min_sep = check_int("min_sep", min_sep, minimum=1)
    return Run(scheme, dataset_size, batch_size, steps, factorization, min_sep)


def strategy_bandwidth(C) -> int:
    """Number of non-zero diagonals of a lower-triangular C (1 for diagonal C)."""
    if isinstance(C, ScaledToeplitz):
        return C.bandwidth
    M = np.asarray(C.dense() if isinstance(C, DenseLowerTriangular) else C)
    i, j = np.nonzero(M)
    return int(np.max(i - j)) + 1 if i.size else 1


def _max_column_norm(run: Run) -> float:
    if run.factorization is None:
        return 1.0
    return float(np.max(run.factorization.C.column_norms()))


def _check_nonnegative_gram(C) -> None:
    """Raise unless CᵀC ≥ 0 entry-wise (needed by the balls-in-bins dominating pair)."""
    if isinstance(C, ScaledToeplitz):
        signs = [np.sign(C.coeffs[C.coeffs != 0])]
        for v in (C.row_scale, C.col_scale):
            if v is not None:
                signs.append(np.sign(v))
        if all(np.all(s == s[0]) for s in signs):
            return  # every entry of C has one sign, so CᵀC ≥ 0
    if C.n > _GRAM_CHECK_MAX_N:
        raise ValueError(
            f"factorization is invalid for balls_in_bins: CᵀC >= 0 cannot be verified for n={C.n} "
            f"> {_GRAM_CHECK_MAX_N} unless C has entries of one sign"
        )
    from dpmf.mechanisms import gram

    X = gram(C)
    tol = 1e-12 * float(np.max(np.abs(X)))
    if np.any(X < -tol):
        raise ValueError(
            "factorization is invalid for balls_in_bins: CᵀC has negative entries (min "
            f"{X.min():.3g}); "
            "the balls-in-bins dominating pair needs CᵀC >= 0"
        )


def bin_gram(C, bins: int, scale: float) -> np.ndarray:
    """G_ij = ⟨C x_i, C x_j⟩/s² for the bin indicators x_j (steps t ≡ j mod b), shape (b, b).

    Uses C.matmul on the n×b indicator matrix (O(n·b) memory, no n×n array for Toeplitz C).
    """
    n = C.n
    X = np.zeros((n, bins))
    X[np.arange(n), np.arange(n) % bins] = 1.0
    V = C.matmul(X) / scale
    G = V.T @ V
    G[np.abs(G) <= 1e-13 * np.max(np.abs(G))] = 0.0  # round-off of the FFT product
    return G


def build_event(run: Run, noise_multiplier: float):
    """The privacy event of ``run`` at σ = ``noise_multiplier``, and its facts.

    Returns:
        (event, info): info has ``sensitivity`` (s), ``sampling_rate`` (or None) and
        scheme-specific ``details``.

    Raises:
        ValueError: σ ≤ 0; a scheme's precondition fails (single_release over more than one
            epoch; cyclic_poisson with p > b' or q = B·b'/N > 1; balls_in_bins with CᵀC having
            negative entries).
    """
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
    N, B, n = run.dataset_size, run.batch_size, run.steps
    b = run.steps_per_epoch
    C = None if run.factorization is None else run.factorization.C
    scheme = run.scheme
    if scheme == "poisson":
        q = B / N
        return PoissonGaussianEvent(sigma, q, n), dict(sensitivity=1.0, sampling_rate=q, details={})
    if scheme == "single_release":
        if n > b:
            raise ValueError(
                f"steps={n} is invalid for scheme='single_release': each example may be used "
                "once, so "
                f"steps must be <= ceil(dataset_size/batch_size)={b}; use fixed_order for several "
                "epochs"
            )
        s = _max_column_norm(run)
        return GaussianEvent(sigma), dict(sensitivity=s, sampling_rate=None, details={"participations": 1})
    if scheme == "fixed_order":
        k = math.ceil(n / b)
        if C is None:
            s, exact, method = math.sqrt(k), True, "identity"
        else:
            sens = sensitivity(C, Participation.fixed_epochs(b, k))
            s, exact, method = sens.value, sens.exact, sens.method
        details = {
            "participations": k,
            "steps_per_epoch": b,
            "sensitivity_exact": exact,
            "sensitivity_method": method,
        }
        return GaussianEvent(sigma), dict(sensitivity=s, sampling_rate=None, details=details)
    if scheme == "cyclic_poisson":
        p = 1 if C is None else strategy_bandwidth(C)
        sep = run.min_sep if run.min_sep is not None else p
        if p > sep:
            raise ValueError(
                f"factorization {run.label!r} is invalid for scheme='cyclic_poisson': C has {p} "
                "bands but "
                f"min_sep={sep}; amplification needs bands <= min_sep (use a banded strategy such "
                f"as bsr:{sep})"
            )
        q = B * sep / N
        if q > 1.0:
            raise ValueError(
                f"min_sep={sep} is invalid for scheme='cyclic_poisson': the sampling rate "
                f"batch_size*min_sep/dataset_size={q:.4g} exceeds 1 (need min_sep <= {N // B})"
            )
        compositions = math.ceil(n / sep)
        s = _max_column_norm(run)
        details = {"bands": p, "min_sep": sep, "compositions": compositions}
        return PoissonGaussianEvent(sigma, q, compositions), dict(
            sensitivity=s, sampling_rate=q, details=details
        )
    if scheme in MONTE_CARLO_SCHEMES and b > MAX_BINS:
        raise ValueError(
            f"batch_size={B} is invalid for scheme={scheme!r}: it makes {b} bins "
            "(ceil(dataset_size/batch_size)) and the Monte Carlo accountant supports at most "
            f"{MAX_BINS}"
        )
    if scheme == "epoch_balls_in_bins":
        full, rest = divmod(n, b)
        events = []
        if full:
            events.append(MixtureGaussianEvent(sigma, np.eye(b), full))
        if rest:
            events.append(MixtureGaussianEvent(sigma, np.diag((np.arange(b) < rest).astype(float)), 1))
        event = events[0] if len(events) == 1 else ComposedEvent(tuple(events))
        details = {"bins": b, "epochs": full + (1 if rest else 0), "last_epoch_steps": rest or b}
        return event, dict(sensitivity=1.0, sampling_rate=None, details=details)
    # balls_in_bins (fixed bins)
    s = _max_column_norm(run)
    if C is None:  # v_j = x_j: orthogonal, ‖x_j‖² = number of steps in bin j
        G = np.diag(np.bincount(np.arange(n) % b, minlength=b).astype(float))
    else:
        _check_nonnegative_gram(C)
        G = bin_gram(C, b, s)
    details = {"bins": b, "participations": math.ceil(n / b)}
    return MixtureGaussianEvent(sigma, G, 1), dict(sensitivity=s, sampling_rate=None, details=details)
