"""The accountant registry: each accountant a specification object (name, the events it
measures, its own settings) in one ``ACCOUNTANTS``; the names are spelled nowhere else."""

import ast
import dataclasses
import math
import pathlib
from dataclasses import dataclass
from typing import ClassVar

import pytest

from dpmf.accountants import (
    ACCOUNTANTS,
    AccountantSpec,
    GaussianEvent,
    MixtureGaussianEvent,
    MonteCarloAccountant,
    PLDAccountant,
    PoissonGaussianEvent,
    accountants_for,
    gaussian_epsilon,
    gaussian_mu,
    make_accountant,
    register_accountant,
)
from dpmf.accountants.calibration import calibrate_event
from dpmf.accountants.registry import PLD, PRV, MonteCarlo, get_accountant
from dpmf.accountants.result import Measurement

ROOT = pathlib.Path(__file__).resolve().parent.parent / "dpmf"


def test_one_registry_in_order_with_the_event_types_each_accountant_measures():
    assert tuple(ACCOUNTANTS) == ("pld", "rdp", "prv", "monte_carlo", "allocation_pld")
    assert accountants_for(PoissonGaussianEvent) == ("pld", "rdp", "prv")
    assert accountants_for(MixtureGaussianEvent) == ("monte_carlo", "allocation_pld")
    assert accountants_for(MixtureGaussianEvent, randomized=False) == ("allocation_pld",)
    # the declared event types agree with each accountant's own exact test
    poisson = PoissonGaussianEvent(1.0, 0.01, 10)
    for name, cls in ACCOUNTANTS.items():
        assert cls().supports(poisson) == (PoissonGaussianEvent in cls.events), name


def test_specifications_hold_the_settings_and_build_the_accountants():
    mc = make_accountant("monte_carlo", samples=1000, seed=7, confidence=None, progress=False)
    assert isinstance(mc, MonteCarloAccountant)
    assert (mc.samples, mc.seed, mc.confidence, mc.progress) == (1000, 7, None, False)
    pld = make_accountant("pld", samples=5, seed=3)  # Monte Carlo settings are not PLD's
    assert isinstance(pld, PLDAccountant) and pld.value_discretization_interval == 1e-4
    assert make_accountant("pld", value_discretization_interval=1e-3).value_discretization_interval == 1e-3
    spec = MonteCarlo(samples=10, confidence=0.95)
    assert spec.build().confidence == 0.95 and MonteCarlo.randomized and not PLD.randomized
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.samples = 11
    assert PRV().build().eps_error == 0.01


def test_bad_settings_and_names_are_refused_before_any_work():
    with pytest.raises(ValueError, match="samples=0 is invalid"):
        MonteCarlo(samples=0)
    with pytest.raises(ValueError, match="accountant='gdp' is invalid: must be one of pld, rdp, prv"):
        get_accountant("gdp")
    with pytest.raises(ValueError, match="accountant='gdp' is invalid"):
        make_accountant("gdp")


class _Analytic:
    """μ-GDP accounting of Gaussian events (exact for them)."""

    name = "analytic_gdp"

    def supports(self, event):
        return isinstance(event, GaussianEvent)

    def epsilon(self, event, delta):
        return Measurement(gaussian_epsilon(event.mu, delta), delta, self.name, "upper_bound", "GDP")


def test_a_registered_accountant_is_calibrated_by_the_generic_calibrator():
    @register_accountant
    @dataclass(frozen=True)
    class AnalyticGDP(AccountantSpec):
        name: ClassVar[str] = "analytic_gdp"
        events: ClassVar[tuple] = (GaussianEvent,)

        def build(self):
            return _Analytic()

    try:
        n, eps, delta = 100, 2.0, 1e-5
        sigma, meas, _ = calibrate_event(GaussianEvent(1.0, n), eps, delta, "analytic_gdp", rtol=1e-4)
        exact = math.sqrt(n) / gaussian_mu(eps, delta)  # Balle & Wang: the smallest σ
        assert meas.epsilon <= eps and exact <= sigma <= exact * (1 + 2e-4)
        assert accountants_for(GaussianEvent)[-1] == "analytic_gdp"
    finally:
        ACCOUNTANTS.pop("analytic_gdp")


def test_accountant_names_are_not_listed_outside_the_registry():
    """No tuple, list or set literal in dpmf names two or more accountants (a second list of
    names would drift from the registry)."""
    names = set(ACCOUNTANTS)
    found = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).as_posix() == "accountants/registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                spelled = {e.value for e in node.elts if isinstance(e, ast.Constant)} & names
                if len(spelled) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(spelled)}")
    assert found == []
