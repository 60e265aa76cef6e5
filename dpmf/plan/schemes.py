"""Batch-sampling schemes as objects: each one owns its rules, in one registry.

A scheme says how the examples of each step are chosen and how that is accounted. A run has N
examples (``dataset_size``), expected batch size B, n steps, noise multiplier σ and a strategy
C (a ``dpmf.mechanisms.Factorization``, or the identity for DP-SGD). The noise added to C·G
(G: the sums of clipped gradients, clip norm ζ) has std σ·ζ·s per entry, where the
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
                            every epoch (random allocation), epochs composed;
                            deterministic PLD bound by default, Monte Carlo too
==========================  ==================================================  =================

Every scheme is a frozen dataclass that owns: which strategies it accepts (``check_strategy``,
with the reason), the participation pattern its sensitivity and the optimized strategies use
(``participation``), its privacy event for a noise multiplier (``event``), the sensitivity its
noise is normalized by, its sampler for a seed (``sampler``), its accountants and default
(``accountants``, ``default_accountant``), and whether ε is reported after every epoch by default
(``epsilon_each_epoch``). ``SCHEMES`` maps the command-line names to the classes; adding a scheme
is one class and one ``register_scheme`` call.

Sources: Choquette-Choo et al., "Amplified Banded Matrix Factorization: A Unified Approach to
Private Training" (NeurIPS 2023), Theorem 4 (cyclic Poisson sampling of a b-banded strategy
equals DP-SGD with ⌈n/b⌉ steps at rate B·b/N when C's columns have norm ≤ 1); Chua et al.,
"Balls-and-Bins Sampling for DP-SGD" (AISTATS 2025) for the per-epoch dominating pair;
Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix Mechanisms" (ICLR 2025),
balls-in-bins for matrix mechanisms, for the fixed-bins pair and its condition CᵀC ≥ 0.

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
from typing import ClassVar

import numpy as np

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.events import (
    ComposedEvent,
    GaussianEvent,
    MixtureGaussianEvent,
    PoissonGaussianEvent,
)
from dpmf.accountants.registry import ACCOUNTANTS, AccountantSpec, AllocationPLD, MonteCarlo, accountants_for
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.registry import STRATEGIES
from dpmf.mechanisms.sensitivity import gram, sensitivity
from dpmf.mechanisms.structured import DenseLowerTriangular, ScaledToeplitz
from dpmf.plan import samplers as _samplers

__all__ = [
    "SCHEMES",
    "MAX_BINS",
    "Scheme",
    "EventInfo",
    "Poisson",
    "CyclicPoisson",
    "BallsInBins",
    "EpochBallsInBins",
    "FixedOrder",
    "SingleRelease",
    "register_scheme",
    "get_scheme",
    "scheme_names",
    "strategy_bandwidth",
    "bin_gram",
]

_GRAM_CHECK_MAX_N = 8192
MAX_BINS = 4096  # the Monte Carlo sampler works with b×b matrices
# the accountants of Poisson-subsampled Gaussian events (PLD, RDP, PRV), in registry order
_LIBRARY = accountants_for(PoissonGaussianEvent)


@dataclass(frozen=True)
class EventInfo:
    """The facts of a run's privacy event.

    Attributes:
        sensitivity: s, the normalization of the noise on C·G (std σ·ζ·s).
        sampling_rate: the Poisson rate q, or None.
        details: scheme-specific facts (participations, bands, bins, …).
    """

    sensitivity: float
    sampling_rate: float | None
    details: dict


def strategy_bandwidth(C) -> int:
    """Number of non-zero diagonals of a lower-triangular C (1 for diagonal C)."""
    if isinstance(C, ScaledToeplitz):
        return C.bandwidth
    M = np.asarray(C.dense() if isinstance(C, DenseLowerTriangular) else C)
    i, j = np.nonzero(M)
    return int(np.max(i - j)) + 1 if i.size else 1


def _max_column_norm(f) -> float:
    return 1.0 if f is None else float(np.max(f.C.column_norms()))


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
    X = gram(C)
    tol = 1e-12 * float(np.max(np.abs(X)))
    if np.any(X < -tol):
        raise ValueError(
            "factorization is invalid for balls_in_bins: CᵀC has negative entries (min "
            f"{X.min():.3g}); the balls-in-bins dominating pair needs CᵀC >= 0"
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


@dataclass(frozen=True)
class Scheme:
    """A batch-sampling scheme and its accounting (the base class; see the module table).

    The methods take ``run``: any object with ``dataset_size``, ``batch_size``, ``steps``,
    ``steps_per_epoch`` and ``factorization`` (a ``Factorization``, or None for C = I) — a
    ``dpmf.plan.PrivatePlan``.

    Class attributes:
        name: the registry key (the command-line name).
        summary: one line for help texts.
        matrix_mechanism: accepts strategies other than the identity.
        accountants: the accountants that can measure its event; ``default_accountant`` first.
        epsilon_each_epoch: whether ε after every epoch is reported by default.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    matrix_mechanism: ClassVar[bool] = True
    accountants: ClassVar[tuple[str, ...]] = _LIBRARY
    epsilon_each_epoch: ClassVar[bool] = True

    @property
    def default_accountant(self) -> str:
        """The accountant used when none is named."""
        return self.accountants[0]

    @property
    def label(self) -> str:
        """The name (with options where a scheme has them)."""
        return self.name

    def check_accountant(self, accountant: str | None) -> str:
        """The accountant to use: ``accountant`` if this scheme supports it, else the default
        for None.

        Raises:
            ValueError: an unknown accountant, or one that cannot measure this scheme's event.
        """
        if accountant is None:
            return self.default_accountant
        check_choice("accountant", accountant, ACCOUNTANTS)
        if accountant not in self.accountants:
            raise ValueError(
                f"accountant={accountant!r} is invalid for scheme={self.name!r}: use "
                f"{' or '.join(self.accountants)}"
            )
        return accountant

    def accountant_spec(self, accountant) -> AccountantSpec:
        """The accountant specification of a plan under this scheme: ``accountant`` itself (an
        ``AccountantSpec``), the default settings of a registered name, or the scheme's default
        accountant for None.

        Raises:
            ValueError: an unknown accountant, or one that cannot measure this scheme's event.
            TypeError: neither None, a name nor an ``AccountantSpec``, or a specification whose
                class is not the one registered under its name.
        """
        if isinstance(accountant, AccountantSpec):
            name = self.check_accountant(type(accountant).name)
            if ACCOUNTANTS.get(name) is not type(accountant):  # an impostor would be reported as `name`
                raise TypeError(
                    f"accountant={type(accountant).__name__}(...) is invalid: the name {name!r} is "
                    f"registered to {ACCOUNTANTS[name].__name__}; give that class, or register yours "
                    "under a name of its own (dpmf.accountants.registry.register_accountant)"
                )
            return accountant
        if accountant is not None and not isinstance(accountant, str):
            raise TypeError(
                f"accountant={accountant!r} is invalid: must be a name ({', '.join(self.accountants)}), "
                "a dpmf.accountants.registry.AccountantSpec, or None"
            )
        return ACCOUNTANTS[self.check_accountant(accountant)]()

    def check_strategy(self, run) -> None:
        """Raise ValueError, with the reason, when this scheme cannot account ``run``'s
        strategy or shape (called once, when a plan is built)."""
        if not self.matrix_mechanism and run.factorization is not None:
            raise ValueError(
                f"factorization={run.factorization.label!r} is invalid for scheme={self.name!r}: "
                "it accounts DP-SGD (C = I) only; use cyclic_poisson, balls_in_bins, fixed_order or "
                "single_release for a matrix mechanism"
            )

    def refuse_candidate(self, entry, bands: int | None, run) -> str | None:
        """Why ``pick`` should skip a strategy before building it (None: try it).

        Args:
            entry: the strategy's registry entry (``dpmf.mechanisms.registry.Strategy``).
            bands: its number of bands for a banded entry, else None.
            run: the run (identity strategy).
        """
        return None

    def participation(self, steps: int, steps_per_epoch: int) -> Participation:
        """The participation pattern the scheme's sensitivity (and the optimized strategies
        built for it) use; single participation unless the scheme says otherwise."""
        return Participation.single()

    def event(self, run, sigma: float):
        """The privacy event of ``run`` at σ = ``sigma`` (> 0), and its ``EventInfo``."""
        raise NotImplementedError

    def event_key(self, run):
        """A hashable key such that runs with equal keys (same N, B, n) have the same event
        (so a calibrated σ can be shared), or None when the event depends on all of C."""
        return None

    def sampler(self, run, seed: int):
        """The run's batch sampler (``dpmf.plan.samplers``) with ``seed``."""
        raise NotImplementedError

    def expected_batch_size(self, run) -> float:
        """B̄, the public expected number of examples per step (B unless the scheme fixes
        batches: then N/b)."""
        return float(run.batch_size)

    def frozen_for(self, run) -> Scheme:
        """This scheme with the defaults that depend on the run fixed (so that a shorter run of
        the same plan keeps them)."""
        return self

    def dpsgd_counterpart(self) -> Scheme:
        """The scheme under which DP-SGD (C = I) is accounted when a user asks ``pick`` for
        this one (the amplified DP-SGD scheme for the amplified matrix schemes)."""
        return self

    def _named(self, sampler):
        sampler.scheme = self.name
        return sampler


