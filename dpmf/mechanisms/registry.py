"""The strategy registry: name → builder, with what the rest of the toolkit needs to know.

Each ``Strategy`` entry carries its name (as written in specs such as ``bisr:16``), its
parameter (bands, buffers or λ, parsed and validated here), whether its C is banded (so that
cyclic Poisson sampling can amplify it), whether it is optimized for a participation pattern
(and so takes optimizer options), the bounded optimizer effort ``pick`` uses, and which
candidates it contributes to ``pick``. How its noise is streamed is the ``Factorization``'s own
``noise_layout()``.

Adding a strategy is one ``register_strategy(Strategy(...))`` call next to its mathematics;
``factorize``, ``curves``, ``pick``, ``epsilon``, ``calibrate`` and ``train`` then accept it.

=====================  =========  ======  =========  ===============================
name                   parameter  banded  optimized  pick candidates
=====================  =========  ======  =========  ===============================
identity               —          yes     no         always (DP-SGD)
output                 —          no      no         —
sqrt_prefix            —          no      no         always
sqrt_prefix_scaled     —          no      no         —
sqrt                   —          no      no         —
lr_aware               —          no      no         with a learning-rate decay
bsr, bisr              bands p    bsr     no         p = 2, 4, 8, … ≤ max_bands
lr_bsr, lr_bisr        bands p    lr_bsr  no         as above, with a decay
bisr_opt, bsr_opt      bands p    bsr     yes        p = max_bands (optimized)
blt                    buffers d  no      yes        d = 2, 4 ≤ max_bands (optimized)
dense                  —          no      yes        n ≤ dense_max_steps (optimized)
lcgd                   λ ∈ [0,1)  no      no         —
lcgd_opt               —          no      yes        optimized
=====================  =========  ======  =========  ===============================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dpmf._validation import check_choice, check_int, check_real
from dpmf.mechanisms.factorizations import CLOSED_FORMS, Factorization, closed_form
from dpmf.mechanisms.participation import Participation
from dpmf.workloads.workload import Workload

__all__ = [
    "DENSE_MAX_GAP",
    "Parameter",
    "Strategy",
    "PickContext",
    "STRATEGIES",
    "register_strategy",
    "get_strategy",
    "parse_factorization",
    "factorize",
    "strategy_names",
]

# factorize(..., "dense") refuses a solve that stopped further than this (relative) above its
# certified lower bound; optimize_dense returns such runs with converged=False for inspection
DENSE_MAX_GAP = 1e-3


@dataclass(frozen=True)
class Parameter:
    """The parameter written after the colon of a spec.

    Attributes:
        name: ``bands``, ``buffers`` or ``lambda`` (used in messages).
        kind: ``int`` (≥ 1) or ``float`` (in [low, high)).
        low, high: the range of a float parameter.
        example: a valid spec for messages, e.g. ``bisr:16``.
    """

    name: str
    kind: type
    example: str
    low: float = 0.0
    high: float = 1.0

    def parse(self, text: str, spec: str):
        """The parameter's value from its text; raises ValueError naming ``spec``."""
        if self.kind is int:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(
                    f"{self.name}={text!r} is invalid in {spec!r}: must be an integer >= 1"
                ) from None
            return self.check(value)
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{self.name}={text!r} is invalid in {spec!r}: must be a number in "
                f"[{self.low:g}, {self.high:g})"
            ) from None
        return self.check(value)

    def check(self, value):
        if self.kind is int:
            return check_int(self.name, value, minimum=1)
        return check_real(self.name, value, low=self.low, high=self.high, high_inclusive=False)


@dataclass(frozen=True)
class PickContext:
    """What a strategy needs to propose ``pick`` candidates.

    Attributes:
        steps: n.
        has_decay: the learning-rate schedule is not constant.
        band_grid: the band counts to try (2, 4, 8, … ≤ max_bands, and max_bands), each ≤ n.
        max_bands: the memory budget.
        optimized: include optimized strategies.
        dense_max_steps: include ``dense`` when n ≤ this.
    """

    steps: int
    has_decay: bool
    band_grid: tuple[int, ...]
    max_bands: int
    optimized: bool
    dense_max_steps: int


def _no_candidates(ctx: PickContext) -> list[str]:
    return []


