"""Monte Carlo accounting of the balls-in-bins dominating pair, with certified δ.

The pair (``MixtureGaussianEvent``): P = (1/b) Σ_j N(v_j, σ²I) and Q = N(0, σ²I). Its privacy
loss at an output y is

    ℓ(y) = log (P/Q)(y) = log (1/b) Σ_j exp((⟨y, v_j⟩ − ‖v_j‖²/2)/σ²),

so it depends on y only through the b projections ⟨y, v_j⟩. Under Q these are jointly
N(0, σ²G) with G the Gram matrix of the v_j; under P (bin j* uniform) they are N(G_{j*,:}, σ²G).
The sampler therefore draws ξ ~ N(0, I) in ℝ^b, sets w = Tξ with T·Tᵀ = G, and evaluates

    remove (y ~ P):  ℓ_R = lse_j((G_{j*j} − G_jj/2)/σ² + w_j/σ) − log b
    add    (y ~ Q):  ℓ_A = −(lse_j(−G_jj/2/σ² + w_j/σ) − log b)        (the loss of Q against P)

exactly in distribution, at O(b²) per sample whatever n is (the n-dimensional structure of C
enters once, through G). Independent copies (epochs with fresh bins, composed events) add
their losses. For either direction the hockey-stick divergence is (Balle et al. 2018; the PLD
form of Koskela et al. 2020)

    δ(ε) = E[(1 − e^{ε − ℓ})₊],   a mean of a variable in [0, 1],

and δ(ε) of the pair is the larger of the two directions.

Certification. For m i.i.d. variables in [0, 1] with mean δ and sample mean δ̂, Hoeffding's
(1963, Theorem 1) Chernoff bound gives P(δ̂ ≤ d) ≤ exp(−m·kl(d‖δ)) for d < δ, with kl the
Bernoulli relative entropy. So δ⁺ = max{p ≥ δ̂ : kl(δ̂‖p) ≤ ln(1/α)/m} is an upper confidence
bound: P(δ ≤ δ⁺) ≥ 1 − α, and δ⁺ ≥ δ̂ always. The pair's δ is the larger direction's δ, a fixed
(unknown) one of the two, so taking the larger δ⁺ keeps confidence 1 − α without a union bound
(the directions may share their Gaussian draws). The reported ε is the smallest ε with
δ⁺(ε) ≤ δ: since δ⁺(ε) is non-increasing in ε for fixed samples, reporting ε̂ < ε* (the true
ε at δ) implies δ⁺(ε*) ≤ δ = δ(ε*), the failure of one fixed-ε bound, so the reported ε is
also valid with probability ≥ 1 − α.

Samples needed. ``samples_needed`` returns the m for which a run whose true δ is at most
``ratio``·δ_target certifies δ_target with probability ≥ ``power`` (Chernoff bounds in both
directions); it grows like ln(1/α)/δ_target, as noted by Choquette-Choo et al. (2025) and
Schuchardt & Kalinin (2026) for this approach.

Limits. A run of more than ``max_samples`` samples per direction (default ``MAX_SAMPLES``;
``sample_limit`` raises it for a block of code) is refused before any sampling, with the count
and the time it would take (timed on a short pilot): δ = 10⁻¹² needs about 10¹⁴ samples. The
confidence of a ``certified`` answer is at least ``MIN_CONFIDENCE``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dpmf._validation import check_int, check_real
from dpmf.accountants.events import GaussianEvent, MixtureGaussianEvent, flatten
from dpmf.accountants.result import Measurement

__all__ = [
    "MAX_SAMPLES",
    "MIN_CONFIDENCE",
    "TooManySamplesError",
    "check_confidence",
    "sample_limit",
    "MonteCarloAccountant",
    "PrivacyLossSample",
    "certified_delta",
    "kl_bernoulli",
    "samples_needed",
    "sample_privacy_losses",
    "delta_means",
]

_CHUNK_FLOATS = 1 << 20  # entries of one (chunk × bins) work array: 8 MiB

# The default most samples per direction one query may draw (about 15 minutes for 10 bins on
# two cores); ``sample_limit`` or ``max_samples=`` raise it.
MAX_SAMPLES = 10**9
# A "certified" bound must hold more often than not: below this confidence the bound would fail
# for most seeds, and the label would mislead.
MIN_CONFIDENCE = 0.5

_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar("dpmf_max_samples", default=None)


class TooManySamplesError(ValueError):
    """A Monte Carlo query needs more samples than the limit allows (refused before sampling)."""


@contextlib.contextmanager
def sample_limit(max_samples: int | None):
    """Within the block, Monte Carlo queries may draw up to ``max_samples`` samples per
    direction (None: ``MAX_SAMPLES``). Used by ``dpmf --max-samples``.

    Raises:
        ValueError: ``max_samples`` < 1.
    """
    value = None if max_samples is None else check_int("max_samples", max_samples, minimum=1)
    token = _LIMIT.set(value)
    try:
        yield value
    finally:
        _LIMIT.reset(token)


def _max_samples(max_samples: int | None) -> int:
    if max_samples is not None:
        return check_int("max_samples", max_samples, minimum=1)
    limit = _LIMIT.get()
    return MAX_SAMPLES if limit is None else limit


def check_confidence(confidence) -> float:
    """``confidence`` as a float in [``MIN_CONFIDENCE``, 1).

    Raises:
        ValueError: outside that range (a bound failing more often than not is no certificate).
    """
    value = check_real("confidence", confidence, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    if value < MIN_CONFIDENCE:
        raise ValueError(
            f"confidence={confidence!r} is invalid: must be in [{MIN_CONFIDENCE:g}, 1) (a certified "
            "bound that fails for most seeds is no certificate; 0.99 is usual)"
        )
    return value


def _duration(seconds: float) -> str:
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _check_budget(event, samples: int, scales: int, max_samples: int | None, why: str = "") -> None:
    """Refuse ``samples`` above the limit, naming the count and the time it would take."""
    limit = _max_samples(max_samples)
    if samples <= limit:
        return
    blocks = _blocks(event)
    pilot = 2000
    began = time.perf_counter()
    _chunk_losses(blocks, [1.0] * scales, pilot, np.random.default_rng(0))
    per_sample = (time.perf_counter() - began) / pilot / _workers()
    raise TooManySamplesError(
        f"samples={samples:.3g} per direction{why} is above the limit max_samples={limit:.3g}: it "
        f"would take about {_duration(per_sample * samples)} here; raise the limit "
        "(max_samples=, sample_limit(), or dpmf --max-samples) or use a larger delta"
    )


def _workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(cores, 8))


def kl_bernoulli(p: float, q: float) -> float:
    """KL(Ber(p) ‖ Ber(q)) in nats, for p, q in [0, 1] (inf where undefined by support)."""
    if q <= 0.0:
        return 0.0 if p <= 0.0 else math.inf
    if q >= 1.0:
        return 0.0 if p >= 1.0 else math.inf
    out = 0.0
    if p > 0.0:
        out += p * math.log(p / q)
    if p < 1.0:
        out += (1.0 - p) * (math.log1p(-p) - math.log1p(-q))
    return max(out, 0.0)


def certified_delta(mean: float, samples: int, confidence: float) -> float:
    """The upper confidence bound δ⁺ on the mean of [0, 1] variables from their sample mean.

    δ⁺ = max{p ≥ mean : kl(mean‖p) ≤ ln(1/α)/m}, α = 1 − confidence (Hoeffding 1963, Thm 1).

    Args:
        mean: the sample mean δ̂ in [0, 1].
        samples: m ≥ 1.
        confidence: 1 − α in (0, 1).

    Returns:
        δ⁺ in [δ̂, 1]; with δ̂ = 0 it is 1 − α^{1/m}.

    Raises:
        ValueError: mean outside [0, 1], m < 1, confidence outside (0, 1).
    """
    mean = check_real("mean", mean, low=0.0, high=1.0)
    m = check_int("samples", samples, minimum=1)
    confidence = check_real(
        "confidence", confidence, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
    )
    level = math.log(1.0 / (1.0 - confidence)) / m
    if mean >= 1.0:
        return 1.0
    if mean == 0.0:
        return float(-math.expm1(-level))
    if kl_bernoulli(mean, 1.0 - 1e-300) <= level:
        return 1.0
    lo, hi = mean, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if kl_bernoulli(mean, mid) <= level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return float(hi)


def samples_needed(delta: float, *, ratio: float = 0.5, confidence: float = 0.99, power: float = 0.9) -> int:
    """Samples per direction so that a run whose true δ ≤ ratio·``delta`` certifies ``delta``.

    Certification at confidence 1 − α succeeds when the sample mean δ̂ ≤ d for some d with
    kl(d‖δ_t) ≥ ln(1/α)/m. Since P(δ̂ > d) ≤ exp(−m·kl(d‖δ₀)) for a true mean δ₀ < d (Hoeffding
    1963), the choice

        m = min over δ₀ < d < δ_t of max( ln(1/α)/kl(d‖δ_t), ln(2/(1−power))/kl(d‖δ₀) )

    (δ₀ = ratio·δ_t; the 2 covers both directions) certifies with probability ≥ ``power``.
    With ratio = 0 it is ln(1/α)/(−ln(1−δ_t)) ≈ ln(1/α)/δ_t, the fewest samples that can
    certify δ_t at all.

    Args:
        delta: the target δ_t in (0, 1).
        ratio: δ₀/δ_t in [0, 1): how far below the target the true δ is assumed to be.
        confidence: 1 − α in (0, 1).
        power: the probability of success in (0, 1).

    Returns:
        m ≥ 1.

    Raises:
        ValueError: any argument outside its range.
    """
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    ratio = check_real("ratio", ratio, low=0.0, high=1.0, high_inclusive=False)
    confidence = check_real(
        "confidence", confidence, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
    )
    power = check_real("power", power, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    a = math.log(1.0 / (1.0 - confidence))
    if ratio == 0.0:
        return int(math.ceil(a / -math.log1p(-delta)))
    b = math.log(2.0 / (1.0 - power))
    d0 = ratio * delta
    grid = d0 + (delta - d0) * np.linspace(0.0, 1.0, 4002)[1:-1]
    best = math.inf
    for d in grid:
        best = min(best, max(a / kl_bernoulli(d, delta), b / kl_bernoulli(d, d0)))
    return int(math.ceil(best))


# --------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True, eq=False)
class _Block:
    """One mixture (b bins) with its square-root factor; repeated ``repetitions`` times."""

    gram: np.ndarray  # (b, b)
    factor: np.ndarray | None  # (b, r) with factor @ factor.T = gram; None: diagonal gram
    root_diag: np.ndarray  # sqrt(diag(gram)), used when factor is None
    half: np.ndarray  # diag(gram)/2
    noise_multiplier: float
    repetitions: int

    @property
    def bins(self) -> int:
        return int(self.gram.shape[0])


def _blocks(event) -> list[_Block]:
    out = []
    for e in flatten(event):
        if isinstance(e, GaussianEvent):
            e = MixtureGaussianEvent(e.noise_multiplier, np.array([[float(e.count)]]), 1)
        if not isinstance(e, MixtureGaussianEvent):
            raise ValueError(
                f"event {type(e).__name__} is not supported by the Monte Carlo accountant: it "
                "measures balls-in-bins (mixture) and Gaussian events"
            )
        G = e.gram
        off = G - np.diag(np.diag(G))
        if not np.any(off):
            factor = None
        else:
            try:
                factor = np.linalg.cholesky(G)
            except np.linalg.LinAlgError:  # singular (e.g. empty bins): eigen-factor
                vals, vecs = np.linalg.eigh(G)
                if vals.min() < -1e-8 * max(vals.max(), 1e-300):
                    raise ValueError("gram is invalid: not positive semi-definite") from None
                keep = vals > 1e-13 * vals.max()
                factor = vecs[:, keep] * np.sqrt(vals[keep])[None, :]
        d = np.diag(G).copy()
        out.append(_Block(G, factor, np.sqrt(d), d / 2.0, e.noise_multiplier, e.repetitions))
    return out


def _lse_rows(a: np.ndarray) -> np.ndarray:
    """log Σ_j exp(a_ij) per row, in place on ``a`` (destroys it)."""
    mx = a.max(axis=1)
    a -= mx[:, None]
    np.exp(a, out=a)
    return np.log(a.sum(axis=1)) + mx


def _chunk_losses(blocks, scales, count: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Privacy losses of ``count`` samples at noise multipliers σ_block·scale_k.

    Returns:
        (remove, add), each of shape (K, count) with K = len(scales).
    """
    K = len(scales)
    rem = np.zeros((K, count))
    add = np.zeros((K, count))
    for blk in blocks:
        b = blk.bins
        log_b = math.log(b)
        for _ in range(blk.repetitions):
            if blk.factor is None:
                w = rng.standard_normal((count, b))
                w *= blk.root_diag[None, :]
            else:
                w = rng.standard_normal((count, blk.factor.shape[1])) @ blk.factor.T
            j = rng.integers(0, b, size=count)
            shift = blk.gram[j]  # (count, b): E[<y, v_i>] under P given bin j ...
            shift -= blk.half[None, :]  # ... minus ||v_i||^2/2
            t_add = np.empty_like(w)
            t_rem = np.empty_like(w)
            for k, scale in enumerate(scales):
                s = blk.noise_multiplier * scale
                inv, inv2 = 1.0 / s, 1.0 / (s * s)
                np.multiply(w, inv, out=t_add)
                np.multiply(shift, inv2, out=t_rem)
                t_rem += t_add
                t_add -= blk.half[None, :] * inv2
                add[k] -= _lse_rows(t_add) - log_b
                rem[k] += _lse_rows(t_rem) - log_b
    return rem, add


