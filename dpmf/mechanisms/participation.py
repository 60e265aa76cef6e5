"""Participation patterns: in which steps one example's gradient may appear.

* ``single`` — at most once in the run.
* ``min_sep(b, k)`` — up to k times, any two participations at least b steps apart
  (Choquette-Choo et al., "Multi-Epoch Matrix Factorization Mechanisms for Private Machine
  Learning", ICML 2023, the b-min-sep participation).
* ``fixed_epochs(b, k)`` — cyclic order with b steps per epoch: an example sits in one of b
  classes and participates in steps s, s+b, s+2b, … (k epochs, so n ≤ b·k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmf._validation import check_choice, check_int

__all__ = ["Participation", "PARTICIPATIONS"]

PARTICIPATIONS = ("single", "min_sep", "fixed_epochs")


@dataclass(frozen=True)
class Participation:
    """How often, and how far apart, one example participates.

    Attributes:
        kind: ``single``, ``min_sep`` or ``fixed_epochs``.
        min_sep: b ≥ 1, the minimum separation (steps per epoch for ``fixed_epochs``).
        max_participations: k ≥ 1, the maximum number of participations.

    Raises:
        ValueError: unknown kind, b < 1 or k < 1.
    """

    kind: str = "single"
    min_sep: int = 1
    max_participations: int = 1

    def __post_init__(self):
        check_choice("participation", self.kind, PARTICIPATIONS)
        object.__setattr__(self, "min_sep", check_int("min_sep", self.min_sep, minimum=1))
        object.__setattr__(
            self, "max_participations", check_int("max_participations", self.max_participations, minimum=1)
        )
        if self.kind == "single":
            object.__setattr__(self, "min_sep", 1)
            object.__setattr__(self, "max_participations", 1)

    @classmethod
    def single(cls) -> Participation:
        return cls("single")

    @classmethod
    def separated(cls, min_sep: int, max_participations: int) -> Participation:
        """The b-min-sep pattern with at most k participations."""
        return cls("min_sep", min_sep, max_participations)

    @classmethod
    def fixed_epochs(cls, steps_per_epoch: int, epochs: int) -> Participation:
        """Cyclic fixed order: b = steps_per_epoch classes, k = epochs participations."""
        return cls("fixed_epochs", steps_per_epoch, epochs)

    def participations(self, n: int) -> int:
        """The largest number of participations that fit in n steps: min(k, ⌈n/b⌉)."""
        n = check_int("n", n, minimum=1)
        return min(self.max_participations, math.ceil(n / self.min_sep))

    def check_steps(self, n: int) -> int:
        """Validate n against the pattern (``fixed_epochs`` needs n ≤ b·k); return n.

        Raises:
            ValueError: n < 1, or n > b·k for ``fixed_epochs``.
        """
        n = check_int("n", n, minimum=1)
        if self.kind == "fixed_epochs" and n > self.min_sep * self.max_participations:
            raise ValueError(
                f"n={n} is invalid for fixed_epochs(b={self.min_sep}, k={self.max_participations}): "
                f"k epochs of b steps cover at most {self.min_sep * self.max_participations} steps"
            )
        return n

    @property
    def label(self) -> str:
        if self.kind == "single":
            return "single"
        return f"{self.kind}(b={self.min_sep},k={self.max_participations})"
