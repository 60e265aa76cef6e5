"""``dpmf audit``: one private training run with canaries → scores → an ε lower bound.

The run is that of ``dpmf train`` for the same configuration, on the data set plus m canary
pseudo-examples (indices N..N+m−1, so the plan — sampler, sensitivity, accounting — is that of
N + m examples, and the claimed (ε, δ) is the plan's). Each canary is "in" with probability ½.
White-box canaries are gradients added to the clipped sum (``dpmf.audit.canaries``); input
canaries are mislabeled copies of training examples. An "out" canary's slot is empty when it is
sampled (the neighbouring data set without it). The scores go to an estimator of
``dpmf.audit.estimators``; ``audit.json`` and ``audit.png`` are written atomically.

Methods: ``one-run`` and ``one-run-fdp`` are valid for the m canaries of one run (Steinke et al.
2023; Mahloujifar et al. 2024). ``gdp`` and ``clopper-pearson`` assume independent trials: with
the canaries of one run they are a heuristic (the canaries share the run), reported as such.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from dpmf._validation import check_choice, check_int, check_real

__all__ = ["KINDS", "METHODS", "run_audit"]

KINDS = ("white-box", "input")
METHODS = ("one-run", "one-run-fdp", "clopper-pearson", "gdp")
VALID_IN_ONE_RUN = ("one-run", "one-run-fdp")


def check_audit_args(canaries, kind, method, significance) -> tuple[int, str, str, float]:
    """Validate the audit's own arguments (before any work).

    Raises:
        ValueError: canaries < 10, an unknown kind or method, significance outside (0, 0.5).
    """
    m = check_int("canaries", canaries, minimum=10)
    kind = check_choice("canary", kind, KINDS)
    method = check_choice("method", method, METHODS)
    sig = check_real(
        "significance", significance, low=0.0, high=0.5, low_inclusive=False, high_inclusive=False
    )
    return m, kind, method, sig


OUTPUTS = ("audit.json", "audit.png")


def check_audit_out(out_dir: str, *, overwrite: bool) -> None:
    """Refuse, before any work, an ``out_dir`` that is a file (or lies under one) or that holds
    an earlier audit (``audit.json`` or ``audit.png``) unless ``overwrite``.

    Raises:
        ValueError: one line naming ``out_dir``, what it holds and the fix.
    """
    from dpmf._io import check_out_dir

    check_out_dir(out_dir, name="out_dir")
    if overwrite:
        return
    found = [n for n in OUTPUTS if os.path.exists(os.path.join(out_dir, n))]
    if found:
        raise ValueError(
            f"out_dir={out_dir!r} is invalid: it holds an earlier audit ({', '.join(found)}); pass "
            "--overwrite (overwrite=True) to replace it or choose another --out"
        )


def estimate(method: str, ins, outs, *, delta: float, significance: float) -> float:
    """ε̂ of ``method`` (one of ``METHODS``) on the scores."""
    from dpmf.audit import estimators as E

    fn = {
        "one-run": E.epsilon_one_run,
        "one-run-fdp": E.epsilon_one_run_fdp,
        "clopper-pearson": E.epsilon_clopper_pearson,
        "gdp": E.epsilon_from_gdp,
    }[method]
    return float(fn(ins, outs, delta=delta, significance=significance))


def run_audit(
    config,
    out_dir: str,
    *,
    canaries: int = 1000,
    kind: str = "white-box",
    method: str = "one-run",
    significance: float = 0.05,
    progress: bool = True,
    log=print,
    data=None,
    overwrite: bool = False,
) -> dict:
    """Train ``config`` once with ``canaries`` canaries and audit it.

    Args:
        config: a ``dpmf.train.TrainConfig`` (as for ``dpmf train``).
        out_dir: folder for ``audit.json`` and ``audit.png`` (created).
        canaries: m ≥ 10.
        kind: ``white-box`` (gradient canaries) or ``input`` (mislabeled examples).
        method: one of ``METHODS``.
        significance: α in (0, 0.5); the bound holds with confidence 1 − α.
        progress: a progress bar over the steps.
        log: where to print the summary.
        data: a ``dpmf.train.Dataset`` instead of loading ``config.dataset``.
        overwrite: replace an earlier audit's ``audit.json``/``audit.png`` in ``out_dir``
            (without it such a folder is refused before any work).

    Returns:
        The dict written to ``audit.json``.

    Raises:
        ValueError / TypeError: bad arguments (before any work), as ``dpmf train``; the DiSK
            filter (its look-ahead is not supported here); ``out_dir`` a file, or holding an
            earlier audit without ``overwrite``.
    """
    import torch.nn.functional as F

    from dpmf import seeds
    from dpmf._io import atomic_write_json
    from dpmf.audit import canaries as K
    from dpmf.audit.mechanism import _possible_steps, likelihood_scores, precision_matrix
    from dpmf.train.build import build_optimizer, resolve_device, sub_seed
    from dpmf.train.config import TrainConfig
    from dpmf.train.data import load_dataset
    from dpmf.train.models import build_model
    from dpmf.train.planning import plan_for

    m, kind, method, sig = check_audit_args(canaries, kind, method, significance)
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config={config!r} is invalid: must be a TrainConfig")
    if config.filter == "disk":
        raise ValueError(
            "filter='disk' is invalid for dpmf audit: its look-ahead is not supported; use none or doppler"
        )
    check_audit_out(out_dir, overwrite=overwrite)
    start = time.perf_counter()
    device = resolve_device(config.device)
    if data is None:
        data = load_dataset(config.dataset, config.data_dir)
    N = len(data)
    config, plan = plan_for(config, N + m, progress=False, log=log)
    policy = seeds.SeedPolicy.of(config.seed)  # a given seed: reproducible and predictable
    if policy.notice:
        log(policy.notice)
    seed = policy.key
    audit_rng = seeds.generator(seed, "audit-included")
    included = audit_rng.random(m) < 0.5

    model = build_model(config.model, data.input_shape, data.num_classes, seed=sub_seed(seed, 0)).to(device)
    optimizer = build_optimizer(config, model, log=log, seed=seed)
    # the step of dpmf train for the same key: sampler, noise and privatizer from the plan
    from dpmf.step import build as build_step

    step = build_step(plan, model, F.cross_entropy, config.execution_flags(), seed=policy)
    sampler, privatizer = step.sampler, step.privatizer
    stage, canary_inputs = _canaries(
        kind, privatizer, sampler, model, data, included, N, seed, config.clip_norm
    )
    step.bind(optimizer)
    desc = f"audit ({kind}, {m} canaries)" if progress else None
    participation = _train(data, model, optimizer, step, plan, N, included, canary_inputs, device, desc)

    if kind == "white-box":
        possible = _possible_steps(plan, sampler, participation)[:, N:]
        P = precision_matrix(plan, plan.noise_std(config.clip_norm))
        scores = likelihood_scores(plan, sampler, np.stack(stage.projections), possible, config.clip_norm, P)
    else:
        scores = -K.canary_losses(model, *canary_inputs)
    accuracy = _test_accuracy(model, data, device)
    result = _report(
        config, plan, scores, included, method, sig, kind, accuracy, time.perf_counter() - start, log
    )
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(os.path.join(out_dir, "audit.json"), result)
    ins, outs = scores[included], scores[~included]
    _figure(ins, outs, result, os.path.join(out_dir, "audit.png"))
    return result


def _test_accuracy(model, data, device) -> float:
    """The trained model's accuracy on (at most) the first 2048 test examples."""
    import torch

    with torch.no_grad():
        model.eval()
        logits = model(data.test_x[:2048].to(device))
        return float((logits.argmax(1).cpu() == data.test_y[:2048]).float().mean())


