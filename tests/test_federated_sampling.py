"""Client sampling per round in client mode: ε against dp-accounting's
PoissonSampledDpEvent(q, GaussianDpEvent(σ)) self-composed over the rounds, the rounds' client
counts, the aggregate divided by the expected count, refusals."""

import numpy as np
import pytest

pytest.importorskip("flwr")

from dpmf.cli import main  # noqa: E402
from dpmf.federated.run import FLConfig, run_federated  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_poisson_client_sampling_epsilon_is_dp_accountings_subsampled_gaussian():
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    cfg = FLConfig(num_clients=8, rounds=5, local_steps=1, privacy="client", client_noise_multiplier=1.2,
                   client_sampling="poisson", clients_per_round=2, seed=0)  # fmt: skip
    res = run_federated(cfg, log=lambda *_: None)
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(2 / 8, dp_accounting.GaussianDpEvent(1.2)), 5)
    want = acc.get_epsilon(1e-5)
    full = run_federated(cfg.replace(client_sampling="all", clients_per_round=None), log=lambda *_: None)
    e = res.ledger[0]
    assert e.epsilon == pytest.approx(want, rel=2e-3) and e.epsilon < full.ledger[0].epsilon
    assert "poisson client sampling" in e.note and len(res.metrics) == 6


def test_sampled_rounds_train_the_sampled_clients_and_divide_by_the_expected_count():
    from dpmf.federated.sampling import SampledClientNoise

    s = SampledClientNoise("fixed", 6, 2, 6, noise_multiplier=1.0, clip_norm=1.0, delta=1e-5, dim=3, seed=1)
    groups = [tuple(s.participants()) for _ in range(6)]
    assert all(len(g) == 2 for g in groups) and len(set(groups[:3])) == 3 and groups[:3] == groups[3:]
    assert s.divisor == 2.0
    # identity noise keeps Flower's σ: N(0, σ²ζ²) on the sum per round (std over many coordinates)
    big = SampledClientNoise("poisson", 10, 3, 2, noise_multiplier=1.5, clip_norm=0.5, delta=1e-5,
                             dim=200_000, seed=2)  # fmt: skip
    assert np.std(big.next()) == pytest.approx(1.5 * 0.5, rel=0.01)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--client-sampling", "poisson"], "needs clients_per_round"),
        (["--clients-per-round", "2"], "clients_per_round is invalid with client_sampling='all'"),
        (["--client-sampling", "poisson", "--clients-per-round", "2", "--privacy", "record"],
         "client sampling is accounted for client-level noise only"),
        (["--client-sampling", "poisson", "--clients-per-round", "2", "--client-factorization", "bisr:2"],
         "accounts DP-SGD (C = I) only"),
    ],
)  # fmt: skip
def test_sampling_settings_are_refused_in_one_line(tmp_path, capsys, extra, match):
    base = ["fl", "--clients", "4", "--rounds", "2", "--privacy", "client"]
    assert main([*base, *extra, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err and not (tmp_path / "x").exists()
