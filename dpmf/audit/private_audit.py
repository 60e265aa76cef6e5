"""White-box canaries in a ``make_private`` run (the user's own loop, one process or torchrun).

``audit_make_private(module, optimizer, dataset, canaries=m, **make_private_kwargs)`` calls
``dpmf.make_private`` on the data set plus m canary slots (indices N..N+m−1, so the plan —
sampler, sensitivity, accounting — is that of N + m examples and the claimed (ε, δ) is the
plan's, exactly as ``dpmf audit``), and turns the run's private step into one that injects the
white-box gradient canaries of ``dpmf.audit.canaries``: canary j is a direction u_j of norm ζ,
"in" with probability ½; at the steps the plan's sampler draws slot N + j, u_j is added to the
clipped sum if the canary is in, and nothing if it is out (the neighbouring data set without
it). The loop is the user's own and unchanged (``for x, y in run.private.data_loader: …``): the
loader yields the drawn batch including a placeholder row per drawn slot (a copy of a real
example, so the batch collates), the private step checks the batch as usual, removes the
placeholder rows before the per-example gradients, and adds the "in" canaries. The batch's
logged loss (``backward``'s return value) includes the placeholder rows; the privatized
gradient does not.

Over several processes (``process_group=``), every rank draws the same global batch; the
canaries are added once, to rank 0's local clipped sum before the reduction, so the global
clipped sum holds each "in" canary once whatever the world size and mode; the projection of
the released gradient on the canary directions is summed over the owners (sharded mode) or
read from the full gradient every rank holds (replicated, rank0).

The seeds follow ``dpmf audit``: the in/out draw and the directions derive from the run's key
(``dpmf.seeds``, purposes ``audit-included`` and ``audit-canaries``), never printed. With the same key,
configuration and initial weights, the ``dpmf audit`` run and this one are the same run.
"""

from __future__ import annotations

import math

import numpy as np
from torch.utils.data import Dataset

from dpmf._validation import check_int
from dpmf.audit.stage import CanaryStage

__all__ = ["CanaryAudit", "audit_make_private"]


class CanarySlots(Dataset):
    """``dataset`` followed by m canary slots: item N + j is a copy of item j mod N (a
    placeholder that collates with the real examples; the audited private step removes it)."""

    def __init__(self, dataset, count: int):
        self.dataset = dataset
        self.size = len(dataset)
        self.count = count

    def __len__(self) -> int:
        return self.size + self.count

    def __getitem__(self, i):
        i = int(i)
        return self.dataset[i if i < self.size else (i - self.size) % self.size]


