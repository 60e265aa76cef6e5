"""The run's noise key: drawn, derived and compared in one place (numpy and the standard library).

Every random stream of a private run comes from one integer, the run's **key**:

* by default the key is ``KEY_BITS`` = 256 bits of the operating system's entropy
  (``secrets.token_bytes``), drawn once per run and never shown: it lives in memory and in the
  run's checkpoint (a private file), and a resumed run adopts the checkpoint's key;
* a user-given seed (any integer ≥ 0) is used as the key instead: the run is then
  reproducible, and its noise predictable to whoever knows the seed (``NOTICE`` says so).

``SeedPolicy`` holds which of the two a run uses. Streams never use the key directly: each
purpose (the raw noise of a step, parameter and chunk; the batch sampler; the model's initial
weights; public probes) gets a **subkey** by a keyed hash (``DERIVATION``):

    root   = BLAKE2b-256(key as minimal big-endian bytes, person = b"dpmf-root-v1")
    subkey = BLAKE2b-128(purpose ‖ 0x00 ‖ i₁ ‖ i₂ ‖ …, key = root, person = b"dpmf-kdf-v1")

with the indices iⱼ as 8-byte little-endian unsigned integers. A 128-bit subkey keys numpy's
``Philox`` counter-based generator (``generator``): Philox-4×64 with a 128-bit key, Salmon et
al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); BLAKE2 keyed hashing as a PRF,
Aumasson et al., RFC 7693. Subkeys of different purposes or indices are independent, and
every subkey depends on every bit of the key.

Keys are compared across processes or with a checkpoint by a salted digest (``key_digest``):
a fresh random salt per comparison, so that a digest reveals nothing reusable about the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dpmf._validation import check_int

__all__ = [
    "DERIVATION",
    "KEY_BITS",
    "KeyHolder",
    "NOTICE",
    "SeedPolicy",
    "check_seed",
    "child_key",
    "derive",
    "derive_int",
    "draw_key",
    "generator",
    "key_digest",
    "new_salt",
]

#: the version of the derivation below (part of every noise stream's fingerprint)
DERIVATION = "blake2b-philox/1"
#: bits of operating-system entropy in a drawn key
KEY_BITS = 256
#: the one-line notice of a run whose seed was given (every entry point prints this text)
NOTICE = (
    "notice: a seed was given: the noise is predictable to whoever knows it (no privacy against "
    "them); omit the seed for a secret key"
)

_ROOT_PERSON = b"dpmf-root-v1"
_KDF_PERSON = b"dpmf-kdf-v1"


def check_seed(seed, name: str = "seed") -> int | None:
    """``seed`` validated: None, or an integer ≥ 0 of any size (``check_int``'s rules).

    Raises:
        TypeError: not an integer.
        ValueError: negative or non-integral.

    The messages never show the value: a seed, even an invalid one, is meant to be secret.
    """
    if seed is None:
        return None
    try:
        return check_int(name, seed, minimum=0)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TypeError):
            got = f"a value of type {type(seed).__name__}"
        else:
            got = "a negative number" if seed < 0 else "a non-integral or non-finite number"
        raise type(exc)(
            f"{name} (value not shown: it is secret) is invalid: got {got}; must be an integer >= 0 "
            "(give a non-negative int, or None for a fresh secret key)"
        ) from None


def draw_key() -> int:
    """A fresh secret key: ``KEY_BITS`` bits from the operating system (``secrets``)."""
    return int.from_bytes(secrets.token_bytes(KEY_BITS // 8), "big")


@lru_cache(maxsize=64)
def _root(key: int) -> bytes:
    raw = key.to_bytes(max(1, (key.bit_length() + 7) // 8), "big")
    return hashlib.blake2b(raw, digest_size=32, person=_ROOT_PERSON).digest()


def derive(key: int, purpose: str, *indices: int, size: int = 16) -> bytes:
    """The subkey of ``purpose`` and ``indices`` (module docstring), ``size`` bytes (≤ 64).

    Args:
        key: the run's key, an integer ≥ 0.
        purpose: a short name (``"noise"``, ``"sampler"``, ``"model"``, …).
        indices: integers in [0, 2⁶⁴) (step, parameter, chunk, …).
    """
    msg = purpose.encode() + b"\x00" + b"".join(int(i).to_bytes(8, "little") for i in indices)
    return hashlib.blake2b(msg, digest_size=size, key=_root(int(key)), person=_KDF_PERSON).digest()


def derive_int(key: int, purpose: str, *indices: int, bits: int = 128) -> int:
    """``derive`` as an integer of ``bits`` bits (e.g. 63 for ``torch.manual_seed``)."""
    raw = derive(key, purpose, *indices, size=(bits + 7) // 8)
    return int.from_bytes(raw, "little") & ((1 << bits) - 1)


def child_key(key: int, purpose: str, *indices: int) -> int:
    """A 256-bit key of its own for one component of a run (e.g. one client's private run),
    from which that component derives its streams as a run does."""
    return derive_int(key, purpose, *indices, bits=256)


def generator(key: int, purpose: str, *indices: int) -> np.random.Generator:
    """A numpy ``Generator`` on ``Philox`` keyed by the 128-bit subkey ``derive(key, purpose,
    *indices)`` (counter 0)."""
    return np.random.Generator(np.random.Philox(key=derive_int(key, purpose, *indices)))


def new_salt() -> str:
    """A fresh random salt (32 hex digits) for ``key_digest``."""
    return secrets.token_hex(16)


def key_digest(key: int, salt: str) -> str:
    """A salted digest of ``key`` (32 hex digits): what processes or checkpoints compare,
    never the key. Equal keys give equal digests for the same salt."""
    return hmac.new(bytes.fromhex(salt), _root(int(key)), hashlib.sha256).hexdigest()[:32]


class KeyHolder:
    """Base of every object that holds a run's key (the seed policy, noise streams, samplers,
    privatizers, bound steps): pickling one is refused, since a pickle (``torch.save(obj)``,
    joblib caches, ``multiprocessing``) would write the key to a file with the umask's mode.
    A run's state goes to its checkpoint (0600) instead."""

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or deep-copied: it holds the run's secret noise key; "
            "save the run with its checkpoint (make_private's run.save(path), dpmf train's "
            "checkpoint.pt: private 0600 files) and build the step again from its plan"
        )


