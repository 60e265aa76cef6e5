"""Accounting of DP-SGD and matrix mechanisms: reference numbers, cross-checks between
dp-accounting (PLD, RDP) and prv-accountant, closed forms, brute-force sensitivities,
calibration, validation and the ``dpmf epsilon`` / ``dpmf calibrate`` commands."""

import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from dpmf import account, account_segments, calibrate, cli, max_batch_size, max_steps
from dpmf.accountants import gaussian_epsilon
from dpmf.mechanisms import Participation, factorize, sensitivity
from dpmf.plan import accounting as plan_accounting
from dpmf.workloads import prefix_sum


def _gaussian_eps(mu, delta):
    """ε(δ) of a μ-GDP mechanism, solved here from δ(ε) = Φ(−ε/μ+μ/2) − e^ε Φ(−ε/μ−μ/2)."""
    d = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)  # noqa: E731
    if d(0.0) <= delta:
        return 0.0
    return brentq(lambda e: d(e) - delta, 0.0, 100.0, xtol=1e-13)


DPSGD = dict(noise_multiplier=1.0, dataset_size=10_000, batch_size=100, steps=1000, delta=1e-5)


def test_pld_reference_and_rdp_upper_bound():
    pld = account("poisson", **DPSGD)
    assert abs(pld.epsilon - 1.8282) < 2e-3
    assert (pld.accountant, pld.guarantee, pld.sampling_rate, pld.sensitivity) == (
        "pld",
        "upper_bound",
        0.01,
        1.0,
    )
    rdp = account("poisson", accountant="rdp", **DPSGD)
    assert rdp.guarantee == "upper_bound" and rdp.accountant == "rdp"
    assert rdp.epsilon >= pld.epsilon


@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.01, 1000), (0.8, 0.05, 300), (2.0, 0.002, 5000)])
def test_pld_agrees_with_prv_accountant(sigma, q, steps):
    """Two independent numerical accountants agree; prv's upper end is a bound too."""
    N = 100_000
    kw = dict(noise_multiplier=sigma, dataset_size=N, batch_size=int(q * N), steps=steps, delta=1e-6)
    pld = account("poisson", **kw).epsilon
    prv = account("poisson", accountant="prv", **kw).epsilon
    assert prv >= pld - 2e-3
    assert abs(prv - pld) < 0.03


@pytest.mark.parametrize("accountant", ["pld", "rdp", "prv"])
def test_full_batch_is_the_composed_gaussian(accountant):
    """q = 1: n Gaussian steps = one Gaussian with μ = √n/σ (exact for PLD/PRV, RDP above)."""
    r = account(
        "poisson",
        noise_multiplier=4.0,
        dataset_size=500,
        batch_size=500,
        steps=64,
        delta=1e-5,
        accountant=accountant,
    )
    exact = _gaussian_eps(math.sqrt(64) / 4.0, 1e-5)
    if accountant == "rdp":
        assert r.epsilon >= exact
    elif accountant == "prv":  # prv-accountant's upper end: exact + its eps_error
        assert exact <= r.epsilon <= exact + 0.02
    else:
        assert r.epsilon == pytest.approx(exact, abs=1e-9)
        assert r.epsilon >= exact - 1e-12


def test_library_pld_without_shortcut_matches_closed_form():
    """dp-accounting's own PLD of the composed Gaussian (no closed-form shortcut) agrees."""
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), 64))
    assert acc.get_epsilon(1e-5) == pytest.approx(gaussian_epsilon(2.0, 1e-5), abs=2e-3)


@pytest.mark.parametrize("accountant", ["pld", "rdp", "prv"])
def test_epsilon_zero_when_delta_at_zero_is_small(accountant):
    """δ(0) ≤ δ ⇒ ε = 0 exactly (μ = 1e-3: δ(0) = 2Φ(μ/2) − 1 ≈ 4e-4 ≤ 1e-2)."""
    r = account(
        "poisson",
        noise_multiplier=1000.0,
        dataset_size=10,
        batch_size=10,
        steps=1,
        delta=1e-2,
        accountant=accountant,
    )
    assert r.epsilon == 0.0


