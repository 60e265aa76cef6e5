"""Batch samplers: which examples each step uses, one per accounting scheme.

===========================  =====================================================
sampler                      rule
===========================  =====================================================
``PoissonSampler``           every example joins each step independently with
                             probability q = B/N (variable, possibly empty batches)
``CyclicPoissonSampler``     examples split once into b groups; step t samples
                             group t mod b with probability q = B·b/N
``BallsInBinsSampler``       every example thrown once into one of b = ⌈N/B⌉ bins;
                             step t uses bin t mod b (fixed bins for the whole run)
``EpochBallsInBinsSampler``  as above, bins redrawn at the start of every epoch
``ShuffledFixedSampler``     one shuffle, then b = ⌈N/B⌉ fixed batches (near-equal
                             sizes ⌊N/b⌋ or ⌈N/b⌉, at most B) in the same cyclic
                             order every epoch
===========================  =====================================================

Which scheme uses which sampler is the scheme's own rule (``dpmf.plan.schemes``; each scheme's
``sampler``). A sampler built by a scheme carries the scheme's name in ``scheme`` (checked when
a checkpoint's sampler state is loaded).

An epoch is b = ⌈N/B⌉ steps for every scheme (the accountants' convention). The expected batch
size B̄ (``expected_batch_size``: B for the Poisson schemes, N/b for bins and fixed batches), a
public number, is what the private gradient is divided by. Every sampler returns index arrays
(int64, sorted), one per step, for exactly ``steps`` steps; an empty array is a step too (a
noise-only update, counted by the accountant). Randomness comes from one
``numpy.random.Generator`` per sampler — ``Philox`` keyed by the 128-bit subkey
``dpmf.seeds.derive(key, "sampler")`` of the run's key — whose state is checkpointed with
``state_dict()`` (a private file: batch membership is secret); the key is checked on load by
a salted digest, never shown.

Sources: Poisson subsampling — Abadi et al., CCS 2016; cyclic Poisson for banded strategies —
Choquette-Choo et al., "Amplified Banded Matrix Factorization: A unified approach to private
training" (NeurIPS 2023); balls-in-bins batching — Chua et al., "Balls-and-Bins Sampling for
DP-SGD" (AISTATS 2025), and for matrix mechanisms Choquette-Choo et al., "Near Exact Privacy
Amplification for Matrix Mechanisms" (ICLR 2025).
"""

from __future__ import annotations

import numpy as np

from dpmf import seeds as _seeds
from dpmf._validation import check_int
from dpmf.seeds import KeyHolder

__all__ = [
    "BatchSampler",
    "PoissonSampler",
    "CyclicPoissonSampler",
    "BallsInBinsSampler",
    "EpochBallsInBinsSampler",
    "ShuffledFixedSampler",
    "steps_per_epoch",
]