SCHEMES: dict[str, type[Scheme]] = {}


def register_scheme(cls: type[Scheme]) -> type[Scheme]:
    """Add a ``Scheme`` subclass to ``SCHEMES`` under ``cls.name`` (usable as a decorator).

    Raises:
        TypeError: not a subclass of ``Scheme``.
        ValueError: an empty or taken name.
    """
    if not (isinstance(cls, type) and issubclass(cls, Scheme)):
        raise TypeError(f"cls={cls!r} is invalid: must be a subclass of dpmf.plan.schemes.Scheme")
    if not cls.name or cls.name in SCHEMES:
        raise ValueError(f"name={cls.name!r} is invalid: must be non-empty and not yet registered")
    SCHEMES[cls.name] = cls
    return cls


def scheme_names() -> tuple[str, ...]:
    """The registered scheme names, in registration order."""
    return tuple(SCHEMES)


def get_scheme(scheme, **options) -> Scheme:
    """A scheme object from its name (with its options, e.g. ``min_sep``) or a ``Scheme``.

    Raises:
        ValueError: an unknown name, or options the scheme does not take.
        TypeError: neither a name nor a ``Scheme``, or a ``Scheme`` whose class is not the one
            registered under its name.
    """
    if isinstance(scheme, Scheme):  # options it already has (a plan rebuilt by replace) are fine
        if SCHEMES.get(scheme.name) is not type(scheme):  # an impostor would be reported as its name
            raise TypeError(
                f"scheme={type(scheme).__name__}(...) is invalid: the name {scheme.name!r} is registered "
                f"to {getattr(SCHEMES.get(scheme.name), '__name__', None)}; give that class, or register "
                "yours under a name of its own (dpmf.plan.register_scheme)"
            )
        if any(v is not None and getattr(scheme, k, None) != v for k, v in options.items()):
            raise ValueError(f"options {sorted(options)} are invalid with a Scheme object: set them on it")
        return scheme
    if not isinstance(scheme, str):
        raise TypeError(f"scheme={scheme!r} is invalid: must be a scheme name or a dpmf.plan.Scheme")
    check_choice("scheme", scheme, scheme_names())
    cls = SCHEMES[scheme]
    given = {k: v for k, v in options.items() if v is not None}
    fields = set(cls.__dataclass_fields__)
    extra = sorted(set(given) - fields)
    if extra:
        raise ValueError(
            f"{extra[0]}={given[extra[0]]!r} is invalid for scheme={scheme!r}: it takes no {extra[0]}"
        )
    return cls(**given)


