"""The accountant registry: each accountant as a specification object, one ``ACCOUNTANTS``.

An accountant specification is a frozen dataclass holding an accountant's own settings (the
PLD grid, the PRV error budget, the Monte Carlo samples, seed and confidence, …) with, as class
attributes, its name, the privacy events it measures (compositions of those event types,
``dpmf.accountants.events``) and whether it is randomized (Monte Carlo: a certificate at a
confidence). ``spec.build()`` returns the accountant object (``epsilon(event, δ)``,
``delta(event, ε)``, ``supports(event)``). ``ACCOUNTANTS`` maps each name to its
specification class; ``make_accountant`` builds one by name, and ``accountants_for`` lists the
accountants that measure a kind of event (e.g. the Poisson-subsampled Gaussian events of DP-SGD).

Adding an accountant: a specification class decorated with ``register_accountant`` (and the
schemes that can use it list it in their ``accountants``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from dpmf._validation import check_choice
from dpmf.accountants.allocation import AllocationPLDAccountant
from dpmf.accountants.events import GaussianEvent, MixtureGaussianEvent, PoissonGaussianEvent
from dpmf.accountants.library import PLDAccountant, PRVAccountant, RDPAccountant
from dpmf.accountants.montecarlo import MonteCarloAccountant

__all__ = [
    "ACCOUNTANTS",
    "AccountantSpec",
    "PLD",
    "RDP",
    "PRV",
    "MonteCarlo",
    "AllocationPLD",
    "register_accountant",
    "get_accountant",
    "accountant_names",
    "accountants_for",
    "make_accountant",
]


@dataclass(frozen=True)
class AccountantSpec:
    """An accountant's specification: its settings (fields) and, as class attributes:

    Attributes:
        name: the name given as ``accountant=`` (and ``--accountant``).
        events: the event types (``dpmf.accountants.events``) it measures, alone or composed.
        randomized: True for a sampled (Monte Carlo) accountant, whose ε is certified at a
            confidence or a point estimate; it takes the settings ``samples``, ``seed``,
            ``confidence`` and ``progress``.
        guarantee: what its ε is (``upper_bound`` or ``certified``).

    Settings are validated when the specification is built (by building the accountant).
    """

    name: ClassVar[str] = ""
    events: ClassVar[tuple[type, ...]] = ()
    randomized: ClassVar[bool] = False
    guarantee: ClassVar[str] = "upper_bound"

    def __post_init__(self):
        self.build()  # the accountant validates its settings: bad ones fail here

    def build(self):
        """The accountant object of these settings."""
        raise NotImplementedError

    def supports(self, event) -> bool:
        """Whether this accountant can measure ``event`` (its exact test)."""
        return self.build().supports(event)

    @classmethod
    def from_options(cls, **options) -> AccountantSpec:
        """The specification with those of ``options`` that are its settings (the others —
        e.g. Monte Carlo settings given to a deterministic accountant — are ignored; None
        keeps a setting's default)."""
        own = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in own and v is not None})


ACCOUNTANTS: dict[str, type[AccountantSpec]] = {}


def register_accountant(cls: type[AccountantSpec]) -> type[AccountantSpec]:
    """Add an accountant specification class to ``ACCOUNTANTS`` (a class decorator).

    Raises:
        TypeError: not an ``AccountantSpec`` subclass.
        ValueError: an empty or taken name.
    """
    if not (isinstance(cls, type) and issubclass(cls, AccountantSpec)):
        raise TypeError(f"{cls!r} is invalid: must be a subclass of AccountantSpec")
    if not isinstance(cls.name, str) or not cls.name:
        raise ValueError(f"{cls.__name__}.name={cls.name!r} is invalid: must be a non-empty string")
    if cls.name in ACCOUNTANTS and ACCOUNTANTS[cls.name] is not cls:
        raise ValueError(f"accountant {cls.name!r} is already registered ({ACCOUNTANTS[cls.name].__name__})")
    ACCOUNTANTS[cls.name] = cls
    return cls


def get_accountant(name: str) -> type[AccountantSpec]:
    """The specification class of accountant ``name``.

    Raises:
        ValueError: an unknown name (listing the registered ones).
    """
    return ACCOUNTANTS[check_choice("accountant", name, ACCOUNTANTS)]


