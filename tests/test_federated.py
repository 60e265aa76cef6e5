"""Federated learning on Flower: compliance maps, data, strategy parity and the privacy units."""

import math

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from dpmf.federated.compliance import (  # noqa: E402
    CRITERIA,
    NoiseMap,
    example_profiles,
    load_profiles,
    uniform_control,
)
from dpmf.federated.data import PARTITIONS, load_federated, partition  # noqa: E402
from dpmf.federated.grid import LocalGrid, server_identity  # noqa: E402
from dpmf.federated.ledger import VACUOUS_EPSILON, PrivacyEntry, format_entry  # noqa: E402
from dpmf.federated.strategies import STRATEGIES, make_strategy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- compliance ------------------------------------------------------------------------------


def test_score_is_the_weighted_mean_of_the_five_criteria(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "weights: {hipaa: 4, gdpr: 1, nist: 0, iso: 0, hl7_fhir: 0}\n"
        "compliant_threshold: 0.7\n"
        "clients:\n"
        "  - {id: a, hipaa: 1.0, gdpr: 0.5, nist: 0.0, iso: 0.0, hl7_fhir: 0.0}\n"
        "  - {id: b, hipaa: 0.5, gdpr: 0.0, nist: 1.0, iso: 1.0, hl7_fhir: 1.0}\n"
    )
    comp = load_profiles(path)
    np.testing.assert_allclose(comp.scores(), [(4 * 1.0 + 0.5) / 5, (4 * 0.5) / 5])
    assert comp.compliant().tolist() == [True, False]
    equal = load_profiles(path, weights=dict.fromkeys(CRITERIA, 1.0))
    np.testing.assert_allclose(equal.scores(), [1.5 / 5, 3.5 / 5])