def steps_per_epoch(dataset_size: int, batch_size: int) -> int:
    """b = ⌈N/B⌉, the number of steps of one epoch (one pass over the data on average).

    Raises:
        ValueError: N < 1, B < 1, or B > N (a batch larger than the data set).
    """
    n = check_int("dataset_size", dataset_size, minimum=1)
    b = check_int("batch_size", batch_size, minimum=1)
    if b > n:
        raise ValueError(
            f"batch_size={b} is invalid: larger than the data set (dataset_size={n}); must be in [1, {n}]"
        )
    return -(-n // b)


class BatchSampler(KeyHolder):
    """Common part: N examples, T steps, a keyed generator, a step counter.

    Args:
        dataset_size: N ≥ 1.
        batch_size: B in [1, N], the (expected) batch size.
        steps: T ≥ 1, the number of steps of the run.
        seed: the run's key, an integer ≥ 0 (secret: ``dpmf.seeds``); the generator is keyed by
            its subkey ``derive(seed, "sampler")``.
    """

    scheme = ""

    def __init__(self, dataset_size: int, batch_size: int, steps: int, *, seed: int = 0):
        self.steps_per_epoch = steps_per_epoch(dataset_size, batch_size)
        self.dataset_size = int(dataset_size)
        self.batch_size = int(batch_size)
        self.steps = check_int("steps", steps, minimum=1)
        self.seed = _seeds.check_seed(seed)
        if self.seed is None:
            raise TypeError("seed=None is invalid here: give the run's key (dpmf.seeds.draw_key())")
        self.rng = _seeds.generator(self.seed, "sampler")
        self.step = 0
        self._watchers: list = []
        self._setup()

    def _setup(self) -> None:
        """Draw what stays fixed for the run (groups, bins, order) from ``self.rng``."""

    @property
    def expected_batch_size(self) -> float:
        """B̄: the expected number of examples per step (public)."""
        return float(self.batch_size)

    def next(self) -> np.ndarray:
        """The indices of the examples of the current step (sorted int64, maybe empty).

        Raises:
            RuntimeError: all ``steps`` steps were already drawn.
        """
        if self.step >= self.steps:
            raise RuntimeError(f"sampler exhausted: the run has {self.steps} steps and all were drawn")
        idx = np.sort(self._draw(self.step)).astype(np.int64)
        for watch in getattr(self, "_watchers", ()):
            watch(self.step, idx.copy())
        self.step += 1
        return idx

    def watch(self, fn) -> None:
        """Call ``fn(step, indices)`` after each draw from now on (a white-box audit records the
        batches it scores; the indices are secret: never log them). Not part of the state."""
        self._watchers.append(fn)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_watchers"] = []  # a copy sent to a loader's worker process watches nothing
        return state

    def _draw(self, t: int) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches per epoch: b = ⌈N/B⌉ (the ``torch.utils.data.Sampler`` protocol; the last
        epoch of a run whose steps are not a multiple of b is shorter)."""
        return self.steps_per_epoch

    def __iter__(self):
        """The next epoch's batches (index arrays), continuing the run's steps: iterate once per
        epoch, as a ``torch.utils.data.DataLoader`` ``batch_sampler`` is iterated.

        Raises:
            RuntimeError: every step of the run was already drawn.
        """
        if self.step >= self.steps:
            raise RuntimeError(
                f"sampler exhausted: the run has {self.steps} steps and all were drawn (make a new plan "
                "for more steps: its accounting covers only these)"
            )
        end = min(self.steps, (self.step // self.steps_per_epoch + 1) * self.steps_per_epoch)
        while self.step < end:
            yield self.next()

    def state_dict(self) -> dict:
        """Step counter, generator state, the fixed structures of the run and a salted digest
        of the key (``key_check``; the generator state itself is secret)."""
        salt = _seeds.new_salt()
        return {
            "scheme": self.scheme,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "derivation": _seeds.DERIVATION,
            "key_check": {"salt": salt, "digest": _seeds.key_digest(self.seed, salt)},
            "step": self.step,
            "rng": self.rng.bit_generator.state,
            "fixed": {k: np.array(v) for k, v in self._fixed().items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``.

        Raises:
            ValueError: the state belongs to a sampler with other settings, another key
                derivation or another key (never shown).
        """
        for key in ("scheme", "dataset_size", "batch_size", "steps"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state is invalid: {key}={state.get(key)!r} in the checkpoint, "
                    f"{getattr(self, key)!r} here"
                )
        if state.get("derivation") != _seeds.DERIVATION:
            raise ValueError(
                "sampler state is invalid: it was written with another key derivation "
                f"({state.get('derivation') or 'of an older dpmf'}; this dpmf uses "
                f"{_seeds.DERIVATION}); such a checkpoint cannot be resumed (start the run again)"
            )
        check = state.get("key_check") or {}
        if "salt" not in check or _seeds.key_digest(self.seed, str(check["salt"])) != check.get("digest"):
            raise ValueError(
                "sampler state is invalid: it was saved under another key (resume with the "
                "checkpoint's own key: the run adopts it when no other seed is given)"
            )
        self.step = check_int("step", state["step"], minimum=0, maximum=self.steps)
        self.rng.bit_generator.state = state["rng"]
        for k, v in state["fixed"].items():
            setattr(self, k, np.array(v))

    def _fixed(self) -> dict:
        return {}

    def use_key(self, key: int) -> None:
        """Adopt ``key`` (a checkpoint's, on resume, before ``load_state_dict``); the generator
        state itself comes from the checkpoint."""
        key = _seeds.check_seed(key, "key")
        if key is None:
            raise TypeError("key=None is invalid: give the checkpoint's key")
        self.seed = key
        self.rng = _seeds.generator(key, "sampler")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset_size={self.dataset_size}, batch_size={self.batch_size}, "
            f"steps={self.steps}, step={self.step})"
        )


