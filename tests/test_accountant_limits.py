"""Accountants at their limits: prv-accountant's discretization failure falls back to PLD with a
notice; Monte Carlo sample counts beyond reach and confidences below one half are refused; the
Gaussian profile beyond its exact range is a tight upper bound; noise multipliers so small that
1/σ² overflows give ε = ∞ with a reason (or a refusal); PLD names RDP at a δ it cannot resolve."""

import math

import mpmath
import pytest
from cli_helpers import SINGLE, _one_line_error
from scipy.stats import norm

from dpmf import calibrate, cli
from dpmf.accountants import samples_needed
from dpmf.accountants.calibration import check_monte_carlo
from dpmf.accountants.events import GaussianEvent, PoissonGaussianEvent
from dpmf.accountants.gaussian import EXACT_MAX_MU, gaussian_delta, gaussian_epsilon, gaussian_mu
from dpmf.accountants.library import (
    DeltaTooSmallError,
    NoiseTooSmallError,
    PLDAccountant,
    RDPAccountant,
)
from dpmf.accountants.montecarlo import (
    MIN_CONFIDENCE,
    MonteCarloAccountant,
    TooManySamplesError,
    sample_limit,
    sample_privacy_losses,
)

BINS = ["--scheme", "balls_in_bins", "--noise-multiplier", "1", "--dataset-size", "1000"]
BINS += ["--batch-size", "100", "--epochs", "2"]


# --- prv-accountant's discretization failure ------------------------------------------------