@pytest.mark.parametrize("accountant", ["pld", "rdp", "prv"])
@pytest.mark.parametrize("sigma,B,steps", [(0.5, 1, 1), (3.0, 10, 20), (0.6, 900, 50), (50.0, 100, 3)])
def test_epsilon_never_negative_or_nan(accountant, sigma, B, steps):
    r = account(
        "poisson",
        noise_multiplier=sigma,
        dataset_size=1000,
        batch_size=B,
        steps=steps,
        delta=1e-5,
        accountant=accountant,
    )
    assert math.isfinite(r.epsilon) and r.epsilon >= 0.0


def test_single_release_reference():
    f = factorize(prefix_sum(1000), "sqrt_prefix")
    r = account(
        "single_release",
        noise_multiplier=1.0,
        dataset_size=256_000,
        batch_size=256,
        steps=1000,
        delta=1e-5,
        factorization=f,
    )
    assert round(r.sensitivity, 4) == 1.8069
    assert round(r.epsilon, 4) == 4.3772
    assert r.epsilon == pytest.approx(_gaussian_eps(1.0, 1e-5), abs=1e-9)
    with pytest.raises(ValueError, match="single_release"):
        account(
            "single_release",
            noise_multiplier=1.0,
            dataset_size=1000,
            batch_size=256,
            steps=1000,
            delta=1e-5,
            factorization=f,
        )


@pytest.mark.parametrize("spec,min_sep", [("bsr:8", None), ("bsr:8", 10), ("bsr:1", None)])
def test_cyclic_poisson_equals_dpsgd_with_reduced_steps(spec, min_sep):
    n, N, B = 400, 50_000, 50
    f = factorize(prefix_sum(n), spec)
    b = min_sep or f.bands
    r = account(
        "cyclic_poisson",
        noise_multiplier=0.9,
        dataset_size=N,
        batch_size=B,
        steps=n,
        delta=1e-6,
        factorization=f,
        min_sep=min_sep,
    )
    dp = account(
        "poisson",
        noise_multiplier=0.9,
        dataset_size=N,
        batch_size=B * b,
        steps=math.ceil(n / b),
        delta=1e-6,
    )
    assert r.epsilon == dp.epsilon
    assert r.sampling_rate == pytest.approx(B * b / N)
    assert r.details["compositions"] == math.ceil(n / b)
    assert r.sensitivity == pytest.approx(np.max(np.linalg.norm(f.C.dense(), axis=0)))


def test_cyclic_poisson_preconditions():
    f = factorize(prefix_sum(64), "bisr:4")  # C itself is not banded
    with pytest.raises(ValueError, match="not banded"):
        account(
            "cyclic_poisson",
            noise_multiplier=1.0,
            dataset_size=6400,
            batch_size=100,
            steps=64,
            delta=1e-5,
            factorization=f,
            min_sep=8,
        )
    g = factorize(prefix_sum(64), "bsr:4")
    with pytest.raises(ValueError, match="exceeds 1"):
        account(
            "cyclic_poisson",
            noise_multiplier=1.0,
            dataset_size=300,
            batch_size=100,
            steps=64,
            delta=1e-5,
            factorization=g,
        )


def test_fixed_order_brute_force_sensitivity():
    """fixed_order: s = max over classes of ‖C·1_class‖ (CᵀC ≥ 0), then a Gaussian at μ = 1/σ."""
    n, N, B = 24, 80, 10  # b = 8 steps per epoch, k = 3 epochs
    f = factorize(prefix_sum(n), "sqrt_prefix")
    C = f.C.dense()
    brute = max(np.linalg.norm(C[:, s::8].sum(axis=1)) for s in range(8))
    r = account(
        "fixed_order",
        noise_multiplier=1.5,
        dataset_size=N,
        batch_size=B,
        steps=n,
        delta=1e-5,
        factorization=f,
    )
    assert r.sensitivity == pytest.approx(brute, rel=1e-12)
    assert r.sensitivity == pytest.approx(sensitivity(f.C, Participation.fixed_epochs(8, 3)).value)
    assert r.epsilon == pytest.approx(_gaussian_eps(1 / 1.5, 1e-5), abs=1e-9)
    ident = account("fixed_order", noise_multiplier=1.5, dataset_size=N, batch_size=B, steps=n, delta=1e-5)
    assert ident.sensitivity == pytest.approx(math.sqrt(3))