@register_scheme
@dataclass(frozen=True)
class Poisson(Scheme):
    """DP-SGD (C = I) with Poisson subsampling at q = B/N for n steps (Abadi et al., CCS 2016)."""

    name: ClassVar[str] = "poisson"
    summary: ClassVar[str] = "DP-SGD, each example in each step with probability B/N"
    matrix_mechanism: ClassVar[bool] = False

    def event(self, run, sigma):
        q = run.batch_size / run.dataset_size
        return PoissonGaussianEvent(sigma, q, run.steps), EventInfo(1.0, q, {})

    def event_key(self, run):
        return (self.name,)

    def sampler(self, run, seed):
        return self._named(_samplers.PoissonSampler(run.dataset_size, run.batch_size, run.steps, seed=seed))


@register_scheme
@dataclass(frozen=True)
class CyclicPoisson(Scheme):
    """A banded C with cyclic Poisson sampling (Choquette-Choo et al., NeurIPS 2023, Thm 4).

    Attributes:
        min_sep: b', the number of groups (steps between an example's participations); None:
            the bands p of C. Needs p ≤ b' and q = B·b'/N ≤ 1.
    """

    name: ClassVar[str] = "cyclic_poisson"
    summary: ClassVar[str] = "banded C; data in min_sep groups, group t mod min_sep Poisson-sampled"
    min_sep: int | None = None

    def __post_init__(self):
        if self.min_sep is not None:
            object.__setattr__(self, "min_sep", check_int("min_sep", self.min_sep, minimum=1))

    def groups(self, run) -> int:
        """b': ``min_sep``, or the bands of C (1 for C = I)."""
        if self.min_sep is not None:
            return self.min_sep
        return 1 if run.factorization is None else strategy_bandwidth(run.factorization.C)

    def check_strategy(self, run):
        f = run.factorization
        p = 1 if f is None else strategy_bandwidth(f.C)
        sep = self.groups(run)
        q = run.batch_size * sep / run.dataset_size
        if (p > sep or q > 1.0) and f is not None and f.name in STRATEGIES and not STRATEGIES[f.name].banded:
            raise ValueError(
                f"factorization={f.label!r} is invalid for scheme='cyclic_poisson': C is not banded "
                f"(it has {p} non-zero diagonals; for bisr-like strategies C⁻¹ is banded, C is not); "
                "use a banded strategy such as bsr:p, bsr_opt:p or identity"
            )
        if p > sep:
            raise ValueError(
                f"factorization {run.label!r} is invalid for scheme='cyclic_poisson': C has {p} bands but "
                f"min_sep={sep}; amplification needs bands <= min_sep (use a banded strategy such "
                f"as bsr:{sep})"
            )
        if q > 1.0:
            most = run.dataset_size // run.batch_size
            given = "" if self.min_sep is not None else f" (the {p} bands of factorization {run.label!r})"
            raise ValueError(
                f"min_sep={sep}{given} is invalid for scheme='cyclic_poisson': the sampling rate "
                f"batch_size*min_sep/dataset_size={q:.4g} exceeds 1 (need min_sep <= {most}); use a "
                f"strategy of at most {most} bands, a smaller batch_size, or more data"
            )

    def refuse_candidate(self, entry, bands, run):
        if bands is None:
            return "C is not banded (cyclic_poisson needs a banded strategy)"
        if bands > run.dataset_size // run.batch_size:
            return f"{bands} bands need q = B·p/N > 1"
        return None

    def event(self, run, sigma):
        f = run.factorization
        p = 1 if f is None else strategy_bandwidth(f.C)
        sep = self.groups(run)
        q = run.batch_size * sep / run.dataset_size
        compositions = math.ceil(run.steps / sep)
        details = {"bands": p, "min_sep": sep, "compositions": compositions}
        return PoissonGaussianEvent(sigma, q, compositions), EventInfo(_max_column_norm(f), q, details)

    def event_key(self, run):
        return (self.name, self.groups(run))

    def frozen_for(self, run):
        return self if self.min_sep is not None else CyclicPoisson(self.groups(run))

    @property
    def label(self) -> str:
        return self.name if self.min_sep is None else f"{self.name}(min_sep={self.min_sep})"

    def sampler(self, run, seed):
        return self._named(
            _samplers.CyclicPoissonSampler(
                run.dataset_size, run.batch_size, run.steps, groups=self.groups(run), seed=seed
            )
        )

    def dpsgd_counterpart(self):
        return Poisson()


