"""Compliance profiles of the participating institutions and the score → noise-multiplier map.

A profile is public, per-client metadata: the scores of one assessment against five criteria
(HIPAA, GDPR, NIST, ISO, HL7/FHIR), each in [0, 1]. The compliance score is their weighted mean,

    s_k = Σ_c w_c·s_{k,c} / Σ_c w_c,   s_k ∈ [0, 1],

with non-negative weights w (default equal). A ``NoiseMap`` turns s_k into a noise multiplier
σ_k, non-increasing in s (lower compliance → more noise):

==============  ===========================================================================
``linear``      σ(s) = σ_max − (σ_max − σ_min)·s
``exponential`` σ(s) = σ_max·(σ_min/σ_max)^s   (geometric interpolation)
``table``       σ(s) = σ_i for the largest threshold t_i ≤ s (thresholds increasing,
                σ_i non-increasing; the first threshold must be 0 so that every score maps)
==============  ===========================================================================

``uniform_control`` gives the control arm of the comparison in the compliance-aware FL study:
every client receives the mean of the clients' σ_k, so the two allocations have equal mean noise.

The YAML file read by ``load_profiles``::

    weights: {hipaa: 0.2, gdpr: 0.2, nist: 0.2, iso: 0.2, hl7_fhir: 0.2}   # optional
    compliant_threshold: 0.8                                               # optional
    clients:
      - {id: hospital-01, hipaa: 0.96, gdpr: 0.94, nist: 0.92, iso: 0.95, hl7_fhir: 0.9}
      - ...

Source: the compliance-aware federated learning study (server-side DP-SGD whose per-step noise
scale is set from each institution's compliance score; HIPAA/GDPR/NIST/ISO/HL7-FHIR criteria).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_choice, check_int, check_real

__all__ = [
    "CRITERIA",
    "DEFAULT_WEIGHTS",
    "NOISE_MAPS",
    "ComplianceProfile",
    "ComplianceSet",
    "NoiseMap",
    "check_weights",
    "example_profiles",
    "load_profiles",
    "uniform_control",
]

CRITERIA = ("hipaa", "gdpr", "nist", "iso", "hl7_fhir")
DEFAULT_WEIGHTS = dict.fromkeys(CRITERIA, 0.2)
NOISE_MAPS = ("linear", "exponential", "table")


def check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Criterion weights as a full dict over ``CRITERIA`` (missing ones 0).

    Raises:
        TypeError: not a mapping.
        ValueError: an unknown criterion, a negative weight, or all weights zero.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights={weights!r} is invalid: must be a mapping criterion -> weight")
    unknown = sorted(set(weights) - set(CRITERIA))
    if unknown:
        raise ValueError(f"weights has unknown criteria {unknown}: allowed are {list(CRITERIA)}")
    out = {c: check_real(f"weights[{c}]", weights.get(c, 0.0), low=0.0) for c in CRITERIA}
    if sum(out.values()) <= 0:
        raise ValueError(f"weights={dict(weights)!r} is invalid: at least one weight must be > 0")
    return out


@dataclass(frozen=True)
class ComplianceProfile:
    """One institution's assessment: five criterion scores in [0, 1].

    Attributes:
        client_id: a public name of the institution.
        scores: criterion → score in [0, 1], for every criterion of ``CRITERIA``.
    """

    client_id: str
    scores: Mapping[str, float]

    def __post_init__(self):
        if not isinstance(self.client_id, str) or not self.client_id:
            raise TypeError(f"client_id={self.client_id!r} is invalid: must be a non-empty string")
        if not isinstance(self.scores, Mapping):
            raise TypeError(f"scores={self.scores!r} is invalid: must be a mapping criterion -> score")
        missing = [c for c in CRITERIA if c not in self.scores]
        unknown = sorted(set(self.scores) - set(CRITERIA))
        if missing or unknown:
            raise ValueError(
                f"scores of client {self.client_id!r} are invalid: missing {missing}, unknown {unknown}; "
                f"give exactly {list(CRITERIA)}"
            )
        clean = {c: check_real(f"{self.client_id}.{c}", self.scores[c], low=0.0, high=1.0) for c in CRITERIA}
        object.__setattr__(self, "scores", clean)

    def score(self, weights: Mapping[str, float] | None = None) -> float:
        """The compliance score s = Σ w_c s_c / Σ w_c in [0, 1] (``weights`` default equal)."""
        w = check_weights(DEFAULT_WEIGHTS if weights is None else weights)
        return float(sum(w[c] * self.scores[c] for c in CRITERIA) / sum(w.values()))


@dataclass(frozen=True)
class ComplianceSet:
    """The profiles of all clients, the criterion weights and the "compliant" threshold.

    Attributes:
        profiles: one ``ComplianceProfile`` per client, in client order (client k is
            ``profiles[k]``).
        weights: criterion weights (non-negative, not all zero).
        compliant_threshold: a client with score ≥ this is "compliant" (Experiment 4 keeps only
            those).
        source: where the profiles came from (a file path or ``example``).
    """

    profiles: tuple[ComplianceProfile, ...]
    weights: Mapping[str, float]
    compliant_threshold: float = 0.8
    source: str = "example"

    def __post_init__(self):
        profiles = tuple(self.profiles)
        if not profiles or not all(isinstance(p, ComplianceProfile) for p in profiles):
            raise ValueError("profiles is invalid: must be a non-empty sequence of ComplianceProfile")
        ids = [p.client_id for p in profiles]
        if len(set(ids)) != len(ids):
            raise ValueError(f"profiles is invalid: client ids repeat ({ids})")
        object.__setattr__(self, "profiles", profiles)
        object.__setattr__(self, "weights", check_weights(self.weights))
        object.__setattr__(
            self,
            "compliant_threshold",
            check_real("compliant_threshold", self.compliant_threshold, low=0.0, high=1.0),
        )

    def __len__(self) -> int:
        return len(self.profiles)

    @property
    def client_ids(self) -> tuple[str, ...]:
        return tuple(p.client_id for p in self.profiles)

    def scores(self) -> np.ndarray:
        """Compliance scores s_k, shape (K,), float64 in [0, 1]."""
        return np.array([p.score(self.weights) for p in self.profiles], dtype=np.float64)

    def compliant(self) -> np.ndarray:
        """Boolean mask, shape (K,): score ≥ ``compliant_threshold``."""
        return self.scores() >= self.compliant_threshold

    def select(self, num_clients: int) -> ComplianceSet:
        """The first ``num_clients`` profiles.

        Raises:
            ValueError: more clients than profiles.
        """
        k = check_int("num_clients", num_clients, minimum=1, maximum=len(self.profiles))
        return ComplianceSet(self.profiles[:k], self.weights, self.compliant_threshold, self.source)


def load_profiles(path, weights: Mapping[str, float] | None = None) -> ComplianceSet:
    """Read a YAML file of compliance profiles (format in the module docstring).

    Args:
        path: the YAML file.
        weights: criterion weights overriding the file's (None: the file's, else equal).

    Returns:
        ``ComplianceSet`` with ``source`` the path.

    Raises:
        FileNotFoundError: no such file.
        ValueError: malformed content, a missing or out-of-range score, repeated ids.
    """
    import yaml

    with open(path) as fh:
        try:
            doc = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ValueError(f"compliance file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("clients"), list):
        raise ValueError(
            f"compliance file {str(path)!r} is invalid: expected a mapping with a 'clients' list"
        )
    profiles = []
    for i, entry in enumerate(doc["clients"]):
        if not isinstance(entry, Mapping) or "id" not in entry:
            raise ValueError(f"compliance file {str(path)!r}: clients[{i}] must be a mapping with an 'id'")
        scores = {k: v for k, v in entry.items() if k != "id"}
        profiles.append(ComplianceProfile(str(entry["id"]), scores))
    w = weights if weights is not None else doc.get("weights", DEFAULT_WEIGHTS)
    threshold = doc.get("compliant_threshold", 0.8)
    return ComplianceSet(tuple(profiles), w, threshold, source=str(path))


# The example of Experiment 1: 4 compliant and 12 lower-compliance institutions (illustrative
# assessments, not real hospitals). Rows: hipaa, gdpr, nist, iso, hl7_fhir.
_COMPLIANT = (
    (0.97, 0.95, 0.93, 0.96, 0.92),
    (0.94, 0.92, 0.95, 0.90, 0.93),
    (0.92, 0.96, 0.90, 0.93, 0.88),
    (0.95, 0.90, 0.92, 0.94, 0.91),
)
_LOWER = (
    (0.72, 0.65, 0.70, 0.60, 0.68),
    (0.60, 0.55, 0.62, 0.58, 0.50),
    (0.78, 0.70, 0.66, 0.72, 0.64),
    (0.50, 0.45, 0.55, 0.40, 0.52),
    (0.66, 0.72, 0.58, 0.62, 0.70),
    (0.40, 0.38, 0.45, 0.35, 0.42),
    (0.70, 0.62, 0.74, 0.68, 0.60),
    (0.55, 0.60, 0.50, 0.48, 0.58),
    (0.75, 0.68, 0.72, 0.70, 0.66),
    (0.45, 0.50, 0.42, 0.52, 0.40),
    (0.62, 0.58, 0.66, 0.55, 0.61),
    (0.35, 0.42, 0.38, 0.30, 0.36),
)


def example_profiles(num_clients: int = 16) -> ComplianceSet:
    """The bundled example (Experiment 1): a quarter compliant, three quarters lower-compliance.

    With 16 clients: 4 compliant (scores ≈ 0.91–0.95) and 12 lower-compliance (≈ 0.36–0.70).
    With K clients: round(K/4) compliant (at least 1) and the rest lower-compliance, the rows
    taken in order and repeated (with a suffix in the id) when K exceeds the table.

    Raises:
        ValueError: num_clients < 1.
    """
    k = check_int("num_clients", num_clients, minimum=1)
    n_good = max(1, int(round(k / 4)))
    if k == 1:
        n_good = 1
    rows: list[tuple[str, Sequence[float]]] = []
    for i in range(n_good):
        rows.append((f"compliant-{i + 1:02d}", _COMPLIANT[i % len(_COMPLIANT)]))
    for i in range(k - n_good):
        rows.append((f"lower-{i + 1:02d}", _LOWER[i % len(_LOWER)]))
    profiles = tuple(ComplianceProfile(name, dict(zip(CRITERIA, r, strict=True))) for name, r in rows)
    return ComplianceSet(profiles, DEFAULT_WEIGHTS, 0.8, source="example")


@dataclass(frozen=True)
class NoiseMap:
    """A monotone (non-increasing) map from compliance score s ∈ [0, 1] to σ > 0.

    Attributes:
        kind: ``linear``, ``exponential`` or ``table`` (formulas in the module docstring).
        sigma_min: σ at s = 1 (``linear``, ``exponential``); > 0.
        sigma_max: σ at s = 0; ≥ sigma_min.
        table: for ``table``: ((t_0 = 0, σ_0), (t_1, σ_1), …), thresholds strictly increasing
            in [0, 1], σ_i > 0 non-increasing.

    Raises:
        ValueError: σ_min > σ_max, a non-positive σ, a table that is not monotone or does not
            start at 0.
    """

    kind: str = "linear"
    sigma_min: float = 0.8
    sigma_max: float = 2.0
    table: tuple = ()

    def __post_init__(self):
        check_choice("kind", self.kind, NOISE_MAPS)
        if self.kind == "table":
            rows = tuple((float(t), float(s)) for t, s in self.table)
            if not rows:
                raise ValueError("table=() is invalid for kind='table': give ((0, σ0), (t1, σ1), ...)")
            for i, (t, s) in enumerate(rows):
                check_real(f"table[{i}] threshold", t, low=0.0, high=1.0)
                check_real(f"table[{i}] sigma", s, low=0.0, low_inclusive=False)
            if rows[0][0] != 0.0:
                raise ValueError(f"table[0] threshold={rows[0][0]} is invalid: must be 0 so every score maps")
            for (t0, s0), (t1, s1) in zip(rows, rows[1:], strict=False):
                if t1 <= t0:
                    raise ValueError(f"table thresholds {t0}, {t1} are invalid: must increase strictly")
                if s1 > s0:
                    raise ValueError(
                        f"table sigmas {s0}, {s1} are invalid: σ must not increase with the score "
                        "(lower compliance → more noise)"
                    )
            object.__setattr__(self, "table", rows)
            object.__setattr__(self, "sigma_min", rows[-1][1])
            object.__setattr__(self, "sigma_max", rows[0][1])
            return
        lo = check_real("sigma_min", self.sigma_min, low=0.0, low_inclusive=False)
        hi = check_real("sigma_max", self.sigma_max, low=0.0, low_inclusive=False)
        if lo > hi:
            raise ValueError(f"sigma_min={lo} is invalid: must be <= sigma_max={hi}")
        object.__setattr__(self, "sigma_min", lo)
        object.__setattr__(self, "sigma_max", hi)

    def __call__(self, scores) -> np.ndarray:
        """σ(s) for each score; shape of ``scores``, float64.

        Raises:
            ValueError: a score outside [0, 1] or not finite.
        """
        s = np.asarray(scores, dtype=np.float64)
        if not np.all(np.isfinite(s)) or np.any((s < 0) | (s > 1)):
            raise ValueError(f"scores={scores!r} is invalid: every score must be in [0, 1]")
        if self.kind == "linear":
            return self.sigma_max - (self.sigma_max - self.sigma_min) * s
        if self.kind == "exponential":
            return self.sigma_max * (self.sigma_min / self.sigma_max) ** s
        thresholds = np.array([t for t, _ in self.table])
        sigmas = np.array([v for _, v in self.table])
        return sigmas[np.searchsorted(thresholds, s, side="right") - 1]

    def describe(self) -> str:
        if self.kind == "table":
            return "table " + ", ".join(f"s≥{t:g}: σ={v:g}" for t, v in self.table)
        return f"{self.kind} σ(1)={self.sigma_min:g} … σ(0)={self.sigma_max:g}"


def uniform_control(sigmas) -> np.ndarray:
    """Every client's σ replaced by the mean of ``sigmas`` (equal mean noise), shape kept.

    Raises:
        ValueError: empty, or a σ that is not finite and > 0.
    """
    s = np.asarray(sigmas, dtype=np.float64)
    if s.size == 0 or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"sigmas={sigmas!r} is invalid: must be a non-empty array of σ > 0")
    return np.full_like(s, float(np.mean(s)))
