"""Raw Gaussian noise z ~ N(0, I) keyed by a 128-bit subkey, drawn where the parameters live.

A correlated-noise stream (``dpmf.optim.noise``) needs, for each step t (and, with keys by
coordinate, each chunk of each parameter), fresh standard normals that are a function of the
subkey ``dpmf.seeds.derive(key, "noise", t, …)`` alone, so that any z can be regenerated and a
checkpoint holds no random state. A generator here turns one subkey into one block of normals:

=====================  ===========================================  =========================
generator              state set from the 128-bit subkey            where the numbers are made
=====================  ===========================================  =========================
``torch-mt19937``      torch's CPU Mersenne Twister, its 624        on the CPU, by
                       words = the first 2,496 bytes of numpy's     ``torch.randn``
                       Philox-4×64 keyed by the subkey
``torch-philox-cuda``  torch's CUDA Philox-4×32-10: seed = the      on the GPU, by
                       subkey's low 64 bits, offset = its high 64   ``torch.randn``
                       bits rounded down to a multiple of 4
``numpy-philox``       numpy's Philox-4×64 keyed by the subkey      on the CPU, by numpy,
                       (its ``standard_normal``)                    then copied to the device
=====================  ===========================================  =========================

``device_generator(device)`` is the default: the first on a CPU, the second on a CUDA device
(no noise crosses from host to device), the third elsewhere. ``numpy-philox`` is the generator
of earlier dpmf versions: their checkpoints name none and resume with it. Security: each
subkey is a keyed BLAKE2b output of the run's secret 256-bit key (``dpmf.seeds``), so the
blocks are independent pseudo-random streams; a generator's internal state is never derived
from another block's, so recovering one block's numbers (e.g. by an adversary who knows every
gradient of that step) says nothing about any other block. The CUDA generator holds 126 of the
subkey's 128 bits (torch's Philox offset is a multiple of 4); the CPU twister's 19,968-bit
state is expanded from all 128.

Reproducibility: a block's numbers are a function of (subkey, block length, generator). The
three generators give different numbers, so a checkpoint records its generator and a resume
that cannot run it is refused (``generator_named``). torch's CUDA kernel lays its threads out by
the device's multiprocessor count, so the CUDA generator's name carries that count: a resume on
a GPU with another count is refused too. On a CPU ``torch.randn``'s Box–Muller transform may
round differently with another vector instruction set (the last bit of a float).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from dpmf import seeds
from dpmf.optim.choices import NOISE_GENERATORS

__all__ = ["RawGenerator", "device_generator", "generator_named", "subkey"]

_MASK64 = (1 << 64) - 1
_MT_WORDS = 624
# torch's CPUGeneratorImplStateLegacy: u64 initial seed, i32 left, i32 seeded, u64 next, then
# the 624 twister words, each in a u64 (checked once by _twister_layout).
_MT_AT = 24


class _Rekeyed:
    """One numpy ``Philox`` generator whose state is set to (subkey, counter 0, empty buffer)
    for each draw: the numbers of ``dpmf.seeds.generator`` on that subkey, without building a
    bit generator per draw (numpy seeds a new ``Philox`` from the operating system's entropy
    before the key replaces it: about 10 µs each)."""

    __slots__ = ("bits", "gen")

    _ZEROS = np.zeros(4, dtype=np.uint64)  # counter and buffer (the state setter copies them)

    def __init__(self):
        self.bits = np.random.Philox(key=0)
        self.gen = np.random.Generator(self.bits)

    def __call__(self, subkey: int) -> np.random.Generator:
        self.bits.state = {
            "bit_generator": "Philox",
            "state": {
                "counter": self._ZEROS,
                "key": np.array([subkey & _MASK64, subkey >> 64], dtype=np.uint64),
            },
            "buffer": self._ZEROS,
            "buffer_pos": 4,
            "has_uint32": 0,
            "uinteger": 0,
        }
        return self.gen


class RawGenerator:
    """Fills a tensor with standard normals that are a function of a 128-bit subkey only.

    ``fill(out, subkey)``: ``out`` a contiguous 1-D float32/float64 tensor on the generator's
    device, overwritten in place. ``name`` identifies the numbers (what a checkpoint records).
    """

    name = ""

    def fill(self, out: torch.Tensor, subkey: int) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class NumpyPhilox(RawGenerator):
    """numpy's Philox-4×64 ``standard_normal``, copied to ``out``'s device."""

    name = "numpy-philox"

    def __init__(self):
        self._keyed = _Rekeyed()

    def fill(self, out, subkey):
        np_dtype = np.float32 if out.dtype == torch.float32 else np.float64
        if out.device.type == "cpu":
            self._keyed(subkey).standard_normal(out=out.numpy(), dtype=np_dtype)
            return
        host = np.empty(out.numel(), dtype=np_dtype)
        self._keyed(subkey).standard_normal(out=host, dtype=np_dtype)
        out.copy_(torch.from_numpy(host))


@lru_cache(maxsize=1)
def _twister_template() -> np.ndarray:
    """A CPU generator state (bytes) after ``manual_seed(5489)``, checked against the
    twister's own initialisation: the layout the words are written into."""
    g = torch.Generator()
    g.manual_seed(5489)
    state = g.get_state().numpy().copy()
    mt = [5489]
    for i in range(1, _MT_WORDS):
        prev = mt[-1]
        mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    words = state[_MT_AT : _MT_AT + 8 * _MT_WORDS].view(np.uint64)
    if state.shape[0] < _MT_AT + 8 * _MT_WORDS or not np.array_equal(words, np.array(mt, dtype=np.uint64)):
        raise RuntimeError(
            f"torch {torch.__version__}'s CPU generator state has an unknown layout: draw the noise "
            "with noise_generator='numpy-philox' (dpmf.step.ExecutionFlags)"
        )
    return state