class _Bins(Scheme):
    """Common part of the balls-in-bins schemes: b = ⌈N/B⌉ bins, accounted by Monte Carlo
    (certified at a confidence) or by the deterministic random-allocation bound
    (``allocation_pld``, ``dpmf.accountants.allocation``; an upper bound)."""

    accountants: ClassVar[tuple[str, ...]] = (MonteCarlo.name, AllocationPLD.name)
    epsilon_each_epoch: ClassVar[bool] = False

    def expected_batch_size(self, run):
        return run.dataset_size / run.steps_per_epoch

    def check_strategy(self, run):
        super().check_strategy(run)
        b = run.steps_per_epoch
        if b > MAX_BINS:
            raise ValueError(
                f"batch_size={run.batch_size} is invalid for scheme={self.name!r}: it makes {b} bins "
                "(ceil(dataset_size/batch_size)) and the Monte Carlo accountant supports at most "
                f"{MAX_BINS}"
            )


@register_scheme
@dataclass(frozen=True)
class BallsInBins(_Bins):
    """Each example in one of b fixed bins for the whole run; any C with CᵀC ≥ 0
    (Choquette-Choo et al., ICLR 2025)."""

    name: ClassVar[str] = "balls_in_bins"
    summary: ClassVar[str] = "each example in one of ceil(N/B) fixed bins; step t uses bin t mod b"

    def check_strategy(self, run):
        super().check_strategy(run)
        if run.factorization is not None:
            _check_nonnegative_gram(run.factorization.C)

    def event(self, run, sigma):
        f, n, b = run.factorization, run.steps, run.steps_per_epoch
        s = _max_column_norm(f)
        if f is None:  # v_j = x_j: orthogonal, ‖x_j‖² = number of steps in bin j
            G = np.diag(np.bincount(np.arange(n) % b, minlength=b).astype(float))
        else:
            G = bin_gram(f.C, b, s)
        details = {"bins": b, "participations": math.ceil(n / b)}
        return MixtureGaussianEvent(sigma, G, 1), EventInfo(s, None, details)

    def sampler(self, run, seed):
        return self._named(
            _samplers.BallsInBinsSampler(run.dataset_size, run.batch_size, run.steps, seed=seed)
        )

    def dpsgd_counterpart(self):
        return Poisson()


