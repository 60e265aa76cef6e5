"""The accounting entry points: ε of a run, σ for a target, and the largest steps / batch size.

Above ``dpmf.plan.plan`` (these functions build plans) and exported as ``dpmf.account``,
``dpmf.calibrate``, ``dpmf.max_steps``, ``dpmf.max_batch_size`` and ``dpmf.account_segments``
(and from ``dpmf.plan``).

``account(plan, noise_multiplier, delta=…)`` and ``calibrate(plan, epsilon=…, delta=…)`` take a
``dpmf.PrivatePlan`` (the scheme, N, B, n and strategy of one run) and return a
``PrivacyResult``. The keyword forms — ``account("poisson", noise_multiplier=…, dataset_size=…,
batch_size=…, steps=…, delta=…, factorization=…)`` — are thin conveniences that build the plan
first; so are ``max_steps`` and ``max_batch_size``. The schemes and their sources are in
``dpmf.plan.schemes``; the implementations in ``dpmf.plan.accounting``.
"""

from __future__ import annotations

from dpmf.accountants.result import PrivacyResult
from dpmf.mechanisms import Factorization
from dpmf.plan.accounting import account as _account
from dpmf.plan.accounting import account_segments
from dpmf.plan.accounting import calibrate as _calibrate
from dpmf.plan.accounting import max_batch_size as _max_batch_size
from dpmf.plan.accounting import max_steps as _max_steps
from dpmf.plan.plan import PrivatePlan
from dpmf.plan.schemes import get_scheme

__all__ = [
    "account",
    "account_segments",
    "calibrate",
    "max_steps",
    "max_batch_size",
    "default_accountant",
]


def default_accountant(scheme: str) -> str:
    """The scheme's default accountant: ``monte_carlo`` for the balls-in-bins schemes, ``pld``
    otherwise (``Scheme.default_accountant``)."""
    return get_scheme(scheme).default_accountant


def _plan(scheme, dataset_size, batch_size, steps, factorization, min_sep, epochs=None, schedule=None):
    """The plan of a keyword call (``scheme`` may already be a plan: then nothing else is allowed)."""
    if isinstance(scheme, PrivatePlan):
        given = [
            k
            for k, v in dict(
                dataset_size=dataset_size,
                batch_size=batch_size,
                steps=steps,
                factorization=factorization,
                min_sep=min_sep,
            ).items()
            if v is not None
        ]
        if given:
            raise ValueError(f"{given[0]} is invalid with a plan: the plan fixes it (use plan.replace(...))")
        return scheme
    if factorization is not None and not isinstance(factorization, Factorization):
        raise TypeError(
            f"factorization={factorization!r} is invalid: must be a dpmf.mechanisms.Factorization or None "
            "(for a spec such as 'bsr:4', build a dpmf.PrivatePlan(..., strategy='bsr:4'))"
        )
    return PrivatePlan(
        dataset_size,
        batch_size,
        steps=steps,
        epochs=epochs,
        scheme=scheme,
        strategy="identity" if factorization is None else factorization,
        schedule=schedule,
        min_sep=min_sep,
    )


def account(
    plan,
    noise_multiplier: float | None = None,
    *,
    delta: float,
    dataset_size: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    factorization=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float | None = 0.99,
    min_sep: int | None = None,
    progress: bool | None = None,
) -> PrivacyResult:
    """ε at ``delta`` of a training run.

    Args:
        plan: a ``dpmf.PrivatePlan``, or a scheme name with ``dataset_size``, ``batch_size``,
            ``steps`` (and optionally ``factorization``, ``min_sep``) to build one.
        noise_multiplier: σ > 0 (default: the plan's); the noise on C·G has std σ·ζ·s.
        delta: δ in (0, 1).
        factorization: a ``dpmf.mechanisms.Factorization`` with n = steps, or None (C = I) —
            keyword form only.
        accountant, samples, seed, confidence, progress: as in ``dpmf.plan.accounting.account``.

    Returns:
        ``PrivacyResult`` (ε ≥ 0, never NaN; 0 when δ(0) ≤ δ).

    Raises:
        ValueError/TypeError: any invalid argument, named, before any work.
    """
    p = _plan(plan, dataset_size, batch_size, steps, factorization, min_sep)
    return _account(
        p,
        noise_multiplier,
        delta=delta,
        accountant=accountant,
        samples=samples,
        seed=seed,
        confidence=confidence,
        progress=progress,
    )


