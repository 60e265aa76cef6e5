"""One run, one key: a checkpoint resumes as the continuation of its run, or as a declared fork.

A run state holds the noise key. Two runs resumed from one state with the same key would add
the same noise, so the difference of their releases would be the noiseless difference of their
clipped sums. Hence:

* **Continuation** (``resume(path)``): the optimizer's hyperparameters of every parameter group
  (lr, momentum, betas, weight decay, …) and the data set (every example, ``dataset_digest``)
  must be those of the run that wrote the state; a change is refused at ``resume`` and, for a
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

import math
import uuid

from dpmf import seeds
from dpmf.train.checkpoint import save_checkpoint
from dpmf.train.state import hyperparameter_change, hyperparameters

__all__ = ["Lineage", "check_hyperparameters", "new_run_id"]


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