@pytest.mark.parametrize(
    "text, match",
    [
        ("clients:\n  - {id: a, hipaa: 1.2, gdpr: 1, nist: 1, iso: 1, hl7_fhir: 1}\n", "a.hipaa=1.2"),
        ("clients:\n  - {id: a, hipaa: 1, gdpr: 1, nist: 1, iso: 1}\n", "missing \\['hl7_fhir'\\]"),
        ("clients: 3\n", "'clients' list"),
    ],
)
def test_bad_profiles_are_refused_by_name(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_profiles(path)


def test_example_has_a_quarter_compliant_clients():
    comp = example_profiles(16)
    assert int(comp.compliant().sum()) == 4 and len(comp) == 16
    assert int(example_profiles(8).compliant().sum()) == 2
    assert int(example_profiles(4).compliant().sum()) == 1
    s = comp.scores()
    assert s[:4].min() > 0.8 > s[4:].max()


@pytest.mark.parametrize("kind", ["linear", "exponential"])
def test_noise_maps_hit_their_endpoints_and_never_increase(kind):
    m = NoiseMap(kind, 0.5, 2.0)
    s = np.linspace(0, 1, 101)
    sig = m(s)
    assert sig[0] == pytest.approx(2.0) and sig[-1] == pytest.approx(0.5)
    assert np.all(np.diff(sig) <= 0)
    mid = 2.0 - 1.5 * 0.3 if kind == "linear" else 2.0 * (0.25**0.3)
    assert m(0.3) == pytest.approx(mid)


def test_table_map_is_a_step_function_and_is_validated():
    m = NoiseMap("table", table=((0, 2.0), (0.5, 1.2), (0.8, 0.8)))
    np.testing.assert_allclose(m([0.0, 0.49, 0.5, 0.79, 0.8, 1.0]), [2.0, 2.0, 1.2, 1.2, 0.8, 0.8])
    with pytest.raises(ValueError, match="must not increase"):
        NoiseMap("table", table=((0, 1.0), (0.5, 1.2)))
    with pytest.raises(ValueError, match="must be 0"):
        NoiseMap("table", table=((0.1, 1.0),))
    with pytest.raises(ValueError, match="sigma_min"):
        NoiseMap("linear", 3.0, 2.0)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        NoiseMap()(1.5)


def test_uniform_control_keeps_the_mean_noise():
    sig = NoiseMap()(example_profiles(16).scores())
    u = uniform_control(sig)
    assert np.ptp(u) == 0 and u.mean() == pytest.approx(sig.mean())


def test_ledger_flags_vacuous_epsilon_and_says_what_it_protects():
    e = PrivacyEntry(
        "aggregator", "aggregator-dataset records", "agg", 12.0, 1e-5, "pld", "upper_bound", 1, 5, 9
    )
    assert e.vacuous and "VACUOUS" in format_entry(e) and "aggregator-dataset records" in format_entry(e)
    ok = PrivacyEntry("client", "client", "all", VACUOUS_EPSILON, 1e-5, "pld", "upper_bound", 1, 5, 9)
    assert not ok.vacuous and "VACUOUS" not in format_entry(ok)
    with pytest.raises(ValueError, match="mode"):
        PrivacyEntry("server", "x", "x", 1.0, 1e-5, "pld", "upper_bound", 1, 1, 1)


# -- data --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", PARTITIONS)
def test_partitions_are_disjoint_cover_and_non_empty(scheme):
    y = np.repeat(np.arange(4), 50)
    parts = partition(y, 8, scheme, alpha=1.0, shards=2, seed=3)
    allidx = np.concatenate(parts)
    assert len(parts) == 8 and all(p.size for p in parts)
    assert np.array_equal(np.sort(allidx), np.arange(200))
    if scheme == "shards":  # 16 label-sorted shards of 12-13 examples: each spans at most 2 labels
        assert max(np.unique(y[p]).size for p in parts) <= 4
        assert min(np.unique(y[p]).size for p in parts) <= 2
    if scheme == "iid":
        assert {p.size for p in parts} == {25}


def test_dirichlet_skews_labels_more_at_small_alpha():
    y = np.repeat(np.arange(2), 500)

    def spread(alpha):
        parts = partition(y, 10, "dirichlet", alpha=alpha, seed=0)
        return np.mean([abs(y[p].mean() - 0.5) for p in parts])

    assert spread(0.1) > spread(100.0) + 0.1


def test_breast_cancer_stand_in_splits_569_patients():
    d = load_federated("breast-cancer", 16)
    total = sum(d.client_sizes()) + d.aggregator_y.size + d.test_y.size
    assert total == 569 and d.num_clients == 16 and d.input_shape == (1, 1, 30)
    assert d.test_y.size == 114 and d.aggregator_y.size == 46


# -- strategy parity ---------------------------------------------------------------------------


def _fake_clients(rng, shapes, n=4):
    arrays = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(n)]
    weights = [3, 1, 5, 2]
    return arrays, weights


def _grid_returning(arrays, weights):
    app = ClientApp()

    @app.train()
    def train(msg, context):
        j = int(context.node_config["partition-id"])
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in arrays[j].items()}),
                "metrics": MetricRecord({"num-examples": weights[j]}),
            }
        )
        return Message(content=content, reply_to=msg)

    return LocalGrid(app, len(arrays))


