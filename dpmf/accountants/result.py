"""Results of privacy accounting: what an accountant measured, and the whole run's answer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["GUARANTEES", "Measurement", "PrivacyResult"]

GUARANTEES = ("upper_bound", "certified", "estimate")


@dataclass(frozen=True)
class Measurement:
    """An accountant's (ε, δ) for one event.

    Attributes:
        epsilon: ε ≥ 0 (``math.inf`` when no finite ε meets δ).
        delta: δ in (0, 1).
        accountant: name of the accountant (``pld``, ``rdp``, ``prv``, ``monte_carlo``).
        guarantee: ``upper_bound`` (a proven bound, up to the library's documented numerical
            pessimism), ``certified`` (a Monte Carlo bound holding with probability
            ≥ ``confidence`` over the sampling) or ``estimate`` (no guarantee).
        method: how the number was computed, in words.
        confidence: 1 − α for ``certified`` results, else None.
        samples: Monte Carlo samples per direction, else None.
        seed: Monte Carlo seed, else None.
        epsilon_estimate: the Monte Carlo point estimate of ε at δ, else None.
        delta_estimate: the Monte Carlo point estimate of δ at the reported ε, else None.
    """

    epsilon: float
    delta: float
    accountant: str
    guarantee: str
    method: str
    confidence: float | None = None
    samples: int | None = None
    seed: int | None = None
    epsilon_estimate: float | None = None
    delta_estimate: float | None = None

    def __post_init__(self):
        if self.guarantee not in GUARANTEES:
            raise ValueError(f"guarantee={self.guarantee!r} is invalid: must be one of {GUARANTEES}")
        if math.isnan(self.epsilon) or self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon!r} is invalid: must be >= 0 (internal error)")


@dataclass(frozen=True)
class PrivacyResult:
    """The (ε, δ) guarantee of a whole training run under a batch-sampling scheme.

    The Gaussian noise added to C·G (the strategy applied to the sums of clipped gradients) has
    standard deviation ``noise_multiplier · clip_norm · sensitivity`` per entry; for DP-SGD
    (C = I) ``sensitivity`` is 1.

    Attributes:
        epsilon: ε ≥ 0 of the run at ``delta``.
        delta: δ in (0, 1).
        noise_multiplier: σ > 0.
        scheme: the batch-sampling scheme (``dpmf.accountants.SCHEMES``).
        accountant: the accountant that produced ε.
        guarantee: ``upper_bound``, ``certified`` or ``estimate`` (see ``Measurement``).
        steps: n, the number of training steps.
        sensitivity: s, the noise normalization described above.
        dataset_size: N.
        batch_size: B (expected batch size for the random schemes).
        sampling_rate: the Poisson rate actually accounted (B/N for ``poisson``, B·b/N for
            ``cyclic_poisson``), else None.
        factorization: the strategy's label (``identity`` for DP-SGD).
        method: how ε was computed, in words.
        confidence: 1 − α for ``certified`` results.
        samples: Monte Carlo samples per direction (add and remove), when used.
        seed: Monte Carlo seed, when used.
        epsilon_estimate: Monte Carlo point estimate of ε, when used.
        delta_estimate: Monte Carlo point estimate of δ at ``epsilon``, when used.
        details: scheme-specific numbers (bins, min_sep, participations, compositions, …).
    """

    epsilon: float
    delta: float
    noise_multiplier: float
    scheme: str
    accountant: str
    guarantee: str
    steps: int
    sensitivity: float
    dataset_size: int | None = None
    batch_size: int | None = None
    sampling_rate: float | None = None
    factorization: str = "identity"
    method: str = ""
    confidence: float | None = None
    samples: int | None = None
    seed: int | None = None
    epsilon_estimate: float | None = None
    delta_estimate: float | None = None
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.guarantee not in GUARANTEES:
            raise ValueError(f"guarantee={self.guarantee!r} is invalid: must be one of {GUARANTEES}")
        if math.isnan(self.epsilon) or self.epsilon < 0:
            raise ValueError(f"epsilon={self.epsilon!r} is invalid: must be >= 0 (internal error)")
        object.__setattr__(self, "details", dict(self.details))

    def to_dict(self) -> dict:
        """A JSON-serializable dict of every field (ε = ∞ is written as the string "inf")."""
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "details":
                value = {k: _json_value(v) for k, v in value.items()}
            else:
                value = _json_value(value)
            out[name] = value
        return out


def _json_value(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if hasattr(value, "item") and not isinstance(value, str):  # numpy scalars
        return _json_value(value.item())
    if isinstance(value, tuple | list):
        return [_json_value(v) for v in value]
    return value
