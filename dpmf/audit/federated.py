"""Canary clients in ``dpmf fl``'s client mode: a one-run ε lower bound for client-level DP.

Client mode releases, each round r, the FedAvg mean of the K participants' clipped updates plus
one Gaussian vector: θ_r − θ_{r−1} = (Σ_k clip_ζ(Δ_k) + σ_c·ζ·sens·(C⁻¹Z)_r)/K
(``dpmf.federated.local.ClientLevelNoise``; every client in every round). A canary client j
is a client whose update is a fixed direction u_j of norm ζ (the clip norm: a worst-case
update the clipping lets through) in every round, "in" with probability ½. The "in" canaries'
updates join the sum of clipped updates before the noise, and the divisor stays the public K
(the canary clients join no other part of the run: no data, no training), so the release is
that of the same mechanism on K + |in| clients, whose ε (the ledger's client entry) does not
depend on the number of clients.

The auditor sees every round's global model: S_r = K·(θ_r − θ_{r−1}) is the noisy sum, y_rj =
⟨S_r, u_j⟩/ζ its projection, and score_j = ⟨P1, y_j⟩/√(1ᵀP1), P = CᵀC/(σ_cζ·sens)² (the
whitened sum of the projections over the R rounds; for independent noise the sum divided by
σ_c·ζ·√R). Only FedAvg releases the mean itself, so only ``strategy="fedavg"`` is audited.

The canaries are injected for the duration of ``audit_fl_clients`` by a subclass of
``ClientLevelNoise`` (its ``next`` adds the "in" canaries' sum to the round's noise vector,
which ``dpmf fl`` adds to the sum before dividing by K) and the rounds' models are read where
the server evaluates them; ``dpmf fl`` itself has no canary option.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

__all__ = ["audit_fl_clients"]


@contextlib.contextmanager
def _canary_hooks(state: dict):
    from dpmf.federated import local, run

    base = local.ClientLevelNoise

    class CanaryClientNoise(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            state["noise"] = self
            state["rounds"] = int(args[1])
            state["factorization"] = kwargs.get("factorization", "identity")
            dim, m = int(kwargs["dim"]), state["count"]
            g = np.random.default_rng(state["directions_seed"])
            u = g.standard_normal((m, dim))
            self.canaries = u / np.linalg.norm(u, axis=1, keepdims=True) * self.clip_norm
            self.canary_sum = self.canaries[state["included"]].sum(axis=0)

        def next(self):
            return super().next() + self.canary_sum

    evaluate = run._Server._evaluate

    def recording_evaluate(self, weights):
        state.setdefault("models", []).append(
            np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for v in weights.values()])
        )
        state["participants"] = len(self.idx)
        return evaluate(self, weights)

    local.ClientLevelNoise = CanaryClientNoise
    run._Server._evaluate = recording_evaluate
    try:
        yield
    finally:
        local.ClientLevelNoise = base
        run._Server._evaluate = evaluate


def audit_fl_clients(
    config,
    *,
    canaries: int = 1000,
    method: str = "one-run",
    significance: float = 0.05,
    compliance=None,
    data=None,
    log=print,
) -> dict:
    """Run ``dpmf fl`` in client mode with ``canaries`` canary clients and audit it.

    Args:
        config: a ``dpmf.federated.FLConfig`` with ``privacy="client"``, ``strategy="fedavg"``.
        canaries: m ≥ 10 canary clients (each "in" with probability ½).
        method, significance: the estimator (``dpmf.audit.runner.METHODS``) and α.
        compliance, data, log: as ``run_federated``.

    Returns:
        dict: ``claimed`` (the ledger's client ε, δ), ``epsilon_lower_bound``, ``tightness``,
        ``auroc``, ``scores`` (shape (m,)), ``included`` (shape (m,), boolean).

    Raises:
        ValueError: another privacy mode or strategy, canaries < 10, a bad method or
            significance (before any work).

    Source: Steinke, Nasr & Jagielski (NeurIPS 2023) §6, with client-level canaries as in
    Andrew et al., "One-shot Empirical Privacy Estimation for Federated Learning" (ICLR 2024).
    """
    from dpmf import seeds
    from dpmf.audit import estimators as E
    from dpmf.audit.runner import check_audit_args, estimate
    from dpmf.federated.run import FLConfig, run_federated
    from dpmf.mechanisms import factorize
    from dpmf.workloads import prefix_sum

    if not isinstance(config, FLConfig):
        raise TypeError(f"config={config!r} is invalid: must be a dpmf.federated.FLConfig")
    if config.privacy != "client":
        raise ValueError(f"privacy={config.privacy!r} is invalid for the canary-client audit: use client")
    if config.strategy != "fedavg":
        raise ValueError(
            f"strategy={config.strategy!r} is invalid for the canary-client audit: only fedavg releases "
            "the mean of the updates; use fedavg"
        )
    m, _, method, sig = check_audit_args(canaries, "white-box", method, significance)
    # the audit's own draws: from the given seed, else fresh (they are not the run's secret key)
    key = config.seed if config.seed is not None else seeds.SeedPolicy.of(None).key
    state = {
        "count": m,
        "included": np.random.default_rng(seeds.derive_int(key, "audit-included", bits=63)).random(m) < 0.5,
        "directions_seed": seeds.derive_int(key, "audit-directions", bits=63),
    }
    with _canary_hooks(state):
        result = run_federated(config, compliance=compliance, data=data, log=log)
    noise, K, R = state["noise"], state["participants"], state["rounds"]
    models = np.stack(state["models"])  # round 0 … R
    sums = K * np.diff(models, axis=0)  # (R, d): the noisy sums of clipped updates
    y = sums @ (noise.canaries / noise.clip_norm).T  # (R, m)
    spec = state["factorization"]
    C = factorize(prefix_sum(R), spec if spec != "identity" else "identity").C.dense()
    P = C.T @ C / noise.std_on_sum**2
    one = np.ones(R)
    Pw = P @ one
    scores = (Pw @ y) / math.sqrt(float(one @ Pw))
    inc = state["included"]
    ins, outs = scores[inc], scores[~inc]
    entry = next(e for e in result.ledger if e.mode == "client")
    claimed = float(entry.epsilon)
    eps_lb = estimate(method, ins, outs, delta=float(entry.delta), significance=sig)
    return {
        "claimed": {"epsilon": claimed, "delta": float(entry.delta)},
        "epsilon_lower_bound": eps_lb,
        "method": method,
        "significance": sig,
        "tightness": eps_lb / claimed if claimed > 0 else math.inf,
        "exceeds_claim": bool(eps_lb > claimed),
        "auroc": E.attack_auroc(ins, outs),
        "canaries": {"count": m, "kind": "client", "in": int(ins.size), "out": int(outs.size)},
        "scores": scores,
        "included": inc,
    }