@pytest.mark.parametrize("name", STRATEGIES)
def test_one_round_of_each_flower_strategy_matches_an_independent_computation(name):
    from flwr.serverapp import strategy as fs

    rng = np.random.default_rng(0)
    shapes = {"w": (3, 2), "b": (2,)}
    current = {k: rng.normal(size=s) for k, s in shapes.items()}
    arrays, weights = _fake_clients(rng, shapes)
    strat = make_strategy(name, 4, proximal_mu=0.3, server_lr=0.05)
    cls = {"fedavg": fs.FedAvg, "fedmedian": fs.FedMedian, "fedprox": fs.FedProx}
    cls.update(fedadam=fs.FedAdam, fedyogi=fs.FedYogi)
    assert type(strat) is cls[name]
    grid = _grid_returning(arrays, weights)
    with server_identity():
        msgs = list(
            strat.configure_train(
                1, ArrayRecord({k: Array(v) for k, v in current.items()}), ConfigRecord(), grid
            )
        )
        replies = grid.send_and_receive(msgs)
    if name == "fedprox":
        assert all(m.content["config"]["proximal-mu"] == 0.3 for m in msgs)
    out, _ = strat.aggregate_train(1, replies)
    got = {k: a.numpy() for k, a in out.items()}
    w = np.array(weights, dtype=np.float64) / sum(weights)
    for k in shapes:
        stack = np.stack([a[k] for a in arrays])
        mean = np.tensordot(w, stack, axes=1)
        if name in ("fedavg", "fedprox"):
            want = mean
        elif name == "fedmedian":
            want = np.median(stack, axis=0)
        else:  # Reddi et al. 2021, Algorithm 2, first round: m = (1-β1)Δ, v from 0
            b1, b2, eta, tau = 0.9, 0.99, 0.05, 1e-3
            delta = mean - current[k]
            m = (1 - b1) * delta
            if name == "fedadam":  # with Flower's bias correction at t = round + 1 = 2
                v = (1 - b2) * delta**2
                step = eta * math.sqrt(1 - b2**2) / (1 - b1**2)
            else:  # Yogi: v = v0 - (1-β2)Δ² sign(v0 - Δ²), v0 = 0
                v = (1 - b2) * delta**2
                step = eta
            want = current[k] + step * m / (np.sqrt(v) + tau)
        np.testing.assert_allclose(got[k], want, rtol=0, atol=1e-12)
        assert got[k].dtype == np.float64


# -- accounting --------------------------------------------------------------------------------


def test_aggregator_epsilon_is_the_pld_composition_of_the_per_step_noise():
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    from dpmf.federated.local import AGGREGATOR_PLD_GRID, aggregator_privacy

    sig = NoiseMap(sigma_min=1.5, sigma_max=3.0)(example_profiles(4).scores())
    steps = np.tile(np.repeat(sig, 2), 3)  # 3 rounds, 2 server steps per participant
    q, delta = 0.2, 1e-5
    got = aggregator_privacy(steps, sampling_rate=q, delta=delta)
    ref = PLDAccountant(value_discretization_interval=AGGREGATOR_PLD_GRID)
    for s in steps:  # one step at a time, in the order they run
        ref.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(float(s))))
    assert got.epsilon == pytest.approx(ref.get_epsilon(delta), rel=1e-6)
    assert got.steps == steps.size and len(got.details["segments"]) == 4


def test_raising_any_clients_noise_never_raises_aggregator_epsilon():
    from dpmf.federated.local import aggregator_privacy

    sig = NoiseMap(sigma_min=1.5, sigma_max=3.0)(example_profiles(4).scores())
    base = aggregator_privacy(np.tile(sig, 2), sampling_rate=0.25, delta=1e-5).epsilon
    for k in range(sig.size):
        more = sig.copy()
        more[k] *= 1.3
        eps = aggregator_privacy(np.tile(more, 2), sampling_rate=0.25, delta=1e-5).epsilon
        assert eps < base