def test_segments():
    one = account("poisson", noise_multiplier=1.2, dataset_size=1000, batch_size=20, steps=300, delta=1e-5)
    seg = account_segments([(1.2, 0.02, 100), (1.2, 0.02, 200)], delta=1e-5)
    assert seg.epsilon == pytest.approx(one.epsilon, abs=3e-4)
    mixed = account_segments([(1.0, 0.02, 150), (1.5, 0.02, 150)], delta=1e-5)
    lo = account("poisson", noise_multiplier=1.5, dataset_size=1000, batch_size=20, steps=300, delta=1e-5)
    hi = account("poisson", noise_multiplier=1.0, dataset_size=1000, batch_size=20, steps=300, delta=1e-5)
    assert lo.epsilon < mixed.epsilon < hi.epsilon
    assert mixed.steps == 300 and mixed.details["segments"][1] == [1.5, 0.02, 150]
    with pytest.raises(ValueError, match=r"segments\[1\].*noise_multiplier"):
        account_segments([(1.0, 0.02, 10), (0.0, 0.02, 10)], delta=1e-5)


def test_calibrate_poisson_conservative_and_tight():
    kw = dict(dataset_size=60_000, batch_size=256, steps=2350)
    r = calibrate("poisson", epsilon=3.0, delta=1e-5, **kw)
    assert r.epsilon <= 3.0
    assert account("poisson", noise_multiplier=r.noise_multiplier, delta=1e-5, **kw).epsilon <= 3.0
    worse = account("poisson", noise_multiplier=r.noise_multiplier * (1 - 3e-3), delta=1e-5, **kw)
    assert worse.epsilon > 3.0


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_calibrate_other_accountants(accountant):
    kw = dict(dataset_size=10_000, batch_size=100, steps=500)
    r = calibrate("poisson", epsilon=2.0, delta=1e-5, accountant=accountant, **kw)
    assert r.epsilon <= 2.0 and r.accountant == accountant
    worse = account(
        "poisson",
        noise_multiplier=r.noise_multiplier * 0.99,
        delta=1e-5,
        accountant=accountant,
        **kw,
    )
    assert worse.epsilon > 2.0


def test_calibrate_gaussian_schemes_closed_form():
    f = factorize(prefix_sum(100), "bsr:4")
    for scheme in ("single_release", "fixed_order"):
        steps = 100
        N = 10_000 if scheme == "single_release" else 1000
        r = calibrate(
            scheme,
            epsilon=2.0,
            delta=1e-6,
            dataset_size=N,
            batch_size=100,
            steps=steps,
            factorization=f,
        )
        assert r.epsilon <= 2.0
        assert _gaussian_eps(1 / r.noise_multiplier, 1e-6) <= 2.0
        assert _gaussian_eps(1 / (r.noise_multiplier * (1 - 1e-6)), 1e-6) > 2.0


def test_calibrate_cyclic_poisson_matches_dpsgd():
    f = factorize(prefix_sum(800), "bsr:8")
    r = calibrate(
        "cyclic_poisson",
        epsilon=3.0,
        delta=1e-5,
        dataset_size=20_000,
        batch_size=100,
        steps=800,
        factorization=f,
    )
    d = calibrate("poisson", epsilon=3.0, delta=1e-5, dataset_size=20_000, batch_size=800, steps=100)
    assert r.noise_multiplier == pytest.approx(d.noise_multiplier, rel=1e-12)


