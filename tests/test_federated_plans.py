"""The federated privacy modes build their step from one plan; their outputs are those recorded
(a run of the code before the change with the same seeds: its weights' sums, since as the
fingerprint of the weights, ``tests/recorded.py``)."""

import numpy as np
import pytest
import torch
from recorded import assert_recorded, distance, fingerprint
from torch import nn

from dpmf.federated import local
from dpmf.federated.models import get_weights
from dpmf.plan import PrivatePlan

X = np.random.default_rng(0).normal(size=(200, 6)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 3, 200).astype(np.int64)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


# Fingerprints of the final weights, recorded with torch 2.13 on CPU (AVX2 kernels). Measured with
# ``distance``: their spread between the AVX2 and the scalar kernels (ATEN_CPU_CAPABILITY=default),
# at one and two threads, is 6.9e-8 (aggregator) and 2.5e-7 (record); the sums of the weights
# recorded first (another CPU) are up to 1.2e-6 ‖w‖₂ from this CPU's. σ × 1.1 moves them by 3.3e-2
# and 2.0e-2, one step fewer by 2.3e-2 and 0.17, another seed by 0.50 and 0.80: the tolerance is
# 40× the largest spread, 2000× below the nearest perturbed run.
RECORDED = {
    "aggregator": [2.0896545473065684, 0.8246679771691561, 0.0995652146296945, 0.02790179959198366,
                   0.4516793160170535, -0.016772547405527242],
    "record": [2.226859907844148, 2.5595898253377527, -0.14828703866223958, 0.11107941333863586,
               0.1325857845212448, -0.011824206472096185],
}  # fmt: skip
TOLERANCE = 1e-5


def _aggregator(seed=11):
    m = _model()
    sigmas = np.array([1.0] * 3 + [2.0] * 4 + [1.0] * 3)
    return local.AggregatorDPSGD(X, Y, m, sigmas=sigmas, clip_norm=1.0, batch_size=20, lr=0.3, seed=seed), m


def _record(seed=5):
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
        seed=seed,
    )
    return run, m


def _record_weights(run, m):
    w, _ = run.train_round(get_weights(m), 3)
    w, _ = run.train_round(w, 3)
    return w


@pytest.mark.recorded
def test_aggregator_is_one_plan_with_noise_by_segment_and_unchanged_weights():
    agg, m = _aggregator()
    plan = agg.step.plan
    assert isinstance(plan, PrivatePlan) and plan.noise_segments == ((3, 1.0), (4, 2.0), (3, 1.0))
    privatizer = agg.step.privatizer
    w = agg.run(agg.run(get_weights(m), 5), 5)
    assert agg.step.privatizer is privatizer  # one privatizer for the whole run
    assert_recorded(fingerprint(w), RECORDED["aggregator"], TOLERANCE)


@pytest.mark.recorded
def test_record_mode_with_a_registry_optimizer_gives_the_recorded_weights():
    run, m = _record()
    assert not hasattr(run, "config")  # no stand-in training configuration
    assert_recorded(fingerprint(_record_weights(run, m)), RECORDED["record"], TOLERANCE)


def test_runs_of_another_seed_are_outside_the_recorded_tolerance():
    agg, m = _aggregator(seed=12)
    w = agg.run(agg.run(get_weights(m), 5), 5)
    assert distance(fingerprint(w), RECORDED["aggregator"]) > 1000 * TOLERANCE
    run, m = _record(seed=6)
    assert distance(fingerprint(_record_weights(run, m)), RECORDED["record"]) > 1000 * TOLERANCE


def test_client_level_noise_is_the_plan_of_k_clients_in_r_rounds():
    cl = local.ClientLevelNoise(
        5, 8, noise_multiplier=2.0, clip_norm=1.0, delta=1e-5, factorization="bisr:2", dim=7, seed=3
    )
    assert (cl.plan.dataset_size, cl.plan.batch_size, cl.plan.steps) == (5, 5, 8)
    assert cl.plan.scheme.name == "fixed_order" and cl.plan.label == "bisr:2"
    assert cl.std_on_sum == pytest.approx(2.0 / np.sqrt(8) * cl.plan.sensitivity)
    assert cl.privacy.epsilon == pytest.approx(6.57297007, rel=1e-6)
    z = np.stack([cl.next() for _ in range(8)])
    assert float(z.sum()) == pytest.approx(10.186957203935906, rel=1e-9)
