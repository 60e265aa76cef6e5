"""One run, one key: a checkpoint resumes as the continuation of its run, or as a declared fork.

A run state holds the noise key. Two runs resumed from one state with the same key would add
the same noise, so the difference of their releases would be the noiseless difference of their
clipped sums. Hence:

* **Continuation** (``resume(path)``): the optimizer's hyperparameters of every parameter group
  (lr, momentum, betas, weight decay, …), the loss (``loss_identity``: its type or function,
  settings and code) and the data set (every example, ``dataset_digest``) must be those of the
  run that wrote the state; a change is refused at ``resume`` and, for a
  hyperparameter set after ``resume``, at the first ``backward``. A continuation repeated from
  the same state (after a crash) is the same computation with the same noise: the same release.
* **Fork** (``resume(path, fork=True)``): the same data, any hyperparameters, and raw noise
  from a new key from the state's step on (``CorrelatedNoise.fork``: earlier raw noises are the
  run's, so each fork's noise is the strategy's). The state file counts its forks
  (``secret.children``). The k continuations of one state share its batches (the sampler keeps
  the run's key, as the scheme requires) and add independent noise to their own clipped sums
  after the fork: together they release no more than one run whose every step has k
  independent noises, i.e. one run at noise multiplier σ/√k (the k sums of an example's
  contributions stack to sensitivity √k·ζ against noise σ·ζ; Gaussian mechanism, Dwork & Roth
  2014, Thm A.1, with the same sampling). So every member of a family accounts at σ/√m, m the
  product over its fork points of the continuations known there (``siblings`` in the ledger),
  counting the plain continuation of each state as one of them.

What a ledger cannot know: forks made after it was written, and the run that saved a state and
went on in memory. Their releases compose with the family's; the last fork's ledger covers all
members known when it was made.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sys
import uuid

import torch

from dpmf import seeds
from dpmf.train.checkpoint import save_checkpoint
from dpmf.train.state import hyperparameter_change, hyperparameters

__all__ = ["Lineage", "check_hyperparameters", "check_loss", "loss_identity", "new_run_id"]

_PLAIN = (bool, int, float, str, type(None))


def _code_digest(code) -> str:
    """SHA-256 (16 hex digits) of a code object's instructions, names and constants (nested
    code included; not its line numbers, so a comment elsewhere does not change it)."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        h.update((_code_digest(c) if hasattr(c, "co_code") else repr(c)).encode())
    return h.hexdigest()[:16]


def _settings(obj) -> str:
    """The plain-valued attributes of an object, and a digest of its tensors (nn.Module state)."""
    values = vars(obj) if hasattr(obj, "__dict__") else {}
    plain = {
        k: v
        for k, v in sorted(values.items())
        if isinstance(v, _PLAIN) and not k.startswith("_") and k != "training"  # train()/eval()
    }
    state = getattr(obj, "state_dict", None)
    if callable(state):
        h = hashlib.sha256()
        for k, t in sorted(state().items()):
            h.update(k.encode())
            h.update(
                t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                if t.numel()
                else b""
            )
        plain["state"] = h.hexdigest()[:16]
    return repr(plain)


def _reachable(module, fn) -> bool:
    """Whether ``fn`` is its module's attribute at its qualified name (not a local or lambda)."""
    obj = module
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def loss_identity(loss_fn) -> str:
    """A description of ``loss_fn`` that is the same in every process for the same loss and
    differs for another: a dataclass loss (``dpmf.train.hf``) by its repr; a module-level
    function of an imported module (``F.cross_entropy``) by its qualified name; a script's
    function, a local function or a lambda by its name, code and closure values; a
    ``functools.partial`` by its function and arguments; any other callable
    (``nn.CrossEntropyLoss(label_smoothing=0.1)``) by its type, plain settings and tensors.
    (A resume with another loss would release the noiseless difference of the two runs'
    gradients.)"""
    if isinstance(loss_fn, functools.partial):
        keywords = sorted(loss_fn.keywords.items())
        return f"partial({loss_identity(loss_fn.func)}, {loss_fn.args!r}, {keywords!r})"
    code = getattr(loss_fn, "__code__", None)
    if code is not None:  # a function or lambda
        module = sys.modules.get(loss_fn.__module__)
        if module is not None and module.__name__ != "__main__" and _reachable(module, loss_fn):
            return f"{loss_fn.__module__}.{loss_fn.__qualname__}"  # a library's: by its name
        cells = [c.cell_contents for c in (loss_fn.__closure__ or ())]
        closure = [repr(v) if isinstance(v, _PLAIN) else loss_identity(v) for v in cells]
        return f"{loss_fn.__module__}.{loss_fn.__qualname__}#{_code_digest(code)}{closure or ''}"
    name = f"{type(loss_fn).__module__}.{type(loss_fn).__qualname__}"
    if dataclasses.is_dataclass(loss_fn):
        return f"{name}:{loss_fn!r}"
    if callable(getattr(loss_fn, "__func__", None)):  # a bound method
        return f"{name}:{loss_fn.__qualname__}"
    return f"{name}{_settings(loss_fn)}"


