"""``pick`` returns calibrated plans, and ``factorization="auto"`` trains the winner's plan as
pick built and calibrated it (no second factorization, no second calibration)."""

import pytest

import dpmf.train.planning as run_module
from dpmf import calibrate
from dpmf.pick import pick
from dpmf.plan import PrivatePlan
from dpmf.train.config import TrainConfig
from dpmf.workloads import Schedule

N, B, STEPS, EPS, DELTA = 1000, 100, 30, 4.0, 1e-5
SCHED = Schedule("cosine", 0.1)


@pytest.fixture(scope="module")
def result():
    return pick(
        dataset_size=N,
        batch_size=B,
        steps=STEPS,
        epsilon=EPS,
        delta=DELTA,
        schedule=SCHED,
        max_bands=4,
        progress=False,
        jobs=1,
    )


def test_every_entry_carries_its_calibrated_plan(result):
    for e in result.ranking:
        plan = e.plan
        assert isinstance(plan, PrivatePlan)
        assert plan.label == e.factorization and plan.scheme.name == e.scheme
        assert plan.noise_multiplier == e.noise_multiplier and plan.privacy.epsilon == e.epsilon
        assert plan.privacy.factorization == e.factorization and plan.privacy.sensitivity == plan.sensitivity
        assert plan.schedule == SCHED and plan.steps == STEPS  # the run's schedule, not a constant one
    rec = result.recommendation.plan
    fresh = PrivatePlan(N, B, steps=STEPS, scheme=rec.scheme.name, strategy=rec.label, schedule=SCHED)
    # an independent calibration of the same run finds the same σ
    assert calibrate(fresh, epsilon=EPS, delta=DELTA).noise_multiplier == pytest.approx(rec.noise_multiplier)
    assert "plan" not in result.to_dict()["recommendation"]


def test_auto_trains_the_winner_without_building_or_calibrating_it_again(result, monkeypatch):
    import dpmf.plan.pick

    calls = {"calibrate": 0}
    monkeypatch.setattr(dpmf.plan.pick, "pick", lambda **kw: result)
    original = PrivatePlan.calibrate

    def counting(self, *a, **k):
        calls["calibrate"] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(PrivatePlan, "calibrate", counting)
    config = TrainConfig(
        dataset="digits",
        factorization="auto",
        epochs=3,
        batch_size=B,
        epsilon=EPS,
        delta=DELTA,
        schedule="cosine",
        beta=0.1,
        max_bands=4,
    )
    config, plan = run_module.plan_for(config, N, log=lambda *a: None)
    won = result.recommendation.plan  # the winner itself, with the run's clip norm and seed policy
    assert plan.strategy is won.strategy and plan.privacy is won.privacy and calls["calibrate"] == 0
    assert plan.noise_multiplier == won.noise_multiplier and plan.clip_norm == config.clip_norm
    assert config.factorization == plan.label and config.scheme == plan.scheme.name