class TorchTwister(RawGenerator):
    """torch's CPU Mersenne Twister, its whole state set from the subkey, then ``torch.randn``."""

    name = "torch-mt19937"

    def __init__(self):
        self._state = _twister_template().copy()
        self._words = self._state[_MT_AT : _MT_AT + 8 * _MT_WORDS].view(np.uint64)
        self._keyed = _Rekeyed()
        self._gen = torch.Generator()

    def fill(self, out, subkey):
        raw = self._keyed(subkey).bit_generator.random_raw(_MT_WORDS // 2)  # 312 × 64 bits
        self._words[0::2] = raw & np.uint64(0xFFFFFFFF)
        self._words[1::2] = raw >> np.uint64(32)
        self._gen.set_state(torch.from_numpy(self._state))  # left = 1: a twist before the first number
        torch.randn(out.shape, generator=self._gen, dtype=out.dtype, out=out)


class TorchCudaPhilox(RawGenerator):
    """torch's CUDA Philox-4×32-10 with seed and offset from the subkey, then ``torch.randn``."""

    def __init__(self, device):
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        self.device = torch.device("cuda", index)
        sm = torch.cuda.get_device_properties(index).multi_processor_count
        self.name = f"torch-philox-cuda-{sm}sm"
        self._gen = torch.Generator(device=self.device)

    def fill(self, out, subkey):
        self._gen.manual_seed(subkey & _MASK64)
        self._gen.set_offset((subkey >> 64) & ~3)
        torch.randn(out.shape, generator=self._gen, dtype=out.dtype, device=out.device, out=out)


def device_generator(device) -> RawGenerator:
    """The default generator of noise on ``device``: ``torch-mt19937`` on a CPU,
    ``torch-philox-cuda`` on a CUDA device, ``numpy-philox`` elsewhere."""
    device = torch.device(device)
    if device.type == "cpu":
        return TorchTwister()
    if device.type == "cuda":
        return TorchCudaPhilox(device)
    return NumpyPhilox()


def generator_named(name: str, device) -> RawGenerator:
    """The generator ``name`` (a family of ``NOISE_GENERATORS`` or a recorded name) for noise on
    ``device``.

    Raises:
        ValueError: an unknown name, or a generator that cannot make the same numbers on
            ``device`` (a CUDA generator off CUDA or on a GPU with another multiprocessor
            count, the CPU twister off the CPU).
    """
    device = torch.device(device)
    if name == "device":
        return device_generator(device)
    if name == "numpy-philox":
        return NumpyPhilox()
    if name == "torch-mt19937":
        if device.type != "cpu":
            raise ValueError(
                f"noise_generator={name!r} is invalid on {device}: its numbers are made on the CPU; "
                "resume on the CPU (--device cpu), or start the run again on this device"
            )
        return TorchTwister()
    if name.startswith("torch-philox-cuda"):
        if device.type != "cuda":
            raise ValueError(
                f"noise_generator={name!r} is invalid on {device}: its numbers are made by torch's "
                "CUDA generator; resume on a CUDA device, or start the run again on this device"
            )
        here = TorchCudaPhilox(device)
        if name not in ("torch-philox-cuda", here.name):
            raise ValueError(
                f"noise_generator={name!r} is invalid on {device} ({here.name}): torch's CUDA noise "
                "depends on the multiprocessor count; resume on a GPU of the saved kind, or start again"
            )
        return here
    raise ValueError(f"noise_generator={name!r} is invalid: must be one of {', '.join(NOISE_GENERATORS)}")


def subkey(key: int, step: int, *index: int) -> int:
    """The 128-bit subkey of raw noise z_step (``index`` = (parameter, chunk) with keys by
    coordinate): ``dpmf.seeds.derive_int(key, "noise", step, *index)``."""
    return seeds.derive_int(key, "noise", int(step), *(int(i) for i in index))
