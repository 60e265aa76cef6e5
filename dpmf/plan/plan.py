"""``PrivatePlan``: one object that binds what must agree for a privacy guarantee to hold.

A plan holds the dataset size N, the expected batch size B, the number of steps n, the
batch-sampling scheme (a ``dpmf.plan.schemes.Scheme``), the strategy C (a
``dpmf.mechanisms.Factorization`` of the learning-rate workload A_χ) and the schedule χ, the
clip norm ζ, the accountant specification, the seed policy and, once calibrated, the noise
multiplier σ: everything the guarantee depends on. It is validated once, when built. From it, and only
from it, come the sampler, the sensitivity, the privacy event, the accounting and the calibration,
and ``dpmf.step.build`` builds the noise stream and the privatizer from it, so that these cannot
disagree. The plan is numbers only (numpy; no torch):

    plan = PrivatePlan(dataset_size=60000, batch_size=256, epochs=10,
                       scheme="cyclic_poisson", strategy="bsr:16", clip_norm=1.0)
    plan = plan.calibrate(epsilon=3.0, delta=1e-5)         # a plan with its σ
    step = dpmf.step.build(plan, model, loss_fn)             # sampler + noise + privatizer
    std = plan.noise_std()                                   # σ·ζ·s on the sum of clipped grads

One private step is then: batch from the sampler → per-example gradients → clip to ζ → sum →
+ σ·ζ·s·(C⁻¹Z)_t → ÷ B̄ (the public expected batch size ``plan.expected_batch_size``) →
optimizer (post-processing).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dpmf import seeds
from dpmf._memory import check_memory
from dpmf._validation import check_int, check_real
from dpmf.accountants.library import to_dp_event
from dpmf.mechanisms.factorizations import Factorization
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.registry import STRATEGIES, factorize, parse_factorization
from dpmf.mechanisms.structured import DenseLowerTriangular, ScaledToeplitz
from dpmf.plan.samplers import steps_per_epoch
from dpmf.plan.schemes import Poisson, Scheme, check_sigma, get_scheme, strategy_bandwidth
from dpmf.workloads.schedules import Schedule
from dpmf.workloads.workload import Workload, from_schedule

__all__ = ["PrivatePlan", "build_strategy", "leading_block", "steps_per_epoch"]


def build_strategy(workload: Workload, spec: str, scheme: Scheme, steps_per_epoch: int) -> Factorization:
    """The factorization ``spec`` of ``workload`` for a run accounted under ``scheme``.

    The optimized strategies are optimized for ``scheme.participation(n, b)`` with the bounded
    effort of their registry entry (``pick_options``), so ``pick``, ``train`` and the accounting
    build the same strategy; the others are ``factorize``'s.

    Raises:
        ValueError: an invalid spec, or an optimized strategy infeasible for the participation.
    """
    name, _ = parse_factorization(spec)
    entry = STRATEGIES[name]
    if entry.optimized:
        participation = scheme.participation(workload.n, steps_per_epoch)
        return factorize(workload, spec, participation=participation, **entry.pick_options)
    return factorize(workload, spec)


def leading_block(factorization: Factorization, steps: int) -> Factorization:
    """The factorization of the first ``steps`` steps: the leading t×t blocks of A and C.

    The first t rows of C·G + Z depend only on the first t gradients through C's leading block
    (C is lower-triangular), so the privacy spent after t steps is that of this factorization.

    Raises:
        ValueError: steps outside [1, n].
    """
    n = factorization.n
    if not 1 <= steps <= n:
        raise ValueError(f"steps={steps} is invalid: must be in [1, {n}]")
    if steps == n:
        return factorization
    w = factorization.workload
    scale = None if w.column_scale is None else np.asarray(w.column_scale)[:steps]
    workload = Workload(np.asarray(w.coeffs)[:steps], scale, name=w.name)
    C = factorization.C
    if isinstance(C, ScaledToeplitz):
        cut = lambda v: None if v is None else v[:steps]  # noqa: E731
        C_t = ScaledToeplitz(C.coeffs[:steps], cut(C.row_scale), cut(C.col_scale))
    else:
        C_t = DenseLowerTriangular(C.dense()[:steps, :steps])
    return Factorization(factorization.name, factorization.bands, workload, C_t)


def _check_segments(plan) -> tuple:
    """``plan.noise_segments`` as a tuple of (int steps ≥ 1, float σ ≥ 0) covering its n steps."""
    fix = "give a tuple of (steps, noise_multiplier) pairs whose steps sum to the plan's steps"
    if plan.noise_multiplier is not None:
        raise ValueError("noise_segments is invalid together with noise_multiplier: give one of them")
    if not isinstance(plan.scheme, Poisson) or plan.strategy.name != "identity":
        raise ValueError(
            f"noise_segments is invalid for scheme={plan.scheme.name!r}, strategy={plan.label!r}: "
            "segments are accounted for DP-SGD under Poisson sampling (scheme 'poisson', strategy 'identity')"
        )
    try:
        segs = tuple((int(c), float(v)) for c, v in plan.noise_segments)
    except (TypeError, ValueError):
        raise ValueError(f"noise_segments={plan.noise_segments!r} is invalid: {fix}") from None
    for i, (c, v) in enumerate(segs):
        if c < 1 or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"noise_segments[{i}]=({c}, {v}) is invalid: steps ≥ 1 and σ ≥ 0 (finite)")
    total = sum(c for c, _ in segs)
    if not segs or total != plan.steps:
        raise ValueError(
            f"noise_segments is invalid: its steps sum to {total}, the plan has {plan.steps}; {fix}"
        )
    return segs


def _is_identity(C) -> bool:
    """Whether the strategy matrix C is exactly the identity (the only C that DP-SGD's
    accounting, which never looks at C, describes); O(n) for Toeplitz structure, else one
    product with a fixed random vector (C·x = x exactly only for C = I, almost surely)."""
    if isinstance(C, ScaledToeplitz):
        unit = all(v is None or np.all(np.asarray(v) == 1.0) for v in (C.row_scale, C.col_scale))
        return unit and C.coeffs[0] == 1.0 and not np.any(C.coeffs[1:])
    x = np.random.default_rng(0).standard_normal(C.n)
    return bool(np.array_equal(C.matmul(x), x))


def _inverts(noise, C) -> bool:
    """Whether ``noise`` is C⁻¹ (a strategy carrying its own noise correlation), checked on a
    fixed random vector: ‖C·(noise·x) − x‖ ≤ 10⁻⁶·‖x‖ (O(n log n) for Toeplitz structure)."""
    if noise.n != C.n:
        return False
    x = np.random.default_rng(0).standard_normal(C.n)
    y = C.matmul(noise.matmul(x))
    return bool(np.all(np.isfinite(y)) and np.linalg.norm(y - x) <= 1e-6 * np.linalg.norm(x))


# The factorizations already checked (built from a spec here, or checked once when given): a plan
# derived from another (``with_noise``, ``calibrate``, …) does not repeat an O(n log n) check.
_CHECKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _built_in_factorization_types() -> tuple[type, ...]:
    """The ``Factorization`` classes dpmf defines (a subclass may stream its own noise)."""
    from dpmf.mechanisms.blt import BLTFactorization
    from dpmf.mechanisms.lcgd import LCGDFactorization

    return (Factorization, BLTFactorization, LCGDFactorization)


def _check_given_strategy(strategy: Factorization) -> None:
    """Refuse a given ``Factorization`` whose noise correlation is not C⁻¹, one named
    ``identity`` whose C is not I, or an instance of a subclass dpmf does not define (its
    ``noise_layout`` or matrices may differ from what they report): each would add other noise
    than its accounting describes."""
    if _CHECKED.get(id(strategy)) is strategy:
        return
    if type(strategy) not in _built_in_factorization_types():
        raise ValueError(
            f"strategy is invalid: a {type(strategy).__name__} (a subclass of Factorization that "
            "dpmf does not define) may stream other noise than the C⁻¹ its sensitivity and ε "
            "describe; give a plain Factorization(name, bands, workload, C, noise=C⁻¹) or register "
            "a builder with register_strategy"
        )
    if strategy.noise is not None and not _inverts(strategy.noise, strategy.C):
        raise ValueError(
            f"strategy={strategy.label!r} is invalid: its noise correlation is not C⁻¹ (the noise "
            "would not be the one its sensitivity and ε describe); build it with factorize(...) "
            "or give noise=None"
        )
    if strategy.name == "identity" and not _is_identity(strategy.C):
        raise ValueError(
            "strategy is invalid: a Factorization named 'identity' is accounted as DP-SGD (C = I) "
            "but its C is not the identity; give it another name, or use strategy='identity'"
        )
    _CHECKED[id(strategy)] = strategy


def _check_privacy(plan) -> None:
    """Refuse a ``privacy`` result measured for another run than ``plan`` (another σ, steps,
    N, B, scheme, strategy or sampling rate): its ε would be reported for noise it did not
    measure (e.g. ``dataclasses.replace(plan, noise_multiplier=…)`` keeps the old result)."""
    res = plan.privacy
    own = {
        "noise_multiplier": plan.noise_multiplier,
        "steps": plan.steps,
        "dataset_size": plan.dataset_size,
        "batch_size": plan.batch_size,
        "scheme": plan.scheme.name,
        "factorization": plan.label,
        "sampling_rate": plan.sampling_rate,
        "sensitivity": plan.sensitivity,  # the same label built on another schedule's workload
    }
    for name, value in own.items():
        measured = getattr(res, name, None)
        close = isinstance(measured, float) and math.isclose(measured, value, rel_tol=1e-12)
        if name == "sensitivity" and close:
            continue
        if measured != value and not (name in ("dataset_size", "batch_size") and measured is None):
            raise ValueError(
                f"privacy is invalid: it was measured with {name}={measured!r} but the plan has "
                f"{name}={value!r}; use plan.with_noise(σ) or plan.replace(...) (which drop it) and "
                "account or calibrate the new plan"
            )


@dataclass(frozen=True, eq=False)
class PrivatePlan:
    """One private training run's mechanism: data size, batches, steps, scheme, strategy, σ.

    Args (the fields as given; normalized at construction):
        dataset_size: N ≥ 1.
        batch_size: B in [1, N], the expected (logical) batch size.
        steps: n ≥ 1; or give ``epochs`` instead (n = epochs·⌈N/B⌉).
        epochs: E ≥ 1, when ``steps`` is not given.
        scheme: a scheme name (``dpmf.plan.schemes.SCHEMES``) or a ``Scheme`` object; None:
            Poisson sampling.
        strategy: a spec (``"identity"``, ``"bsr:16"``, ``"lcgd:0.5"``, ``"dense"``, …) or a
            ``Factorization`` with n = steps. A spec is built on the workload of ``schedule``;
            optimized strategies are optimized for the scheme's participation.
        schedule: the learning-rate schedule χ (``dpmf.workloads.Schedule``); None: constant
            (the prefix-sum workload).
        min_sep: b' of ``cyclic_poisson`` (default: the bands of C); refused by other schemes.
        noise_multiplier: σ > 0 once known (``calibrate`` returns a plan with it), else None.
        privacy: the ``PrivacyResult`` that produced σ (set by ``calibrate``/``with_noise``).
        noise_segments: instead of one σ, noise that varies by segment of steps: a tuple of
            (steps_i ≥ 1, σ_i ≥ 0) in order with Σ steps_i = n (DP-SGD under Poisson sampling
            only: the run is the composition of the segments' subsampled Gaussian mechanisms,
            ``dpmf.plan.api.account_segments``). A segment with σ_i = 0 adds no noise: such a
            plan has no finite ε and ``account`` refuses it. None: one σ.
        clip_norm: ζ > 0, the per-example clip norm (the sensitivity of one example's
            gradient); needed by ``dpmf.step.build`` and ``noise_std``. None: not yet chosen.
        accountant: the accountant that measures this plan: a specification from
            ``dpmf.accountants.registry`` (e.g. ``MonteCarlo(samples=10**6, confidence=0.99)``,
            carrying its own settings), a registered name, or None (the scheme's default).
            ``account``, ``calibrate`` and ``epsilon_after`` use it unless given another.
        seed: the seed policy of the run's key: None (default) draws a fresh secret 256-bit
            key from the OS when the private step is built; an integer is the key itself
            (reproducible, and predictable to anyone who knows it: ``dpmf.seeds.NOTICE``).
            Never printed (not in the repr nor in ``to_dict``).

    After construction ``scheme`` is a ``Scheme``, ``strategy`` a ``Factorization``, ``steps``
    an int and ``schedule`` a ``Schedule``.

    Raises:
        ValueError: N, B, n or epochs out of range; both or neither of steps/epochs; an unknown
            scheme or strategy; a strategy the scheme cannot account (with the reason); a
            factorization of another size; a non-finite sensitivity; a ``privacy`` result
            measured for another σ, N, B, n, scheme, strategy, sampling rate or sensitivity; a
            Factorization named ``identity`` whose C is not I, or one whose ``noise`` is not C⁻¹.
        TypeError: arguments of the wrong type; a scheme or accountant object whose class is
            not the one registered under its name.
    """

    dataset_size: int
    batch_size: int
    steps: int | None = None
    epochs: int | None = None
    scheme: Scheme | str | None = None
    strategy: Factorization | str = "identity"
    schedule: Schedule | None = None
    min_sep: int | None = None
    noise_multiplier: float | None = None
    privacy: object = dataclasses.field(default=None, repr=False)
    noise_segments: tuple | None = None
    clip_norm: float | None = None
    accountant: object = None
    seed: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        b = steps_per_epoch(self.dataset_size, self.batch_size)
        setf = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        setf("dataset_size", int(self.dataset_size))
        setf("batch_size", int(self.batch_size))
        if self.epochs is not None:
            setf("epochs", check_int("epochs", self.epochs, minimum=1))
            if self.steps is not None and self.steps != self.epochs * b:
                raise ValueError("steps/epochs is invalid: give exactly one of steps or epochs")
            setf("steps", self.epochs * b)
        elif self.steps is None:
            raise ValueError("steps/epochs is invalid: give exactly one of steps or epochs")
        else:
            setf("steps", check_int("steps", self.steps, minimum=1))
        schedule = self.schedule if self.schedule is not None else Schedule("constant")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule={schedule!r} is invalid: must be a dpmf.workloads.Schedule or None")
        setf("schedule", schedule)
        scheme = get_scheme(self.scheme if self.scheme is not None else Poisson(), min_sep=self.min_sep)
        strategy = self.strategy
        if isinstance(strategy, Factorization):
            if strategy.n != self.steps:
                raise ValueError(
                    f"strategy is invalid: its strategy is {strategy.n}×{strategy.n} but steps={self.steps}"
                )
            _check_given_strategy(strategy)
        elif isinstance(strategy, str):
            _check_strategy_memory(self.steps, strategy)
            strategy = build_strategy(from_schedule(schedule, self.steps), strategy, scheme, b)
            _CHECKED[id(strategy)] = strategy  # built here from its spec: consistent by construction
        else:
            raise TypeError(
                f"strategy={strategy!r} is invalid: must be a spec such as 'bsr:16' or a "
                "dpmf.mechanisms.Factorization"
            )
        setf("strategy", strategy)
        setf("scheme", scheme)
        scheme.check_strategy(self)
        if self.noise_multiplier is not None:
            setf("noise_multiplier", check_sigma(self.noise_multiplier))
        if self.noise_segments is not None:
            setf("noise_segments", _check_segments(self))
        if self.clip_norm is not None:
            setf("clip_norm", check_real("clip_norm", self.clip_norm, low=0.0, low_inclusive=False))
        setf("accountant", scheme.accountant_spec(self.accountant))
        if self.seed is not None:
            setf("seed", seeds.check_seed(self.seed, "seed"))
        s = self.sensitivity
        if not (math.isfinite(s) and s > 0):
            raise ValueError(
                f"strategy={self.label!r} is invalid: its sensitivity under {self.scheme.name} is {s!r}; "
                "it must be finite and > 0"
            )
        if self.privacy is not None:
            _check_privacy(self)

    # -- the run's numbers ----------------------------------------------------------------

    @property
    def factorization(self) -> Factorization | None:
        """The strategy, or None for the identity (C = I, DP-SGD)."""
        return None if self.strategy.name == "identity" else self.strategy

    @property
    def label(self) -> str:
        """The strategy's label (``identity`` for DP-SGD)."""
        return self.strategy.label

    @property
    def steps_per_epoch(self) -> int:
        """b = ⌈N/B⌉."""
        return -(-self.dataset_size // self.batch_size)

    @property
    def workload(self) -> Workload:
        """The workload A the strategy factorizes."""
        return self.strategy.workload

    @property
    def participation(self) -> Participation:
        """The participation pattern of the scheme's sensitivity (and of the optimized
        strategies built for it)."""
        return self.scheme.participation(self.steps, self.steps_per_epoch)

    @cached_property
    def _info(self):
        return self.scheme.event(self, 1.0)[1]

    @property
    def sensitivity(self) -> float:
        """s: the noise on C·G has std σ·ζ·s (1 for DP-SGD under Poisson sampling)."""
        return float(self._info.sensitivity)

    @property
    def sampling_rate(self) -> float | None:
        """The Poisson rate the accountant uses (B/N, or B·b'/N for cyclic Poisson), else None."""
        return self._info.sampling_rate

    @property
    def bands(self) -> int:
        """The number of non-zero diagonals of C (1 for DP-SGD)."""
        return strategy_bandwidth(self.strategy.C)

    @property
    def expected_batch_size(self) -> float:
        """B̄: the public expected number of examples per step, the private gradient's divisor."""
        return self.scheme.expected_batch_size(self)

    def noise_std(self, clip_norm: float | None = None) -> float:
        """σ·ζ·s, the noise standard deviation on the sum of clipped gradients (ζ: the plan's
        ``clip_norm`` unless given).

        Raises:
            ValueError: the plan has no noise multiplier yet (calibrate it or give one), or no
                clip norm.
        """
        zeta = self.require_clip_norm() if clip_norm is None else float(clip_norm)
        return self.require_noise_multiplier() * zeta * self.sensitivity

    def require_clip_norm(self) -> float:
        """ζ, or a ValueError saying how to give one."""
        if self.clip_norm is None:
            raise ValueError(
                "clip_norm is unknown for this plan: build it with PrivatePlan(..., clip_norm=ζ) or use "
                "plan.replace(clip_norm=ζ)"
            )
        return self.clip_norm

    def seed_policy(self) -> seeds.SeedPolicy:
        """The run's key: the given ``seed`` (reproducible), or a fresh secret key from the OS
        (``dpmf.seeds.SeedPolicy``; each call draws a new one)."""
        return seeds.SeedPolicy.of(self.seed)

    def require_noise_multiplier(self) -> float:
        """σ (with ``noise_segments``: the smallest σ_i), or a ValueError saying how to get one."""
        if self.noise_segments is not None:
            return min(sigma for _, sigma in self.noise_segments)
        if self.noise_multiplier is None:
            raise ValueError(
                "noise_multiplier is unknown for this plan: use plan.calibrate(epsilon, delta) or "
                "plan.with_noise(noise_multiplier)"
            )
        return self.noise_multiplier

    def noise_multiplier_at(self, step: int) -> float:
        """σ of 0-based step t: the plan's σ, or that of t's segment (``noise_segments``).

        Raises:
            ValueError: no σ, or t outside [0, n).
        """
        t = check_int("step", step, minimum=0, maximum=self.steps - 1)
        if self.noise_segments is None:
            return self.require_noise_multiplier()
        for count, sigma in self.noise_segments:
            if t < count:
                return sigma
            t -= count
        raise AssertionError("segments cover the steps")  # checked at construction

    # -- events and accounting --------------------------------------------------------------

    def event(self, noise_multiplier: float | None = None):
        """The privacy event at σ (default the plan's), a ``dpmf.accountants.events`` event (a
        ``dp_accounting.DpEvent``)."""
        sigma = check_sigma(self.require_noise_multiplier() if noise_multiplier is None else noise_multiplier)
        return self.scheme.event(self, sigma)[0]

    def to_dp_event(self, noise_multiplier: float | None = None):
        """The ``dp_accounting.DpEvent`` that describes the run exactly, to compose with others in
        dp-accounting: the plan's ``event`` itself, checked to be one dp-accounting's accountants
        measure.

        Raises:
            ValueError: the scheme has no such event (balls-in-bins: a mixture of Gaussians).
        """
        try:
            return to_dp_event(self.event(noise_multiplier))
        except ValueError as exc:
            raise ValueError(f"scheme={self.scheme.name!r}: {exc}") from None

    def account(self, noise_multiplier: float | None = None, *, delta: float, accountant=None, **options):
        """ε at ``delta`` of this run (``dpmf.plan.accounting.account``; with
        ``noise_segments``, the composition of the segments, ``account_segments``)."""
        from dpmf.plan.accounting import account

        if self.noise_segments is not None and noise_multiplier is None:
            return self._account_segments(delta, accountant)
        return account(self, noise_multiplier, delta=delta, accountant=accountant, **options)

    def calibrate(self, epsilon: float, delta: float, accountant=None, **options) -> PrivatePlan:
        """This plan with the smallest σ that meets (ε, δ); its ``privacy`` holds the result
        (``dpmf.plan.accounting.calibrate``) and its ``accountant`` the specification used
        (``accountant`` and Monte Carlo ``options`` as in ``account``)."""
        from dpmf.plan.accounting import accountant_of, calibrate

        rtol = options.pop("rtol", 1e-3)
        spec = accountant_of(self, accountant, **options)
        res = calibrate(self, epsilon=epsilon, delta=delta, accountant=spec, rtol=rtol)
        return dataclasses.replace(self, noise_multiplier=res.noise_multiplier, privacy=res, accountant=spec)

    def epsilon_after(self, steps: int, *, delta: float | None = None, accountant=None, **options):
        """The ``PrivacyResult`` of the first ``steps`` steps, for a run stopped early.

        The first t rows of C·G + Z are the release of the leading block C_t with the noise the
        run adds, std σ·ζ·s_n. The accountant measures a run whose noise is σ'·ζ·s_t with s_t
        its own normalization for C_t (s_t ≤ s_n), so it is called with σ' = σ·s_n/s_t.
        ``delta`` and ``accountant`` default to those of ``privacy``.

        Raises:
            ValueError: steps outside [1, n], no σ, or no δ.
        """
        from dpmf.plan.accounting import account

        steps = check_int("steps", steps, minimum=1, maximum=self.steps)
        sigma = self.require_noise_multiplier()
        if delta is None:
            if self.privacy is None:
                raise ValueError("delta is required: this plan has no privacy result to take it from")
            delta = self.privacy.delta
        if steps == self.steps:
            known = self.privacy
            spec = self.accountant if accountant is None else self.scheme.accountant_spec(accountant)
            if known is not None and known.delta == delta and known.accountant == type(spec).name:
                return known
            return account(self, sigma, delta=delta, accountant=accountant, **options)
        part = self.truncated(steps)
        return account(
            part, sigma * self.sensitivity / part.sensitivity, delta=delta, accountant=accountant, **options
        )

    def _account_segments(self, delta, accountant):
        from dpmf.plan.accounting import account_segments

        if any(sigma == 0 for _, sigma in self.noise_segments):
            raise ValueError(
                "noise_segments is invalid for accounting: a segment has σ = 0 (no noise), so the run "
                "has no finite ε; give every segment σ > 0"
            )
        q = self.sampling_rate
        segs = [(sigma, q, count) for count, sigma in self.noise_segments]
        name = type(self.accountant if accountant is None else self.scheme.accountant_spec(accountant)).name
        return account_segments(segs, delta=delta, accountant=name)

    # -- derived plans ----------------------------------------------------------------------

    def with_noise(self, noise_multiplier: float, *, privacy=None) -> PrivatePlan:
        """This plan with σ = ``noise_multiplier`` (and its accounting ``privacy``, if known)."""
        return dataclasses.replace(self, noise_multiplier=check_sigma(noise_multiplier), privacy=privacy)

    def with_settings(self, *, clip_norm: float | None = None, seed: int | None = None) -> PrivatePlan:
        """This plan with its clip norm ζ and its seed policy (None keeps the plan's), σ and
        ``privacy`` kept: neither changes ε (the noise std σ·ζ·s scales with ζ).

        Raises:
            ValueError / TypeError: ζ not > 0, or a seed not an integer ≥ 0.
        """
        return dataclasses.replace(
            self,
            clip_norm=self.clip_norm if clip_norm is None else clip_norm,
            seed=self.seed if seed is None else seed,
        )

    def with_accountant(self, accountant=None, **settings) -> PrivatePlan:
        """This plan measured by ``accountant`` (a name or ``AccountantSpec``; None: the plan's)
        with Monte Carlo ``settings`` applied (``dpmf.plan.accounting.accountant_of``); σ kept,
        ``privacy`` dropped (it was measured by the previous accountant).

        Raises:
            ValueError: an accountant the scheme cannot use, or invalid settings.
        """
        from dpmf.plan.accounting import accountant_of

        return dataclasses.replace(self, accountant=accountant_of(self, accountant, **settings), privacy=None)

    def truncated(self, steps: int) -> PrivatePlan:
        """The plan of the first ``steps`` steps: the leading block of the strategy, the same
        scheme (its groups unchanged), no σ."""
        block = leading_block(self.strategy, steps)
        return PrivatePlan(
            self.dataset_size,
            self.batch_size,
            steps=steps,
            scheme=self.scheme.frozen_for(self),
            strategy=block,
            schedule=self.schedule,
            clip_norm=self.clip_norm,
            accountant=self.accountant,
            seed=self.seed,
        )

    def replace(self, **changes) -> PrivatePlan:
        """A new plan with some arguments changed (validated again); the strategy is rebuilt from
        its label unless given, and σ and ``privacy`` are dropped unless given."""
        args = {
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "scheme": self.scheme.name if "min_sep" in changes else self.scheme,
            "strategy": self.label,
            "schedule": self.schedule,
            "noise_multiplier": None,
            "privacy": None,
            "clip_norm": self.clip_norm,
            "accountant": self.accountant,
            "seed": self.seed,
        }
        if "epochs" in changes or "steps" in changes:
            args.update({k: changes.pop(k, None) for k in ("steps", "epochs")})
        else:
            args["steps"], args["epochs"] = self.steps, self.epochs
        args.update(changes)
        return PrivatePlan(**args)

    # -- what the training loop needs -------------------------------------------------------

    def sampler(self, seed: int):
        """The batch sampler of the plan's scheme (``dpmf.plan.samplers``), seeded by ``seed``."""
        if seed is None:
            raise TypeError("seed=None is invalid: must be an integer >= 0 (the run's key)")
        return self.scheme.sampler(self, seeds.check_seed(seed))

    def __getattr__(self, name: str):
        # the torch parts of a run are built by ``dpmf.step`` from the plan, never by the plan
        if name in _BUILT_BY_STEP:
            raise AttributeError(
                f"PrivatePlan.{name} is not a plan's: the plan is numbers only; use {_BUILT_BY_STEP[name]}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict:
        """Plain data describing the plan (no seeds, nothing secret)."""
        return {
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "steps_per_epoch": self.steps_per_epoch,
            "scheme": self.scheme.label,
            "strategy": self.label,
            "schedule": self.schedule.name,
            "beta": self.schedule.beta,
            "sensitivity": self.sensitivity,
            "sampling_rate": self.sampling_rate,
            "expected_batch_size": self.expected_batch_size,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "accountant": self.accountant.name,
            **(
                {}
                if self.noise_segments is None
                else {"noise_segments": [list(x) for x in self.noise_segments]}
            ),
        }


#: Names of the torch parts built from a plan, and where they are built.
_BUILT_BY_STEP = {
    "private_step": "dpmf.step.build(plan, model, loss_fn) (sampler, noise stream and privatizer, bound)",
    "noise": "dpmf.step.noise_stream(plan, dim, key)",
}


# Peak float64 arrays of length n while a plan builds its strategy (measured: identity 3,
# Toeplitz strategies 7–11), with a margin.
_ARRAYS_PER_STEP = {"identity": 4}
_ARRAYS_DEFAULT = 16


def _check_strategy_memory(steps: int, spec: str) -> None:
    """Refuse, before any allocation, a strategy whose O(n) arrays exceed the memory budget."""
    name = spec.split(":", 1)[0].strip()
    nbytes = 8.0 * steps * _ARRAYS_PER_STEP.get(name, _ARRAYS_DEFAULT)
    check_memory(
        f"steps={steps} with strategy={spec!r}",
        nbytes,
        "use fewer steps; for DP-SGD the accountants compose any number of steps without "
        "per-step arrays, e.g. dpmf.accountants.RDPAccountant().epsilon("
        "PoissonGaussianEvent(noise_multiplier, sampling_rate, steps), delta)",
    )
