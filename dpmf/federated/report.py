"""Several replicas of a federated run and their files: per-round metrics, the privacy ledger
and a summary table (all written atomically, after every replica).

Replicas are numbered 0..k−1. By default each has its own secret key (``dpmf.seeds``) and the
files record ``seed: null``; with given seeds (``--seeds``) each replica is one seed,
reproducible, and its noise predictable to whoever knows the seed.

Files in ``out_dir``:

* ``metrics.csv`` — ``replica, round, test_accuracy, test_loss, train_loss`` (round 0: the
  initial model);
* ``ledger.json`` — the configuration, the compliance source, the participants and their σ_k,
  where the noise key came from (``noise_key``), what releasing all replicas' models costs
  (``composition``: k models are a k-fold composition), and every ε of every replica (with its
  ``seed``, null when secret) with its unit (``protects``), accountant, guarantee and the
  ``vacuous`` flag (ε > 10);
* ``summary.csv`` — one row per replica: its seed (empty when secret), final and round-1 test
  accuracy, and the ledger's largest ε with its unit.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dpmf._io import atomic_write_csv, atomic_write_json
from dpmf._validation import check_int
from dpmf.federated.ledger import format_entry

__all__ = ["parse_seeds", "run_seeds", "composition", "summarize", "mean_sd"]


#: the most seeds (runs) one experiment takes; a range is checked before it is expanded
MAX_SEEDS = 1000


def parse_seeds(text: str) -> list[int]:
    """``0-4`` → [0, 1, 2, 3, 4]; ``0,2,5`` → [0, 2, 5]; ``3`` → [3].

    Raises:
        ValueError: not a range or list of integers ≥ 0, a decreasing range, repeats, or more
            than ``MAX_SEEDS`` seeds.
    """
    t = str(text).strip()
    try:
        if "-" in t and "," not in t:
            a, b = (int(v) for v in t.split("-", 1))
            if a < 0 or b < a:
                raise ValueError
            if b - a + 1 > MAX_SEEDS:
                raise OverflowError(b - a + 1)
            seeds = list(range(a, b + 1))
        else:
            seeds = [int(v) for v in t.split(",")]  # an empty item (0,,2) is refused
    except OverflowError as count:
        raise ValueError(
            f"seeds={text!r} is invalid: {count} runs (one federated run per seed), allowed up to "
            f"{MAX_SEEDS}; give a shorter range"
        ) from None
    except ValueError:
        raise ValueError(
            f"seeds={text!r} is invalid: give a range A-B (A <= B) or a list like 0,1,2"
        ) from None
    if len(seeds) > MAX_SEEDS:
        raise ValueError(
            f"seeds={text!r} is invalid: {len(seeds)} runs, allowed up to {MAX_SEEDS}; give fewer seeds"
        )
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds={text!r} is invalid: seeds must be distinct integers >= 0")
    return seeds


def mean_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value)."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _eps(e) -> float | str:
    return "inf" if math.isinf(e.epsilon) else e.epsilon


def run_seeds(
    config, seeds=None, *, replicas: int = 1, out_dir: str, compliance=None, backend: str = "local", log=print
) -> list:
    """``run_federated`` for each replica, writing the three files after each one. Returns the
    ``FLResult`` list.

    Args:
        seeds: None (default): ``replicas`` replicas numbered 0..replicas−1, each with its own
            secret key (``dpmf.seeds``; ``seed: null`` in the files); a list of seeds: one
            replica per seed, reproducible, the noise predictable to whoever knows the seeds
            (``dpmf.seeds.NOTICE`` is logged once).
        replicas: the number of secret-key replicas (only without ``seeds``).

    Raises:
        ValueError: both seeds and more than one replica, or replicas < 1.
    """
    from dpmf.federated.run import run_federated

    replicas = check_int("replicas", replicas, minimum=1)
    if seeds is not None and replicas != 1:
        raise ValueError(
            f"replicas={replicas} is invalid with seeds: give either seeds (one replica per seed) or replicas"
        )
    runs = (
        [config.replace(seed=None, replica=i) for i in range(replicas)]
        if seeds is None
        else [config.replace(seed=s, replica=i) for i, s in enumerate(seeds)]
    )
    results = []
    for i, cfg in enumerate(runs):
        quiet = log if i == 0 else (lambda *_: None)  # the notices and the ledger once
        res = run_federated(cfg, compliance=compliance, backend=backend, log=quiet)
        results.append(res)
        os.makedirs(out_dir, exist_ok=True)  # after the first run: a refused run leaves no folder
        log(
            f"replica {i}: test accuracy {100 * res.final_accuracy:.2f} % "
            f"after {len(res.metrics) - 1} rounds "
            f"({res.seconds:.1f} s)" + (f"; {res.stopped}" if res.stopped else "")
        )
        _write(results, out_dir, compliance)
    return results


def composition(results) -> dict:
    """What releasing the models of all replicas costs: k models trained on the same data are a
    k-fold composition of the mechanism. Basic composition (Dwork & Roth, "The Algorithmic
    Foundations of Differential Privacy", Thm 3.16) bounds it by the sums of the replicas'
    largest ε and of their δ."""
    k = len(results)
    eps = sum(max(e.epsilon for e in r.ledger) for r in results)
    delta = sum(max(e.delta for e in r.ledger) for r in results)
    return {
        "models": k,
        "statement": (
            f"each ε above protects one model; releasing all {k} models (one per replica, trained on "
            f"the same data) composes their privacy: a {k}-fold composition, at most "
            f"ε = {eps:.6g}, δ = {delta:.3g} together (basic composition)"
            if k > 1
            else "one model: its ε is the whole release's"
        ),
        "epsilon_all_models": "inf" if math.isinf(eps) else eps,
        "delta_all_models": delta,
    }


def _write(results, out_dir: str, compliance) -> None:
    fed = results[0].config.eval_fraction > 0  # federated evaluation: two more columns
    extra = ("federated_accuracy", "federated_loss") if fed else ()
    rows = [
        (r.config.replica, m["round"], m["test_accuracy"], m["test_loss"], m["train_loss"],
         *(m.get(k, float("nan")) for k in extra))
        for r in results
        for m in r.metrics
    ]  # fmt: skip
    atomic_write_csv(
        os.path.join(out_dir, "metrics.csv"),
        ("replica", "round", "test_accuracy", "test_loss", "train_loss", *extra),
        rows,
    )
    first = results[0]
    secret = all(r.config.seed is None for r in results)
    atomic_write_json(
        os.path.join(out_dir, "ledger.json"),
        {
            "config": {k: v for k, v in first.config.to_dict().items() if k not in ("seed", "replica")},
            "compliance": "example" if compliance is None else compliance.source,
            "participants": first.participants,
            "noise_multipliers": first.sigmas,
            "data": first.data,
            "noise_key": (
                "secret: drawn from the operating system for each replica, never written"
                if secret
                else "given seeds: the noise is predictable to whoever knows them; every ε holds only "
                "against whoever does not"
            ),
            "composition": composition(results),
            "seeds": [
                {
                    "replica": r.config.replica,
                    "seed": r.config.seed,
                    "rounds_run": len(r.metrics) - 1,
                    "stopped": r.stopped or None,
                    "entries": [e.to_dict() for e in r.ledger],
                    "lines": [format_entry(e) for e in r.ledger],
                }
                for r in results
            ],
        },
    )
    srows = []
    for r in results:
        top = max(r.ledger, key=lambda e: e.epsilon)
        srows.append(
            (
                r.config.replica,
                "" if r.config.seed is None else r.config.seed,
                r.final_accuracy,
                r.metrics[1]["test_accuracy"] if len(r.metrics) > 1 else float("nan"),
                _eps(top),
                top.delta,
                top.protects,
                top.vacuous,
            )
        )
    atomic_write_csv(
        os.path.join(out_dir, "summary.csv"),
        (
            "replica",
            "seed",
            "final_accuracy",
            "round1_accuracy",
            "max_epsilon",
            "delta",
            "protects",
            "vacuous",
        ),
        srows,
    )


def summarize(results) -> str:
    """A short table: accuracy mean ± sd over seeds, and each distinct ε with its unit."""
    cfg = results[0].config
    m, s = mean_sd([r.final_accuracy for r in results])
    m1, s1 = mean_sd([r.metrics[1]["test_accuracy"] for r in results])
    lines = [
        f"{cfg.dataset}, {cfg.strategy}, privacy {cfg.privacy}, {len(results[0].participants)} of "
        f"{cfg.num_clients} clients training, {cfg.rounds} rounds, {len(results)} replica(s), "
        f"allocation {cfg.allocation}",
        f"  test accuracy after round {cfg.rounds}: {100 * m:.2f} ± {100 * s:.2f} %  (round 1: "
        f"{100 * m1:.2f} ± {100 * s1:.2f} %)",
    ]
    seen = set()
    for e in results[0].ledger:
        line = format_entry(e)
        if line not in seen:
            seen.add(line)
            lines.append("  " + line)
    return "\n".join(lines)
