"""Streaming correlated noise: step t's noise (C⁻¹Z)_t, one step at a time, in torch.

A matrix-factorization mechanism releases C·G + Z with Z ∈ ℝ^{n×d} i.i.d. N(0, 1) entries
(times σ·ζ·sens, applied by the caller); equivalently step t's gradient receives the noise
y_t = (C⁻¹Z)_t = Σ_{s≤t} (C⁻¹)_{t,s} z_s. Over the steps, the noise on any one coordinate
has covariance C⁻¹C⁻ᵀ. The generators here produce y_0, y_1, … on the model's device and
dtype without ever forming Z, with the state listed below (d = number of noised
coordinates, p = bands, k = BLT buffers):

=========================  ==========================================  ====================
generator                  recursion                                   state between steps
=========================  ==========================================  ====================
``ToeplitzInverseNoise``   y_t = r_t Σ_{k<p} g_k s_{t−k} z_{t−k}       (p−1)·d ("buffer")
  (C⁻¹ = diag(r)Toep(g)    — identity (p = 1), banded inverse (BISR,   or 0 ("regenerate":
  diag(s), p nonzero g)    banded-optimized), full Toeplitz (p = n)    past z from seeds)
``BandedSqrtNoise``        c_0 u_t = z_t/r_t − Σ_{k=1}^{p−1} c_k u_{t−k},  (p−1)·d
  (C = diag(r)Toep(c)      y_t = u_t/s_t (forward substitution in
  diag(s), p bands: BSR)   C·y = z on past *correlated* noises)
``BLTNoise``               y_t = z_t + Σ_i ω_i S_{i,t},                k·d
  (C⁻¹ = Toep(1, ω·θ^{j−1}))  S_{i,t+1} = θ_i S_{i,t} + z_t
``DenseInverseNoise``      y_t = Σ_{s≤t} M_{t,s} z_s, z_s regenerated  0
  (any lower-triangular M = C⁻¹)
=========================  ==========================================  ====================

"State" counts the tensor entries a generator holds from one step to the next (besides the
step counter, the seed and the coefficients, which are O(p) or O(n) numbers independent of d);
``state_numel()`` measures it from the tensors actually held and ``documented_state_numel``
states the bound. Each step also uses O(d) working memory (the output and one raw noise).
Regenerating costs compute instead: O(t·d) random numbers at step t for full Toeplitz and
dense C⁻¹ (O(n²d) over a run), O(p·d) per step for a banded C⁻¹.

Raw noise: z_t is drawn from the 128-bit subkey ``dpmf.seeds.derive(key, "noise", t)`` of
the run's secret key (``dpmf.seeds``: keyed BLAKE2b) by the stream's ``generator``
(``dpmf.optim.raw_noise``): by default torch's own generator on the stream's device, its state
set from the subkey (the CPU's Mersenne Twister, CUDA's Philox), so no noise crosses from host
to device; numpy's Philox-4×64 (earlier versions' numbers) on request. Any z_t can be
regenerated exactly, the whole stream is a function of the key and the generator, and the
checkpointable state is the step counter plus the buffers. The key is compared with a
checkpoint's by a salted digest (never stored in the fingerprint or shown in a message); the
fingerprint carries the derivation's version (``dpmf.seeds.DERIVATION``) and the generator's
name, so a checkpoint of another derivation, or of a generator this device cannot run, is
refused in one line (one of earlier versions, which name no generator, resumes with numpy's).
Output is in the requested dtype; raw noise,
recursions and buffers use that dtype, except for float16/bfloat16 models, whose noise is
computed in float32 and rounded at the end.

Raw noise keyed by coordinate (``ChunkedKeys``): for a run spread over processes, z_t is
instead drawn in chunks of at most ``CHUNK_ENTRIES`` entries, chunk c of parameter j from the
subkey ``derive(key, "noise", t, j, c)``. The global noise is then a function of those keys alone,
whatever the number of processes and however the parameters are split between them: a
generator built for a subset of the parameters (``ChunkedKeys.owned``) produces exactly those
parameters' coordinates of the full stream, with state for them only (the recursions act
coordinate by coordinate). The single-stream keys stay the default in one process.

Sources: the streaming forms of banded and BLT strategies — Kalinin & Lampert, "Banded Square
Root Matrix Factorization for Differentially Private Model Training" (NeurIPS 2024) for BSR;
Kalinin et al., "Back to Square Roots" (2025) for BISR; Dvijotham, McMahan, Pillutla, Steinke
and Thakurta, "Efficient and Near-Optimal Noise Generation for Streaming Differential
Privacy" (FOCS 2024) for buffered linear Toeplitz (BLT) noise; McKenna, "Scaling up the
Banded Matrix Factorization Mechanism for Differentially Private ML" (2024) for regenerating
past noise from seeds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from dpmf import seeds
from dpmf._validation import check_choice, check_int, check_vector
from dpmf.mechanisms.streaming import (
    NOISE_MODES,
    BandedSqrtLayout,
    BLTLayout,
    DenseInverseLayout,
    ToeplitzInverseLayout,
)
from dpmf.optim.raw_noise import NumpyPhilox, device_generator, generator_named, subkey
from dpmf.seeds import KeyHolder

__all__ = [
    "CHUNK_ENTRIES",
    "ChunkedKeys",
    "NOISE_MODES",
    "STREAMS",
    "noise_stream",
    "CorrelatedNoise",
    "ToeplitzInverseNoise",
    "BandedSqrtNoise",
    "BLTNoise",
    "DenseInverseNoise",
    "identity_noise",
    "raw_generator",
    "noise_for_factorization",
]

CHUNK_ENTRIES = 1 << 16


def raw_generator(key: int, step: int, *index: int) -> np.random.Generator:
    """The generator of the raw noise z_step of a stream with ``key``: numpy ``Philox`` keyed by
    ``dpmf.seeds.derive(key, "noise", step, *index)``; ``index`` = (parameter, chunk) selects
    one chunk of a ``ChunkedKeys`` stream."""
    return seeds.generator(key, "noise", int(step), *(int(i) for i in index))


def _fill_span(out, at: int, span: tuple[int, int], size: int, chunk: int, fill, key, step, j) -> None:
    """Write coordinates span = [a, b) of parameter j's raw noise (``size`` entries, chunk c
    from ``subkey(key, step, j, c)``) into ``out[at : at + b − a]``: whole chunks in place, a
    chunk cut by the span's ends drawn whole and sliced (the same values either way)."""
    a, b = span
    for c in range(a // chunk, -(-b // chunk)):
        lo, hi = c * chunk, min((c + 1) * chunk, size)
        sub = subkey(key, step, j, c)
        if a <= lo and hi <= b:
            fill(out[at + lo - a : at + hi - a], sub)
        else:
            whole = out.new_empty(hi - lo)
            fill(whole, sub)
            x, y = max(a, lo), min(b, hi)
            out[at + x - a : at + y - a].copy_(whole[x - lo : y - lo])


@dataclass(frozen=True)
class ChunkedKeys:
    """Raw noise keyed by (key, step, parameter, chunk) instead of (key, step).

    Coordinate i of parameter j at step t is entry i mod ``chunk`` of the ``chunk``-sized block
    ⌊i/chunk⌋ drawn from ``raw_generator(key, t, j, ⌊i/chunk⌋)``. A
    generator with these keys covers the parameters ``owned`` (in increasing order), their
    coordinates concatenated: d = Σ_{j∈owned} sizes[j].

    Attributes:
        sizes: the number of entries of every noised parameter of the model, in the model's
            order (shape (P,), each ≥ 1).
        owned: the indices of the parameters this generator covers (sorted, distinct; may be
            empty: a process that owns nothing still counts steps). None: all of them.
        chunk: entries per chunk (≥ 1); part of the stream's identity.
        ranges: None (default): every owned parameter whole; else one (start, stop) per owned
            parameter, 0 ≤ start ≤ stop ≤ sizes[j]: the generator covers only those
            coordinates of it (a shard of a ``fully_shard`` parameter, its rows' flat range),
            with the same values as the whole parameter's there.

    Raises:
        ValueError: a size < 1, an owned index out of range or repeated, chunk < 1, a range
            outside its parameter or one per owned parameter missing.
    """

    sizes: tuple[int, ...]
    owned: tuple[int, ...] | None = None
    chunk: int = CHUNK_ENTRIES
    ranges: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        sizes = tuple(check_int(f"sizes[{j}]", s, minimum=1) for j, s in enumerate(self.sizes))
        if not sizes:
            raise ValueError("sizes is invalid: at least one parameter is needed")
        owned = tuple(range(len(sizes))) if self.owned is None else tuple(int(j) for j in self.owned)
        if list(owned) != sorted(set(owned)) or any(not 0 <= j < len(sizes) for j in owned):
            raise ValueError(
                f"owned={self.owned!r} is invalid: must be distinct increasing indices in [0, {len(sizes)})"
            )
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "owned", owned)
        object.__setattr__(self, "chunk", check_int("chunk", self.chunk, minimum=1))
        if self.ranges is not None:
            ranges = tuple((int(a), int(b)) for a, b in self.ranges)
            if len(ranges) != len(owned) or any(
                not 0 <= a <= b <= sizes[j] for j, (a, b) in zip(owned, ranges, strict=False)
            ):
                raise ValueError(
                    f"ranges={self.ranges!r} is invalid: one (start, stop) per owned parameter, "
                    "0 <= start <= stop <= its size"
                )
            object.__setattr__(self, "ranges", ranges)

    def span(self, j: int) -> tuple[int, int]:
        """(start, stop): the coordinates of owned parameter j that the generator covers."""
        if self.ranges is None:
            return 0, self.sizes[j]
        return self.ranges[self.owned.index(j)]

    @property
    def dim(self) -> int:
        """d: the number of coordinates covered (Σ over the owned parameters' sizes or ranges)."""
        return sum(b - a for a, b in map(self.span, self.owned))

    def offsets(self) -> dict[int, tuple[int, int]]:
        """Owned parameter j → (start, stop) of its coordinates in the generator's vector."""
        out, start = {}, 0
        for j in self.owned:
            a, b = self.span(j)
            out[j] = (start, start + b - a)
            start += b - a
        return out

    def restricted(self, owned) -> ChunkedKeys:
        """The same keys for another subset of the parameters (whole)."""
        return ChunkedKeys(self.sizes, tuple(sorted(owned)), self.chunk)

    def describe(self) -> dict:
        """Plain data identifying the keying (what a checkpoint must match)."""
        out = {"keys": "chunked", "chunk": self.chunk, "sizes": list(self.sizes), "owned": list(self.owned)}
        if self.ranges is not None:
            out["ranges"] = [list(r) for r in self.ranges]
        return out