@dataclass(frozen=True)
class Strategy:
    """One registry entry.

    Attributes:
        name: the spec name.
        build: ``build(workload, parameter, participation, options) -> Factorization``
            (``parameter`` validated, or None; ``participation`` and ``options`` only reach
            optimized strategies).
        parameter: the spec's parameter, or None when it takes none.
        banded: C has exactly ``parameter`` (or 1) non-zero diagonals, so cyclic Poisson
            sampling with min_sep = bands amplifies it.
        optimized: built by an optimizer for a participation pattern (takes options).
        pick_options: the bounded optimizer effort ``pick`` and ``train`` use.
        candidates: the specs this entry proposes to ``pick`` (``PickContext`` → list).
        summary: one line for tables and help.
    """

    name: str
    build: Callable[..., Factorization]
    parameter: Parameter | None = None
    banded: bool = False
    optimized: bool = False
    pick_options: dict = field(default_factory=dict)
    candidates: Callable[[PickContext], list[str]] = _no_candidates
    summary: str = ""

    def bands_of(self, parameter) -> int | None:
        """The number of non-zero diagonals of C for a banded entry, else None."""
        if not self.banded:
            return None
        return 1 if parameter is None else int(parameter)


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(entry: Strategy) -> Strategy:
    """Add ``entry`` to ``STRATEGIES`` (its name must be new); returns it.

    Raises:
        TypeError: not a ``Strategy``.
        ValueError: the name is taken or contains ':'.
    """
    if not isinstance(entry, Strategy):
        raise TypeError(f"entry={entry!r} is invalid: must be a dpmf.mechanisms.registry.Strategy")
    if not entry.name or ":" in entry.name:
        raise ValueError(f"name={entry.name!r} is invalid: must be non-empty, without ':'")
    if entry.name in STRATEGIES:
        raise ValueError(f"name={entry.name!r} is invalid: a strategy of that name is registered")
    STRATEGIES[entry.name] = entry
    return entry


def strategy_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(STRATEGIES)


def get_strategy(name: str) -> Strategy:
    """The entry named ``name``.

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
    """
    check_choice("factorization", name, strategy_names())
    return STRATEGIES[name]


def parse_factorization(spec: str, bands: int | float | None = None) -> tuple[str, int | float | None]:
    """Split ``"bisr:16"`` into ``("bisr", 16)``, ``"lcgd:0.5"`` into ``("lcgd", 0.5)``;
    ``bands`` fills in a missing parameter.

    Raises:
        TypeError: ``spec`` not a string.
        ValueError: unknown name, a missing or invalid parameter, or a parameter given to a
            strategy that takes none.
    """
    if not isinstance(spec, str):
        raise TypeError(f"factorization={spec!r} is invalid: must be a string such as 'bisr:16'")
    name, _, text = spec.strip().partition(":")
    entry = get_strategy(name)
    par = entry.parameter
    if par is None:
        if text:
            raise ValueError(f"factorization={spec!r} is invalid: {name} takes no bands")
        return name, None
    if text:
        return name, par.parse(text, spec)
    if bands is None:
        raise ValueError(f"factorization={spec!r} is invalid: {name} needs {par.name}, e.g. '{par.example}'")
    return name, par.check(bands)