def _chunk_size(blocks) -> int:
    width = max(blk.bins for blk in blocks)
    return max(1, _CHUNK_FLOATS // width)


def _iterate(event, scales, samples: int, seed: int, stream: int, progress, desc: str):
    """Yield (remove, add) loss arrays of shape (K, c) chunk by chunk; reproducible from
    (seed, stream, samples) — chunk i draws from ``default_rng([seed, stream, i])``."""
    blocks = _blocks(event)
    chunk = _chunk_size(blocks)
    n_chunks = -(-samples // chunk)
    bar = None
    if progress is not False:
        from tqdm import tqdm

        bar = tqdm(
            total=samples,
            unit="samples",
            desc=desc,
            disable=None if progress is None else not progress,
            leave=False,
        )

    def work(i: int):
        count = min(chunk, samples - i * chunk)
        return count, _chunk_losses(blocks, scales, count, np.random.default_rng([seed, stream, i]))

    # numpy's element-wise work releases the GIL: chunks run on the machine's cores, and are
    # yielded in order (every chunk has its own stream, so the result does not depend on it)
    workers = _workers()
    pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 and n_chunks > 1 else None
    try:
        pending: deque = deque()
        next_i = 0
        while next_i < n_chunks or pending:
            while pool is not None and next_i < n_chunks and len(pending) < 2 * workers:
                pending.append(pool.submit(work, next_i))
                next_i += 1
            if pool is None:
                count, out = work(next_i)
                next_i += 1
            else:
                count, out = pending.popleft().result()
            yield out
            if bar is not None:
                bar.update(count)
    finally:
        if pool is not None:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True)
        if bar is not None:
            bar.close()


@dataclass(frozen=True, eq=False)
class PrivacyLossSample:
    """The Monte Carlo sample of privacy losses above a threshold, in both directions.

    Attributes:
        remove: sorted losses ℓ_R > ``threshold`` (shape (r,)).
        add: sorted losses ℓ_A > ``threshold`` (shape (a,)).
        samples: m, the number of samples per direction (including those not kept).
        threshold: τ ≥ 0; δ(ε) is available for ε ≥ τ.
        confidence: 1 − α of the certified bounds.
        seed: the seed used.
    """

    remove: np.ndarray
    add: np.ndarray
    samples: int
    threshold: float
    confidence: float
    seed: int

    def __post_init__(self):
        for name in ("remove", "add"):
            x = np.sort(np.asarray(getattr(self, name), dtype=np.float64))
            object.__setattr__(self, name, x)
            # suffix sums of exp(-l): S[i] = sum_{t >= i} exp(-x_t)
            s = np.concatenate([np.cumsum(np.exp(-x)[::-1])[::-1], [0.0]])
            object.__setattr__(self, f"_{name}_tail", s)

    def _mean(self, name: str, epsilon: float) -> float:
        x = getattr(self, name)
        s = getattr(self, f"_{name}_tail")
        i = int(np.searchsorted(x, epsilon, side="right"))
        count = x.shape[0] - i
        if count == 0:
            return 0.0
        total = count - math.exp(epsilon) * s[i]
        return float(min(max(total, 0.0), count) / self.samples)

    def _check_eps(self, epsilon) -> float:
        epsilon = check_real("epsilon", epsilon, low=0.0)
        if epsilon < self.threshold:
            raise ValueError(
                f"epsilon={epsilon!r} is invalid: this sample keeps losses above {self.threshold}"
            )
        return epsilon

    def delta_estimate(self, epsilon: float) -> float:
        """The point estimate max(δ̂_remove(ε), δ̂_add(ε))."""
        epsilon = self._check_eps(epsilon)
        return max(self._mean("remove", epsilon), self._mean("add", epsilon))

    def delta_certified(self, epsilon: float) -> float:
        """δ⁺(ε): valid with probability ≥ ``confidence``; never below ``delta_estimate``."""
        epsilon = self._check_eps(epsilon)
        return max(
            certified_delta(self._mean(name, epsilon), self.samples, self.confidence)
            for name in ("remove", "add")
        )

    @property
    def delta_floor(self) -> float:
        """The smallest δ these samples can certify: 1 − α^{1/m}."""
        return certified_delta(0.0, self.samples, self.confidence)

    def _epsilon(self, delta: float, fn) -> float:
        delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        lo = self.threshold
        if fn(lo) <= delta:
            return lo
        top = max([lo] + [float(x[-1]) for x in (self.remove, self.add) if x.size])
        hi = top + 1.0
        if fn(hi) > delta:
            return math.inf
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if fn(mid) <= delta:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-12 * max(1.0, hi):
                break
        return float(hi)

    def epsilon_certified(self, delta: float) -> float:
        """The smallest ε ≥ τ with δ⁺(ε) ≤ ``delta`` (valid with probability ≥ confidence).

        Raises:
            ValueError: δ is below ``delta_floor``: no number of successes can certify it.
        """
        if delta < self.delta_floor:
            need = samples_needed(delta, ratio=0.0, confidence=self.confidence)
            raise ValueError(
                f"samples={self.samples} is too few to certify delta={delta:g} at confidence "
                f"{self.confidence:g}: at least {need} are needed (more for a tight epsilon; see "
                "samples_needed)"
            )
        return self._epsilon(delta, self.delta_certified)

    def epsilon_estimate(self, delta: float) -> float:
        """The smallest ε ≥ τ with δ̂(ε) ≤ ``delta`` (a point estimate, no guarantee)."""
        return self._epsilon(delta, self.delta_estimate)


def sample_privacy_losses(
    event,
    samples: int,
    *,
    seed: int = 0,
    confidence: float = 0.99,
    threshold: float = 0.0,
    stream: int = 0,
    progress: bool | None = None,
    max_samples: int | None = None,
) -> PrivacyLossSample:
    """Draw ``samples`` privacy losses per direction of ``event`` and keep those above τ.

    Args:
        event: a ``MixtureGaussianEvent``, ``GaussianEvent`` or a composition of them.
        samples: m ≥ 1 per direction.
        seed: seed of the generator (reproducible for a given (seed, stream, m, event)).
        confidence: 1 − α for the certified bounds.
        threshold: τ ≥ 0; only losses above τ are stored (memory), so ε < τ cannot be resolved.
        stream: an independent stream index under the same seed.
        progress: show a tqdm progress bar (None: only on a terminal).
        max_samples: the most samples allowed (None: ``sample_limit``'s, else ``MAX_SAMPLES``).

    Returns:
        ``PrivacyLossSample``.

    Raises:
        ValueError: invalid arguments (confidence below ``MIN_CONFIDENCE``) or an unsupported
            event.
        TooManySamplesError: ``samples`` above the limit (before any sampling).
    """
    samples = check_int("samples", samples, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    confidence = check_confidence(confidence)
    threshold = check_real("threshold", threshold, low=0.0)
    _blocks(event)  # validate before any work
    _check_budget(event, samples, 1, max_samples)
    rem_keep, add_keep = [], []
    for rem, add in _iterate(event, [1.0], samples, seed, stream, progress, "privacy losses"):
        rem_keep.append(rem[0][rem[0] > threshold])
        add_keep.append(add[0][add[0] > threshold])
    return PrivacyLossSample(
        np.concatenate(rem_keep), np.concatenate(add_keep), samples, threshold, confidence, seed
    )


def delta_means(
    event,
    scales,
    epsilon: float,
    samples: int,
    *,
    seed: int = 0,
    stream: int = 0,
    progress: bool | None = None,
    max_samples: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample means of (1 − e^{ε−ℓ})₊ for every noise scale, sharing the Gaussian draws.

    The event's noise multipliers are multiplied by each entry of ``scales`` (shape (K,)).

    Returns:
        (remove, add) means, each of shape (K,).

    Raises:
        TooManySamplesError: ``samples`` above ``max_samples`` (as in ``sample_privacy_losses``).
    """
    scales = np.asarray(scales, dtype=np.float64)
    epsilon = check_real("epsilon", epsilon, low=0.0)
    samples = check_int("samples", samples, minimum=1)
    _check_budget(event, samples, max(1, scales.shape[0]), max_samples)
    tot_r = np.zeros(scales.shape[0])
    tot_a = np.zeros(scales.shape[0])
    for rem, add in _iterate(event, list(scales), samples, seed, stream, progress, "calibration"):
        for tot, loss in ((tot_r, rem), (tot_a, add)):
            f = -np.expm1(np.minimum(epsilon - loss, 0.0))  # (1 - e^{eps - l})_+
            tot += f.sum(axis=1)
    return tot_r / samples, tot_a / samples


def _method(samples: int, seed: int) -> str:
    return f"Monte Carlo, balls-in-bins dominating pair ({samples} samples/direction, seed {seed})"


class MonteCarloAccountant:
    """Certified Monte Carlo accountant for balls-in-bins (mixture) and Gaussian events.

    Args:
        samples: m per direction; None picks ``samples_needed(δ, ratio=0.5, confidence)`` for
            ``epsilon`` queries and 10⁶ for ``delta`` queries.
        seed: the generator seed.
        confidence: 1 − α of the certified bound, in [``MIN_CONFIDENCE``, 1); None reports
            point estimates (guarantee ``estimate``).
        progress: tqdm progress bar (None: only on a terminal).
        max_samples: the most samples per direction a query may draw (None: ``sample_limit``'s,
            else ``MAX_SAMPLES``); a query needing more is refused before sampling, with the
            count and the time it would take.

    Raises:
        ValueError: an argument out of range (confidence below ``MIN_CONFIDENCE``).
    """

    name = "monte_carlo"

    def __init__(
        self,
        samples: int | None = None,
        seed: int = 0,
        confidence: float | None = 0.99,
        progress: bool | None = None,
        max_samples: int | None = None,
    ):
        self.samples = None if samples is None else check_int("samples", samples, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.confidence = None if confidence is None else check_confidence(confidence)
        self.progress = progress
        self.max_samples = None if max_samples is None else check_int("max_samples", max_samples, minimum=1)

    def supports(self, event) -> bool:
        """Whether ``event`` is made of mixture and Gaussian events."""
        try:
            _blocks(event)
        except (ValueError, TypeError):
            return False
        return True

    def samples_for(self, delta: float) -> int:
        """The sample count used for an ε query at ``delta``."""
        if self.samples is not None:
            return self.samples
        return samples_needed(delta, ratio=0.5, confidence=self.confidence or 0.99)

    def sample(self, event, samples: int) -> PrivacyLossSample:
        """The privacy-loss sample (losses above 0) this accountant uses."""
        return sample_privacy_losses(
            event,
            samples,
            seed=self.seed,
            confidence=self.confidence or 0.99,
            progress=self.progress,
            max_samples=self.max_samples,
        )

    def epsilon(self, event, delta: float) -> Measurement:
        """The certified ε at ``delta`` (or the point estimate when confidence is None).

        Raises:
            ValueError: δ outside (0, 1), an unsupported event, or too few samples to certify δ.
            TooManySamplesError: the samples δ needs are above ``max_samples``.
        """
        delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        _blocks(event)
        m = self.samples_for(delta)
        if self.confidence is not None:
            floor = certified_delta(0.0, m, self.confidence)
            if delta < floor:
                need = samples_needed(delta, ratio=0.0, confidence=self.confidence)
                raise ValueError(
                    f"samples={m} is too few to certify delta={delta:g} at confidence "
                    f"{self.confidence:g}: "
                    f"at least {need} are needed, about "
                    f"{samples_needed(delta, confidence=self.confidence)} "
                    "for a tight epsilon"
                )
        why = "" if self.samples is not None else f" (needed for delta={delta:g})"
        _check_budget(event, m, 1, self.max_samples, why)
        s = self.sample(event, m)
        est = s.epsilon_estimate(delta)
        method = _method(m, self.seed)
        if self.confidence is None:
            return Measurement(
                est,
                delta,
                self.name,
                "estimate",
                method,
                None,
                m,
                self.seed,
                est,
                s.delta_estimate(est) if math.isfinite(est) else None,
            )
        eps = s.epsilon_certified(delta)
        d_est = s.delta_estimate(eps) if math.isfinite(eps) else None
        return Measurement(
            eps, delta, self.name, "certified", method, self.confidence, m, self.seed, est, d_est
        )

    def delta(self, event, epsilon: float) -> Measurement:
        """The certified δ at ``epsilon`` (or the point estimate when confidence is None)."""
        epsilon = check_real("epsilon", epsilon, low=0.0)
        _blocks(event)
        m = self.samples if self.samples is not None else 1_000_000
        s = sample_privacy_losses(
            event,
            m,
            seed=self.seed,
            confidence=self.confidence or 0.99,
            threshold=epsilon,
            progress=self.progress,
            max_samples=self.max_samples,
        )
        est = s.delta_estimate(epsilon)
        method = _method(m, self.seed)
        if self.confidence is None:
            return Measurement(epsilon, est, self.name, "estimate", method, None, m, self.seed, None, est)
        return Measurement(
            epsilon,
            s.delta_certified(epsilon),
            self.name,
            "certified",
            method,
            self.confidence,
            m,
            self.seed,
            None,
            est,
        )