def test_calibrate_balls_in_bins_certified():
    """Monte Carlo calibration: the σ it returns, re-checked on fresh samples, meets the target;
    it is below the no-amplification (Gaussian) bound and above the amplified estimate's σ."""
    f = factorize(prefix_sum(40), "bsr:4")
    kw = dict(dataset_size=1000, batch_size=100, steps=40, factorization=f)
    r = calibrate("balls_in_bins", epsilon=2.0, delta=1e-3, samples=60_000, seed=4, progress=False, **kw)
    assert r.guarantee == "certified" and r.samples == 60_000 and r.seed == 4
    assert r.noise_multiplier < r.details["gaussian_bound_noise_multiplier"]
    check = account(
        "balls_in_bins",
        noise_multiplier=r.noise_multiplier,
        delta=1e-3,
        samples=200_000,
        seed=99,
        confidence=None,
        progress=False,
        **kw,
    )
    assert check.epsilon <= 2.0


def test_max_steps_and_batch_size():
    kw = dict(noise_multiplier=1.5, delta=1e-5, dataset_size=2000)
    r = max_steps("poisson", epsilon=2.0, batch_size=40, limit=100_000, **kw)
    assert r.accountant == "pld" and r.epsilon <= 2.0
    assert account("poisson", batch_size=40, steps=r.steps + 1, **kw).epsilon > 2.0
    b = max_batch_size("poisson", epsilon=2.0, steps=100, accountant="rdp", **kw)
    assert b.epsilon <= 2.0
    nxt = account("poisson", batch_size=b.batch_size + 1, steps=100, accountant="rdp", **kw)
    assert nxt.epsilon > 2.0
    s = max_steps(
        "cyclic_poisson",
        epsilon=2.0,
        batch_size=40,
        factorization="bsr:4",
        limit=800,
        accountant="rdp",
        **kw,
    )
    assert s.factorization == "bsr:4" and s.epsilon <= 2.0
    k = max_steps("poisson", epsilon=2.0, batch_size=160, accountant="rdp", **kw).steps
    assert s.steps == min(800, 4 * k)  # ceil(n/4) compositions at rate 40·4/2000


# --------------------------------------------------------------------------------------------
# Validation: the named parameter, before any work

BASE = dict(noise_multiplier=1.0, dataset_size=1000, batch_size=10, steps=100, delta=1e-5)


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(noise_multiplier=0.0), "noise_multiplier"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=float("nan")), "noise_multiplier"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=1001), "batch_size"),
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(delta=float("nan")), "delta"),
        (dict(steps=0), "steps"),
        (dict(dataset_size=0), "dataset_size"),
        (dict(accountant="gdp"), "accountant"),
        (dict(samples=0), "samples"),
    ],
)
def test_invalid_input_raises_before_work(monkeypatch, change, name):
    def boom(*a, **k):
        raise AssertionError("work started before validation")

    monkeypatch.setattr(plan_accounting, "make_accountant", boom)
    with pytest.raises(ValueError, match=name):
        account("poisson", **{**BASE, **change})


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(epsilon=-1.0), "epsilon"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=float("nan")), "epsilon"),
        (dict(delta=2.0), "delta"),
        (dict(rtol=0.0), "rtol"),
        (dict(confidence=1.0), "confidence"),
    ],
)
def test_calibrate_invalid_input(monkeypatch, change, name):
    monkeypatch.setattr(
        plan_accounting, "calibrate_event", lambda *a, **k: (_ for _ in ()).throw(AssertionError)
    )
    kw = dict(epsilon=1.0, delta=1e-5, dataset_size=1000, batch_size=10, steps=100)
    with pytest.raises(ValueError, match=name):
        calibrate("poisson", **{**kw, **change})


def test_scheme_and_factorization_checks():
    f = factorize(prefix_sum(50), "bsr:4")
    with pytest.raises(ValueError, match="scheme"):
        account("shuffle", **BASE)
    with pytest.raises(ValueError, match="factorization"):
        account("poisson", **BASE, factorization=factorize(prefix_sum(100), "bsr:4"))
    with pytest.raises(ValueError, match="steps=100"):
        account("fixed_order", **BASE, factorization=f)
    with pytest.raises(ValueError, match="accountant='pld' is invalid"):
        account("balls_in_bins", **BASE, accountant="pld")
    with pytest.raises(TypeError, match="factorization"):
        account("fixed_order", **BASE, factorization="bsr:4")


