"""Speed and memory of privacy accounting, as ratios against baselines measured in the same run.

1. PLD calibration of DP-SGD with 10⁴ steps (target: < 5 s); baseline: one PLD evaluation.
2. Monte Carlo privacy-loss samples for a 16-banded C (bsr:16), n = 1000, b = 100 bins
   (target: 10⁷ samples in < 10 min on 2 cores, < 2 GB); baseline: drawing the same number of
   b-dimensional standard normal vectors with numpy. ``--samples`` sets how many are drawn
   (default 10⁶; the 10⁷ figure is extrapolated from the per-sample cost unless --samples 1e7).
3. ``calibrate`` for N = 60000, B = 256, 10 epochs, ε = 3, δ = 1e-5: DP-SGD (Poisson),
   bsr:16 with cyclic Poisson, and bsr:16 with balls-in-bins at ``--mc-samples``.

Run from the repository root:  python benchmarks/bench_accounting.py [--samples N] [--mc-samples M]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

from dpmf import PrivatePlan, account, calibrate
from dpmf.accountants import PLDAccountant, sample_privacy_losses
from dpmf.mechanisms import factorize
from dpmf.workloads import prefix_sum


def _timed(fn, repeats=1):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_pld_calibration(repeats: int) -> None:
    kw = dict(dataset_size=60_000, batch_size=256, steps=10_000)
    t_cal, r = _timed(lambda: calibrate("poisson", epsilon=3.0, delta=1e-5, **kw), repeats)
    plan = PrivatePlan(kw["dataset_size"], kw["batch_size"], steps=kw["steps"], scheme="poisson")
    event = plan.event(r.noise_multiplier)
    t_one, _ = _timed(lambda: PLDAccountant().epsilon(event, 1e-5), repeats)
    print("[1] PLD calibration, DP-SGD, 10^4 steps, q = 256/60000, (3, 1e-5)")
    print(
        f"    sigma = {r.noise_multiplier:.6f}  epsilon = {r.epsilon:.6f}  "
        f"evaluations = {r.details.get('evaluations')}"
    )
    print(
        f"    calibrate: {t_cal:.2f} s (median of {repeats}); one PLD evaluation: {t_one:.2f} s; "
        f"ratio {t_cal / t_one:.1f}x; target < 5 s: {'met' if t_cal < 5 else 'NOT met'}"
    )


def bench_monte_carlo(samples: int) -> None:
    n, b = 1000, 100
    f = factorize(prefix_sum(n), "bsr:16")
    event = PrivatePlan(b * 100, 100, steps=n, scheme="balls_in_bins", strategy=f).event(1.0)
    rng = np.random.default_rng(0)
    chunk = 10_000

    def baseline():
        for _ in range(samples // chunk):
            rng.standard_normal((chunk, b))

    t_base, _ = _timed(baseline)
    t_mc, s = _timed(lambda: sample_privacy_losses(event, samples, seed=0, progress=False))
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    per = t_mc / samples
    print(f"[2] Monte Carlo, bsr:16, n = {n}, b = {b} bins, sigma = 1: {samples:.3g} samples per direction")
    print(
        f"    {t_mc:.1f} s = {per * 1e6:.2f} us per sample (both directions); "
        f"baseline (numpy normals, same count): {t_base:.1f} s; ratio {t_mc / t_base:.1f}x"
    )
    print(
        f"    extrapolated 10^7 samples: {per * 1e7:.0f} s; target < 600 s: "
        f"{'met' if per * 1e7 < 600 else 'NOT met'}; peak RSS {rss_gb:.2f} GB (target < 2 GB)"
    )
    cert = s.epsilon_certified(1e-5) if s.delta_floor <= 1e-5 else float("nan")
    print(f"    epsilon at delta = 1e-5: estimate {s.epsilon_estimate(1e-5):.4f}, certified (99%) {cert:.4f}")


def bench_cli_calibrate(mc_samples: int) -> None:
    N, B, epochs = 60_000, 256, 10
    n = epochs * (-(-N // B))
    f = factorize(prefix_sum(n), "bsr:16")
    print(f"[3] calibrate N = {N}, B = {B}, {epochs} epochs (n = {n}), epsilon = 3, delta = 1e-5")
    cases = [
        ("poisson", None, {}),
        ("cyclic_poisson", f, {}),
        ("balls_in_bins", f, {"samples": mc_samples, "progress": False}),
    ]
    for scheme, fac, extra in cases:
        t, r = _timed(
            lambda s=scheme, fa=fac, e=extra: calibrate(
                s,
                epsilon=3.0,
                delta=1e-5,
                dataset_size=N,
                batch_size=B,
                steps=n,
                factorization=fa,
                **e,
            )
        )
        label = "identity" if fac is None else fac.label
        mc = f", {r.samples} samples, seed {r.seed}, confidence {r.confidence}" if r.samples else ""
        print(
            f"    {scheme:<15} {label:<9} sigma = {r.noise_multiplier:.4f} (noise std sigma*s, "
            f"s = {r.sensitivity:.4f}) {r.guarantee}{mc}: {t:.1f} s; under a minute: "
            f"{'yes' if t < 60 else 'NO'}"
        )
    dp = account("poisson", noise_multiplier=1.0, dataset_size=N, batch_size=B, steps=n, delta=1e-5)
    print(f"    (reference: DP-SGD at sigma = 1 has epsilon {dp.epsilon:.4f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=float, default=1e6, help="Monte Carlo samples for [2]")
    p.add_argument("--mc-samples", type=float, default=1e6, help="Monte Carlo samples for [3]")
    p.add_argument("--repeats", type=int, default=3, help="repeats of [1] (median)")
    p.add_argument("--only", choices=("1", "2", "3"), default=None)
    args = p.parse_args()
    if args.only in (None, "1"):
        bench_pld_calibration(args.repeats)
    if args.only in (None, "2"):
        bench_monte_carlo(int(args.samples))
    if args.only in (None, "3"):
        bench_cli_calibrate(int(args.mc_samples))


if __name__ == "__main__":
    main()