class PoissonSampler(BatchSampler):
    """Each example joins each step independently with probability q = B/N."""

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.dataset_size

    def _draw(self, t):
        return np.flatnonzero(self.rng.random(self.dataset_size) < self.sampling_rate)


class CyclicPoissonSampler(BatchSampler):
    """b groups fixed once (a random partition into near-equal parts); step t Poisson-samples
    group t mod b with rate q = B·b/N, so an example can only appear in steps b apart.

    Args:
        groups: b ≥ 1 with B·b ≤ N (q ≤ 1); for a banded strategy, its number of bands.
    """

    def __init__(self, dataset_size, batch_size, steps, *, groups: int, seed: int = 0):
        self.groups = check_int("groups", groups, minimum=1)
        if batch_size * self.groups > dataset_size:
            raise ValueError(
                f"groups={groups} is invalid for batch_size={batch_size} and dataset_size="
                f"{dataset_size}: the sampling rate B·b/N must be ≤ 1, so b ≤ {dataset_size // batch_size}"
            )
        super().__init__(dataset_size, batch_size, steps, seed=seed)

    def _setup(self):
        self.assignment = self.rng.permutation(self.dataset_size) % self.groups

    def _fixed(self):
        return {"assignment": self.assignment}

    @property
    def sampling_rate(self) -> float:
        return self.batch_size * self.groups / self.dataset_size

    def _draw(self, t):
        members = np.flatnonzero(self.assignment == t % self.groups)
        return members[self.rng.random(members.shape[0]) < self.sampling_rate]


class BallsInBinsSampler(BatchSampler):
    """Each example thrown once, uniformly, into one of b = ⌈N/B⌉ bins; step t uses bin t mod b.

    Batches have random sizes (Binomial(N, 1/b)) with mean B̄ = N/b.
    """

    @property
    def bins(self) -> int:
        return self.steps_per_epoch

    @property
    def expected_batch_size(self) -> float:
        return self.dataset_size / self.bins

    def _setup(self):
        self.assignment = self._throw()

    def _throw(self):
        return self.rng.integers(0, self.bins, size=self.dataset_size)

    def _fixed(self):
        return {"assignment": self.assignment}

    def _draw(self, t):
        return np.flatnonzero(self.assignment == t % self.bins)


class EpochBallsInBinsSampler(BallsInBinsSampler):
    """Balls-in-bins redrawn at the start of each epoch (a DP-SGD scheme; epoch = b steps)."""

    def _setup(self):
        self.assignment = np.zeros(self.dataset_size, dtype=np.int64)

    def _draw(self, t):
        if t % self.bins == 0:
            self.assignment = self._throw()
        return super()._draw(t)


class ShuffledFixedSampler(BatchSampler):
    """One shuffle, then b = ⌈N/B⌉ fixed batches of near-equal size (⌊N/b⌋ or ⌈N/b⌉ ≤ B),
    cycled every epoch; B̄ = N/b.

    Each example is in exactly one batch, so it participates at steps s, s + b, s + 2b, … — the
    ``fixed_epochs(b, k)`` participation of the accountant.
    """

    def _setup(self):
        self.order = self.rng.permutation(self.dataset_size)

    def _fixed(self):
        return {"order": self.order}

    @property
    def expected_batch_size(self) -> float:
        return self.dataset_size / self.steps_per_epoch

    def _draw(self, t):
        b = self.steps_per_epoch
        s = t % b
        # np.array_split's boundaries: the first N mod b batches hold one more example
        size, extra = divmod(self.dataset_size, b)
        start = s * size + min(s, extra)
        return self.order[start : start + size + (1 if s < extra else 0)]