def test_result_to_dict_is_json():
    r = account("poisson", **DPSGD)
    d = json.loads(json.dumps(r.to_dict()))
    for key in (
        "epsilon",
        "delta",
        "noise_multiplier",
        "scheme",
        "accountant",
        "guarantee",
        "steps",
    ):
        assert key in d
    assert d["epsilon"] == r.epsilon


# --------------------------------------------------------------------------------------------
# Command line


def test_cli_epsilon_table_and_json(capsys):
    argv = [
        "epsilon",
        "--scheme",
        "poisson",
        "--noise-multiplier",
        "1",
        "--dataset-size",
        "10000",
        "--batch-size",
        "100",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "epsilon" in out and "1.828" in out
    assert cli.main(argv + ["--json", "--accountant", "rdp"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["accountant"] == "rdp" and d["guarantee"] == "upper_bound" and d["steps"] == 1000


def test_cli_epochs_and_factorization(capsys):
    argv = [
        "epsilon",
        "--scheme",
        "cyclic_poisson",
        "--noise-multiplier",
        "1.2",
        "--dataset-size",
        "6000",
        "--batch-size",
        "256",
        "--epochs",
        "3",
        "--delta",
        "1e-5",
        "--factorization",
        "bsr:4",
        "--schedule",
        "exponential",
        "--beta",
        "0.1",
        "--json",
    ]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["steps"] == 3 * math.ceil(6000 / 256) and d["factorization"] == "bsr:4"
    f = factorize(prefix_sum(d["steps"]), "bsr:4")
    assert (
        d["epsilon"]
        == account(
            "cyclic_poisson",
            noise_multiplier=1.2,
            dataset_size=6000,
            batch_size=256,
            steps=d["steps"],
            delta=1e-5,
            factorization=f,
        ).epsilon
    )


def test_cli_calibrate_json(capsys):
    argv = [
        "calibrate",
        "--scheme",
        "poisson",
        "--epsilon",
        "3",
        "--dataset-size",
        "60000",
        "--batch-size",
        "256",
        "--epochs",
        "10",
        "--delta",
        "1e-5",
        "--json",
    ]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["epsilon"] <= 3.0 and d["steps"] == 2350 and 0.5 < d["noise_multiplier"] < 1.0


@pytest.mark.parametrize(
    "bad",
    [
        ["--noise-multiplier", "-1"],
        ["--noise-multiplier", "1", "--delta", "1.5"],
        ["--noise-multiplier", "1", "--batch-size", "20000"],
        ["--noise-multiplier", "1", "--factorization", "nope:3"],
        ["--noise-multiplier", "1", "--beta", "0.5"],
        ["--noise-multiplier", "1", "--factorization", "bsr:4", "--scheme", "poisson"],
    ],
)
def test_cli_bad_input_exits_2(capsys, bad):
    argv = [
        "epsilon",
        "--scheme",
        "cyclic_poisson",
        "--dataset-size",
        "10000",
        "--batch-size",
        "100",
        "--steps",
        "100",
        "--delta",
        "1e-5",
    ] + bad
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_prv_calibration_without_amplification_meets_the_target():
    """fixed_order is one Gaussian mechanism; prv-accountant reads ~0.01 above the exact ε,
    so its calibrated σ is slightly above the analytic one and its ε is at most the target."""
    r = calibrate(
        "fixed_order", epsilon=3.0, dataset_size=2000, batch_size=100, steps=40, delta=1e-5, accountant="prv"
    )
    exact = calibrate("fixed_order", epsilon=3.0, dataset_size=2000, batch_size=100, steps=40, delta=1e-5)
    assert r.epsilon <= 3.0 and r.noise_multiplier >= exact.noise_multiplier
    assert r.noise_multiplier == pytest.approx(exact.noise_multiplier, rel=0.02)


def test_noise_too_small_for_the_pld_grid_is_refused_by_name():
    for scheme, fac in [("poisson", None), ("cyclic_poisson", factorize(prefix_sum(40), "bsr:4"))]:
        with pytest.raises(ValueError, match=r"noise_multiplier=0\.001 .* must be >= 0\.1"):
            account(
                scheme,
                noise_multiplier=1e-3,
                dataset_size=2000,
                batch_size=100,
                steps=40,
                delta=1e-5,
                factorization=fac,
            )
    # RDP has no grid: it answers (a huge but finite upper bound)
    r = account(
        "poisson",
        noise_multiplier=1e-3,
        dataset_size=2000,
        batch_size=100,
        steps=40,
        delta=1e-5,
        accountant="rdp",
    )
    assert math.isfinite(r.epsilon) and r.epsilon > 100


def test_huge_target_epsilon_calibrates_to_the_smallest_measurable_noise():
    r = calibrate("poisson", epsilon=1e6, dataset_size=1000, batch_size=100, steps=3, delta=1e-5)
    assert 0.1 <= r.noise_multiplier < 0.2 and 0 < r.epsilon <= 1e6


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--schedule", "cosine"], "needs --beta"),
        (["--schedule", "constant", "--beta", "0.5"], "--beta is invalid with --schedule constant"),
    ],
)
def test_cli_schedule_needs_a_meaningful_beta(capsys, extra, match):
    argv = [
        "calibrate",
        "--scheme",
        "fixed_order",
        "--factorization",
        "lr_aware",
        "--dataset-size",
        "2000",
        "--batch-size",
        "100",
        "--epochs",
        "2",
        "--epsilon",
        "3",
        "--delta",
        "1e-5",
        *extra,
    ]
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err


# -- one event currency: dpmf's events are dp_accounting.DpEvents ---------------------------------


def test_dpmf_events_are_dp_accounting_events_composed_as_they_are():
    import dp_accounting
    from dp_accounting.pld import PLDAccountant as LibraryPLD

    from dpmf import PrivatePlan
    from dpmf.accountants import PLDAccountant, RDPAccountant, make_accountant
    from dpmf.accountants.events import (
        ComposedEvent,
        GaussianEvent,
        MixtureGaussianEvent,
        PoissonGaussianEvent,
    )

    plan = PrivatePlan(10_000, 100, steps=300, scheme="cyclic_poisson", strategy="bsr:3")
    event = plan.event(1.1)
    assert isinstance(event, dp_accounting.DpEvent) and plan.to_dp_event(1.1) == event
    # dp-accounting's own accountant composes dpmf's event and dpmf's own one of that grid agrees
    lib = LibraryPLD(value_discretization_interval=1e-4)
    lib.compose(ComposedEvent((event, GaussianEvent(8.0, 2))))
    mine = PLDAccountant().epsilon(ComposedEvent((event, GaussianEvent(8.0, 2))), 1e-6).epsilon
    assert mine == pytest.approx(lib.get_epsilon(1e-6), rel=1e-9)
    # a dpmf event equals the one built by hand from dp-accounting's classes, both ways
    hand = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.03, dp_accounting.GaussianDpEvent(1.1)), 100
    )
    assert event == hand and hand == event and hash(event) == hash(hand)
    assert event != PoissonGaussianEvent(1.1, 0.03, 99)
    # and a hand-built one is measured by dpmf's accountants exactly as dpmf's
    assert RDPAccountant().epsilon(hand, 1e-6).epsilon == RDPAccountant().epsilon(event, 1e-6).epsilon
    # the balls-in-bins mixture is a DpEvent that only the Monte Carlo accountant measures
    mixture = MixtureGaussianEvent(1.0, np.eye(3), 2)
    assert isinstance(mixture, dp_accounting.DpEvent)
    assert not lib.supports(mixture) and not PLDAccountant().supports(mixture)
    assert make_accountant("monte_carlo").supports(mixture)
    with pytest.raises(TypeError, match="not an event dpmf's accountants measure"):
        ComposedEvent((dp_accounting.LaplaceDpEvent(1.0),))
    # frozen, as every DpEvent, and its σ rescaled only by a new event
    with pytest.raises(AttributeError):
        event.count = 3
    assert event.with_noise(2.2) == PoissonGaussianEvent(2.2, 0.03, 100)
