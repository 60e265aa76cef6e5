"""MaxSE/MeanSE and lower-bound speed and memory of the structured evaluation, one core.

Targets: lr_aware and sqrt_prefix on exponential A_χ at n = 16384 in < 10 s and < 500 MB peak;
the prefix-sum square root at n = 10⁶ in < 5 s; the error curves of ``dpmf curves`` with the
nuclear-norm lower bound at n = 16384 (exponential, sqrt_prefix and lr_aware) in < 5 s and at
n = 10⁵ (constant, sqrt_prefix) in < 30 s. The baselines, measured in the same run, are the
dense computation (B = A·C⁻¹ as n×n arrays, row norms) at a size it can afford, and for the
bound the former method (the 2n×2n Golub–Kahan tridiagonal eigenvalues, O(n²)) at n = 4096;
the ratios are baseline time / structured time at the same n.

Usage: python benchmarks/bench_errors.py [--quick]
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import median_seconds, peak_mb  # noqa: E402

from dpmf.mechanisms import evaluate, factorize, nuclear_norm  # noqa: E402
from dpmf.mechanisms.sweeps import error_curves  # noqa: E402
from dpmf.workloads import Schedule, from_schedule, prefix_sum  # noqa: E402


def golub_kahan_nuclear_norm(workload):
    """The former bound: Σ 1/σ_i(A⁻¹) from the 2n×2n Golub–Kahan matrix (LAPACK MRRR)."""
    from scipy.linalg import eigh_tridiagonal

    n = workload.n
    inv_diag = 1.0 / (workload.coeffs[0] * workload.scale)
    off = np.empty(2 * n - 1)
    off[0::2] = inv_diag
    off[1::2] = -inv_diag[1:]
    ev = eigh_tridiagonal(np.zeros(2 * n), off, eigvals_only=True)
    return float(np.sum(1.0 / np.abs(ev[n:])))


def structured(workload, spec):
    f = factorize(workload, spec)
    e = evaluate(f, with_lower_bound=False)
    return e.max_se, e.mean_se


def dense(workload, spec):
    f = factorize(workload, spec)
    A = workload.dense()
    Ci = np.linalg.inv(f.C.dense())
    B = A @ Ci
    s = np.linalg.norm(f.C.dense(), axis=0).max()
    rows = np.linalg.norm(B, axis=1)
    return s * rows.max(), s * np.sqrt(np.mean(rows**2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = ap.parse_args()
    n_big = 4096 if args.quick else 16384
    n_dense = 1024 if args.quick else 4096
    n_million = 100_000 if args.quick else 1_000_000
    repeat = 3

    print(f"# one core; medians of {repeat} runs")
    print(f"{'case':<44} {'n':>8} {'seconds':>9} {'peak MB':>9} {'dense/ours':>11}")
    for spec in ("lr_aware", "sqrt_prefix"):
        wd = from_schedule(Schedule("exponential", 0.1), n_dense)
        ours_d = median_seconds(partial(structured, wd, spec), repeat)
        dense_d = median_seconds(partial(dense, wd, spec), 1)
        a, b = structured(wd, spec), dense(wd, spec)
        assert np.allclose(a, b, rtol=1e-8), (a, b)
        print(
            f"{spec + ' exp. A_chi (ours)':<44} {n_dense:>8} {ours_d:>9.3f} {'':>9} {dense_d / ours_d:>11.1f}"
        )
        w = from_schedule(Schedule("exponential", 0.1), n_big)
        t = median_seconds(partial(structured, w, spec), repeat)
        mem = peak_mb(partial(structured, w, spec))
        mx, mn = structured(w, spec)
        print(
            f"{spec + ' exp. A_chi MaxSE+MeanSE':<44} {n_big:>8} {t:>9.3f} {mem:>9.1f} {'':>11}"
            f"   MaxSE={mx:.4f} MeanSE={mn:.4f}"
        )

    w_gk = from_schedule(Schedule("exponential", 0.1), 1024 if args.quick else 4096)
    t_gk = median_seconds(partial(golub_kahan_nuclear_norm, w_gk), 1)
    t_q = median_seconds(partial(nuclear_norm, w_gk), repeat)
    rel = abs(nuclear_norm(w_gk) / golub_kahan_nuclear_norm(w_gk) - 1.0)
    print(
        f"{'nuclear norm, exp. A_chi (quadrature)':<44} {w_gk.n:>8} {t_q:>9.3f} {'':>9} {t_gk / t_q:>11.1f}"
        f"   relative difference to Golub-Kahan {rel:.1e}"
    )
    curve_cases = [
        (
            "curves exp. sqrt_prefix,lr_aware + bound",
            Schedule("exponential", 0.1),
            n_big,
            ["sqrt_prefix", "lr_aware"],
        ),
        ("curves constant sqrt_prefix + bound", Schedule("constant", 1.0), n_million // 10, ["sqrt_prefix"]),
    ]
    for label, sched, n, facts in curve_cases:
        t = median_seconds(partial(error_curves, sched, [n], facts), repeat)
        t_nb = median_seconds(partial(error_curves, sched, [n], facts, with_lower_bound=False), repeat)
        print(f"{label:<44} {n:>8} {t:>9.3f} {'':>9} {'':>11}   without the bound {t_nb:.3f} s")

    w = prefix_sum(n_million)
    t = median_seconds(lambda: evaluate(factorize(w, "sqrt_prefix"), with_lower_bound=False), repeat)
    mem = peak_mb(lambda: evaluate(factorize(w, "sqrt_prefix"), with_lower_bound=False))
    e = evaluate(factorize(w, "sqrt_prefix"), with_lower_bound=False)
    r = factorize(w, "sqrt_prefix").C.coeffs
    print(
        f"{'prefix-sum sqrt (sens, MaxSE, MeanSE)':<44} {n_million:>8} {t:>9.3f} {mem:>9.1f} {'':>11}"
        f"   MaxSE={e.max_se:.6f} (sum r_j^2 = {np.sum(r**2):.6f})"
    )


if __name__ == "__main__":
    main()
