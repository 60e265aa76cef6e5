"""Inputs that cannot crash the numerics: refused up front (one line, the parameter, the
range, the fix) or computed stably; δ ≥ 1/N warned about."""

import logging
import math
import subprocess
import sys

import pytest

from dpmf import PrivatePlan
from dpmf._memory import MemoryLimitError
from dpmf.accountants import PoissonGaussianEvent, RDPAccountant
from dpmf.accountants.library import NoiseTooSmallError, PLDAccountant
from dpmf.accountants.memory import pld_bytes
from dpmf.mechanisms import Participation, nuclear_norm, optimize_dense
from dpmf.mechanisms.bounds import lower_bound
from dpmf.workloads import Schedule, from_schedule, prefix_sum


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dpmf", *args], capture_output=True, text=True, timeout=300)


def test_delta_at_least_one_over_n_warns_once_and_still_accounts(caplog):
    plan = PrivatePlan(dataset_size=1000, batch_size=10, steps=100, noise_multiplier=1.0)
    with caplog.at_level(logging.WARNING, logger="dpmf"):
        a = plan.account(delta=0.5)
        plan.account(delta=0.5)
        plan.account(delta=1e-5)
    warned = [r.getMessage() for r in caplog.records if "1/N" in r.getMessage()]
    assert len(warned) == 1 and "delta=0.5" in warned[0] and "N=1000" in warned[0]
    assert a.epsilon >= 0 and math.isfinite(a.epsilon)
    for bad in (0.0, 1.0, -1e-3):
        with pytest.raises(ValueError, match="delta"):
            plan.account(delta=bad)


def test_cli_delta_warning_is_one_stderr_line():
    args = ["epsilon", "--scheme", "poisson", "--noise-multiplier", "1", "--dataset-size", "1000"]
    args += ["--batch-size", "10", "--steps", "100"]
    out = _cli(*args, "--delta", "0.5")
    assert out.returncode == 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "delta=0.5 >= 1/N" in lines[0]
    quiet = _cli(*args, "--delta", "1e-5")
    assert quiet.returncode == 0 and quiet.stderr.strip() == ""


def test_huge_noise_multiplier_refused_and_the_limit_accounted():
    plan = PrivatePlan(dataset_size=1000, batch_size=10, steps=100)
    with pytest.raises(ValueError, match=r"noise_multiplier=1e\+300 is invalid: must be in \(0, 1e\+100\]"):
        plan.account(1e300, delta=1e-5)
    for acc in ("pld", "rdp"):
        r = plan.account(1e100, delta=1e-5, accountant=acc)
        assert r.epsilon == 0.0
    out = _cli(
        "epsilon",
        "--scheme",
        "poisson",
        "--noise-multiplier",
        "1e300",
        "--dataset-size",
        "1000",
        "--batch-size",
        "10",
        "--steps",
        "100",
        "--delta",
        "1e-5",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "noise_multiplier" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_tiny_beta_refused_and_the_smallest_allowed_bound_is_finite():
    with pytest.raises(ValueError, match=r"beta=1e-300 is invalid: must be in \[1e-60, 1\]"):
        Schedule("exponential", 1e-300)
    w = from_schedule(Schedule("exponential", 1e-60), 64)
    ref = float(__import__("numpy").linalg.svd(w.dense(), compute_uv=False).sum())
    assert nuclear_norm(w) == pytest.approx(ref, rel=1e-10)  # was NaN/overflow before
    assert math.isfinite(lower_bound(w, Participation.single())) and lower_bound(w) > 0


@pytest.mark.slow
def test_pld_beyond_its_grid_names_the_noise_not_delta():
    """ε too large for the PLD grid: the message names σ (too little noise), not δ; calibrate
    for a huge ε target then steps over such σ and meets the target."""
    event = PoissonGaussianEvent(0.125, 256 / 60000, 2350)  # measured: overflows the 1e-3 grid
    with pytest.raises(NoiseTooSmallError, match=r"noise_multiplier=0.125 .*beyond what its grid") as exc:
        PLDAccountant(value_discretization_interval=1e-3).epsilon(event, 1e-5)
    assert "delta=1e-05 is invalid" not in str(exc.value)
    plan = PrivatePlan(dataset_size=60000, batch_size=256, epochs=10)
    r = plan.calibrate(epsilon=2000.0, delta=1e-5)  # the coarse search meets σ = 0.125's overflow
    assert r.privacy.epsilon <= 2000.0 and 0.1 <= r.noise_multiplier < 0.13


def test_memory_refused_before_any_allocation():
    with pytest.raises(
        MemoryLimitError, match=r"steps=10000000000 .* needs about .* GiB, more than the memory budget"
    ):
        PrivatePlan(dataset_size=1000, batch_size=10, steps=10**10)
    event = PoissonGaussianEvent(1.0, 0.01, 10**10)
    with pytest.raises(MemoryLimitError, match="accountant='rdp'"):
        PLDAccountant().epsilon(event, 1e-5)
    # the named alternative works, without per-step arrays
    assert math.isfinite(RDPAccountant().epsilon(event, 1e-5).epsilon)
    with pytest.raises(MemoryLimitError, match=r"dense strategy at n=2048 .*fixed_epochs\(b=8,k=256\)"):
        optimize_dense(prefix_sum(2048), Participation.fixed_epochs(8, 256))


def test_pld_memory_estimate_is_on_the_safe_side_of_a_measured_case():
    # measured: dp-accounting allocated 45.3 GiB (one complex128 array of 3.04e9 points) for this
    event = PoissonGaussianEvent(1.0, 0.01, 10**10)
    assert pld_bytes([event], 1e-4) >= 45.3 * 2**30
    # typical runs stay far below the budget
    assert pld_bytes([PoissonGaussianEvent(1.0, 0.01, 10**5)], 1e-4) < 2**30


def test_memory_budget_override(monkeypatch):
    monkeypatch.setenv("DPMF_MEMORY_LIMIT_GIB", "0.001")
    with pytest.raises(MemoryLimitError, match="DPMF_MEMORY_LIMIT_GIB"):
        PrivatePlan(dataset_size=10**6, batch_size=10, steps=10**5, strategy="sqrt_prefix")
    monkeypatch.setenv("DPMF_MEMORY_LIMIT_GIB", "-1")
    with pytest.raises(ValueError, match="DPMF_MEMORY_LIMIT_GIB"):
        PrivatePlan(dataset_size=1000, batch_size=10, steps=100, strategy="sqrt_prefix")


# -- workloads: an inverse-power γ so small that the schedule would be NaN -----------------------------
# Schedule("inverse_power", gamma=1e-17) is refused naming gamma, or gives a finite schedule: values()
# divides (t^−γ − n^−γ)/(1 − n^−γ), 0/0 with n^−γ == 1.0 in float64 — χ NaN with a RuntimeWarning,
# and `dpmf curves --schedule inverse_power --gamma 1e-17` failing later with "chi is invalid:
# contains NaN or infinite entries", which names neither gamma nor the allowed range.
@pytest.mark.torch
def test_inverse_power_with_a_tiny_gamma_is_refused_or_finite():
    import numpy as np

    from dpmf.workloads.schedules import Schedule

    try:
        sched = Schedule("inverse_power", beta=0.5, gamma=1e-17)
    except ValueError as err:
        assert "gamma" in str(err)
        return
    chi = sched.values(5)
    assert np.all(np.isfinite(chi)) and np.all(np.diff(chi) <= 0)
