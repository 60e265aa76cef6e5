"""The federated privacy modes build their step from one plan; their outputs are those recorded
before the change (the record of a run of the earlier code with the same seeds)."""

import numpy as np
import pytest
import torch
from torch import nn

from dpmf.federated import local
from dpmf.federated.models import get_weights
from dpmf.plan import PrivatePlan

X = np.random.default_rng(0).normal(size=(200, 6)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 3, 200).astype(np.int64)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _sums(weights):
    return [float(np.asarray(v, dtype=np.float64).sum()) for v in weights.values()]


def test_aggregator_is_one_plan_with_noise_by_segment_and_unchanged_weights():
    m = _model()
    sigmas = np.array([1.0] * 3 + [2.0] * 4 + [1.0] * 3)
    agg = local.AggregatorDPSGD(X, Y, m, sigmas=sigmas, clip_norm=1.0, batch_size=20, lr=0.3, seed=11)
    plan = agg.step.plan
    assert isinstance(plan, PrivatePlan) and plan.noise_segments == ((3, 1.0), (4, 2.0), (3, 1.0))
    privatizer = agg.step.privatizer
    w = agg.run(agg.run(get_weights(m), 5), 5)
    assert agg.step.privatizer is privatizer  # one privatizer for the whole run
    recorded = [0.02752355788834393, 0.09181310329586267, 0.5277877002954483, -0.3637344613671303]
    np.testing.assert_allclose(_sums(w), recorded, rtol=1e-6)


def test_record_mode_with_a_registry_optimizer_gives_the_recorded_weights():
    m = _model()
    run = local.PrivateLocalRun(
        X,
        Y,
        m,
        noise_multiplier=1.1,
        clip_norm=1.0,
        batch_size=20,
        steps=6,
        delta=1e-5,
        optimizer="dp-muon",
        lr=0.2,
        seed=5,
    )
    assert not hasattr(run, "config")  # no stand-in training configuration
    w, _ = run.train_round(get_weights(m), 3)
    w, _ = run.train_round(w, 3)
    recorded = [-0.07413561642169952, 0.09558769315481186, -0.5618666475638747, -0.47799690067768097]
    np.testing.assert_allclose(_sums(w), recorded, rtol=1e-6)


def test_client_level_noise_is_the_plan_of_k_clients_in_r_rounds():
    cl = local.ClientLevelNoise(
        5, 8, noise_multiplier=2.0, clip_norm=1.0, delta=1e-5, factorization="bisr:2", dim=7, seed=3
    )
    assert (cl.plan.dataset_size, cl.plan.batch_size, cl.plan.steps) == (5, 5, 8)
    assert cl.plan.scheme.name == "fixed_order" and cl.plan.label == "bisr:2"
    assert cl.std_on_sum == pytest.approx(2.0 / np.sqrt(8) * cl.plan.sensitivity)
    assert cl.privacy.epsilon == pytest.approx(6.57297007, rel=1e-6)
    z = np.stack([cl.next() for _ in range(8)])
    assert float(z.sum()) == pytest.approx(-3.216952582664211, rel=1e-9)
