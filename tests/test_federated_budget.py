"""``max_epsilon``: the run stops before the round that would exceed it (ε against
dp-accounting's composition of Gaussians), the reason and the last ε in the ledger, refusals."""

import json

import pytest

pytest.importorskip("flwr")

from dpmf.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST = ["--clients", "4", "--sigma-min", "2", "--sigma-max", "4", "--local-steps", "1"]


def _gaussians(sigma, r, delta=1e-5):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(sigma), r)
    return acc.get_epsilon(delta)


def test_client_mode_stops_before_the_round_that_would_exceed_the_budget(tmp_path, capsys):
    sigma = 3.0
    e3, e4 = _gaussians(sigma, 3), _gaussians(sigma, 4)
    cap = (e3 + e4) / 2
    out = tmp_path / "b"
    args = ["fl", *FAST, "--rounds", "6", "--privacy", "client", "--client-noise-multiplier", str(sigma),
            "--max-epsilon", repr(cap), "--seeds", "0", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "stopped before round 4 of 6" in text
    ledger = json.loads((out / "ledger.json").read_text())["seeds"][0]
    entry = ledger["entries"][0]
    assert ledger["rounds_run"] == 3 and entry["steps"] == 3 and "stopped before round 4" in entry["note"]
    assert entry["epsilon"] == pytest.approx(e3, rel=2e-3) and entry["epsilon"] <= cap
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 4  # rounds 0..3


def test_record_mode_budget_is_each_clients_epsilon_after_the_rounds_run(tmp_path, capsys):
    from dpmf.federated.compliance import NoiseMap, example_profiles
    from dpmf.federated.data import load_federated
    from dpmf.federated.local import record_privacy
    from dpmf.federated.run import FLConfig, participants

    _, sigmas = participants(
        FLConfig(num_clients=4, noise_map=NoiseMap("linear", 2.0, 4.0)), example_profiles(4)
    )
    sizes = load_federated("breast-cancer", 4, seed=0).client_sizes()

    def eps(r):
        return [record_privacy(float(s), dataset_size=n, batch_size=8, steps=r, delta=1e-5).epsilon
                for s, n in zip(sigmas, sizes, strict=True)]  # fmt: skip

    cap = (max(eps(2)) + max(eps(3))) / 2
    out = tmp_path / "r"
    args = ["fl", *FAST, "--rounds", "4", "--privacy", "record", "--local-batch-size", "8", "--seeds", "0",
            "--max-epsilon", repr(cap), "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    got = json.loads((out / "ledger.json").read_text())["seeds"][0]
    assert got["rounds_run"] == 2 and [e["epsilon"] for e in got["entries"]] == eps(2)
    assert all(e["steps"] == 2 for e in got["entries"]) and "stopped before round 3 of 4" in got["stopped"]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--privacy", "client", "--client-noise-multiplier", "1", "--max-epsilon", "0.01"],
         "one round already gives ε"),
        (["--privacy", "client", "--client-factorization", "bisr:2", "--max-epsilon", "0.5"],
         "correlated client noise"),
        (["--max-epsilon", "-1"], "max_epsilon=-1"),
    ],
)  # fmt: skip
def test_a_budget_that_cannot_hold_exits_2_before_any_folder(tmp_path, capsys, extra, match):
    out = tmp_path / "never"
    assert main(["fl", *FAST, "--rounds", "3", *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and match in err and not out.exists()