def check_loss(saved: str | None, loss_fn, where: str) -> None:
    """Refuse a continuation whose loss is not the one the run was saved with (a state of a
    version that recorded none is not compared).

    Raises:
        ValueError: another loss, with the way out (the run's loss, or ``fork=True``).
    """
    if saved is None or saved == loss_identity(loss_fn):
        return
    raise ValueError(
        f"{where} is invalid for a continuation: the loss changed (saved {saved!r}, here "
        f"{loss_identity(loss_fn)!r}); a resumed run reuses the run's noise key, so two continuations "
        "with other losses would release the noiseless difference of their gradients: resume with the "
        "run's loss_fn, or pass fork=True for new noise from here on"
    )


def new_run_id() -> str:
    """A public identifier of one run (random, 128 bits; no relation to the noise key)."""
    return uuid.uuid4().hex


def check_hyperparameters(saved_groups, groups, where: str) -> None:
    """Refuse a continuation whose optimizer hyperparameters are not those of ``saved_groups``.

    Raises:
        ValueError: one line naming the group, the hyperparameter, both values and the fix.
    """
    change = hyperparameter_change(hyperparameters(saved_groups), hyperparameters(groups))
    if change is not None:
        raise ValueError(
            f"{where} is invalid for a continuation: the optimizer's hyperparameters changed ({change}); "
            "a resumed run reuses the run's noise key, so two continuations with other hyperparameters "
            "would release the noiseless difference of their gradients: keep the run's hyperparameters, "
            "or resume(path, fork=True) for a fork with its own noise (its ε then composes with its "
            "siblings')"
        )


class Lineage:
    """A run's place in a family of forks: its run id, the forks of its noise and ``siblings``
    (m, the factor its accounting divides σ by √m for).

    Args:
        run_id: the run's public id.
        siblings: m ≥ 1.
    """

    def __init__(self, run_id: str | None = None, siblings: int = 1):
        self.run_id = run_id or new_run_id()
        self.siblings = int(siblings)

    def noise_multiplier(self, sigma: float) -> float:
        """σ/√m: the noise multiplier the family's releases are accounted at."""
        return sigma / math.sqrt(self.siblings)

    def ledger_entry(self) -> dict:
        """What the ledger says of the family (empty for a run that was never forked)."""
        if self.siblings == 1:
            return {}
        return {
            "siblings": self.siblings,
            "siblings_note": (
                f"ε covers releasing all {self.siblings} continuations known of this run's checkpoints "
                f"(one run at σ/√{self.siblings}); forks made later compose with it"
            ),
        }

    @staticmethod
    def of_state(state: dict) -> tuple[str | None, int, int]:
        """(run id, siblings, children) a run state records (an earlier version's: None, 1, 0)."""
        secret = state.get("secret") if isinstance(state.get("secret"), dict) else {}
        identity = state.get("run_identity") if isinstance(state.get("run_identity"), dict) else {}
        return identity.get("run_id"), int(secret.get("siblings", 1)), int(secret.get("children", 0))

    @classmethod
    def resumed(cls, state: dict, path: str, *, fork: bool) -> Lineage:
        """The lineage of a run resumed from ``state`` (read from ``path``). A fork counts
        itself in the file's ``children`` (the file is rewritten, atomically, 0600)."""
        run_id, siblings, children = cls.of_state(state)
        if fork:
            children += 1
            state["secret"]["children"] = children
            save_checkpoint(path, state)
            return cls(None, siblings * (children + 1))
        return cls(run_id, siblings * (children + 1))


def fork_key(base: int, given: int | None, forks) -> int:
    """The key of a fork's new raw noise: a fresh secret key, or the given seed when it is
    neither the run's key nor an earlier fork's.

    Raises:
        ValueError: a given seed equal to the run's or an earlier fork's key (never shown).
    """
    if given is None:
        return seeds.draw_key()
    if given == base or any(int(k) == given for _, k in forks):
        raise ValueError(
            "seed is invalid for a fork: it is the checkpoint's own noise key, so the fork would repeat "
            "its noise; give make_private another seed, or seed=None for a fresh secret key"
        )
    return given
