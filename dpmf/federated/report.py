"""Several seeds of a federated run and their files: per-round metrics, the privacy ledger and a
summary table (all written atomically, after every seed).

Files in ``out_dir``:

* ``metrics.csv`` — ``seed, round, test_accuracy, test_loss, train_loss`` (round 0: the initial
  model);
* ``ledger.json`` — the configuration, the compliance source, the participants and their σ_k,
  and every ε of every seed with its unit (``protects``), accountant, guarantee and the
  ``vacuous`` flag (ε > 10);
* ``summary.csv`` — one row per seed: final and round-1 test accuracy, and the ledger's largest
  ε with its unit.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dpmf._io import atomic_write_csv, atomic_write_json
from dpmf.federated.ledger import format_entry

__all__ = ["parse_seeds", "run_seeds", "summarize", "mean_sd"]


def parse_seeds(text: str) -> list[int]:
    """``0-4`` → [0, 1, 2, 3, 4]; ``0,2,5`` → [0, 2, 5]; ``3`` → [3].

    Raises:
        ValueError: not a range or list of integers ≥ 0, a decreasing range, or repeats.
    """
    t = str(text).strip()
    try:
        if "-" in t and "," not in t:
            a, b = (int(v) for v in t.split("-", 1))
            if a < 0 or b < a:
                raise ValueError
            seeds = list(range(a, b + 1))
        else:
            seeds = [int(v) for v in t.split(",")]  # an empty item (0,,2) is refused
    except ValueError:
        raise ValueError(
            f"seeds={text!r} is invalid: give a range A-B (A <= B) or a list like 0,1,2"
        ) from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds={text!r} is invalid: seeds must be distinct integers >= 0")
    return seeds


def mean_sd(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value)."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _eps(e) -> float | str:
    return "inf" if math.isinf(e.epsilon) else e.epsilon


def run_seeds(config, seeds, *, out_dir: str, compliance=None, backend: str = "local", log=print) -> list:
    """``run_federated`` for each seed (config.seed replaced), writing the three files after
    each seed. Returns the ``FLResult`` list."""
    from dpmf.federated.run import run_federated

    results = []
    # out_dir is created by the first write, after the first seed's input was validated and
    # run: a refused input leaves no folder behind
    for i, seed in enumerate(seeds):
        quiet = log if i == 0 else (lambda *_: None)  # the notices and the ledger once
        res = run_federated(config.replace(seed=seed), compliance=compliance, backend=backend, log=quiet)
        results.append(res)
        log(
            f"seed {seed}: test accuracy {100 * res.final_accuracy:.2f} % after {config.rounds} rounds "
            f"({res.seconds:.1f} s)"
        )
        _write(results, out_dir, compliance)
    return results


def _write(results, out_dir: str, compliance) -> None:
    rows = [
        (r.config.seed, m["round"], m["test_accuracy"], m["test_loss"], m["train_loss"])
        for r in results
        for m in r.metrics
    ]
    atomic_write_csv(
        os.path.join(out_dir, "metrics.csv"),
        ("seed", "round", "test_accuracy", "test_loss", "train_loss"),
        rows,
    )
    first = results[0]
    atomic_write_json(
        os.path.join(out_dir, "ledger.json"),
        {
            "config": {k: v for k, v in first.config.to_dict().items() if k != "seed"},
            "compliance": "example" if compliance is None else compliance.source,
            "participants": first.participants,
            "noise_multipliers": first.sigmas,
            "data": first.data,
            "seeds": [
                {
                    "seed": r.config.seed,
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
                r.config.seed,
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
        ("seed", "final_accuracy", "round1_accuracy", "max_epsilon", "delta", "protects", "vacuous"),
        srows,
    )


def summarize(results) -> str:
    """A short table: accuracy mean ± sd over seeds, and each distinct ε with its unit."""
    cfg = results[0].config
    m, s = mean_sd([r.final_accuracy for r in results])
    m1, s1 = mean_sd([r.metrics[1]["test_accuracy"] for r in results])
    lines = [
        f"{cfg.dataset}, {cfg.strategy}, privacy {cfg.privacy}, {len(results[0].participants)} of "
        f"{cfg.num_clients} clients training, {cfg.rounds} rounds, {len(results)} seed(s), "
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