@register_scheme
@dataclass(frozen=True)
class EpochBallsInBins(_Bins):
    """DP-SGD with a fresh uniform bin per example every epoch (Chua et al., AISTATS 2025)."""

    name: ClassVar[str] = "epoch_balls_in_bins"
    summary: ClassVar[str] = "DP-SGD, bins redrawn every epoch"
    matrix_mechanism: ClassVar[bool] = False
    # deterministic and seconds per calibration: the default, and cheap enough for every epoch
    accountants: ClassVar[tuple[str, ...]] = (AllocationPLD.name, MonteCarlo.name)
    epsilon_each_epoch: ClassVar[bool] = True

    def event(self, run, sigma):
        n, b = run.steps, run.steps_per_epoch
        full, rest = divmod(n, b)
        events = []
        if full:
            events.append(MixtureGaussianEvent(sigma, np.eye(b), full))
        if rest:
            events.append(MixtureGaussianEvent(sigma, np.diag((np.arange(b) < rest).astype(float)), 1))
        event = events[0] if len(events) == 1 else ComposedEvent(tuple(events))
        details = {"bins": b, "epochs": full + (1 if rest else 0), "last_epoch_steps": rest or b}
        return event, EventInfo(1.0, None, details)

    def sampler(self, run, seed):
        return self._named(
            _samplers.EpochBallsInBinsSampler(run.dataset_size, run.batch_size, run.steps, seed=seed)
        )