def test_prv_discretization_failure_falls_back_to_pld_with_a_notice(capsys):
    # prv-accountant raises "Discrete mean differs from continuous mean significantly" here
    # (as for σ = 0.8, q = 1/8, 1000 steps, δ = 1e-6, where PLD gives 56.726)
    import json

    argv = ["epsilon", "--scheme", "poisson", "--noise-multiplier", "0.8", "--dataset-size", "800"]
    argv += ["--batch-size", "100", "--steps", "100", "--delta", "1e-6", "--accountant", "prv", "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    pld = PLDAccountant().epsilon(PoissonGaussianEvent(0.8, 0.125, 100), 1e-6)
    assert result["epsilon"] == pytest.approx(pld.epsilon, rel=1e-12)
    assert result["accountant"] == "pld" and result["guarantee"] == "upper_bound"
    assert "prv-accountant failed" in result["method"]
    assert "pld accountant instead" in out.err and "Traceback" not in out.err


# --- Monte Carlo sample counts beyond reach -----------------------------------------------


def test_monte_carlo_refuses_a_sample_count_above_the_limit_before_sampling(capsys):
    need = samples_needed(1e-5, ratio=0.5, confidence=0.99)
    assert cli.main(["epsilon", *BINS, "--delta", "1e-5", "--max-samples", "1000"]) == 2
    line = _one_line_error(capsys, "epsilon")
    assert f"samples={need:.3g}" in line and "max_samples=1e+03" in line
    assert "would take about" in line


def test_monte_carlo_default_limit_refuses_delta_1e_12_with_the_count_and_time(capsys):
    need = samples_needed(1e-12, ratio=0.5, confidence=0.99)
    assert need > 10**13  # about 8.8e13: months of sampling
    assert cli.main(["epsilon", *BINS, "--delta", "1e-12"]) == 2
    line = _one_line_error(capsys, "epsilon")
    assert f"samples={need:.3g}" in line
    assert "days" in line or "years" in line


def test_sample_limit_and_max_samples_parameter():
    event = GaussianEvent(1.0)
    with pytest.raises(TooManySamplesError, match="max_samples=10"):
        sample_privacy_losses(event, 11, max_samples=10)
    with sample_limit(10), pytest.raises(TooManySamplesError):
        sample_privacy_losses(event, 11)
    assert sample_privacy_losses(event, 10, max_samples=10).samples == 10
    acc = MonteCarloAccountant(samples=5000, max_samples=4999)
    with pytest.raises(TooManySamplesError, match="samples=5e\\+03"):
        acc.epsilon(event, 0.01)


# --- noise multipliers so small that 1/σ² overflows ----------------------------------------


def _exact_delta(mu, eps, digits=60):
    """δ(ε) of μ-GDP in mpmath at high precision (no cancellation)."""
    with mpmath.workdps(digits):
        mu, eps = mpmath.mpf(mu), mpmath.mpf(eps)
        cdf = lambda x: mpmath.ncdf(x)  # noqa: E731
        return cdf(-eps / mu + mu / 2) - mpmath.exp(eps) * cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("mu", [2e3, 1e5, 1e8])
def test_gaussian_epsilon_beyond_the_exact_range_is_a_tight_upper_bound(mu):
    delta = 1e-5
    eps = gaussian_epsilon(mu, delta)
    assert mu > EXACT_MAX_MU
    assert _exact_delta(mu, eps) <= delta  # a valid ε
    # and tight: the exact ε (found in mpmath) is within a relative 1e-5
    with mpmath.workdps(60):
        exact = mpmath.findroot(lambda e: _exact_delta(mu, e) - delta, eps)
    assert float(exact) <= eps <= float(exact) * (1 + 1e-5)


def test_gaussian_profile_at_infinite_mu():
    assert gaussian_epsilon(math.inf, 1e-5) == math.inf
    assert gaussian_delta(math.inf, 10.0) == 1.0
    assert gaussian_epsilon(1e300, 1e-5) == math.inf  # μ²/2 overflows


def test_gaussian_mu_for_an_enormous_epsilon():
    delta = 1e-5
    z = norm.isf(delta)
    for eps in (1e6, 1e100, 1e300):
        mu = gaussian_mu(eps, delta)
        assert mu == pytest.approx(math.sqrt(z * z + 2 * eps) - z, rel=1e-9)
        assert gaussian_delta(mu, eps) <= delta
    assert _exact_delta(gaussian_mu(1e6, delta), 1e6) <= delta


@pytest.mark.parametrize("sigma", ["1e-300", "1e-155"])
def test_tiny_noise_multiplier_gives_infinite_epsilon_with_a_reason(sigma, capsys):
    argv = ["epsilon", *SINGLE, "--noise-multiplier", sigma, "--delta", "1e-5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "epsilon           inf" in out.out
    assert "noise is negligible" in out.out and "Traceback" not in out.err
    for acc in ("rdp", "prv"):
        assert cli.main([*argv, "--accountant", acc]) == 0
        assert "epsilon           inf" in capsys.readouterr().out


def test_calibrate_enormous_epsilon_returns_the_tiny_sigma(capsys):
    argv = ["calibrate", *SINGLE, "--epsilon", "1e300", "--delta", "1e-5", "--json"]
    assert cli.main(argv) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    z = norm.isf(1e-5)
    assert result["noise_multiplier"] == pytest.approx(1.0 / (math.sqrt(z * z + 2e300) - z), rel=1e-9)
    assert result["epsilon"] <= 1e300


def test_rdp_refuses_a_subsampled_noise_multiplier_whose_square_underflows():
    # dp-accounting's RDP answered ε = 0 here (and divided by zero at 1e-200)
    for sigma in (1e-160, 1e-200):
        with pytest.raises(NoiseTooSmallError, match="noise_multiplier=1e-.*rdp.*>= 1e-50"):
            RDPAccountant().epsilon(PoissonGaussianEvent(sigma, 0.1, 10), 1e-5)
    assert RDPAccountant().epsilon(PoissonGaussianEvent(1e-40, 0.1, 10), 1e-5).epsilon > 1e70


# --- PLD at a δ it cannot resolve ----------------------------------------------------------


def test_pld_names_rdp_when_delta_is_below_its_resolution(capsys):
    event = PoissonGaussianEvent(3.0, 0.1, 100)
    with pytest.raises(DeltaTooSmallError, match="delta=1e-300 .*pld.*rdp"):
        PLDAccountant().epsilon(event, 1e-300)
    assert math.isfinite(RDPAccountant().epsilon(event, 1e-300).epsilon)
    run = ["--scheme", "poisson", "--dataset-size", "1000", "--batch-size", "100", "--steps", "100"]
    assert cli.main(["epsilon", *run, "--noise-multiplier", "3", "--delta", "1e-300"]) == 2
    assert "accountant='rdp'" in _one_line_error(capsys, "epsilon")
    assert cli.main(["calibrate", *run, "--epsilon", "1", "--delta", "1e-300"]) == 2
    line = _one_line_error(capsys, "calibrate")
    assert "accountant='rdp'" in line and "1e6" not in line
    with pytest.raises(DeltaTooSmallError):
        calibrate("poisson", epsilon=1.0, delta=1e-300, dataset_size=1000, batch_size=100, steps=100)


# --- a confidence too low to call the answer certified --------------------------------------


def test_confidence_below_one_half_is_refused(capsys):
    with pytest.raises(ValueError, match="confidence=0.0001 is invalid: must be in \\[0.5, 1\\)"):
        MonteCarloAccountant(confidence=1e-4)
    with pytest.raises(ValueError, match="confidence"):
        check_monte_carlo(None, 0, 0.3)
    assert MonteCarloAccountant(confidence=MIN_CONFIDENCE).confidence == 0.5
    assert cli.main(["epsilon", *BINS, "--delta", "1e-5", "--confidence", "0.0001"]) == 2
    assert "confidence=0.0001" in _one_line_error(capsys, "epsilon")
