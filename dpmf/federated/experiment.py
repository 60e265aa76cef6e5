"""The experiment grid of the compliance-aware FL study, in aggregator mode.

Cells: data set × strategy × {Experiment 1: all clients (a quarter compliant, three quarters
lower-compliance), Experiment 4: the compliant clients only} × {weighted σ_k from the scores,
uniform σ at the participants' mean} × seed. Paired comparisons use the same seed (same data
partition, initial weights and sampling streams where the participants coincide).

* ``compliance_grid`` — one row per cell: final and round-1 test accuracy, ε and its unit;
* ``first_round_cost`` — round-1 accuracy without server noise minus with it (same seed);
* ``paired_differences`` — mean ± sd over seeds of a − b for two levels of one factor;
* ``mode_epsilons`` — one short run per privacy mode and its ledger (what each ε protects).

Source of the design: the compliance-aware federated learning study (Experiments 1 and 4;
weighted against uniform noise at equal mean; the accuracy cost of the first round's noise).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from dpmf.federated.data import load_federated
from dpmf.federated.modes import privacy_modes
from dpmf.federated.report import mean_sd
from dpmf.federated.run import FLConfig, run_federated

__all__ = ["compliance_grid", "first_round_cost", "paired_differences", "mode_epsilons", "summary_table"]


def _data(cache, dataset, num_clients, seed, base: FLConfig):
    """The data of one cell: ``base``'s data file (MedMNIST names), partition and aggregator
    split, cached per (data set, K, seed)."""
    key = (dataset, num_clients, seed)
    if key not in cache:
        medmnist = dataset in ("pneumoniamnist", "breastmnist", "medmnist")
        cache[key] = load_federated(
            dataset,
            num_clients,
            data_file=base.data_file if medmnist else None,
            partition_scheme=base.partition,
            alpha=base.alpha,
            shards=base.shards,
            seed=seed,
            aggregator_fraction=base.aggregator_fraction,
        )
    return cache[key]


def _cell(base: FLConfig, dataset: str, **changes) -> FLConfig:
    """``base`` for one cell; its data file only for the MedMNIST names."""
    medmnist = dataset in ("pneumoniamnist", "breastmnist", "medmnist")
    return base.replace(dataset=dataset, data_file=base.data_file if medmnist else None, **changes)


def compliance_grid(
    datasets,
    strategies,
    *,
    rounds: int,
    seeds,
    num_clients: int = 16,
    experiments=(1, 4),
    allocations=("weighted", "uniform"),
    base: FLConfig | None = None,
    progress=None,
) -> list[dict]:
    """Run every cell of the grid (aggregator mode, local backend, bundled example profiles).

    Args:
        datasets, strategies: names (``dpmf.federated.data.DATASETS``, ``STRATEGIES``).
        rounds: R per run; seeds: the seeds; num_clients: K.
        experiments: 1 (all clients) and/or 4 (compliant only).
        allocations: ``weighted`` and/or ``uniform``.
        base: settings shared by every cell (dataset, strategy, rounds, seed, compliant_only and
            allocation are set per cell); its ``data_file`` is read for the MedMNIST names
            (``pneumoniamnist``, ``breastmnist``, ``medmnist``), its partition for every data set.
        progress: callable(done, total, row) after each cell, or None.

    Returns:
        rows with ``dataset, strategy, experiment, allocation, seed, participants,
        final_accuracy, round1_accuracy, epsilon, protects, seconds``.
    """
    base = base or FLConfig()
    cache: dict = {}
    cells = [
        (d, s, e, a, seed)
        for seed in seeds
        for d in datasets
        for e in experiments
        for a in allocations
        for s in strategies
    ]
    rows = []
    for i, (d, s, e, a, seed) in enumerate(cells):
        cfg = _cell(
            base, d, strategy=s, rounds=rounds, seed=seed, num_clients=num_clients,
            compliant_only=(e == 4), allocation=a, privacy="aggregator",
        )  # fmt: skip
        res = run_federated(cfg, data=_data(cache, d, num_clients, seed, base), log=lambda *_: None)
        led = res.ledger[0]
        row = {
            "dataset": d,
            "strategy": s,
            "experiment": e,
            "allocation": a,
            "seed": seed,
            "participants": len(res.participants),
            "final_accuracy": res.final_accuracy,
            "round1_accuracy": float(res.metrics[1]["test_accuracy"]),
            "epsilon": led.epsilon,
            "protects": led.protects,
            "mean_sigma": float(np.mean(list(res.sigmas.values()))),
            "seconds": res.seconds,
        }
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(cells), row)
    return rows


def first_round_cost(
    datasets, *, seeds, strategy: str = "fedavg", num_clients: int = 16, base=None
) -> list[dict]:
    """Round-1 test accuracy of Experiment 1 (weighted) with and without the server's noise.

    The noise-free arm runs the same server DP-SGD steps with σ = 0 (not private; a control
    only). Returns rows ``dataset, seed, noisy, noise_free, cost`` (cost = noise_free − noisy).
    """
    base = base or FLConfig()
    cache: dict = {}
    rows = []
    for d in datasets:
        for seed in seeds:
            cfg = _cell(base, d, strategy=strategy, rounds=1, seed=seed, num_clients=num_clients)
            data = _data(cache, d, num_clients, seed, base)
            noisy = run_federated(cfg, data=data, log=lambda *_: None).final_accuracy
            free = run_federated(
                cfg.replace(server_noise=False), data=data, log=lambda *_: None
            ).final_accuracy
            rows.append(
                {"dataset": d, "seed": seed, "noisy": noisy, "noise_free": free, "cost": free - noisy}
            )
    return rows


def paired_differences(rows, factor: str, a, b, by=("dataset", "strategy"), value: str = "final_accuracy"):
    """Mean ± sd over seeds of value(factor = a) − value(factor = b), per group of ``by`` (the
    other factors held equal and paired by seed), plus a pooled row per data set.

    Returns:
        rows ``{**group, "mean", "sd", "n", "min", "max"}``; pooled rows have strategy ``pooled``.
    """
    keyed = {}
    for r in rows:
        rest = tuple((k, r[k]) for k in sorted(r) if k in ("dataset", "strategy", "experiment", "allocation"))
        keyed[(rest, r["seed"])] = r
    diffs = defaultdict(list)
    for (rest, seed), r in keyed.items():
        if r[factor] != a:
            continue
        other = tuple((k, b if k == factor else v) for k, v in rest)
        if (other, seed) in keyed:
            group = tuple(r[k] for k in by)
            diffs[group].append(r[value] - keyed[(other, seed)][value])
    out = []
    pooled = defaultdict(list)
    for group, vals in sorted(diffs.items()):
        m, s = mean_sd(vals)
        out.append({**dict(zip(by, group, strict=True)), "mean": m, "sd": s, "n": len(vals),
                    "min": min(vals), "max": max(vals)})  # fmt: skip
        pooled[group[0]].extend(vals)
    if "strategy" in by:
        for d, vals in sorted(pooled.items()):
            m, s = mean_sd(vals)
            out.append({"dataset": d, "strategy": "pooled", "mean": m, "sd": s, "n": len(vals),
                        "min": min(vals), "max": max(vals)})  # fmt: skip
    return out


def summary_table(rows, value: str = "final_accuracy") -> list[dict]:
    """Mean ± sd over seeds per (dataset, strategy, experiment, allocation)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["strategy"], r["experiment"], r["allocation"])].append(r[value])
    out = []
    for (d, s, e, a), vals in sorted(groups.items()):
        m, sd = mean_sd(vals)
        out.append({"dataset": d, "strategy": s, "experiment": e, "allocation": a, "mean": m, "sd": sd,
                    "n": len(vals)})  # fmt: skip
    return out


def mode_epsilons(dataset: str, *, rounds: int, num_clients: int = 16, seed: int = 0, base=None) -> list:
    """One FedAvg run per registered privacy mode (``dpmf.federated.modes``; weighted
    allocation); the ``PrivacyEntry`` list of each with its unit, and the run's final accuracy:
    rows ``mode, accuracy, entry``."""
    base = base or FLConfig()
    data = _data({}, dataset, num_clients, seed, base)
    out = []
    for mode in privacy_modes():
        cfg = _cell(base, dataset, rounds=rounds, seed=seed, num_clients=num_clients, privacy=mode)
        res = run_federated(cfg, data=data, log=lambda *_: None)
        for e in res.ledger:
            out.append({"mode": mode, "accuracy": res.final_accuracy, "entry": e})
    return out
