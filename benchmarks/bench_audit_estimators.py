"""Compare dpmf.audit.estimators with jax-privacy's CanaryScoreAuditor on the same scores.

jax-privacy 2.0.0 comes with the ``bench`` extra (installed by ``make test``'s set-up):

    .venv/bin/python benchmarks/bench_audit_estimators.py

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
        "epsilon_one_run_split": E.epsilon_one_run(
            ins, outs, delta=d, significance=0.05, threshold_strategy=E.Split(0.5, seed=7)
        ),
        "epsilon_one_run_fdp": E.epsilon_one_run_fdp(ins, outs, delta=d, significance=0.05),
        "epsilon_clopper_pearson": E.epsilon_clopper_pearson(ins, outs, delta=d, significance=0.05),
        "epsilon_clopper_pearson_two_sided": E.epsilon_clopper_pearson(
            ins, outs, delta=0.0, significance=0.05, one_sided=False
        ),
        "epsilon_clopper_pearson_split": E.epsilon_clopper_pearson(
            ins, outs, delta=d, significance=0.05, threshold_strategy=E.Split(0.5, seed=7)
        ),
        "epsilon_clopper_pearson_explicit": E.epsilon_clopper_pearson(
            ins, outs, delta=d, significance=0.05, threshold_strategy=E.Explicit(1.0)
        ),
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
        "epsilon_clopper_pearson_split": a.epsilon_clopper_pearson(
            0.05, d, threshold_strategy=A.Split(0.5, seed=7)
        ),
        "epsilon_clopper_pearson_explicit": a.epsilon_clopper_pearson(
            0.05, d, threshold_strategy=A.Explicit(1.0)
        ),
        "epsilon_from_gdp": a.epsilon_from_gdp(0.05, d),
        "attack_auroc": a.attack_auroc(),
        "tpr_at_fpr_0.01": a.tpr_at_given_fpr(0.01),
        "tpr_at_fpr_0.1": a.tpr_at_given_fpr(0.1),
    }


def gdp_with_absolute_mu(ins, outs, delta=1e-5, significance=0.05):
    """jax-privacy's variant of ``epsilon_from_gdp`` (largest |μ|), rebuilt from dpmf's pieces,
    to show that everything else (hull, Clopper–Pearson, Bonferroni, conversion) agrees."""
    import math

    import scipy.optimize

    c = E._counts(ins, outs)
    k = len(c.fn)
    fnr = E.clopper_pearson_upper(c.fn, c.n_in, significance / (2 * k))
    fpr = E.clopper_pearson_upper(c.n_out - c.tn, c.n_out, significance / (2 * k))
    ok = np.maximum(fnr, fpr) < 1 - delta
    if not ok.any():
        return 0.0
    mu = float(np.max(np.abs(E._norm.isf(fpr[ok]) - E._norm.ppf(fnr[ok]))))
    if mu == 0:
        return 0.0

    def gap(e):
        x = E._norm.logcdf(-e / mu + mu / 2)
        y = e + E._norm.logcdf(-e / mu - mu / 2)
        return x + np.log1p(-np.exp(y - x)) - math.log(delta)

    if gap(0.0) <= 0:
        return 0.0
    return float(scipy.optimize.brentq(gap, 0.0, 100.0, xtol=1e-6))


def null_false_alarms(runs=20, m=2000):
    """ε̂ of both libraries' GDP estimators on scores with no signal (in and out ~ N(0, 1))."""
    from jax_privacy import auditing as A

    rng = np.random.default_rng(0)
    ours, theirs = [], []
    for _ in range(runs):
        a, b = rng.normal(0, 1, m), rng.normal(0, 1, m)
        ours.append(E.epsilon_from_gdp(a, b, delta=1e-5))
        theirs.append(A.CanaryScoreAuditor(a, b).epsilon_from_gdp(0.05, 1e-5))
    return np.array(ours), np.array(theirs)


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
        ours["epsilon_from_gdp(|mu|, jax-privacy's variant)"] = gdp_with_absolute_mu(ins, outs)
        theirs["epsilon_from_gdp(|mu|, jax-privacy's variant)"] = theirs["epsilon_from_gdp"]
        for key in ours:
            a, b = float(ours[key]), float(theirs[key])
            if key == "epsilon_from_gdp" and a < b:
                print(
                    f"{name:20s} {key:36s} dpmf={a:.12g} jax-privacy={b:.12g} (differs by design when "
                    "jax-privacy's |mu| comes from the reverse direction; see the next line)"
                )
                continue
            rel = abs(a - b) / max(abs(b), 1e-12) if a != b else 0.0
            worst = max(worst, rel)
            print(f"{name:20s} {key:36s} dpmf={a:.12g} jax-privacy={b:.12g} rel.diff={rel:.2e}")
    print(f"worst relative difference: {worst:.2e} (target <= 1e-6)")
    ours, theirs = null_false_alarms()
    print("no-signal scores (in, out ~ N(0,1), m=2000 each, 20 draws), epsilon_from_gdp at delta=1e-5:")
    print(f"  dpmf:        {np.round(ours, 2).tolist()} (false alarms: {(ours > 0.5).sum()}/20 above 0.5)")
    print(
        f"  jax-privacy: {np.round(theirs, 2).tolist()} (false alarms: {(theirs > 0.5).sum()}/20 above 0.5)"
    )
    if args.record:
        print(repr(record))
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