def test_client_mode_epsilon_with_independent_noise_equals_flowers_rdp_accountant():
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    from dpmf.accountants import gaussian_epsilon
    from dpmf.federated.local import ClientLevelNoise

    K, R, sigma, delta = 8, 20, 1.3, 1e-5
    mine = ClientLevelNoise(
        K, R, noise_multiplier=sigma, clip_norm=1.0, delta=delta, accountant="rdp", dim=3, seed=0
    )
    cfg = PrivacyConfig(delta, K, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    flower = RdpAccountant(cfg)
    flower.compose(GaussianPrivacyEvent(sigma, K, K), count=R)
    assert mine.privacy.epsilon == pytest.approx(flower.get_epsilon(delta), rel=1e-9)
    # with PLD (the default), the exact Gaussian-mechanism ε at μ = √R/σ, below RDP's
    pld = ClientLevelNoise(K, R, noise_multiplier=sigma, clip_norm=1.0, delta=delta, dim=3, seed=0)
    assert pld.privacy.epsilon == pytest.approx(gaussian_epsilon(math.sqrt(R) / sigma, delta), rel=1e-6)
    assert pld.privacy.epsilon < mine.privacy.epsilon
    assert pld.std_on_sum == pytest.approx(sigma)  # σ_c·ζ per round, Flower's convention


def test_correlated_client_noise_has_the_covariance_of_its_strategy():
    from dpmf.federated.local import ClientLevelNoise

    R, sigma = 6, 2.0
    noise = ClientLevelNoise(
        4,
        R,
        noise_multiplier=sigma,
        clip_norm=0.5,
        delta=1e-5,
        factorization="sqrt_prefix",
        dim=20000,
        seed=1,
    )
    z = np.stack([noise.next() for _ in range(R)])  # (R, d)
    from dpmf.mechanisms import factorize
    from dpmf.workloads import prefix_sum

    Ci = np.linalg.inv(factorize(prefix_sum(R), "sqrt_prefix").C.dense())
    scale = sigma / math.sqrt(R) * 0.5 * noise.privacy.sensitivity
    cov = z @ z.T / z.shape[1]
    np.testing.assert_allclose(cov, scale**2 * Ci @ Ci.T, atol=0.05 * scale**2)
    # the same ε as R independent rounds at σ_c (the accountant's σ is σ_c/√R on C·G)
    indep = ClientLevelNoise(4, R, noise_multiplier=sigma, clip_norm=0.5, delta=1e-5, dim=2, seed=1)
    assert noise.privacy.epsilon == pytest.approx(indep.privacy.epsilon, rel=1e-9)
    assert noise.privacy.sensitivity != pytest.approx(math.sqrt(R))


def test_client_mode_mean_is_the_clipped_mean_plus_one_noise_before_the_server_optimizer():
    from dpmf.federated.local import ClientLevelNoise
    from dpmf.federated.run import FLConfig, _Server, participants

    cfg = FLConfig(num_clients=4, rounds=3, privacy="client", strategy="fedadam", client_clip=0.5)
    comp = example_profiles(4)
    idx, sig = participants(cfg, comp)
    data = load_federated("breast-cancer", 4)
    server = _Server(cfg, data, comp, idx, sig, log=lambda *_: None, key=0)
    rng = np.random.default_rng(5)
    base = {k: v.astype(np.float64) for k, v in server.initial.items()}
    updates = [{k: rng.normal(scale=s, size=v.shape) for k, v in base.items()} for s in (0.01, 0.1, 1.0, 3.0)]
    arrays = [{k: (base[k] + u[k]).astype(np.float32) for k in base} for u in updates]
    grid = _grid_returning(arrays, [7, 1, 2, 9])
    rec = ArrayRecord({k: Array(v.astype(np.float32)) for k, v in base.items()})
    with server_identity():
        replies = grid.send_and_receive(list(server.strategy.configure_train(1, rec, ConfigRecord(), grid)))
    replies = server.part.privatize(replies, rec, 1)
    # FedAvg's mean of the privatized replies, from Flower's own aggregation
    from flwr.serverapp.strategy import FedAvg

    mean, _ = FedAvg(min_available_nodes=4).aggregate_train(1, replies)
    from dpmf.seeds import child_key

    ref_noise = ClientLevelNoise(
        4, 3, noise_multiplier=float(sig.max()), clip_norm=0.5, delta=1e-5, dim=server.dim,
        seed=child_key(0, "fl-client-noise"),
    )  # fmt: skip
    z = ref_noise.next() / 4
    off = 0
    for k, b in base.items():
        clipped = []
        for u in updates:
            norm = math.sqrt(
                sum(float(np.sum(v.astype(np.float32).astype(np.float64) ** 2)) for v in u.values())
            )
            clipped.append(u[k] * min(1.0, 0.5 / norm))
        want = b + np.mean(clipped, axis=0) + z[off : off + b.size].reshape(b.shape)
        off += b.size
        np.testing.assert_allclose(mean[k].numpy(), want, atol=2e-6)
    assert ref_noise.std_on_sum == pytest.approx(float(sig.max()) * 0.5)
