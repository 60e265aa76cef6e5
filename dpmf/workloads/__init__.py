"""Learning-rate schedules χ and workload matrices A (prefix sum, A_χ, Toep(χ), momentum)."""

from dpmf.workloads.schedules import SCHEDULES, Schedule, schedule
from dpmf.workloads.workload import (
    Workload,
    from_schedule,
    lr_scheduled,
    momentum,
    momentum_coefficients,
    prefix_sum,
    toeplitz_surrogate,
)

__all__ = [
    "SCHEDULES",
    "Schedule",
    "schedule",
    "Workload",
    "from_schedule",
    "lr_scheduled",
    "momentum",
    "momentum_coefficients",
    "prefix_sum",
    "toeplitz_surrogate",
]
