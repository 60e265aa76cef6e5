"""Banded strategies under min-sep participation: dpmf against jax-privacy's banded optimizer.

jax-privacy 2.0.0 optimizes banded Toeplitz strategies C (b bands, valid under min-sep
participation with separation ≥ b) with ``toeplitz.optimize_banded_toeplitz(n, b,
reduction_fn=jnp.mean)``; it has no optimizer over banded noise C⁻¹. For each case (n, b, k)
— k participations at least b steps apart — the script runs it (in a child process,
``--jax-python``; by default this Python, where the ``bench`` extra installs jax-privacy) and
dpmf's ``bsr_opt:b`` (the same class, banded C) and ``bisr_opt:b`` (banded C⁻¹), and prints
sens²·MeanSE² of each as evaluated by dpmf's exact code (``evaluate`` under
``Participation.separated(b, k)``), with the times. The jax-privacy values recorded here are
the references of ``tests/test_banded_opt.py``.

Usage:
    python benchmarks/bench_banded_jax.py [--cases 128:64:2,256:64:4,...] [--jax-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from dpmf.mechanisms import evaluate  # noqa: E402
from dpmf.mechanisms.banded_opt import optimize_banded  # noqa: E402
from dpmf.mechanisms.factorizations import Factorization  # noqa: E402
from dpmf.mechanisms.participation import Participation  # noqa: E402
from dpmf.mechanisms.structured import ScaledToeplitz  # noqa: E402
from dpmf.workloads import prefix_sum  # noqa: E402

CASES = "128:64:2,256:64:4,256:128:2,512:128:4,1024:64:2"

_JAX_CHILD = r"""
import json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
from jax_privacy.matrix_factorization import toeplitz
n, b = int(sys.argv[1]), int(sys.argv[2])
t = time.perf_counter()
c = toeplitz.optimize_banded_toeplitz(n, b, reduction_fn=jnp.mean)
print(json.dumps(dict(seconds=time.perf_counter() - t, coeffs=np.asarray(c).tolist())))
"""


def loss_of_banded_c(n: int, coeffs, part: Participation) -> float:
    """sens²·MeanSE² of the banded Toeplitz C with these first coefficients, by dpmf."""
    c = np.zeros(n)
    c[: len(coeffs)] = coeffs
    fact = Factorization("jax_banded", len(coeffs), prefix_sum(n), ScaledToeplitz(c))
    return evaluate(fact, part, with_lower_bound=False).mean_se ** 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=CASES, help="n:b:k triples, comma-separated")
    p.add_argument("--jax-python", default=sys.executable)
    args = p.parse_args(argv)
    print(
        f"{'n':>5} {'b':>4} {'k':>2} {'jax-privacy':>14} {'s':>6} {'bsr_opt':>14} {'s':>6} "
        f"{'bisr_opt':>14} {'s':>6} {'conv':>5}"
    )
    for case in args.cases.split(","):
        n, b, k = (int(x) for x in case.split(":"))
        part = Participation.separated(b, k)
        out = subprocess.run(
            [args.jax_python, "-c", _JAX_CHILD, str(n), str(b)], capture_output=True, text=True, check=True
        )
        jax = json.loads(out.stdout.strip().splitlines()[-1])
        jax_loss = loss_of_banded_c(n, jax["coeffs"], part)
        t = time.perf_counter()
        bsr = optimize_banded(prefix_sum(n), "bsr_opt", b, part)
        t_bsr = time.perf_counter() - t
        t = time.perf_counter()
        bisr = optimize_banded(prefix_sum(n), "bisr_opt", b, part)
        t_bisr = time.perf_counter() - t
        print(
            f"{n:>5} {b:>4} {k:>2} {jax_loss:14.10f} {jax['seconds']:6.2f} {bsr.value**2:14.10f} "
            f"{t_bsr:6.2f} {bisr.value**2:14.10f} {t_bisr:6.2f} {str(bisr.converged):>5}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
