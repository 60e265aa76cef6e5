"""Adaptive clipping in ``CorrelatedClientDP`` (Andrew et al. 2021): the updates' noise
multiplier against its closed form, the clip norm's geometric step against a hand computation
and the wrapper's aggregate round by round, ε against dp-accounting's composition of the two
Gaussian releases."""

import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from flower_helpers import SHAPES, P  # noqa: E402
from flower_helpers import client_app as _app  # noqa: E402
from flower_helpers import fedavg as _strategy  # noqa: E402
from flower_helpers import updates as _updates  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord  # noqa: E402
from flwr.serverapp import strategy as fs  # noqa: E402

from dpmf import seeds  # noqa: E402
from dpmf.federated.adaptive import AdaptiveClipping, adjusted_noise_multiplier, geometric_update  # noqa: E402
from dpmf.federated.grid import LocalGrid, server_identity  # noqa: E402
from dpmf.federated.local import ClientLevelNoise  # noqa: E402
from dpmf.federated.wrappers import CLIP_NORM_KEY, EPSILON_KEY, CorrelatedClientDP  # noqa: E402

R, SIGMA, C1 = 4, 1.5, 0.5


def test_noise_multiplier_adjustment_is_the_closed_form():
    # z = 1, σ_b = 1: (1 − 1/4)^(−1/2) = 2/√3
    assert adjusted_noise_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3), rel=1e-15)
    # z = 1.5, σ_b = 1.5: (1/2.25 − 1/9)^(−1/2) = (1/3)^(−1/2) = √3
    assert adjusted_noise_multiplier(1.5, 1.5) == pytest.approx(math.sqrt(3), rel=1e-15)
    with pytest.raises(ValueError, match="clipped_count_stddev=0.5 is invalid for noise_multiplier=1"):
        adjusted_noise_multiplier(1.0, 0.5)  # z = 2σ_b: the count alone spends the budget
    with pytest.raises(ValueError, match="clipped_count_stddev"):  # the default P/20 = 0.15, σ = 1.5
        CorrelatedClientDP(_strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=C1,
                           adaptive=AdaptiveClipping())  # fmt: skip
    with pytest.raises(ValueError, match="target_clipped_quantile"):
        AdaptiveClipping(target_clipped_quantile=1.5)


def test_geometric_step_by_hand():
    # one of three updates unclipped, γ = 0.5, η = 0.2: C · exp(−0.2·(1/3 − 1/2)) = 0.5·e^(1/30)
    # = 0.5·(1 + 1/30 + 1/1800 + 1/162000 + …)
    assert geometric_update(0.5, 1 / 3, 0.5, 0.2) == pytest.approx(0.5169475568, rel=1e-9)
    assert geometric_update(2.0, 1.0, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.1), rel=1e-15)


def test_each_round_clips_to_the_adapted_norm_and_adds_the_adjusted_noise():
    ad = AdaptiveClipping(target_clipped_quantile=0.5, clip_norm_lr=0.2, clipped_count_stddev=1.5)
    dp = CorrelatedClientDP(_strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=C1,
                            factorization="bisr:2", seed=7, adaptive=ad)  # fmt: skip
    z_delta = math.sqrt(3)  # (1.5⁻² − 3⁻²)^(−1/2)
    assert dp.stream_noise_multiplier == pytest.approx(z_delta, rel=1e-14)
    ref = ClientLevelNoise(P, R, noise_multiplier=z_delta, clip_norm=1.0, delta=1e-5, factorization="bisr:2",
                           dim=9, seed=seeds.child_key(7, "fl-client-noise"))  # fmt: skip
    count_noise = seeds.generator(7, "fl-clip-count")
    grid = LocalGrid(_app(), P)
    w = {k: np.zeros(s, dtype=np.float32) for k, s in SHAPES.items()}
    clip = C1
    with server_identity():
        for r in (1, 2, 3):
            arrays = ArrayRecord({k: Array(v) for k, v in w.items()})
            agg, metrics = dp.aggregate_train(
                r, grid.send_and_receive(dp.configure_train(r, arrays, ConfigRecord({}), grid))
            )
            assert metrics[CLIP_NORM_KEY] == pytest.approx(clip, rel=1e-15)
            norms = (0.1, 1.0, 5.0)  # the updates of ``_updates``
            clipped = [
                {k: u[k] * min(1.0, clip / n) for k in u} for u, n in zip(_updates(r), norms, strict=True)
            ]
            z = ref.noise.next().numpy() * (z_delta / math.sqrt(R)) * clip * ref.plan.sensitivity / P
            off = 0
            for k in ("w", "b"):
                n = int(np.prod(SHAPES[k]))
                want = w[k] + np.mean([c[k] for c in clipped], axis=0) + z[off : off + n].reshape(SHAPES[k])
                off += n
                np.testing.assert_allclose(agg[k].numpy(), want, atol=2e-6)
            w = {k: a.numpy() for k, a in agg.items()}
            unclipped = sum(n <= clip for n in norms)
            clip = clip * math.exp(-0.2 * ((unclipped + count_noise.normal(0.0, 1.5)) / P - 0.5))
            assert dp.current_clip_norm == pytest.approx(clip, rel=1e-14)


def test_epsilon_with_adaptive_clipping_is_dp_accountings_two_gaussian_composition():
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    sb = 1.5
    z_delta = adjusted_noise_multiplier(SIGMA, sb)
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z_delta), R),   # the updates
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2 * sb), R),    # the counts
    ]))  # fmt: skip
    want = acc.get_epsilon(1e-5)
    for fact in ("identity", "bisr:2"):
        dp = CorrelatedClientDP(_strategy(), num_clients=P, rounds=R, noise_multiplier=SIGMA, clip_norm=C1,
                                factorization=fact,
                                adaptive=AdaptiveClipping(clipped_count_stddev=sb))  # fmt: skip
        dp._build(9)
        assert dp.privacy.epsilon == pytest.approx(want, rel=2e-3)
        # the updates alone at z_Δ would claim less: the count's release is accounted
        assert dp._noise.privacy.epsilon < dp.privacy.epsilon - 0.5


def test_adaptive_clipping_runs_in_flowers_loop_and_reports_the_clip_norm():
    inner = fs.FedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=P, min_available_nodes=P)
    dp = CorrelatedClientDP(inner, num_clients=P, rounds=2, noise_multiplier=SIGMA, clip_norm=0.1,
                            adaptive=AdaptiveClipping(clipped_count_stddev=1.0))  # fmt: skip
    with server_identity():
        w0 = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in SHAPES.items()})
        result = dp.start(LocalGrid(_app(), P), w0, num_rounds=2)
    m = result.train_metrics_clientapp
    assert m[1][CLIP_NORM_KEY] == pytest.approx(0.1) and m[2][CLIP_NORM_KEY] != m[1][CLIP_NORM_KEY]
    assert m[2][EPSILON_KEY] == dp.privacy.epsilon > 0 and "adaptive" in repr(dp)