class CorrelatedNoise(KeyHolder, ABC):
    """A stream y_0, y_1, … of d-dimensional noise with step covariance C⁻¹C⁻ᵀ (unit scale).

    Subclasses implement ``_next()`` and the state they hold. Use ``next()`` to get the
    noise of the current step (and advance), ``state_dict()``/``load_state_dict()`` to
    checkpoint.

    Args:
        dim: d ≥ 1, the number of noised coordinates (all trainable parameters together).
        seed: the run's key (an integer ≥ 0: a secret drawn key, ``dpmf.seeds``, or a given
            seed); every raw noise is drawn from a subkey derived from it. Never shown.
        steps: n, the number of steps the strategy covers; ``next()`` refuses step n+1.
        device, dtype: where and in which precision the noise is produced.
        keys: None (default): one raw stream keyed by (key, step); a ``ChunkedKeys``: raw
            noise keyed by (key, step, parameter, chunk), for the owned parameters only
            (then ``dim`` must equal ``keys.dim``, and may be 0).
    """

    kind = "correlated"

    def __init__(self, dim: int, *, seed: int, steps: int, device=None, dtype=torch.float32, keys=None):
        if keys is not None and not isinstance(keys, ChunkedKeys):
            raise TypeError(f"keys={keys!r} is invalid: must be None or a ChunkedKeys")
        self.keys = keys
        self.dim = check_int("dim", dim, minimum=1 if keys is None else 0)
        if keys is not None and self.dim != keys.dim:
            raise ValueError(
                f"dim={dim} is invalid: the keys cover {keys.dim} coordinates of the owned parameters"
            )
        self.seed = seeds.check_seed(seed)
        if self.seed is None:
            raise TypeError("seed=None is invalid here: give the run's key (dpmf.seeds.draw_key())")
        self.steps = check_int("steps", steps, minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype={dtype!r} is invalid: must be a floating torch.dtype")
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        # half-precision models get their noise computed (and its state kept) in float32
        self.work_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.step = 0
        self.generator = device_generator(self.device)  # raw normals made on the device
        self._forks: tuple[tuple[int, int], ...] = ()  # (first step, key) of each fork, in order

    # -- raw noise ------------------------------------------------------------------------
    def raw_noise(self, step: int) -> torch.Tensor:
        """z_step ~ N(0, I_d), regenerated exactly from (key, step) — or, with ``ChunkedKeys``,
        chunk by chunk from (key, step, parameter, chunk) — by ``self.generator`` on the
        stream's device. Shape (d,)."""
        out = torch.empty(self.dim, dtype=self.work_dtype, device=self.device)
        fill, key = self.generator.fill, self._key_at(step)
        if self.keys is None:
            fill(out, subkey(key, step))
        else:
            keys = self.keys
            for j, (start, _) in keys.offsets().items():
                _fill_span(out, start, keys.span(j), keys.sizes[j], keys.chunk, fill, key, step, j)
        return out

    def use_generator(self, name: str) -> None:
        """Draw every later raw noise with the generator ``name`` (``dpmf.optim.raw_noise``:
        ``"device"``, ``"torch-mt19937"``, ``"torch-philox-cuda"``, ``"numpy-philox"``, or a
        checkpoint's recorded name).

        Raises:
            ValueError: an unknown name, or one that cannot make its numbers on this device.
        """
        self.generator = generator_named(name, self.device)

    def use_key(self, key: int) -> None:
        """Adopt ``key`` (a checkpoint's, on resume) for every later raw noise."""
        key = seeds.check_seed(key, "key")
        if key is None:
            raise TypeError("key=None is invalid: give the checkpoint's key")
        self.seed = key

    def _key_at(self, step: int) -> int:
        """The key of raw noise z_step: the last fork's at or before ``step``, else the run's."""
        key = self.seed
        for first, fork_key in self._forks:
            if step >= first:
                key = fork_key
        return key

    def fork(self, key: int) -> None:
        """Draw every raw noise from the current step on from ``key`` (a fork of a checkpoint):
        the raw noises of earlier steps, which the released steps hold, stay those of the run's
        key (regenerated or buffered alike), so the fork's noise is the strategy's correlated
        noise and independent of its siblings' from this step on.

        Raises:
            ValueError: ``key`` is the run's or an earlier fork's key (the noise would repeat).
        """
        key = seeds.check_seed(key, "key")
        if key is None or key == self.seed or any(key == k for _, k in self._forks):
            raise ValueError(
                "key is invalid for a fork: it must differ from the run's and earlier forks' keys"
            )
        self._forks = (*self._forks, (int(self.step), key))

    @property
    def forks(self) -> list[list[int]]:
        """[[first step, key], …] of the forks (secret: the keys), for a run state."""
        return [[int(first), int(key)] for first, key in self._forks]

    def use_forks(self, forks) -> None:
        """Restore ``forks`` (a run state's) on resume.

        Raises:
            ValueError: not a list of [step ≥ 0, key ≥ 0] pairs with increasing steps.
        """
        pairs = []
        for item in forks or ():
            first, key = (int(v) for v in item)
            if first < 0 or key < 0 or (pairs and first < pairs[-1][0]):
                raise ValueError("noise forks are invalid: not [step, key] pairs with increasing steps")
            pairs.append((first, key))
        self._forks = tuple(pairs)

    def _key_check(self) -> dict:
        salt = seeds.new_salt()
        return {"salt": salt, "digest": seeds.key_digest(self.seed, salt)}

    def _check_key(self, saved: dict | None) -> None:
        """Refuse state saved under another key (compared by salted digest, never shown)."""
        if not isinstance(saved, dict) or "salt" not in saved:
            raise ValueError("noise state is invalid: it records no key check (not written by this dpmf)")
        if seeds.key_digest(self.seed, saved["salt"]) != saved.get("digest"):
            raise ValueError(
                "noise state is invalid for this generator: it was saved under another noise key "
                "(resume with the checkpoint's own key: the run adopts it when no other seed is given)"
            )

    # -- streaming ------------------------------------------------------------------------
    def next(self) -> torch.Tensor:
        """The noise y_t of the current step t (0-based), shape (d,); then t ← t + 1.

        Raises:
            RuntimeError: all n steps of the strategy were already used.
        """
        if self.step >= self.steps:
            raise RuntimeError(
                f"noise stream exhausted: the strategy covers {self.steps} steps and all were used"
            )
        y = self._next(self.step)
        self.step += 1
        return y if y.dtype == self.dtype else y.to(self.dtype)

    @abstractmethod
    def _next(self, t: int) -> torch.Tensor: ...

    @abstractmethod
    def innovation(self, t: int) -> float:
        """(C⁻¹)_tt: the coefficient of the fresh raw noise z_t in y_t (the part of step t's
        noise independent of all earlier steps has std |(C⁻¹)_tt|)."""

    # -- state ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def documented_state_numel(self) -> int:
        """The documented bound on the tensor entries held between steps (see module table)."""

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_numel(self) -> int:
        """Tensor entries actually held between steps (measured from the held tensors)."""
        return sum(int(t.numel()) for t in self._state_tensors().values())

    def state_bytes(self) -> int:
        """Bytes of the tensors held between steps."""
        return sum(int(t.numel() * t.element_size()) for t in self._state_tensors().values())

    def fingerprint(self) -> dict:
        """What must match for a checkpoint to be loaded into this generator."""
        out = {
            "kind": self.kind,
            "derivation": seeds.DERIVATION,
            "generator": self.generator.name,
            "dim": self.dim,
            "steps": self.steps,
        }
        if self.keys is not None:
            out.update(self.keys.describe())
        return out

    def state_dict(self) -> dict:
        """The step counter, the fingerprint, a salted digest of the key (``key_check``) and
        copies of the buffers (on CPU)."""
        return {
            "step": self.step,
            "fingerprint": self.fingerprint(),
            "key_check": self._key_check(),
            "tensors": {k: v.detach().cpu().clone() for k, v in self._state_tensors().items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``.

        Raises:
            ValueError: the checkpoint belongs to a different generator (derivation version,
                kind, d, n or coefficients differ) or was saved under another key.
        """
        self._adopt_generator(state.get("fingerprint"))
        _compare_fingerprints(state.get("fingerprint"), self.fingerprint())
        self._check_key(state.get("key_check"))
        self.step = check_int("step", state["step"], minimum=0, maximum=self.steps)
        self._load_tensors({k: v.to(self.device, self.work_dtype) for k, v in state["tensors"].items()})

    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if tensors:
            raise ValueError(f"noise state is invalid: unexpected tensors {sorted(tensors)}")

    def parameter_state(self) -> dict:
        """The state split by parameter, to move it between processes (``ChunkedKeys`` only):
        ``{"step", "fingerprint" (without ``owned``/``dim``), "parameters": {j: {name: tensor
        (…, sizes[j]) on CPU}}}``; every held tensor's last axis runs over the coordinates.

        Raises:
            ValueError: the generator has single-stream keys.
        """
        offsets = self._chunked_offsets("parameter_state")
        tensors = self._state_tensors()
        return {
            "step": self.step,
            "fingerprint": _shared_fingerprint(self.fingerprint()),
            "key_check": self._key_check(),
            "parameters": {
                j: {k: v[..., a:b].detach().cpu().clone() for k, v in tensors.items()}
                for j, (a, b) in offsets.items()
            },
            "ranges": {j: self.keys.span(j) for j in offsets},
        }

    def load_parameter_state(self, states) -> None:
        """Restore the owned parameters' state from ``parameter_state()`` results of any split
        (e.g. one per process of a run with another number of processes).

        Raises:
            ValueError: another generator (derivation, kind, steps, coefficients, sizes), another
                key, steps that disagree, or an owned parameter missing from ``states``.
        """
        offsets = self._chunked_offsets("load_parameter_state")
        states = list(states)
        mine = _shared_fingerprint(self.fingerprint())
        pieces: dict = {}  # j → [((start, stop) of the saved coordinates, {name: tensor})]
        steps = set()
        for st in states:
            self._adopt_generator(st.get("fingerprint"))
            mine = _shared_fingerprint(self.fingerprint())
            _compare_fingerprints(st.get("fingerprint"), mine)
            self._check_key(st.get("key_check"))
            steps.add(int(st["step"]))
            spans = st.get("ranges") or {}
            for j, part in st["parameters"].items():
                pieces.setdefault(j, []).append((spans.get(j, (0, self.keys.sizes[j])), part))
        if len(steps) != 1:
            raise ValueError(f"noise states are inconsistent: saved at different steps {sorted(steps)}")
        step = check_int("step", steps.pop(), minimum=0, maximum=self.steps)
        tensors = self._state_tensors()
        missing = []
        for j, (at, _) in offsets.items():
            a, b = self.keys.span(j)
            reach = a  # the saved pieces, in order of their starts, must cover [a, b)
            for (x, y), part in sorted(pieces.get(j, ()), key=lambda piece: piece[0]):
                lo, hi = max(a, x), min(b, y)
                if lo > reach or lo >= hi:
                    continue
                reach = max(reach, hi)
                for k, v in tensors.items():
                    saved = part[k][..., lo - x : hi - x].to(self.device, self.work_dtype)
                    v[..., at + lo - a : at + hi - a].copy_(saved)
            if reach < b:
                missing.append(j)
        if missing:
            raise ValueError(f"noise state is incomplete: no saved state for parameters {missing}")
        self.step = step

    def _adopt_generator(self, saved) -> None:
        """Continue with the generator a checkpoint's noise was drawn with (earlier dpmf
        versions record none: theirs is ``numpy-philox``); refuse one this device cannot run."""
        if isinstance(saved, dict) and saved.get("derivation") == seeds.DERIVATION:
            name = _saved_generator(saved)
            if name != self.generator.name:
                self.generator = generator_named(name, self.device)

    def _chunked_offsets(self, what: str) -> dict:
        if self.keys is None:
            raise ValueError(f"{what} is invalid for single-stream noise: build the stream with ChunkedKeys")
        return self.keys.offsets()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, steps={self.steps}, step={self.step})"


def _saved_generator(fingerprint: dict) -> str:
    """The generator a saved fingerprint names; earlier versions name none: numpy's Philox."""
    return fingerprint.get("generator", NumpyPhilox.name)


def _compare_fingerprints(saved, mine: dict) -> None:
    """One-line refusal naming what differs (a fingerprint holds nothing secret)."""
    saved = saved if isinstance(saved, dict) else {}
    if saved.get("derivation") != mine["derivation"]:
        theirs = saved.get("derivation")
        raise ValueError(
            "noise state is invalid for this generator: it was written with the noise derivation "
            f"{theirs if theirs is not None else 'of an older dpmf'!s}, this dpmf derives noise with "
            f"{mine['derivation']}; such a checkpoint cannot be resumed (start the run again)"
        )
    saved = {**saved, "generator": _saved_generator(saved)}
    if saved != mine:
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        detail = ", ".join(f"{k}: {saved.get(k)!r} saved, {mine.get(k)!r} here" for k in diff)
        raise ValueError(f"noise state is invalid for this generator: {detail}")


def _shared_fingerprint(fp: dict) -> dict:
    """A fingerprint without what differs between the processes of one run."""
    return {k: v for k, v in fp.items() if k not in ("owned", "dim", "ranges")}


def _scales(row_scale, col_scale, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    out = []
    for name, v in (("row_scale", row_scale), ("col_scale", col_scale)):
        if v is None:
            out.append(None)
        else:
            v = check_vector(name, v, length=n)
            if np.any(v == 0):
                raise ValueError(f"{name} is invalid: entries must be non-zero")
            out.append(None if np.all(v == 1.0) else v)
    return out[0], out[1]


def _digest(*arrays) -> str:
    """A short exact fingerprint of float64 arrays (None allowed)."""
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(b"none" if a is None else np.ascontiguousarray(a, dtype=np.float64).tobytes())
    return h.hexdigest()[:16]


class ToeplitzInverseNoise(CorrelatedNoise):
    """Noise for C⁻¹ = diag(r)·Toep(g)·diag(s) with g banded: y_t = r_t Σ_{k<p} g_k s_{t−k} z_{t−k}.

    Covers the identity (g = [1], plain DP-SGD), the banded inverse strategies (BISR and
    banded-optimized: p = bands of C⁻¹), and a full Toeplitz C⁻¹ (p = n).

    Args:
        coeffs: g, the first column of Toep(g) truncated after its last non-zero entry;
            length p ≤ n, g_0 ≠ 0.
        row_scale, col_scale: r and s, shape (n,), non-zero; None for ones.
        mode: ``"buffer"`` keeps the p−1 previous scaled raw noises s·z ((p−1)·d state);
            ``"regenerate"`` redraws them from their keys at every step (no state, p× the
            random-number work).
        dim, seed, steps, device, dtype: as ``CorrelatedNoise``.

    Raises:
        ValueError: g empty/non-finite, g_0 = 0, p > n, bad scales, unknown mode.
    """

    kind = "toeplitz_inverse"

    def __init__(
        self,
        coeffs,
        dim: int,
        *,
        seed: int,
        steps: int,
        row_scale=None,
        col_scale=None,
        mode: str = "buffer",
        device=None,
        dtype=torch.float32,
        keys=None,
    ):
        super().__init__(dim, seed=seed, steps=steps, device=device, dtype=dtype, keys=keys)
        g = check_vector("coeffs", coeffs)
        nz = np.flatnonzero(g)
        if g[0] == 0:
            raise ValueError("coeffs is invalid: coeffs[0] must be non-zero (invertible C)")
        g = g[: int(nz[-1]) + 1]
        if g.shape[0] > self.steps:
            raise ValueError(f"coeffs is invalid: {g.shape[0]} bands exceed steps={self.steps}")
        self.coeffs = g
        self.bands = int(g.shape[0])
        self.row_scale, self.col_scale = _scales(row_scale, col_scale, self.steps)
        self.mode = check_choice("mode", mode, NOISE_MODES)
        # ring buffer of the last p−1 scaled raw noises s_u·z_u (row u mod (p−1))
        self._buffer = (
            torch.zeros(self.bands - 1, self.dim, device=self.device, dtype=self.work_dtype)
            if self.mode == "buffer" and self.bands > 1
            else None
        )

    @property
    def documented_state_numel(self) -> int:
        return (self.bands - 1) * self.dim if self.mode == "buffer" else 0

    def fingerprint(self) -> dict:
        return {
            **super().fingerprint(),
            "mode": self.mode,
            "coeffs": _digest(self.coeffs, self.row_scale, self.col_scale),
        }

    def innovation(self, t: int) -> float:
        r = 1.0 if self.row_scale is None else float(self.row_scale[t])
        c = 1.0 if self.col_scale is None else float(self.col_scale[t])
        return float(self.coeffs[0]) * r * c

    def _scaled_raw(self, u: int) -> torch.Tensor:
        z = self.raw_noise(u)
        return z if self.col_scale is None else z * float(self.col_scale[u])

    def _next(self, t: int) -> torch.Tensor:
        w_t = self._scaled_raw(t)
        c0 = float(self.coeffs[0])
        # a fresh tensor either way; w_t itself when nothing else is added to it (y = z_t for
        # identity noise, no multiplication by 1)
        y = w_t if c0 == 1.0 and self._buffer is None and min(self.bands, t + 1) == 1 else w_t * c0
        for k in range(1, min(self.bands, t + 1)):
            if self.coeffs[k] == 0.0:
                continue
            u = t - k
            w_u = self._buffer[u % (self.bands - 1)] if self._buffer is not None else self._scaled_raw(u)
            y.add_(w_u, alpha=float(self.coeffs[k]))
        if self._buffer is not None:
            self._buffer[t % (self.bands - 1)].copy_(w_t)
        if self.row_scale is not None:
            y.mul_(float(self.row_scale[t]))
        return y

    def _state_tensors(self):
        return {} if self._buffer is None else {"buffer": self._buffer}

    def _load_tensors(self, tensors):
        if self._buffer is None:
            super()._load_tensors(tensors)
        else:
            self._buffer.copy_(tensors["buffer"])


def identity_noise(dim: int, *, seed: int, steps: int, device=None, dtype=torch.float32):
    """Independent noise y_t = z_t (C = I, plain DP-SGD): a ``ToeplitzInverseNoise`` with g = [1].

    State between steps: none.
    """
    return ToeplitzInverseNoise([1.0], dim, seed=seed, steps=steps, device=device, dtype=dtype)


class BandedSqrtNoise(CorrelatedNoise):
    """Noise y = C⁻¹z for a banded C = diag(r)·Toep(c)·diag(s) (BSR), by forward substitution.

    Row t of C·y = z reads r_t Σ_{k<p} c_k s_{t−k} y_{t−k} = z_t; with u = s·y,
    c_0 u_t = z_t / r_t − Σ_{k=1}^{p−1} c_k u_{t−k} and y_t = u_t / s_t. The recursion runs on
    past *correlated* noises u, so it holds (p−1)·d numbers and never regenerates.

    Args:
        coeffs: c, the first column of the banded Toeplitz factor, length p ≤ n, c_0 ≠ 0
            (trailing zeros are dropped).
        row_scale, col_scale: r and s of C, shape (n,), non-zero; None for ones.
        dim, seed, steps, device, dtype: as ``CorrelatedNoise``.

    Raises:
        ValueError: as ``ToeplitzInverseNoise``.
    """

    kind = "banded_sqrt"

    def __init__(
        self,
        coeffs,
        dim: int,
        *,
        seed: int,
        steps: int,
        row_scale=None,
        col_scale=None,
        device=None,
        dtype=torch.float32,
        keys=None,
    ):
        super().__init__(dim, seed=seed, steps=steps, device=device, dtype=dtype, keys=keys)
        c = check_vector("coeffs", coeffs)
        if c[0] == 0:
            raise ValueError("coeffs is invalid: coeffs[0] must be non-zero (invertible C)")
        nz = np.flatnonzero(c)
        c = c[: int(nz[-1]) + 1]
        if c.shape[0] > self.steps:
            raise ValueError(f"coeffs is invalid: {c.shape[0]} bands exceed steps={self.steps}")
        self.coeffs = c
        self.bands = int(c.shape[0])
        self.row_scale, self.col_scale = _scales(row_scale, col_scale, self.steps)
        self._past = (
            torch.zeros(self.bands - 1, self.dim, device=self.device, dtype=self.work_dtype)
            if self.bands > 1
            else None
        )

    @property
    def documented_state_numel(self) -> int:
        return (self.bands - 1) * self.dim

    def fingerprint(self) -> dict:
        return {**super().fingerprint(), "coeffs": _digest(self.coeffs, self.row_scale, self.col_scale)}

    def innovation(self, t: int) -> float:
        r = 1.0 if self.row_scale is None else float(self.row_scale[t])
        c = 1.0 if self.col_scale is None else float(self.col_scale[t])
        return 1.0 / (float(self.coeffs[0]) * r * c)

    def _next(self, t: int) -> torch.Tensor:
        u = self.raw_noise(t)
        if self.row_scale is not None:
            u.div_(float(self.row_scale[t]))
        for k in range(1, min(self.bands, t + 1)):
            if self.coeffs[k] != 0.0:
                u.add_(self._past[(t - k) % (self.bands - 1)], alpha=-float(self.coeffs[k]))
        u.div_(float(self.coeffs[0]))
        if self._past is not None:
            self._past[t % (self.bands - 1)].copy_(u)
        return u if self.col_scale is None else u / float(self.col_scale[t])

    def _state_tensors(self):
        return {} if self._past is None else {"past": self._past}

    def _load_tensors(self, tensors):
        if self._past is None:
            super()._load_tensors(tensors)
        else:
            self._past.copy_(tensors["past"])


class BLTNoise(CorrelatedNoise):
    """Noise for a buffered linear Toeplitz C⁻¹ = Toep(g), g_0 = 1, g_j = Σ_i ω_i θ_i^{j−1} (j ≥ 1).

    Streaming form with k buffers S_i (all zero at t = 0):
    y_t = z_t + Σ_i ω_i S_{i,t},  S_{i,t+1} = θ_i S_{i,t} + z_t.
    Unrolled, y_t = z_t + Σ_{j≥1} (Σ_i ω_i θ_i^{j−1}) z_{t−j}, the Toeplitz form above. Optional
    row and column scales give diag(r)·Toep(g)·diag(s) (the buffers then accumulate s·z).

    Args:
        omega: ω, shape (k,), the output weights.
        theta: θ, shape (k,), the buffer decays.
        row_scale, col_scale: shape (n,), non-zero; None for ones.
        dim, seed, steps, device, dtype: as ``CorrelatedNoise``.

    Raises:
        ValueError: ω and θ empty, non-finite or of different lengths; bad scales.
    """

    kind = "blt"

    def __init__(
        self,
        omega,
        theta,
        dim: int,
        *,
        seed: int,
        steps: int,
        row_scale=None,
        col_scale=None,
        device=None,
        dtype=torch.float32,
        keys=None,
    ):
        super().__init__(dim, seed=seed, steps=steps, device=device, dtype=dtype, keys=keys)
        self.omega = check_vector("omega", omega)
        self.theta = check_vector("theta", theta, length=self.omega.shape[0])
        self.buffers = int(self.omega.shape[0])
        self.row_scale, self.col_scale = _scales(row_scale, col_scale, self.steps)
        self._state = torch.zeros(self.buffers, self.dim, device=self.device, dtype=self.work_dtype)
        self._omega = torch.as_tensor(self.omega, device=self.device, dtype=self.work_dtype)
        self._theta = torch.as_tensor(self.theta, device=self.device, dtype=self.work_dtype)

    @property
    def documented_state_numel(self) -> int:
        return self.buffers * self.dim

    def fingerprint(self) -> dict:
        return {
            **super().fingerprint(),
            "coeffs": _digest(self.omega, self.theta, self.row_scale, self.col_scale),
        }

    def innovation(self, t: int) -> float:
        r = 1.0 if self.row_scale is None else float(self.row_scale[t])
        c = 1.0 if self.col_scale is None else float(self.col_scale[t])
        return r * c

    def _next(self, t: int) -> torch.Tensor:
        w = self.raw_noise(t)
        if self.col_scale is not None:
            w.mul_(float(self.col_scale[t]))
        y = w + self._omega @ self._state
        self._state.mul_(self._theta[:, None]).add_(w)
        if self.row_scale is not None:
            y.mul_(float(self.row_scale[t]))
        return y

    def _state_tensors(self):
        return {"buffers": self._state}

    def _load_tensors(self, tensors):
        self._state.copy_(tensors["buffers"])


class DenseInverseNoise(CorrelatedNoise):
    """Noise for any lower-triangular C⁻¹ = M: y_t = Σ_{s≤t} M_{t,s} z_s, past z regenerated.

    For strategies without Toeplitz structure (the square root of A_χ, optimized dense
    strategies). No state between steps; step t draws the t+1 raw noises again (O(t·d) work).
    M itself is held on the host (O(n²) float64, independent of d).

    Args:
        matrix: M, shape (n, n), lower-triangular.
        dim, seed, device, dtype: as ``CorrelatedNoise``; steps = n.

    Raises:
        ValueError: M not square, not lower-triangular, or non-finite.
    """

    kind = "dense_inverse"

    def __init__(self, matrix, dim: int, *, seed: int, device=None, dtype=torch.float32, keys=None):
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
            raise ValueError(f"matrix is invalid: must be square n×n, got shape {m.shape}")
        if not np.all(np.isfinite(m)):
            raise ValueError("matrix is invalid: contains NaN or infinite entries")
        if np.any(np.triu(m, 1) != 0):
            raise ValueError("matrix is invalid: must be lower-triangular")
        super().__init__(dim, seed=seed, steps=m.shape[0], device=device, dtype=dtype, keys=keys)
        self.matrix = m

    @property
    def documented_state_numel(self) -> int:
        return 0

    def fingerprint(self) -> dict:
        return {**super().fingerprint(), "coeffs": _digest(self.matrix)}

    def innovation(self, t: int) -> float:
        return float(self.matrix[t, t])

    def _next(self, t: int) -> torch.Tensor:
        row = self.matrix[t]
        y = self.raw_noise(t).mul_(float(row[t]))
        for s in np.flatnonzero(row[:t]):
            y.add_(self.raw_noise(int(s)), alpha=float(row[s]))
        return y


def noise_stream(
    layout, dim: int, *, seed: int, device=None, dtype=torch.float32, keys=None
) -> CorrelatedNoise:
    """The generator of a strategy's ``NoiseLayout`` (``dpmf.mechanisms.streaming``) for ``dim``
    coordinates: one generator class per layout class (``STREAMS``); ``keys`` as
    ``CorrelatedNoise``.

    Raises:
        TypeError: not a known layout.
    """
    build = STREAMS.get(type(layout))
    if build is None:
        raise TypeError(f"layout={layout!r} is invalid: no noise generator for {type(layout).__name__}")
    return build(layout, dim, {"seed": seed, "device": device, "dtype": dtype, "keys": keys})


#: layout class → builder(layout, dim, common keyword arguments)
STREAMS = {
    ToeplitzInverseLayout: lambda L, dim, kw: ToeplitzInverseNoise(
        L.coeffs, dim, steps=L.steps, row_scale=L.row_scale, col_scale=L.col_scale, mode=L.mode, **kw
    ),
    BandedSqrtLayout: lambda L, dim, kw: BandedSqrtNoise(
        L.coeffs, dim, steps=L.steps, row_scale=L.row_scale, col_scale=L.col_scale, **kw
    ),
    BLTLayout: lambda L, dim, kw: BLTNoise(
        L.omega, L.theta, dim, steps=L.steps, row_scale=L.row_scale, col_scale=L.col_scale, **kw
    ),
    DenseInverseLayout: lambda L, dim, kw: DenseInverseNoise(L.matrix, dim, **kw),
}


def noise_for_factorization(
    factorization,
    dim: int,
    *,
    seed: int,
    device=None,
    dtype=torch.float32,
    mode: str | None = None,
    keys=None,
) -> CorrelatedNoise:
    """The cheapest streaming generator of (C⁻¹Z)_t for a ``Factorization``: the generator of
    its own ``noise_layout(mode)`` (BLT buffers for BLT strategies; a Toeplitz inverse with
    p(C⁻¹) coefficients for identity, BISR, banded-optimized, λCGD, buffered when banded and
    regenerated when full; the banded-square-root recursion for BSR; a dense inverse otherwise).

    Args:
        factorization: a ``dpmf.mechanisms.Factorization`` (n steps).
        dim: d, the number of noised coordinates.
        seed: the run's key (secret; ``dpmf.seeds``).
        device, dtype: of the produced noise (the model's).
        mode: ``"buffer"`` or ``"regenerate"`` for a Toeplitz-inverse generator; None picks
            buffer for a banded C⁻¹ (p < n) and regenerate for a full one.
        keys: None (one raw stream) or ``ChunkedKeys`` (raw noise keyed by parameter and
            chunk, for the owned parameters; ``dim`` = ``keys.dim``).

    Returns:
        a ``CorrelatedNoise`` covering n = ``factorization.n`` steps.

    Raises:
        TypeError: not a factorization (no ``noise_layout``).
        ValueError: unknown mode.
    """
    if not callable(getattr(factorization, "noise_layout", None)):
        raise TypeError(
            f"factorization={factorization!r} is invalid: must have C and C_inverse "
            "(a dpmf.mechanisms.Factorization)"
        )
    if mode is not None:
        check_choice("mode", mode, NOISE_MODES)
    return noise_stream(
        factorization.noise_layout(mode), dim, seed=seed, device=device, dtype=dtype, keys=keys
    )
