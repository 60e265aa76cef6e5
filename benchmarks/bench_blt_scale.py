"""BLT optimization at production scale: dpmf against jax-privacy on the same n, one run.

For every n the script optimizes a BLT with d buffers for MaxSE under single participation
with ``dpmf.mechanisms.optimize_blt`` (in this process) and with jax-privacy's
``buffered_toeplitz.optimize(n=n, error="max", min_buffers=d, max_buffers=d)`` (in a child
process, ``--jax-python``: by default this Python, where the ``bench`` extra installs
jax-privacy 2.0.0), and prints for both the wall
time and sens²·MaxSE², each evaluated by dpmf: the exact O(n) evaluation
(``dpmf.mechanisms.evaluate``) up to n = 10⁶, the closed forms beyond. Targets: dpmf's time ≤
jax-privacy's and dpmf's loss ≤ jax-privacy's within 1e-6 relative; dpmf under 30 s per n.

Usage:
    python benchmarks/bench_blt_scale.py [--n 10000,100000,1000000,10000000] [--buffers 4]
        [--jax-python /path/to/python] [--no-jax]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpmf.mechanisms import evaluate, optimize_blt  # noqa: E402
from dpmf.mechanisms.blt import blt_closed_form, blt_factorization, blt_inverse_parameters  # noqa: E402
from dpmf.workloads import prefix_sum  # noqa: E402

EXACT_MAX_N = 1_000_000

_JAX_CHILD = r"""
import json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
from jax_privacy.matrix_factorization import buffered_toeplitz as bt
n, d = int(sys.argv[1]), int(sys.argv[2])
t = time.perf_counter()
blt = bt.optimize(n=n, error="max", min_buffers=d, max_buffers=d)
seconds = time.perf_counter() - t
print(json.dumps(dict(seconds=seconds, loss=float(bt.max_loss(blt, n)),
                      theta=np.asarray(blt.buf_decay).tolist(), omega=np.asarray(blt.output_scale).tolist())))
"""


def dpmf_loss(n: int, noise_theta, noise_omega) -> tuple[float, str]:
    """sens²·MaxSE² of C⁻¹ = BLT(θ, ω) for the prefix sum, by dpmf (method named)."""
    if n <= EXACT_MAX_N:
        fact = blt_factorization(prefix_sum(n), noise_theta, noise_omega)
        ev = evaluate(fact, with_lower_bound=False)
        return ev.max_se**2, "exact O(n)"
    return blt_closed_form(noise_theta, noise_omega, n).max_se_sq, "closed form"


def run_jax(python: str, n: int, d: int) -> dict:
    out = subprocess.run(
        [python, "-c", _JAX_CHILD, str(n), str(d)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="10000,100000,1000000,10000000")
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--jax-python", default=os.environ.get("JAX_PYTHON", sys.executable))
    p.add_argument("--no-jax", action="store_true")
    args = p.parse_args(argv)
    d = args.buffers
    print(f"{'n':>9} {'dpmf s':>8} {'jax s':>8} {'dpmf loss':>20} {'jax loss':>20} {'rel diff':>10}  by")
    ok = True
    for n in [int(x) for x in args.n.split(",")]:
        t0 = time.perf_counter()
        res = optimize_blt(prefix_sum(n), d, objective="max_se")
        t_dpmf = time.perf_counter() - t0
        loss, how = dpmf_loss(n, res.theta, res.omega)
        if args.no_jax:
            print(f"{n:>9} {t_dpmf:8.2f} {'-':>8} {loss:20.12f} {'-':>20} {'-':>10}  {how}")
            ok &= t_dpmf < 30.0
            continue
        jr = run_jax(args.jax_python, n, d)
        th, om = blt_inverse_parameters(jr["theta"], jr["omega"])  # jax returns the strategy C
        jloss, _ = dpmf_loss(n, th, om)
        rel = (loss - jloss) / jloss
        print(f"{n:>9} {t_dpmf:8.2f} {jr['seconds']:8.2f} {loss:20.12f} {jloss:20.12f} {rel:10.2e}  {how}")
        print(f"{'':>9} jax-privacy's own loss {jr['loss']!r}; its C: theta={jr['theta']}")
        print(f"{'':>9} omega={jr['omega']}")
        ok &= t_dpmf <= jr["seconds"] and rel <= 1e-6 and t_dpmf < 30.0
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