def accountant_names() -> tuple[str, ...]:
    """The registered accountant names, in registration order."""
    return tuple(ACCOUNTANTS)


def accountants_for(event_type: type, *, randomized: bool | None = None) -> tuple[str, ...]:
    """The accountants that measure events of ``event_type`` (and compositions of them), in
    registration order; ``randomized`` True/False keeps only the sampled/deterministic ones."""
    return tuple(
        name
        for name, cls in ACCOUNTANTS.items()
        if event_type in cls.events and (randomized is None or cls.randomized == randomized)
    )


def make_accountant(name: str, samples=None, seed: int = 0, confidence=None, progress=None, **settings):
    """A fresh accountant by name (one of ``ACCOUNTANTS``), with the Monte Carlo settings for a
    randomized one (ignored by the others) and any of its own ``settings``.

    Raises:
        ValueError: an unknown name, or invalid settings.
    """
    cls = get_accountant(name)
    options = dict(settings)
    if cls.randomized:
        options.update(samples=samples, seed=seed, confidence=confidence, progress=progress)
        spec = cls(**{k: v for k, v in options.items() if k in {f.name for f in fields(cls)}})
    else:
        spec = cls.from_options(**options)
    return spec.build()


# --------------------------------------------------------------------------------------------
# The built-in accountants (in the order their names are listed)


@register_accountant
@dataclass(frozen=True)
class PLD(AccountantSpec):
    """Privacy loss distributions (dp-accounting): tight upper bound on a loss grid."""

    name: ClassVar[str] = "pld"
    events: ClassVar[tuple[type, ...]] = (GaussianEvent, PoissonGaussianEvent)
    value_discretization_interval: float = 1e-4

    def build(self):
        return PLDAccountant(self.value_discretization_interval)


@register_accountant
@dataclass(frozen=True)
class RDP(AccountantSpec):
    """Rényi DP (dp-accounting): fast, looser upper bound."""

    name: ClassVar[str] = "rdp"
    events: ClassVar[tuple[type, ...]] = (GaussianEvent, PoissonGaussianEvent)

    def build(self):
        return RDPAccountant()


@register_accountant
@dataclass(frozen=True)
class PRV(AccountantSpec):
    """Privacy random variables (prv-accountant): upper bound within an error budget."""

    name: ClassVar[str] = "prv"
    events: ClassVar[tuple[type, ...]] = (GaussianEvent, PoissonGaussianEvent)
    eps_error: float = 0.01
    delta_error_ratio: float = 1e-3

    def build(self):
        return PRVAccountant(self.eps_error, self.delta_error_ratio)


@register_accountant
@dataclass(frozen=True)
class MonteCarlo(AccountantSpec):
    """Monte Carlo privacy-loss sampling (``dpmf.accountants.montecarlo``): ε certified at
    ``confidence`` (None: a point estimate); mixtures of Gaussians (balls-in-bins)."""

    name: ClassVar[str] = "monte_carlo"
    events: ClassVar[tuple[type, ...]] = (GaussianEvent, MixtureGaussianEvent)
    randomized: ClassVar[bool] = True
    guarantee: ClassVar[str] = "certified"
    samples: int | None = None
    seed: int = 0
    confidence: float | None = 0.99
    progress: bool | None = None
    max_samples: int | None = None

    def build(self):
        return MonteCarloAccountant(self.samples, self.seed, self.confidence, self.progress, self.max_samples)


@register_accountant
@dataclass(frozen=True)
class AllocationPLD(AccountantSpec):
    """Deterministic PLD bound for balls-in-bins / random allocation
    (``dpmf.accountants.allocation``): orthogonal mixtures of Gaussians."""

    name: ClassVar[str] = "allocation_pld"
    events: ClassVar[tuple[type, ...]] = (GaussianEvent, MixtureGaussianEvent)
    value_discretization_interval: float = 1e-4
    resolution: float = 0.03
    tail_fraction: float = 1e-3

    def build(self):
        return AllocationPLDAccountant(
            self.value_discretization_interval, self.resolution, self.tail_fraction
        )