@register_scheme
@dataclass(frozen=True)
class FixedOrder(Scheme):
    """One shuffle, then fixed batches in cyclic order: k = ⌈n/b⌉ participations, no
    amplification; sensitivity under fixed_epochs(b, k)."""

    name: ClassVar[str] = "fixed_order"
    summary: ClassVar[str] = "one shuffle, fixed batches in the same order every epoch (no amplification)"
    accountants: ClassVar[tuple[str, ...]] = _LIBRARY + (MonteCarlo.name,)

    def expected_batch_size(self, run):
        return run.dataset_size / run.steps_per_epoch

    def participation(self, steps, steps_per_epoch):
        k = math.ceil(steps / steps_per_epoch)
        return Participation.fixed_epochs(steps_per_epoch, k) if k > 1 else Participation.single()

    def event(self, run, sigma):
        n, b = run.steps, run.steps_per_epoch
        k = math.ceil(n / b)
        f = run.factorization
        if f is None:
            s, exact, method = math.sqrt(k), True, "identity"
        else:
            sens = sensitivity(f.C, Participation.fixed_epochs(b, k))
            s, exact, method = sens.value, sens.exact, sens.method
        details = {
            "participations": k,
            "steps_per_epoch": b,
            "sensitivity_exact": exact,
            "sensitivity_method": method,
        }
        return GaussianEvent(sigma), EventInfo(s, None, details)

    def event_key(self, run):
        return (self.name,)

    def sampler(self, run, seed):
        return self._named(
            _samplers.ShuffledFixedSampler(run.dataset_size, run.batch_size, run.steps, seed=seed)
        )


@register_scheme
@dataclass(frozen=True)
class SingleRelease(Scheme):
    """One Gaussian release: each example used at most once (n ≤ b), μ = 1/σ."""

    name: ClassVar[str] = "single_release"
    summary: ClassVar[str] = "at most one epoch, each example used once; one Gaussian release"
    accountants: ClassVar[tuple[str, ...]] = _LIBRARY + (MonteCarlo.name,)

    def check_strategy(self, run):
        super().check_strategy(run)
        b = run.steps_per_epoch
        if run.steps > b:
            raise ValueError(
                f"steps={run.steps} is invalid for scheme='single_release': each example may be used "
                f"once, so steps must be <= ceil(dataset_size/batch_size)={b}; use fixed_order for "
                "several epochs"
            )

    def expected_batch_size(self, run):
        return run.dataset_size / run.steps_per_epoch

    def event(self, run, sigma):
        return GaussianEvent(sigma), EventInfo(
            _max_column_norm(run.factorization), None, {"participations": 1}
        )

    def event_key(self, run):
        return (self.name,)

    def sampler(self, run, seed):
        return self._named(
            _samplers.ShuffledFixedSampler(run.dataset_size, run.batch_size, run.steps, seed=seed)
        )


def auto_scheme(entry, bands: int | None, run) -> Scheme:
    """``pick``'s ``auto`` choice for a strategy: DP-SGD under Poisson sampling; a banded C with
    p ≤ min(b, ⌊N/B⌋) bands under cyclic Poisson sampling (min_sep = p); anything else in fixed
    order (no amplification).

    Args:
        entry: the strategy's registry entry, or None for the identity.
        bands: its bands (banded entries), else None.
        run: the run (N, B, steps_per_epoch).
    """
    if entry is None or entry.name == "identity":
        return Poisson()
    if bands is not None and bands <= min(run.steps_per_epoch, run.dataset_size // run.batch_size):
        return CyclicPoisson()
    return FixedOrder()


# The largest noise multiplier accepted: far above it the accountants' arithmetic overflows
# (σ² past 1e308 in dp-accounting), and already at σ ≈ 1e6 every ε they report is 0.
MAX_NOISE_MULTIPLIER = 1e100


def check_sigma(noise_multiplier) -> float:
    """σ in (0, ``MAX_NOISE_MULTIPLIER``]; raises ValueError naming it otherwise."""
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0, low_inclusive=False)
    if sigma > MAX_NOISE_MULTIPLIER:
        raise ValueError(
            f"noise_multiplier={sigma!r} is invalid: must be in (0, {MAX_NOISE_MULTIPLIER:g}] "
            "(the accountants overflow beyond it, and every ε is already 0 from about 1e6); "
            f"use noise_multiplier={MAX_NOISE_MULTIPLIER:g} or less"
        )
    return sigma