def calibrate(
    plan,
    *,
    epsilon: float,
    delta: float,
    dataset_size: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    factorization=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    min_sep: int | None = None,
    rtol: float = 1e-3,
    progress: bool | None = None,
) -> PrivacyResult:
    """The smallest noise multiplier σ that meets (ε, δ) under the accountant (conservative).

    Args:
        plan: a ``dpmf.PrivatePlan``, or a scheme name with the run's keywords (as ``account``).
        epsilon: target ε > 0.
        delta: target δ in (0, 1).
        others: as in ``dpmf.plan.accounting.calibrate``.

    Returns:
        ``PrivacyResult`` whose ``noise_multiplier`` is the calibrated σ.

    Raises:
        ValueError/TypeError: invalid arguments, named, before any work.
    """
    p = _plan(plan, dataset_size, batch_size, steps, factorization, min_sep)
    return _calibrate(
        p,
        epsilon=epsilon,
        delta=delta,
        accountant=accountant,
        samples=samples,
        seed=seed,
        confidence=confidence,
        rtol=rtol,
        progress=progress,
    )


def max_steps(
    scheme,
    *,
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    dataset_size: int | None = None,
    batch_size: int | None = None,
    factorization=None,
    schedule=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    min_sep: int | None = None,
    limit: int = 1_000_000,
    progress: bool | None = None,
) -> PrivacyResult | None:
    """The largest number of steps n ≤ ``limit`` whose run meets (ε, δ) at σ.

    Args:
        scheme: a scheme name (with ``dataset_size``, ``batch_size``) or a plan.
        factorization: None (C = I), a spec such as ``"bisr:16"`` (built for each n on
            ``schedule``'s workload, the prefix sum by default), or a callable n → Factorization.
        schedule: a ``dpmf.workloads.Schedule``, or None.
        others: as in ``dpmf.plan.accounting.max_steps``.

    Returns:
        The ``PrivacyResult`` at the largest feasible n, or None when even n = 1 fails.

    Raises:
        ValueError/TypeError: invalid arguments, named, before any work.
    """
    base, strategy = _search_base(scheme, dataset_size, batch_size, min_sep, schedule, factorization)
    return _max_steps(
        base,
        noise_multiplier=noise_multiplier,
        epsilon=epsilon,
        delta=delta,
        strategy=strategy,
        accountant=accountant,
        samples=samples,
        seed=seed,
        confidence=confidence,
        limit=limit,
        progress=progress,
    )


def max_batch_size(
    scheme,
    *,
    noise_multiplier: float,
    epsilon: float,
    delta: float,
    dataset_size: int | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    factorization=None,
    schedule=None,
    accountant: str | None = None,
    samples: int | None = None,
    seed: int = 0,
    confidence: float = 0.99,
    min_sep: int | None = None,
    progress: bool | None = None,
) -> PrivacyResult | None:
    """The largest batch size B ≤ N whose run meets (ε, δ) at σ.

    Exactly one of ``steps`` (fixed n) or ``epochs`` (n = epochs·⌈N/B⌉, so n changes with B)
    is given. Other arguments as in ``max_steps``.

    Returns:
        The ``PrivacyResult`` at the largest feasible B, or None when even B = 1 fails.

    Raises:
        ValueError/TypeError: invalid arguments (including both or neither of steps/epochs).
    """
    if (steps is None) == (epochs is None):
        raise ValueError("steps/epochs is invalid: give exactly one of steps or epochs")
    base, strategy = _search_base(scheme, dataset_size, None, min_sep, schedule, factorization)
    return _max_batch_size(
        base,
        noise_multiplier=noise_multiplier,
        epsilon=epsilon,
        delta=delta,
        steps=steps,
        epochs=epochs,
        strategy=strategy,
        accountant=accountant,
        samples=samples,
        seed=seed,
        confidence=confidence,
        progress=progress,
    )


def _search_base(scheme, dataset_size, batch_size, min_sep, schedule, factorization):
    """The plan a steps/batch-size search starts from (its steps, and its batch size when
    ``batch_size`` is None, are placeholders the search replaces), and the strategy to rebuild
    for every candidate (None: the given plan's own)."""
    if isinstance(scheme, PrivatePlan):
        base = _plan(scheme, dataset_size, batch_size, None, None, min_sep, schedule=schedule)
        return base, factorization
    base = _plan(
        scheme, dataset_size, 1 if batch_size is None else batch_size, 1, None, min_sep, schedule=schedule
    )
    return base, "identity" if factorization is None else factorization
