"""Canaries in ``dpmf fl``: canary clients in client mode, canary records in record mode,
canary aggregator records in aggregator mode.

``audit_fl_records`` (record mode): white-box canary records in the first participant's
private run (its data gets m canary slots; its private step is that of
``dpmf.audit.private_audit``), scored from every local step's noisy gradient against that
client's record-level ε.

``audit_fl_aggregator`` (aggregator mode): white-box canary records in the server's DP-SGD
over its aggregator dataset. The aggregator dataset gets m canary slots (records N..N+m−1, so
the server's plan, Poisson sampler at q = B/(N + m) and accounting — the ledger's aggregator
ε — are those of N + m records); its private step removes the slot rows and adds u_j (‖u_j‖ = ζ)
to the clipped sum at the steps slot j is drawn if canary j is "in" (``dpmf.audit.private_audit``'s
step). The auditor sees every server step's noisy gradient; the score is the Poisson likelihood
ratio Σ_t log(1 − q + q·e^{a_t}), a_t = ζ·y_t/s_t² − ζ²/(2s_t²), with y_t the release's
projection on u_j/ζ and s_t = σ_t·ζ the step's noise (σ_t varies with the participants'
compliance, ``dpmf.federated.local.AggregatorDPSGD``).

``audit_fl_clients`` (client mode), a one-run ε lower bound for client-level DP:

Client mode releases, each round r, the mean of the K participants' clipped updates plus one
Gaussian vector: m_r = θ_{r−1} + (Σ_k clip_ζ(Δ_k) + σ_c·ζ·sens·(C⁻¹Z)_r)/K
(``dpmf.federated.local.ClientLevelNoise``; every client in every round), which the strategy
turns into the next model: FedAvg and FedProx take θ_r = m_r, FedAdam and FedYogi apply their
server optimizer to m_r − θ_{r−1} (post-processing). A canary client j is a client whose update
is a fixed direction u_j of norm ζ (the clip norm: a worst-case update the clipping lets
through) in every round, "in" with probability ½. The "in" canaries' updates join the sum of
clipped updates before the noise, and the divisor stays the public K (the canary clients join
no other part of the run: no data, no training), so the release is that of the same mechanism
on K + |in| clients, whose ε (the ledger's client entry) does not depend on the number of
clients.

The auditor sees every round's noisy mean (white box: the mean of the privatized replies, each of
weight 1, which Flower's ``FedAvg.aggregate_train`` — called by FedProx, FedAdam and FedYogi for
their mean — computes; for FedAvg it is the released model itself): S_r = K·(m_r − θ_{r−1}) is the
noisy sum, y_rj = ⟨S_r, u_j⟩/ζ its projection, and score_j = ⟨P1, y_j⟩/√(1ᵀP1),
P = CᵀC/(σ_cζ·sens)² (the whitened sum of the projections over the R rounds; for independent
noise the sum divided by σ_c·ζ·√R). A median (FedMedian) is not a mean and is refused.

The canaries enter through the run's documented audit hooks (``run_federated(…, audit=…)``,
``dpmf.federated.hooks.AuditHooks``): client mode adds the "in" canaries' sum to each round's
sum of clipped updates before the division by K and reads the privatized replies, whose mean
is what the strategy aggregates; record and aggregator modes append canary slots to one private
run's data and give its privatizer the audited step's stage (``dpmf.audit.private_audit``).
``dpmf fl`` itself has no canary option, and nothing of the run is replaced.

Methods: ``one-run`` and ``one-run-fdp`` are valid for the m canaries of one run. ``gdp`` and
``clopper-pearson`` treat the canaries as independent trials (the canaries share the run): a
heuristic for one run, which detects a noise scale off by a factor 2 where the one-run bound,
capped by m, cannot (``tests/test_audit_doors.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpmf.federated.hooks import AuditHooks

__all__ = ["audit_fl_aggregator", "audit_fl_clients", "audit_fl_records"]


def _audit_result(scores, included, claimed, delta, method, sig, kind) -> dict:
    """The audit of one federated run from its canaries' ``scores`` (shape (m,)) and which were
    in (``included``): the lower bound by ``method`` against the ``claimed`` ε at ``delta``."""
    from dpmf.audit import estimators as E
    from dpmf.audit.runner import estimate

    ins, outs = scores[included], scores[~included]
    claimed, delta = float(claimed), float(delta)
    eps_lb = estimate(method, ins, outs, delta=delta, significance=sig)
    return {
        "claimed": {"epsilon": claimed, "delta": delta},
        "epsilon_lower_bound": eps_lb,
        "method": method,
        "significance": sig,
        "tightness": eps_lb / claimed if claimed > 0 else math.inf,
        "exceeds_claim": bool(eps_lb > claimed),
        "auroc": E.attack_auroc(ins, outs),
        "canaries": {"count": int(scores.size), "kind": kind, "in": int(ins.size), "out": int(outs.size)},
        "scores": scores,
        "included": included,
    }


def _with_canary_slots(x, y, m: int):
    """``x``, ``y`` with m placeholder rows appended: the canary slots N … N + m − 1 (the run's
    plan, sampler and accounting cover N + m records; the audited step replaces the slots)."""
    fill = np.arange(m) % int(y.shape[0])
    return np.concatenate([x, x[fill]]), np.concatenate([y, y[fill]])


def _instrument(privatizer, sampler, model, state: dict, n: int, *, orthonormal: bool) -> None:
    """Make ``privatizer`` the audited step of ``dpmf.audit.private_audit`` for
    ``state["count"]`` canary directions of norm ζ (orthonormal when ``orthonormal`` and m ≤ d:
    each canary's projection then holds no other canary) and record every batch ``sampler``
    draws (step → indices) for the scores."""
    from dpmf.audit.stage import CanaryStage

    params = [p for p in model.parameters() if p.requires_grad]
    m, dim = state["count"], sum(p.numel() for p in params)
    u = np.random.default_rng(state["directions_seed"]).standard_normal((m, dim))
    if orthonormal and m <= dim:
        u = np.linalg.qr(u.T)[0].T
    u = u / np.linalg.norm(u, axis=1, keepdims=True) * privatizer.clip_norm
    directions = torch.as_tensor(u, dtype=params[0].dtype)
    privatizer.set_stage(CanaryStage(privatizer, sampler, directions, state["included"], n))


class _CanaryClients(AuditHooks):
    """Canary clients: the "in" canaries' updates join each round's sum of clipped updates,
    and each round's noisy sum is recorded from the privatized replies (weight 1 each, so the
    strategy's mean is theirs)."""

    def __init__(self, state: dict):
        self.state = state

    def client_noise(self, noise):
        state = self.state
        state["noise"], state["rounds"] = noise, noise.rounds
        state["factorization"] = noise.factorization
        dim, m = noise.noise.dim, state["count"]
        u = np.random.default_rng(state["directions_seed"]).standard_normal((m, dim))
        if m <= dim:  # orthonormal: each canary's projection holds no other canary
            u = np.linalg.qr(u.T)[0].T
        state["canaries"] = u / np.linalg.norm(u, axis=1, keepdims=True) * noise.clip_norm
        state["canary_sum"] = state["canaries"][state["included"]].sum(axis=0)

    def client_updates(self, server_round):
        return self.state.get("canary_sum")

    def client_round(self, server_round, arrays, replies):
        base = _flat(arrays)  # θ_{r−1}, the global model sent this round
        mean = np.mean([_flat(next(iter(m.content.array_records.values()))) for m in replies], axis=0)
        self.state.setdefault("sums", []).append(len(replies) * (mean - base))


def _flat(arrays) -> np.ndarray:
    """A Flower ``ArrayRecord``'s arrays as one float64 vector (in the record's order)."""
    return np.concatenate([np.asarray(a.numpy(), dtype=np.float64).reshape(-1) for a in arrays.values()])


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
        config: a ``dpmf.federated.FLConfig`` with ``privacy="client"``, a strategy whose
            aggregate is a mean (fedavg, fedprox, fedadam, fedyogi) and every client in every
            round (``client_sampling="all"``).
        canaries: m ≥ 10 canary clients (each "in" with probability ½).
        method, significance: the estimator (``dpmf.audit.runner.METHODS``) and α.
        compliance, data, log: as ``run_federated``.

    Returns:
        dict: ``claimed`` (the ledger's client ε, δ), ``epsilon_lower_bound``, ``tightness``,
        ``auroc``, ``scores`` (shape (m,)), ``included`` (shape (m,), boolean).

    Raises:
        ValueError: another privacy mode, a median strategy, client sampling, canaries < 10, a
            bad method or significance (before any work).

    Source: Steinke, Nasr & Jagielski (NeurIPS 2023) §6, with client-level canaries as in
    Andrew et al., "One-shot Empirical Privacy Estimation for Federated Learning" (ICLR 2024).
    """
    from dpmf import seeds
    from dpmf.audit.runner import check_audit_args
    from dpmf.federated.run import FLConfig, run_federated
    from dpmf.mechanisms import factorize
    from dpmf.workloads import prefix_sum

    if not isinstance(config, FLConfig):
        raise TypeError(f"config={config!r} is invalid: must be a dpmf.federated.FLConfig")
    if config.privacy != "client":
        raise ValueError(f"privacy={config.privacy!r} is invalid for the canary-client audit: use client")
    from dpmf.federated.strategies import MEAN_STRATEGIES

    if config.strategy not in MEAN_STRATEGIES:
        raise ValueError(
            f"strategy={config.strategy!r} is invalid for the canary-client audit: its aggregate is not "
            f"a mean of the updates; use one of {', '.join(MEAN_STRATEGIES)}"
        )
    if config.client_sampling != "all":
        raise ValueError(
            f"client_sampling={config.client_sampling!r} is invalid for the canary-client audit: it "
            "audits every client in every round; use all"
        )
    m, _, method, sig = check_audit_args(canaries, "white-box", method, significance)
    # the audit's own draws: from the given seed, else fresh (they are not the run's secret key)
    key = config.seed if config.seed is not None else seeds.SeedPolicy.of(None).key
    state = {
        "count": m,
        "included": seeds.generator(key, "audit-included").random(m) < 0.5,
        "directions_seed": seeds.derive_int(key, "audit-canaries", bits=63),
    }
    result = run_federated(config, compliance=compliance, data=data, log=log, audit=_CanaryClients(state))
    if "noise" not in state or not state.get("sums"):
        raise RuntimeError(
            "the run built no client-level noise or aggregated no round: the audit could not inject "
            "or read its canaries"
        )
    noise, R = state["noise"], state["rounds"]
    sums = np.stack(state["sums"])  # (R, d): the noisy sums of clipped updates
    if sums.shape[0] != R:
        raise RuntimeError(f"the audit saw {sums.shape[0]} aggregates of {R} rounds: it cannot score them")
    y = sums @ (state["canaries"] / noise.clip_norm).T  # (R, m)
    spec = state["factorization"]
    C = factorize(prefix_sum(R), spec if spec != "identity" else "identity").C.dense()
    P = C.T @ C / noise.std_on_sum**2
    one = np.ones(R)
    Pw = P @ one
    scores = (Pw @ y) / math.sqrt(float(one @ Pw))
    entry = next(e for e in result.ledger if e.mode == "client")
    return _audit_result(scores, state["included"], entry.epsilon, entry.delta, method, sig, "client")


class _CanaryRecords(AuditHooks):
    """Canary records in one private run (``role``: the first participant's, or the server's
    aggregator dataset): m slots appended to its data, the audited step's stage on its privatizer."""

    def __init__(self, state: dict, role: str, orthonormal: bool):
        self.state, self.role, self.orthonormal = state, role, orthonormal

    def private_records(self, role, j, x, y):
        if role != self.role or j != 0:
            return x, y
        self.state["real"] = int(y.shape[0])
        return _with_canary_slots(x, y, self.state["count"])

    def private_run(self, role, j, run):
        if role != self.role or j != 0:
            return
        state = self.state
        state["run"] = run
        privatizer = run.step.privatizer if role == "aggregator" else run.privatizer
        _instrument(privatizer, run.sampler, run.model, state, state["real"], orthonormal=self.orthonormal)


def audit_fl_records(
    config,
    *,
    canaries: int = 1000,
    method: str = "one-run",
    significance: float = 0.05,
    compliance=None,
    data=None,
    log=print,
) -> dict:
    """Run ``dpmf fl`` in record mode with ``canaries`` white-box canary records in the first
    participant's private run, and audit that client's record-level ε.

    The client's data gets m canary slots (its run, sampler and accounting are over N_k + m
    records; the claimed ε is that run's); its private step removes the slot rows and adds the
    "in" canaries (``dpmf.audit.private_audit``'s step); the auditor sees every local step's
    noisy gradient (white box; the updates the client sends are post-processing of them).
    Scored by the scheme's likelihood ratio as ``dpmf audit``.

    Returns:
        dict: ``claimed``, ``epsilon_lower_bound``, ``tightness``, ``auroc``, ``scores``,
        ``included``.

    Raises:
        ValueError: another privacy mode, canaries < 10, a bad method or significance (before
            any work).
    """
    from dpmf import seeds
    from dpmf.audit.mechanism import _possible_steps, likelihood_scores, precision_matrix
    from dpmf.audit.runner import check_audit_args
    from dpmf.federated.run import FLConfig, run_federated

    if not isinstance(config, FLConfig):
        raise TypeError(f"config={config!r} is invalid: must be a dpmf.federated.FLConfig")
    if config.privacy != "record":
        raise ValueError(f"privacy={config.privacy!r} is invalid for the canary-record audit: use record")
    m, _, method, sig = check_audit_args(canaries, "white-box", method, significance)
    key = config.seed if config.seed is not None else seeds.SeedPolicy.of(None).key
    state = {
        "count": m,
        "included": seeds.generator(key, "audit-included").random(m) < 0.5,
        "directions_seed": seeds.derive_int(key, "audit-canaries", bits=63),
    }
    hooks = _CanaryRecords(state, "record", orthonormal=False)
    run_federated(config, compliance=compliance, data=data, log=log, audit=hooks)
    run, n = state["run"], state["real"]
    pv = run.privatizer
    stage = pv.stage
    steps = len(stage.projections)
    total = n + m
    plan = pv.plan.replace(steps=steps, noise_multiplier=pv.noise_multiplier)  # N + m examples
    if plan.dataset_size != total:
        raise RuntimeError("the record run's plan does not cover its canary slots: the audit cannot score it")
    if abs(plan.sensitivity - pv.sensitivity) > 1e-9 * pv.sensitivity:
        raise RuntimeError("the record run's sensitivity is not its plan's: the audit cannot score it")
    participation = np.zeros((steps, total), dtype=bool)
    for t, slots in stage.canary_steps.items():
        participation[t, n + slots] = True
    possible = _possible_steps(plan, run.sampler, participation)[:, n:]
    P = precision_matrix(plan, plan.noise_std(pv.clip_norm))
    scores = likelihood_scores(plan, run.sampler, np.stack(stage.projections), possible, pv.clip_norm, P)
    return _audit_result(scores, state["included"], run.privacy.epsilon, config.delta, method, sig, "record")


def audit_fl_aggregator(
    config,
    *,
    canaries: int = 1000,
    method: str = "one-run",
    significance: float = 0.05,
    compliance=None,
    data=None,
    log=print,
) -> dict:
    """Run ``dpmf fl`` in aggregator mode with ``canaries`` white-box canary records in the
    server's DP-SGD over its aggregator dataset, and audit the aggregator ε (see the module).

    Args:
        config: a ``dpmf.federated.FLConfig`` with ``privacy="aggregator"`` and server noise.
        canaries: m ≥ 10 canary records (each "in" with probability ½).
        method, significance: the estimator (``dpmf.audit.runner.METHODS``) and α.
        compliance, data, log: as ``run_federated``.

    Returns:
        dict: ``claimed`` (the ledger's aggregator ε, δ), ``epsilon_lower_bound``,
        ``tightness``, ``auroc``, ``scores`` (shape (m,)), ``included`` (shape (m,), boolean).

    Raises:
        ValueError: another privacy mode, ``server_noise=False`` (ε = ∞: nothing to audit),
            canaries < 10, a bad method or significance (before any work).

    Source: Steinke, Nasr & Jagielski (NeurIPS 2023) §6 (white-box gradient canaries).
    """
    from dpmf import seeds
    from dpmf.audit.mechanism import likelihood_scores
    from dpmf.audit.runner import check_audit_args
    from dpmf.federated.run import FLConfig, run_federated
    from dpmf.plan.schemes import Poisson

    if not isinstance(config, FLConfig):
        raise TypeError(f"config={config!r} is invalid: must be a dpmf.federated.FLConfig")
    if config.privacy != "aggregator":
        raise ValueError(
            f"privacy={config.privacy!r} is invalid for the canary-aggregator audit: use aggregator"
        )
    if not config.server_noise:
        raise ValueError(
            "server_noise=False is invalid for the canary-aggregator audit: the run claims no privacy "
            "(ε = ∞); use server_noise=True"
        )
    m, _, method, sig = check_audit_args(canaries, "white-box", method, significance)
    key = config.seed if config.seed is not None else seeds.SeedPolicy.of(None).key
    state = {
        "count": m,
        "included": seeds.generator(key, "audit-included").random(m) < 0.5,
        "directions_seed": seeds.derive_int(key, "audit-canaries", bits=63),
    }
    hooks = _CanaryRecords(state, "aggregator", orthonormal=True)
    result = run_federated(config, compliance=compliance, data=data, log=log, audit=hooks)
    if "run" not in state:
        raise RuntimeError("the run built no aggregator DP-SGD: the audit could not inject its canaries")
    dp, n = state["run"], state["real"]
    pv = dp.step.privatizer
    plan = pv.plan
    steps = len(pv.stage.projections)
    if plan.dataset_size != n + m or not isinstance(plan.scheme, Poisson) or steps > plan.steps:
        raise RuntimeError("the aggregator's plan is not Poisson DP-SGD over its canary slots: unscorable")
    if not np.allclose(plan.strategy.C.dense(), np.eye(plan.steps)):
        raise RuntimeError("the aggregator's noise is correlated: the audit scores independent noise only")
    std = np.array([plan.noise_multiplier_at(t) for t in range(steps)]) * pv.clip_norm * plan.sensitivity
    P = np.diag(1.0 / std**2)
    possible = np.ones((steps, m), dtype=bool)  # Poisson: the batches are secret
    # the auditor knows the other records (white box): their clipped sum's projection is
    # subtracted, leaving the canaries' contributions and the noise
    residual = np.stack(pv.stage.projections) - np.stack(pv.stage.known_projections)
    scores = likelihood_scores(plan, dp.sampler, residual, possible, pv.clip_norm, P)
    entry = next(e for e in result.ledger if e.mode == "aggregator")
    return _audit_result(scores, state["included"], entry.epsilon, entry.delta, method, sig, "aggregator")