@dataclass(frozen=True, repr=False)
class SeedPolicy(KeyHolder):
    """Where a run's key comes from: secret (drawn, default) or a given seed.

    Build with ``SeedPolicy.of(seed)``; its ``repr`` never shows the key.

    Attributes:
        given: the user's seed, or None for a secret key.
        key: the key every stream derives from (the given seed, or a drawn one).
    """

    given: int | None
    key: int

    @classmethod
    def of(cls, seed: int | None, name: str = "seed") -> SeedPolicy:
        """The policy for ``seed`` (None: a fresh secret key of ``KEY_BITS`` bits).

        Raises:
            TypeError / ValueError: ``seed`` not None or an integer ≥ 0.
        """
        seed = check_seed(seed, name)
        return cls(None, draw_key()) if seed is None else cls(seed, seed)

    @classmethod
    def adopt(cls, key: int, given: bool) -> SeedPolicy:
        """The policy of a checkpoint's key (resuming adopts it)."""
        key = check_seed(key, "key")
        return cls(key if given else None, key)

    @property
    def is_secret(self) -> bool:
        """True when the key was drawn (no seed given)."""
        return self.given is None

    @property
    def notice(self) -> str | None:
        """``NOTICE`` for a given seed, None for a secret key."""
        return None if self.is_secret else NOTICE

    @property
    def public_seed(self) -> int | None:
        """What results may record: the given seed, or None."""
        return self.given

    def derive_int(self, purpose: str, *indices: int, bits: int = 63) -> int:
        """``derive_int(self.key, …)``."""
        return derive_int(self.key, purpose, *indices, bits=bits)

    def __repr__(self) -> str:
        return f"SeedPolicy({'secret' if self.is_secret else 'given'})"