def factorize(
    workload: Workload,
    spec: str,
    bands: int | float | None = None,
    *,
    participation: Participation | None = None,
    **options,
) -> Factorization:
    """Build the factorization ``spec`` (e.g. ``"lr_aware"``, ``"bisr:16"``, ``"lcgd:0.5"``)
    of ``workload``.

    Args:
        workload: the n×n workload A.
        spec: a registered name (``STRATEGIES``), with ``:p`` bands, ``:d`` buffers (``blt``)
            or ``:λ`` (``lcgd``).
        bands: the parameter, when not given in ``spec``. p ≥ n keeps every diagonal.
        participation: the ``Participation`` the optimized strategies (dense, bisr_opt,
            bsr_opt, blt, lcgd_opt) are optimized for; default single participation. The others
            do not depend on it.
        **options: keyword options of the optimizer, for the optimized strategies only:
            ``dense.optimize_dense`` (objective, tol, max_iterations, warm_start, …),
            ``banded_opt.optimize_banded`` (objective, start, max_iterations),
            ``blt.optimize_blt`` (objective, max_iterations, starts) and
            ``lcgd.optimize_lcgd`` (objective, grid).

    Returns:
        ``Factorization`` with structured C and C⁻¹ (O(n) memory for Toeplitz strategies;
        the square root of a non-Toeplitz workload and ``dense`` are dense, O(n²)).

    Raises:
        TypeError: ``workload`` not a Workload; options given to a strategy that is not
            optimized, or unknown options.
        ValueError: unknown name or invalid parameter (``parse_factorization``), invalid
            options (raised by the optimizer), or a ``dense`` solve that stopped more than
            ``DENSE_MAX_GAP`` (relative) above its certified lower bound (a guard: the solver
            reaches its gap on every case tested, min_sep with steep decays included).
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload={workload!r} is invalid: must be a dpmf.workloads.Workload")
    name, param = parse_factorization(spec, bands)
    entry = STRATEGIES[name]
    if options and not entry.optimized:
        optimized = ", ".join(s.name for s in STRATEGIES.values() if s.optimized)
        raise TypeError(
            f"options {sorted(options)} are invalid for factorization={spec!r}: only the "
            f"optimized strategies ({optimized}) take options"
        )
    return entry.build(workload, param, participation, options)


# --- the built-in strategies ------------------------------------------------------------------


def _closed(name: str):
    def build(workload, p, participation, options):
        return closed_form(workload, name, p)

    return build


def _banded_candidates(name: str, lr: bool):
    def candidates(ctx: PickContext) -> list[str]:
        if lr and not ctx.has_decay:
            return []
        return [f"{name}:{p}" for p in ctx.band_grid]

    return candidates


def _build_dense(workload, p, participation, options):
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


def _build_blt(workload, d, participation, options):
    from dpmf.mechanisms.blt import optimize_blt

    return optimize_blt(workload, d, participation, **options).factorization


def _build_banded_opt(name: str):
    def build(workload, p, participation, options):
        from dpmf.mechanisms.banded_opt import optimize_banded

        return optimize_banded(workload, name, p, participation, **options).factorization

    return build


def _build_lcgd(workload, lam, participation, options):
    from dpmf.mechanisms.lcgd import lcgd

    return lcgd(workload, lam)


def _build_lcgd_opt(workload, p, participation, options):
    from dpmf.mechanisms.lcgd import optimize_lcgd

    return optimize_lcgd(workload, participation, **options).factorization


def _top_band(ctx: PickContext) -> list[int]:
    top = min(ctx.max_bands, ctx.steps)
    return [top] if ctx.optimized and top >= 2 else []


for _name, _summary, _cands in (
    ("identity", "C = I: DP-SGD noise", lambda ctx: ["identity"]),
    ("output", "C = A, B = I", _no_candidates),
    ("sqrt_prefix", "C = A₁^{1/2}", lambda ctx: ["sqrt_prefix"]),
    ("sqrt_prefix_scaled", "C = A₁^{1/2}·D", _no_candidates),
    ("sqrt", "C = A^{1/2}", _no_candidates),
    ("lr_aware", "C = Toep(χ)^{1/2}", lambda ctx: ["lr_aware"] if ctx.has_decay else []),
):
    register_strategy(
        Strategy(_name, _closed(_name), banded=_name == "identity", candidates=_cands, summary=_summary)
    )
for _name, _summary in (
    ("bsr", "band_p(T^{1/2})"),
    ("bisr", "(band_p(T^{-1/2}))⁻¹"),
    ("lr_bsr", "bsr with T = Toep(χ)"),
    ("lr_bisr", "bisr with T = Toep(χ)"),
):
    register_strategy(
        Strategy(
            _name,
            _closed(_name),
            Parameter("bands", int, f"{_name}:16"),
            banded=_name.endswith("bsr"),
            candidates=_banded_candidates(_name, _name.startswith("lr_")),
            summary=_summary,
        )
    )
register_strategy(
    Strategy(
        "bisr_opt",
        _build_banded_opt("bisr_opt"),
        Parameter("bands", int, "bisr_opt:16"),
        optimized=True,
        pick_options={"max_iterations": 200},
        summary="(Toep(g))⁻¹, p optimized g",
        candidates=lambda ctx: [f"bisr_opt:{p}" for p in _top_band(ctx)],
    )
)
register_strategy(
    Strategy(
        "bsr_opt",
        _build_banded_opt("bsr_opt"),
        Parameter("bands", int, "bsr_opt:16"),
        banded=True,
        optimized=True,
        pick_options={"max_iterations": 100, "cascade": False},
        summary="Toep(c), p optimized c",
        candidates=lambda ctx: [f"bsr_opt:{p}" for p in _top_band(ctx)],
    )
)
register_strategy(
    Strategy(
        "blt",
        _build_blt,
        Parameter("buffers", int, "blt:4"),
        optimized=True,
        pick_options={"starts": 1, "max_iterations": 150},
        summary="(BLT(θ, ω))⁻¹, d optimized buffers",
        candidates=lambda ctx: [f"blt:{d}" for d in (2, 4) if ctx.optimized and d <= ctx.max_bands],
    )
)
register_strategy(
    Strategy(
        "dense",
        _build_dense,
        optimized=True,
        summary="optimized dense C",
        candidates=lambda ctx: ["dense"] if ctx.optimized and ctx.steps <= ctx.dense_max_steps else [],
    )
)
register_strategy(
    Strategy(
        "lcgd",
        _build_lcgd,
        Parameter("lambda", float, "lcgd:0.5", 0.0, 1.0),
        summary="C⁻¹ = Toep(1, −λ)",
    )
)
register_strategy(
    Strategy(
        "lcgd_opt",
        _build_lcgd_opt,
        optimized=True,
        summary="λCGD, λ optimized",
        candidates=lambda ctx: ["lcgd_opt"] if ctx.optimized else [],
    )
)
assert set(CLOSED_FORMS) <= set(STRATEGIES)
