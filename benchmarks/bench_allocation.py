"""Deterministic balls-in-bins accounting against Monte Carlo, measured in the same run.

N = 60000, B = 256 (b = 235 bins), 10 epochs (n = 2350 steps), target (ε, δ) = (3, 1e-5):

1. ``balls_in_bins`` with bsr:16 (fixed bins): ``calibrate(..., accountant="monte_carlo")``
   (the baseline, certified at 99 %, at ``--mc-samples`` samples per direction and round,
   default 10⁶ as in bench_accounting.py) against ``calibrate_allocation`` (allocation_pld,
   deterministic; target < 10 s);
2. ``epoch_balls_in_bins`` (DP-SGD, a fresh bin per epoch): ``calibrate_allocation`` (target
   < 5 s) against DP-SGD with Poisson sampling at q = 1/b (dp-accounting PLD), and, with
   ``--epoch-monte-carlo``, against the Monte Carlo calibration (slow: 2350 normal draws per
   sample).

Deterministic calibrations are repeated ``--repeats`` times (median); Monte Carlo runs once.

Run from the repository root:  python benchmarks/bench_allocation.py [--repeats R]
    [--mc-samples M] [--epoch-monte-carlo]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dpmf import PrivatePlan, calibrate
from dpmf.accountants import PLDAccountant, PoissonGaussianEvent
from dpmf.accountants.allocation import AllocationPLDAccountant, calibrate_allocation
from dpmf.mechanisms import factorize
from dpmf.workloads import prefix_sum

N, B, STEPS, EPS, DELTA = 60_000, 256, 2350, 3.0, 1e-5


def _timed(fn, repeats=1):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_banded(repeats: int, mc_samples: int) -> None:
    f = factorize(prefix_sum(STEPS), "bsr:16")
    plan = PrivatePlan(N, B, steps=STEPS, scheme="balls_in_bins", strategy=f)
    event1 = plan.event(1.0)
    t_mc, mc = _timed(
        lambda: calibrate(
            "balls_in_bins",
            epsilon=EPS,
            delta=DELTA,
            dataset_size=N,
            batch_size=B,
            steps=STEPS,
            factorization=f,
            accountant="monte_carlo",
            samples=mc_samples,
            progress=False,
        )
    )
    t_al, (sigma, meas, details) = _timed(lambda: calibrate_allocation(event1, EPS, DELTA), repeats)
    check = AllocationPLDAccountant().epsilon(plan.event(sigma), DELTA)
    print("[1] balls_in_bins, bsr:16, N = 60000, B = 256, 10 epochs, (3, 1e-5)")
    print(
        f"    monte_carlo:    sigma = {mc.noise_multiplier:.4f} ({mc.guarantee}, {mc_samples:.3g} "
        f"samples), {t_mc:.1f} s (one run)"
    )
    print(
        f"    allocation_pld: sigma = {sigma:.4f} (upper_bound, epsilon at sigma {check.epsilon:.4f}), "
        f"{t_al:.2f} s (median of {repeats}), {details['evaluations']} evaluations"
    )
    print(
        f"    sigma ratio allocation/monte_carlo = {sigma / mc.noise_multiplier:.3f}; "
        f"time ratio monte_carlo/allocation = {t_mc / t_al:.1f}x; "
        f"target < 10 s: {'met' if t_al < 10 else 'NOT met'}",
        flush=True,
    )


def bench_epochs(repeats: int, with_monte_carlo: bool, mc_samples: int) -> None:
    plan = PrivatePlan(N, B, steps=STEPS, scheme="epoch_balls_in_bins")
    event1 = plan.event(1.0)
    bins = plan.scheme.event(plan, 1.0)[1].details["bins"]
    t_al, (sigma, meas, details) = _timed(lambda: calibrate_allocation(event1, EPS, DELTA), repeats)
    t_po, po = _timed(
        lambda: calibrate("poisson", epsilon=EPS, delta=DELTA, dataset_size=N, batch_size=B, steps=STEPS),
        repeats,
    )
    eps_po = PLDAccountant().epsilon(PoissonGaussianEvent(sigma, 1 / bins, STEPS), DELTA).epsilon
    print("[2] epoch_balls_in_bins (DP-SGD, random allocation), N = 60000, B = 256, 10 epochs, (3, 1e-5)")
    print(
        f"    allocation_pld: sigma = {sigma:.4f} (upper_bound), {t_al:.2f} s (median of {repeats}), "
        f"{details['evaluations']} evaluations; target < 5 s: {'met' if t_al < 5 else 'NOT met'}"
    )
    print(
        f"    poisson (PLD, q = B/N): sigma = {po.noise_multiplier:.4f}, {t_po:.2f} s (median of {repeats}); "
        f"Poisson epsilon at the allocation sigma, q = 1/b: {eps_po:.4f}"
    )
    if with_monte_carlo:
        t_mc, mc = _timed(
            lambda: calibrate(
                "epoch_balls_in_bins",
                epsilon=EPS,
                delta=DELTA,
                dataset_size=N,
                batch_size=B,
                steps=STEPS,
                accountant="monte_carlo",
                samples=mc_samples,
                progress=False,
            )
        )
        print(
            f"    monte_carlo:    sigma = {mc.noise_multiplier:.4f} ({mc.guarantee}), {t_mc:.1f} s "
            f"(one run); sigma ratio allocation/monte_carlo = {sigma / mc.noise_multiplier:.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the deterministic calibrations")
    parser.add_argument(
        "--epoch-monte-carlo",
        action="store_true",
        help="also run the (slow) Monte Carlo calibration of epoch_balls_in_bins",
    )
    parser.add_argument(
        "--mc-samples", type=float, default=1e6, help="Monte Carlo samples per direction and round"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} is invalid: must be >= 1")
    if args.mc_samples < 1000:
        parser.error(f"--mc-samples={args.mc_samples:g} is invalid: must be >= 1000")
    bench_banded(args.repeats, int(args.mc_samples))
    bench_epochs(args.repeats, args.epoch_monte_carlo, int(args.mc_samples))


if __name__ == "__main__":
    main()
