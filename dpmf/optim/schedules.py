"""Learning-rate schedules for training, step by step, from the schedules of ``dpmf.workloads``.

The same χ = ``Schedule.values(steps)`` drives the optimizer (step t uses lr·χ_t) and builds
the workload A_χ = A₁·diag(χ) the factorization is optimized for (``docs/architecture.md``, workloads:
θ_t = θ₀ − η·Σ_{s≤t} χ_s·g_s), so the noise is correlated for the schedule actually used.
``LearningRateSchedule`` is a callable for ``torch.optim.lr_scheduler.LambdaLR``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dpmf._validation import check_int
from dpmf.workloads import Schedule, Workload, from_schedule

__all__ = ["LearningRateSchedule", "lr_scheduler"]


@dataclass(frozen=True, eq=False)
class LearningRateSchedule:
    """The multipliers χ₁..χ_n of a ``Schedule`` over ``steps`` = n optimizer steps.

    Called with k, the number of steps already taken (LambdaLR's ``last_epoch``), it returns
    χ_{k+1}, the multiplier of the next step: k = 0..n−1. k = n (reached by the scheduler's
    call after the final step) returns χ_n; the (n+1)-th step is refused, since the workload
    A_χ only covers n steps.

    Attributes:
        schedule: the ``dpmf.workloads.Schedule`` (name, β, γ).
        steps: n >= 1.
        multipliers: χ, float64 array of shape (n,) (read-only), ``schedule.values(steps)``.

    Raises:
        TypeError: schedule is not a ``Schedule``.
        ValueError: steps < 1.
    """

    schedule: Schedule
    steps: int
    multipliers: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule={self.schedule!r} is invalid: must be a dpmf.workloads.Schedule")
        object.__setattr__(self, "steps", check_int("steps", self.steps, minimum=1))
        chi = np.array(self.schedule.values(self.steps), dtype=np.float64)
        chi.setflags(write=False)
        object.__setattr__(self, "multipliers", chi)

    def __call__(self, k: int) -> float:
        """χ_{k+1} for k steps taken, 0 <= k <= n (k = n gives χ_n).

        Raises:
            ValueError: k < 0 or k > n.
        """
        k = check_int("step", k, minimum=0)
        if k > self.steps:
            raise ValueError(
                f"step={k} is invalid: the schedule covers steps={self.steps} optimizer steps "
                f"(k in [0, {self.steps}]); build it for the run's total number of steps"
            )
        return float(self.multipliers[min(k, self.steps - 1)])

    def workload(self, *, toeplitz: bool = False) -> Workload:
        """A_χ = A₁·diag(χ) for this χ (``toeplitz=True``: the surrogate Toep(χ))."""
        return from_schedule(self.schedule, self.steps, toeplitz=toeplitz)


def lr_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: Schedule | LearningRateSchedule,
    steps: int | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` giving step t the learning rate base_lr·χ_t; call its ``step()`` after
    each ``optimizer.step()``. Its ``state_dict()`` holds plain data only (the step count and
    learning rates); to resume, rebuild it with the same schedule and load that state.

    Args:
        optimizer: any torch optimizer (its groups' ``lr`` are the base learning rates).
        schedule: a ``Schedule`` (then ``steps`` is required) or a ``LearningRateSchedule``.
        steps: number of optimizer steps n of the run.

    Raises:
        TypeError / ValueError: as ``LearningRateSchedule``; ``steps`` missing or inconsistent.
    """
    if isinstance(schedule, LearningRateSchedule):
        if steps is not None and check_int("steps", steps, minimum=1) != schedule.steps:
            raise ValueError(
                f"steps={steps} is invalid: the LearningRateSchedule was built for {schedule.steps} steps"
            )
        fn = schedule
    else:
        if steps is None:
            raise ValueError("steps is required with a Schedule: the run's number of steps n")
        fn = LearningRateSchedule(schedule, steps)

    def multiplier(k: int) -> float:
        # A plain function: LambdaLR then keeps it out of its state dict, which stays plain
        # data (loadable with torch.load(weights_only=True)); the schedule is rebuilt from
        # the run's configuration on resume.
        return fn(k)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