def _canaries(kind: str, privatizer, sampler, model, data, included, N: int, seed: int, clip_norm: float):
    """(the white-box ``CanaryStage`` set on ``privatizer``, None) or (None, the input canaries'
    (x, y)), m = ``included.shape[0]`` canaries drawn from the run's key."""
    from dpmf import seeds
    from dpmf.audit import canaries as K
    from dpmf.audit.stage import CanaryStage

    m = included.shape[0]
    canary_seed = seeds.derive_int(seed, "audit-canaries", bits=63)
    if kind != "white-box":
        return None, K.input_canaries(data.train_x, data.train_y, m, data.num_classes, seed=canary_seed)
    p0 = next(model.parameters())
    directions = K.gradient_canaries(
        K.param_dim(model), m, clip_norm, seed=canary_seed, device=p0.device, dtype=p0.dtype
    )
    # the loop hands the step its real examples only (no slot rows to remove)
    stage = CanaryStage(privatizer, sampler, directions, included, N, slots_in_batch=False)
    privatizer.set_stage(stage)
    return stage, None


def _train(data, model, optimizer, step, plan, N, included, input_canaries, device, desc):
    """The audited run: every step of ``plan`` (``DPStep.take``) on the batch its sampler drew
    (real examples, plus the "in" input canaries when ``input_canaries`` = (x, y) is given;
    white-box canaries are the privatizer's stage). Returns the participation, shape
    (steps, N + m), boolean."""
    import torch

    from dpmf.optim import LearningRateSchedule

    m = included.shape[0]
    chi = LearningRateSchedule(plan.schedule, plan.steps).multipliers
    base = [g["lr"] for g in optimizer.param_groups]
    participation = np.zeros((plan.steps, N + m), dtype=bool)
    steps = range(plan.steps)
    if desc is not None:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=desc, unit="step", leave=False)

    def rows(batch):  # the drawn batch over N + m slots → the real examples and "in" canaries
        participation[t, batch] = True
        real = batch[batch < N]
        canary = batch[batch >= N] - N
        canary_in = canary[included[canary]]
        x, y = data.train_x[torch.from_numpy(real)], data.train_y[torch.from_numpy(real)]
        ids = real
        if input_canaries is not None and canary_in.size:
            cx, cy = input_canaries
            x = torch.cat([x, cx[torch.from_numpy(canary_in)]])
            y = torch.cat([y, cy[torch.from_numpy(canary_in)]])
            ids = np.concatenate([real, N + canary_in])  # an "in" input canary is example N + j
        return x.to(device), y.to(device), ids

    for t in steps:  # as dpmf train: only the drawn batch, once
        for group, lr in zip(optimizer.param_groups, base, strict=True):
            group["lr"] = lr * float(chi[t])
        step.take(optimizer, rows)
    return participation


