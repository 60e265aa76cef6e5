"""Error curves over n and gain grids over n × β: the numbers behind ``dpmf curves`` and
``dpmf colormap`` (Figure 1 of "Learning Rate Scheduling with Matrix Factorization for Private
Training")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
from tqdm import tqdm

from dpmf._validation import check_choice, check_int
from dpmf.mechanisms.bounds import lower_bound
from dpmf.mechanisms.errors import evaluate
from dpmf.mechanisms.participation import Participation
from dpmf.mechanisms.registry import factorize, parse_factorization
from dpmf.workloads.schedules import Schedule
from dpmf.workloads.workload import from_schedule

__all__ = ["CurveRow", "error_curves", "GainGrid", "gain_grid", "CURVE_COLUMNS"]


@dataclass(frozen=True)
class CurveRow:
    """One (n, factorization) point of an error curve; the fields are the CSV columns.

    ``lower_bound`` is None when it was not computed (written as an empty CSV field)."""

    schedule: str
    beta: float
    n: int
    participation: str
    min_sep: int
    max_participations: int
    factorization: str
    bands: int | None
    sensitivity: float
    sensitivity_exact: bool
    max_se: float
    mean_se: float
    lower_bound: float | None

    def as_tuple(self) -> tuple:
        return tuple("" if v is None else v for v in asdict(self).values())


CURVE_COLUMNS = tuple(f.name for f in fields(CurveRow))


def _check_ns(ns: Sequence[int]) -> list[int]:
    ns = [check_int("n", n, minimum=1) for n in ns]
    if not ns:
        raise ValueError("n is invalid: give at least one number of steps")
    return ns


def error_curves(
    schedule: Schedule,
    ns: Sequence[int],
    factorizations: Sequence[str],
    participation: Participation | None = None,
    *,
    progress: bool = False,
    with_lower_bound: bool = True,
) -> list[CurveRow]:
    """Sensitivity, MaxSE, MeanSE and the lower bound of each factorization of A_χ for each n.

    Args:
        schedule: the learning-rate schedule χ (A_χ = A₁·diag(χ); constant gives A₁).
        ns: numbers of steps.
        factorizations: names as accepted by ``factorize`` (``"bisr:16"``, …).
        participation: default single.
        progress: show a tqdm progress bar.
        with_lower_bound: compute ``dpmf.mechanisms.lower_bound`` (O(n) memory, about 150
            vectorized passes over n; see ``nuclear_norm``); False leaves it None.

    Returns:
        One ``CurveRow`` per (n, factorization), n-major.

    Raises:
        ValueError: any invalid n, factorization name or bands (checked before any work), or n
            incompatible with ``participation``.
    """
    ns = _check_ns(ns)
    specs = [parse_factorization(f) for f in factorizations]
    if not specs:
        raise ValueError("factorizations is invalid: give at least one factorization")
    participation = participation or Participation.single()
    for n in ns:
        participation.check_steps(n)
    rows = []
    bar = tqdm(total=len(ns) * len(specs), disable=not progress, desc="curves", unit="point")
    for n in ns:
        workload = from_schedule(schedule, n)
        lb = lower_bound(workload, participation) if with_lower_bound else None
        for name, p in specs:
            f = factorize(workload, name, p, participation=participation)  # used by optimized ones
            e = evaluate(f, participation, with_lower_bound=False)
            rows.append(
                CurveRow(
                    schedule=schedule.name,
                    beta=schedule.beta if schedule.name != "constant" else 1.0,
                    n=n,
                    participation=participation.kind,
                    min_sep=participation.min_sep,
                    max_participations=participation.max_participations,
                    factorization=name if isinstance(p, int | None) else f.label,
                    bands=p if isinstance(p, int | None) else None,
                    sensitivity=e.sensitivity,
                    sensitivity_exact=e.sensitivity_exact,
                    max_se=e.max_se,
                    mean_se=e.mean_se,
                    lower_bound=lb,
                )
            )
            bar.update()
    bar.close()
    return rows


@dataclass(frozen=True)
class GainGrid:
    """metric(numerator)/metric(denominator) on a grid: ``gain[i, j]`` at β = betas[i], n = ns[j].

    A gain below 1 means the numerator factorization has the smaller error.
    ``numerator_error`` and ``denominator_error`` (same shape) are the two errors themselves
    (None when not recorded), ``participation`` the pattern they were evaluated under.
    """

    numerator: str
    denominator: str
    metric: str
    schedule: str
    ns: np.ndarray
    betas: np.ndarray
    gain: np.ndarray
    numerator_error: np.ndarray | None = None
    denominator_error: np.ndarray | None = None
    participation: Participation | None = None


def gain_grid(
    numerator: str,
    denominator: str,
    metric: str,
    schedule: str,
    ns: Sequence[int],
    betas: Sequence[float],
    *,
    gamma: float | None = None,
    participation: Participation | None = None,
    progress: bool = False,
) -> GainGrid:
    """The ratio metric(numerator)/metric(denominator) (``max_se`` or ``mean_se``) of two
    factorizations of A_χ on the grid n × β (the gain colormap of the LR-scheduling paper).

    Returns:
        ``GainGrid`` with ``gain`` of shape (len(betas), len(ns)).

    Raises:
        ValueError: invalid names, metric, n or β (before any work).
    """
    check_choice("metric", metric, ("max_se", "mean_se"))
    num, den = parse_factorization(numerator), parse_factorization(denominator)
    ns = _check_ns(ns)
    scheds = [Schedule(schedule, b, gamma) for b in betas]
    if not scheds:
        raise ValueError("beta is invalid: give at least one value")
    participation = participation or Participation.single()
    for n in ns:
        participation.check_steps(n)
    gain = np.empty((len(scheds), len(ns)))
    err_num, err_den = np.empty_like(gain), np.empty_like(gain)
    bar = tqdm(total=gain.size, disable=not progress, desc="colormap", unit="cell")
    for i, sched in enumerate(scheds):
        for j, n in enumerate(ns):
            w = from_schedule(sched, n)
            f_num = factorize(w, *num, participation=participation)
            f_den = factorize(w, *den, participation=participation)
            e_num = evaluate(f_num, participation, with_lower_bound=False)
            e_den = evaluate(f_den, participation, with_lower_bound=False)
            err_num[i, j], err_den[i, j] = getattr(e_num, metric), getattr(e_den, metric)
            gain[i, j] = err_num[i, j] / err_den[i, j]
            bar.update()
    bar.close()
    return GainGrid(
        numerator=numerator,
        denominator=denominator,
        metric=metric,
        schedule=schedule,
        ns=np.asarray(ns),
        betas=np.asarray([s.beta for s in scheds]),
        gain=gain,
        numerator_error=err_num,
        denominator_error=err_den,
        participation=participation,
    )
