"""Compare dpmf.audit.estimators with jax-privacy's CanaryScoreAuditor on the same scores.

Run with a Python that has jax-privacy (2.0.0) and dpmf on the path, e.g.

    PYTHONPATH=. /path/to/venv-with-jax-privacy/bin/python benchmarks/bench_audit_estimators.py

Prints, for each estimator and score set, both values and their relative difference (target
≤ 1e-6), and with ``--record`` the dpmf values as a Python dict (the references of
tests/test_audit_estimators.py).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dpmf.audit import estimators as E


def score_sets():
    """Named (in, out) score arrays: Gaussian shifts, ties, integers, a separated pair."""
    rng = np.random.default_rng(20260)
    sets = {
        "gauss_mu1_m200": (rng.normal(1.0, 1, 100), rng.normal(0.0, 1, 100)),
        "gauss_mu2_m1000": (rng.normal(2.0, 1, 500), rng.normal(0.0, 1, 500)),
        "gauss_mu0.5_m5000": (rng.normal(0.5, 1, 2600), rng.normal(0.0, 1, 2400)),
        "ties_int": (rng.integers(0, 8, 300).astype(float) + 1, rng.integers(0, 8, 280).astype(float)),
        "separated": (np.arange(100) + 9.5, np.arange(100.0)),
    }
    return sets


def dpmf_values(ins, outs):
    d = 1e-5
    return {
        "epsilon_one_run": E.epsilon_one_run(ins, outs, delta=d, significance=0.05),
        "epsilon_one_run_split": E.epsilon_one_run(ins, outs, delta=d, significance=0.05,
                                                   threshold_strategy=E.Split(0.5, seed=7)),
        "epsilon_one_run_fdp": E.epsilon_one_run_fdp(ins, outs, delta=d, significance=0.05),
        "epsilon_clopper_pearson": E.epsilon_clopper_pearson(ins, outs, delta=d, significance=0.05),
        "epsilon_clopper_pearson_two_sided": E.epsilon_clopper_pearson(
            ins, outs, delta=0.0, significance=0.05, one_sided=False),
        "epsilon_clopper_pearson_split": E.epsilon_clopper_pearson(
            ins, outs, delta=d, significance=0.05, threshold_strategy=E.Split(0.5, seed=7)),
        "epsilon_clopper_pearson_explicit": E.epsilon_clopper_pearson(
            ins, outs, delta=d, significance=0.05, threshold_strategy=E.Explicit(1.0)),
        "epsilon_from_gdp": E.epsilon_from_gdp(ins, outs, delta=d, significance=0.05),
        "attack_auroc": E.attack_auroc(ins, outs),
        "tpr_at_fpr_0.01": E.tpr_at_given_fpr(ins, outs, 0.01),
        "tpr_at_fpr_0.1": E.tpr_at_given_fpr(ins, outs, 0.1),
    }


def jax_values(ins, outs):
    from jax_privacy import auditing as A

    a = A.CanaryScoreAuditor(ins, outs)
    d = 1e-5
    return {
        "epsilon_one_run": a.epsilon_one_run(0.05, d),
        "epsilon_one_run_split": a.epsilon_one_run(0.05, d, threshold_strategy=A.Split(0.5, seed=7)),
        "epsilon_one_run_fdp": a.epsilon_one_run_fdp(0.05, d),
        "epsilon_clopper_pearson": a.epsilon_clopper_pearson(0.05, d),
        "epsilon_clopper_pearson_two_sided": a.epsilon_clopper_pearson(0.05, 0.0, one_sided=False),
        "epsilon_clopper_pearson_split": a.epsilon_clopper_pearson(0.05, d, threshold_strategy=A.Split(0.5, seed=7)),
        "epsilon_clopper_pearson_explicit": a.epsilon_clopper_pearson(0.05, d, threshold_strategy=A.Explicit(1.0)),
        "epsilon_from_gdp": a.epsilon_from_gdp(0.05, d),
        "attack_auroc": a.attack_auroc(),
        "tpr_at_fpr_0.01": a.tpr_at_given_fpr(0.01),
        "tpr_at_fpr_0.1": a.tpr_at_given_fpr(0.1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", action="store_true", help="print the dpmf values as a dict")
    args = p.parse_args(argv)
    worst = 0.0
    record = {}
    for name, (ins, outs) in score_sets().items():
        ours = dpmf_values(ins, outs)
        theirs = jax_values(ins, outs)
        record[name] = {k: float(v) for k, v in ours.items()}
        for key in ours:
            a, b = float(ours[key]), float(theirs[key])
            rel = abs(a - b) / max(abs(b), 1e-12) if a != b else 0.0
            worst = max(worst, rel)
            print(f"{name:20s} {key:36s} dpmf={a:.12g} jax-privacy={b:.12g} rel.diff={rel:.2e}")
    print(f"worst relative difference: {worst:.2e} (target <= 1e-6)")
    if args.record:
        print(repr(record))
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