def _report(config, plan, scores, included, method, sig, kind, accuracy, seconds, log) -> dict:
    """``audit.json``'s dict from the canaries' scores (shape (m,)), logged in three lines.

    Raises:
        ValueError: every canary fell on one side (no bound can be estimated).
    """
    from dpmf.audit import estimators as E

    privacy, m = plan.privacy, included.shape[0]
    ins, outs = scores[included], scores[~included]
    if ins.size == 0 or outs.size == 0:
        raise ValueError(f"canaries={m} is invalid: every canary fell on one side; use more canaries")
    eps_lb = estimate(method, ins, outs, delta=config.delta, significance=sig)
    result = {
        "claimed": {
            "epsilon": float(privacy.epsilon),
            "delta": float(privacy.delta),
            "accountant": privacy.accountant,
            "guarantee": privacy.guarantee,
        },
        "epsilon_lower_bound": eps_lb,
        "method": method,
        "significance": sig,
        "confidence": 1 - sig,
        "valid_for_one_run": method in VALID_IN_ONE_RUN,
        "tightness": eps_lb / privacy.epsilon if privacy.epsilon > 0 else math.inf,
        "exceeds_claim": bool(eps_lb > privacy.epsilon),
        "auroc": E.attack_auroc(ins, outs),
        "tpr_at_fpr": {str(f): float(E.tpr_at_given_fpr(ins, outs, f)) for f in (0.01, 0.1)},
        "canaries": {"count": m, "kind": kind, "in": int(ins.size), "out": int(outs.size)},
        "threat_model": (
            "white box: the auditor sees every step's noisy gradient and scores its projection on "
            "each canary direction, whitened through the strategy"
            if kind == "white-box"
            else "black box: the auditor sees the final model and scores minus its loss on each "
            "mislabeled canary"
        ),
        "test_accuracy": accuracy,
        "seconds": seconds,
        "config": config.to_dict(),
        "plan": plan.to_dict(),
        "seed_given": config.seed is not None,
    }
    result["config"].pop("seed", None)  # the noise seed is secret
    heuristic = "" if method in VALID_IN_ONE_RUN else "; independent-trials heuristic"
    log(
        f"claimed: ε = {privacy.epsilon:.4g} at δ = {privacy.delta:g} "
        f"({privacy.accountant}, {privacy.guarantee})\n"
        f"audit: ε ≥ {eps_lb:.4g} with confidence {1 - sig:.3g} ({method}, {m} {kind} canaries: "
        f"{ins.size} in, {outs.size} out{heuristic})\n"
        f"AUROC = {result['auroc']:.4f}, lower bound / claimed = {result['tightness']:.3f}"
        + ("  ← the claim is VIOLATED" if result["exceeds_claim"] else "")
    )
    return result


def _figure(ins, outs, result, path) -> None:
    """In/out score histograms and the lower bound against the claimed ε."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from dpmf._io import atomic_savefig

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [2.2, 1]})
    bins = np.histogram_bin_edges(np.concatenate([ins, outs]), bins=40)
    a.hist(outs, bins=bins, alpha=0.6, label=f"out ({outs.size})", color="tab:blue")
    a.hist(ins, bins=bins, alpha=0.6, label=f"in ({ins.size})", color="tab:red")
    a.set_xlabel("canary score (higher ⇒ in)")
    a.set_ylabel("canaries")
    a.set_title(f"{result['canaries']['kind']} canaries, AUROC {result['auroc']:.3f}")
    a.legend()
    claimed, lb = result["claimed"]["epsilon"], result["epsilon_lower_bound"]
    b.bar([0, 1], [claimed, lb], color=["tab:gray", "tab:red" if lb > claimed else "tab:green"])
    b.set_xticks([0, 1], ["claimed ε", f"lower bound\n({result['method']})"])
    b.set_title(f"confidence {result['confidence']:.3g}")
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)
