"""Mechanism-level audit of dpmf's accounting: tightness, planted bugs, false alarms.

    PYTHONPATH=. python benchmarks/bench_audit_mechanism.py [--trials 1000000] [--seeds 20]

Prints (1) ε̂/ε for DP-SGD without amplification (fixed order, 4 participations) and bsr:4 in
fixed order at ε ∈ {1, 4} (GDP and Clopper–Pearson, α = 0.05, ``--trials`` canaries),
(2) ε̂ against the claim with each planted bug of tests/test_audit_mechanism.py, (3) false
alarms of correct runs over ``--seeds`` seeds with a one-sided binomial test.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import numpy as np
import scipy.stats

from dpmf.audit import mechanism as M
from dpmf.plan import schemes as S
from dpmf.plan.plan import PrivatePlan

DELTA = 1e-5


def _plan(strategy, scheme="fixed_order"):
    return PrivatePlan(1000, 100, epochs=4, scheme=scheme, strategy=strategy)


def tightness(trials: int, repeats: int = 10) -> None:
    print(
        f"== tightness: fixed order, N=1000, B=100, 4 epochs (40 steps), delta={DELTA}, alpha=0.05, "
        f"{repeats} canaries per example and draw"
    )
    for strategy in ("identity", "bsr:4"):
        for eps in (1.0, 4.0):
            plan = _plan(strategy).calibrate(eps, DELTA)
            runs = max(1, trials // ((1000 if strategy == "identity" else 700) * repeats))
            t0 = time.perf_counter()
            ins, outs, mu = M.mechanism_scores(plan, runs=runs, seed=11, repeats=repeats)
            gdp = M.E.epsilon_from_gdp(ins, outs, delta=DELTA)
            cp = M.E.epsilon_clopper_pearson(ins, outs, delta=DELTA)
            tau = M.claim_threshold(mu, ins.size, outs.size, delta=DELTA)  # from the claim only
            pre = M.E.epsilon_clopper_pearson(ins, outs, delta=DELTA, threshold_strategy=M.E.Explicit(tau))
            split = M.E.epsilon_clopper_pearson(
                ins, outs, delta=DELTA, threshold_strategy=M.E.Split(0.5, seed=1)
            )
            print(
                f"{strategy:9s} eps={eps:g} sigma={plan.noise_multiplier:.4f} trials={ins.size + outs.size} "
                f"mu_claimed={mu:.4f} mu_lb={M.E.gdp_mu_lower_bound(ins, outs):.4f} "
                f"gdp={gdp:.4f} ({gdp / eps:.3f}x) clopper-pearson={cp:.4f} ({cp / eps:.3f}x) "
                f"cp-split={split:.4f} ({split / eps:.3f}x) cp-claim-threshold(tau={tau:.2f})={pre:.4f} "
                f"({pre / eps:.3f}x) "
                f"[{time.perf_counter() - t0:.1f}s]"
            )


def bugs(runs: int) -> None:
    print("== planted bugs (gdp, alpha=0.05): lower bound vs claimed")
    real_std = PrivatePlan.noise_std

    def show(name, plan, claimed=None, **kw):
        r = M.audit_mechanism(
            plan, delta=DELTA, runs=kw.pop("runs", runs), method="gdp", seed=5, claimed_epsilon=claimed, **kw
        )
        print(
            f"{name:44s} claimed={r.claimed_epsilon:.3f} lower_bound={r.epsilon_lower_bound:.3f} "
            f"flagged={r.epsilon_lower_bound > r.claimed_epsilon}"
        )

    b4 = _plan("bsr:4").calibrate(4.0, DELTA)
    show("correct bsr:4 (reference)", b4)
    with mock.patch.object(PrivatePlan, "noise_std", lambda self, z: real_std(self, z) / 2):
        show("noise at half sigma (bsr:4)", b4)
    ident = _plan("identity").calibrate(4.0, DELTA)
    with mock.patch.object(M, "_clip", lambda norm, clip_norm: norm):
        show("clipping skipped, canary norm 3 zeta (identity)", ident, canary_norm=3.0)
    dense = _plan("dense").calibrate(4.0, DELTA)
    show("correct dense, empirical whitening (reference)", dense, score="empirical", runs=10)
    with mock.patch.object(
        M, "_correlated_noise", lambda f, n, d, rng: f.C.matmul(rng.standard_normal((n, d)))
    ):
        show("C and C^-1 swapped in the noise (dense)", dense, score="empirical", runs=10)
    claimed = b4.account(delta=DELTA).epsilon
    s = b4.sensitivity
    with mock.patch.object(PrivatePlan, "sensitivity", property(lambda self: s / 2)):
        show("sensitivity halved (bsr:4)", b4, claimed=claimed)
    with mock.patch.object(S.FixedOrder, "event", lambda self, run, sigma: S.Poisson().event(run, sigma)):
        show("fixed order accounted as Poisson (identity, sigma=1)", _plan("identity").with_noise(1.0))

    def reused(f, n, d, rng):
        z = rng.standard_normal((n, d))
        z[1] = z[0]
        return f.C.inverse().matmul(z)

    show("correct bsr:4, empirical whitening (reference)", b4, score="empirical")
    with mock.patch.object(M, "_correlated_noise", reused):
        show("one noise draw reused for steps 0 and 1 (bsr:4)", b4, score="empirical")


def false_alarms(seeds: int, with_bins: bool) -> None:
    print(
        f"== false alarms of correct runs over {seeds} seeds (8 sampler draws = 8000 canaries each; "
        "amplified "
        "schemes: the likelihood-ratio score)"
    )
    configs = [
        ("identity", "poisson", "clopper-pearson", None),
        ("bsr:4", "cyclic_poisson", "clopper-pearson", None),
        ("dense", "fixed_order", "gdp", None),
    ]
    if with_bins:
        configs.append(("blt:2", "balls_in_bins", "clopper-pearson", 3.0))
    for strategy, scheme, method, sigma in configs:
        plan = _plan(strategy, scheme)
        plan = plan.calibrate(2.0, DELTA) if sigma is None else plan.with_noise(sigma)
        claimed = plan.account(delta=DELTA).epsilon
        lbs = [
            M.audit_mechanism(
                plan,
                delta=DELTA,
                runs=8,
                method=method,
                seed=100 + s,
                claimed_epsilon=claimed,
                canaries="all",
                score="likelihood" if method == "clopper-pearson" else "strategy",
            ).epsilon_lower_bound
            for s in range(seeds)
        ]
        alarms = int(sum(lb > claimed for lb in lbs))
        p = scipy.stats.binomtest(alarms, seeds, 0.05, alternative="greater").pvalue
        print(
            f"{strategy}/{scheme} ({method}): claimed={claimed:.3f} max lower bound={max(lbs):.3f} "
            f"median={np.median(lbs):.3f} alarms={alarms}/{seeds} binomial p={p:.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1_000_000)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10, help="canaries per example and sampler draw")
    p.add_argument("--bug-runs", type=int, default=40)
    p.add_argument(
        "--no-bins", action="store_true", help="skip balls-in-bins (its Monte Carlo accounting takes ~20 s)"
    )
    p.add_argument("--tightness-only", action="store_true", help="only part (1)")
    a = p.parse_args()
    tightness(a.trials, a.repeats)
    if a.tightness_only:
        return
    bugs(a.bug_runs)
    false_alarms(a.seeds, not a.no_bins)


if __name__ == "__main__":
    main()