class CanaryAudit:
    """A ``make_private`` run with white-box canaries (``audit_make_private``).

    Attributes:
        private: the ``PrivateTraining`` to train in the user's loop (``private.data_loader``,
            ``private.backward``, ``private.optimizer``).
        canaries: m.
        included: shape (m,), boolean: which canaries are "in" (secret until the run ends).
    """

    def __init__(self, private, canaries: int, included: np.ndarray, real_size: int):
        self.private = private
        self.canaries = canaries
        self.included = included
        self.real_size = real_size

    def scores(self) -> np.ndarray:
        """The canaries' scores, shape (m,) (higher ⇒ "in"): the scheme's likelihood ratio on
        the whitened projections, as ``dpmf audit`` (``dpmf.audit.mechanism.likelihood_scores``).

        Raises:
            RuntimeError: not every step of the plan was taken.
        """
        from dpmf.audit.mechanism import _possible_steps, likelihood_scores, precision_matrix

        pv, plan = self.private.privatizer.stage, self.private.plan
        if len(pv.projections) != plan.steps:
            raise RuntimeError(
                f"the audit needs the whole run: {len(pv.projections)} of {plan.steps} steps taken "
                "(run.data_loader yields one epoch per loop: loop over every epoch of the plan, "
                "for epoch in range(epochs): for x, y in run.data_loader: …)"
            )
        participation = np.zeros((plan.steps, self.real_size + self.canaries), dtype=bool)
        for t, slots in pv.canary_steps.items():
            participation[t, self.real_size + slots] = True
        possible = _possible_steps(plan, self.private.sampler, participation)[:, self.real_size :]
        P = precision_matrix(plan, plan.noise_std(self.private.clip_norm))
        return likelihood_scores(
            plan, self.private.sampler, np.stack(pv.projections), possible, self.private.clip_norm, P
        )

    def result(
        self, *, method: str = "one-run", significance: float = 0.05, delta: float | None = None
    ) -> dict:
        """The ε lower bound of the run (as ``dpmf audit``'s ``audit.json``, without the
        configuration).

        Args:
            method: one of ``dpmf.audit.runner.METHODS``.
            significance: α in (0, 0.5).
            delta: δ of the claim (default: make_private's ``target_delta``).

        Raises:
            ValueError: a bad method or significance, no δ.
        """
        from dpmf.audit import estimators as E
        from dpmf.audit.runner import VALID_IN_ONE_RUN, check_audit_args, estimate

        _, _, method, sig = check_audit_args(self.canaries, "white-box", method, significance)
        privacy = self.private.privacy(delta)
        scores = self.scores()
        ins, outs = scores[self.included], scores[~self.included]
        if ins.size == 0 or outs.size == 0:
            raise ValueError(
                f"canaries={self.canaries} is invalid: every canary fell on one side; use more canaries"
            )
        eps_lb = estimate(method, ins, outs, delta=privacy.delta, significance=sig)
        return {
            "claimed": {"epsilon": float(privacy.epsilon), "delta": float(privacy.delta)},
            "epsilon_lower_bound": eps_lb,
            "method": method,
            "significance": sig,
            "valid_for_one_run": method in VALID_IN_ONE_RUN,
            "tightness": eps_lb / privacy.epsilon if privacy.epsilon > 0 else math.inf,
            "exceeds_claim": bool(eps_lb > privacy.epsilon),
            "auroc": E.attack_auroc(ins, outs),
            "canaries": {
                "count": self.canaries,
                "kind": "white-box",
                "in": int(ins.size),
                "out": int(outs.size),
            },
        }


def audit_make_private(module, optimizer, dataset, *, canaries: int = 1000, **kwargs) -> CanaryAudit:
    """``dpmf.make_private`` with m white-box gradient canaries (see the module).

    Args:
        module, optimizer, dataset: as ``make_private`` (N examples).
        canaries: m ≥ 10 canary slots appended to the data set (the plan is for N + m).
        **kwargs: ``make_private``'s keyword arguments (``loss_fn``, ``batch_size``, …,
            ``process_group``); ``seed`` as there (None: a secret key).

    Returns:
        ``CanaryAudit``: train ``.private`` in the usual loop for all of the plan's steps, then
        ``.result()``.

    Raises:
        ValueError / TypeError: canaries < 10, and whatever ``make_private`` raises (before
            any work).

    Source: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
    2023), §6 (white-box gradient canaries).
    """
    from dpmf import seeds
    from dpmf.audit.canaries import gradient_canaries
    from dpmf.optim.clipping import trainable_parameters
    from dpmf.train.private import make_private

    m = check_int("canaries", canaries, minimum=10)
    try:
        N = len(dataset)
    except TypeError:
        raise TypeError(f"dataset={dataset!r} is invalid: must be a map-style Dataset with len()") from None
    if N < 1:
        raise ValueError("dataset is invalid: it is empty")
    private = make_private(module, optimizer, CanarySlots(dataset, m), **kwargs)
    key = private._seed
    included = seeds.generator(key, "audit-included").random(m) < 0.5
    params = [p for _, p in trainable_parameters(module)]
    dim = sum(p.numel() for p in params)
    directions = gradient_canaries(
        dim,
        m,
        private.clip_norm,
        seed=seeds.derive_int(key, "audit-canaries", bits=63),
        device=params[0].device,
        dtype=params[0].dtype,
    )
    pv = private.privatizer
    pv.set_stage(CanaryStage(pv, private.sampler, directions, included, N))
    return CanaryAudit(private, m, included, N)
