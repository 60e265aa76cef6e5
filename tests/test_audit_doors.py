"""White-box canaries through every door: make_private (one process and torchrun) and dpmf fl."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audit_door_helpers import SIGMA, audited, train
from scipy import stats

from dpmf.audit import estimators as E
from dpmf.audit import runner as R
from dpmf.optim.batches import BatchCheckError
from dpmf.optim.privatize import Privatizer
from dpmf.step import noise_stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _capture(monkeypatch):
    seen = []
    real = R.estimate

    def spy(method, ins, outs, **kw):
        seen.append((np.array(ins), np.array(outs)))
        return real(method, ins, outs, **kw)

    monkeypatch.setattr(R, "estimate", spy)
    return seen


@pytest.mark.slow
def test_make_private_audit_is_the_dpmf_audit_run_for_the_same_key(monkeypatch, tmp_path):
    # the two doors make the same run (same plan over N + m, key, initial weights, batches,
    # noise, canaries): the canaries' scores agree to rounding
    from dpmf.audit.private_audit import audit_make_private
    from dpmf.train.build import build_optimizer, sub_seed
    from dpmf.train.config import TrainConfig
    from dpmf.train.data import load_dataset
    from dpmf.train.models import build_model

    seen = _capture(monkeypatch)
    cfg = TrainConfig(
        dataset="digits",
        epochs=1,
        batch_size=256,
        epsilon=4.0,
        seed=7,
        scheme="fixed_order",
        factorization="bsr:4",
        device="cpu",
        clipping="vmap",
    )
    data = load_dataset(cfg.dataset, cfg.data_dir)
    res = R.run_audit(cfg, str(tmp_path), canaries=100, progress=False, log=lambda *a: None, data=data)
    model = build_model(cfg.model, data.input_shape, data.num_classes, seed=sub_seed(7, 0))
    audit = audit_make_private(
        model,
        build_optimizer(cfg, model, seed=7),
        torch.utils.data.TensorDataset(data.train_x, data.train_y),
        canaries=100,
        loss_fn=F.cross_entropy,
        batch_size=256,
        epochs=1,
        noise_multiplier=res["plan"]["noise_multiplier"],
        target_delta=cfg.delta,
        factorization="bsr:4",
        scheme="fixed_order",
        seed=7,
        clipping="vmap",
    )
    mine = train(audit).result()
    assert audit.private.plan.dataset_size == res["plan"]["dataset_size"] == len(data) + 100
    (ins_a, outs_a), (ins_b, outs_b) = seen
    assert ins_a.size == ins_b.size and outs_a.size == outs_b.size
    np.testing.assert_allclose(ins_b, ins_a, rtol=0, atol=1e-4)  # float32 model, same operations
    np.testing.assert_allclose(outs_b, outs_a, rtol=0, atol=1e-4)
    assert mine["auroc"] == pytest.approx(res["auroc"], abs=1e-12)
    assert mine["epsilon_lower_bound"] == pytest.approx(res["epsilon_lower_bound"], abs=1e-9)
    assert mine["claimed"]["epsilon"] == pytest.approx(res["claimed"]["epsilon"], rel=1e-9)


def _claimed(sigma=SIGMA):
    from dpmf.plan.plan import PrivatePlan

    plan = PrivatePlan(300 + 200, 50, steps=12, scheme="fixed_order", strategy="identity")
    return plan.account(sigma, delta=1e-5).epsilon


def _bound(audit, claimed_delta=1e-5):
    s = audit.scores()
    return E.epsilon_one_run(s[audit.included], s[~audit.included], delta=claimed_delta, significance=0.05)


def test_make_private_audit_over_20_seeds_raises_no_more_false_alarms_than_its_level():
    # each correct run is flagged (bound > claimed ε) with probability ≤ 0.05: the number of
    # flags over 20 independent runs is refused only if P(Binomial(20, 0.05) ≥ flags) < 0.05
    claimed = _claimed()
    assert claimed == pytest.approx(4.0, rel=1e-3)
    bounds = np.array(
        [_bound(train(audited(s, target_epsilon=None, noise_multiplier=SIGMA))) for s in range(20)]
    )
    flags = int((bounds > claimed).sum())
    assert stats.binom.sf(flags - 1, 20, 0.05) >= 0.05, (flags, bounds)
    assert bounds.mean() > 0.05 * claimed  # the audit sees the canaries (not a vacuous 0)


def test_make_private_audit_flags_a_run_whose_noise_is_below_the_plans(monkeypatch):
    real = Privatizer.noise_std
    # claimed ε ≈ 0.85 at σ = 4·SIGMA; the noise released at 1/40 of it (200 canaries bound
    # ε̂ ≤ 1.5 or so whatever the leak)
    monkeypatch.setattr(Privatizer, "noise_std", property(lambda self: real.fget(self) / 40))
    bounds = [_bound(train(audited(s, target_epsilon=None, noise_multiplier=4 * SIGMA))) for s in range(2)]
    assert min(bounds) > _claimed(4 * SIGMA)


def test_make_private_audit_removes_the_canary_slots_and_adds_the_in_canaries():
    # the released sum of step t, rebuilt by hand: clipped real examples of the drawn batch +
    # the "in" canaries drawn at t + the plan's noise (same key), divided by B̄
    from dpmf.optim.clipping import clipped_sum

    audit = audited(3, target_epsilon=None, noise_multiplier=SIGMA)
    run, pv = audit.private, audit.private.privatizer
    noise = noise_stream(
        run.plan, pv.noise.dim, 3, dtype=torch.float64, keys=pv.noise.keys
    )  # the run's keying
    x, y = run.data_loader.dataset.dataset.tensors
    ref = torch.nn.Linear(32, 4).to(torch.float64)
    ref.load_state_dict(run.model.state_dict())
    checked = 0
    for xb, yb in run.data_loader:
        t = run.steps_taken
        ref.load_state_dict(run.model.state_dict())
        run.backward(xb, target=yb, return_loss=False)
        glob = pv.stage._draws[t]
        real = torch.from_numpy(glob[glob < 300])
        s = clipped_sum(ref, F.cross_entropy, x[real], y[real], clip_norm=1.0)
        flat = torch.cat([g.reshape(-1) for g in s.grads])
        slots = glob[glob >= 300] - 300
        slots = slots[audit.included[slots]]
        flat = flat + pv.stage.canaries[torch.from_numpy(slots)].sum(0) + noise.next() * pv.noise_std
        got = torch.cat([p.grad.reshape(-1) for p in run.model.parameters()])
        torch.testing.assert_close(got, flat / run.plan.expected_batch_size, rtol=1e-10, atol=1e-10)
        checked += int(slots.size > 0)
        run.optimizer.step()
        run.optimizer.zero_grad()
        if t == 4:
            break
    assert checked >= 3


def test_make_private_audit_still_refuses_a_batch_not_drawn():
    audit = audited(1, target_epsilon=None, noise_multiplier=SIGMA)
    x, y = audit.private.data_loader.dataset.dataset.tensors
    with pytest.raises(BatchCheckError):
        audit.private.backward(x[:50], target=y[:50])


def test_make_private_audit_bad_canaries_is_one_line_before_any_work():
    with pytest.raises(ValueError, match="canaries=5 is invalid"):
        audited(1, canaries=5, target_epsilon=None, noise_multiplier=SIGMA)


# -- over several processes ----------------------------------------------------------------------


def _one_process_scores():
    return train(audited(5, target_epsilon=None, noise_multiplier=SIGMA, noise_keys="chunked")).scores()


@pytest.mark.parametrize("mode", ["sharded", "rank0", "replicated"])
def test_make_private_audit_over_simulated_ranks_scores_as_one_process(mode):
    # the canaries are added once to the global clipped sum: added on every rank, the "in"
    # canaries' scores would move by (W − 1)·ζ per sampled step
    from dpmf.distributed.collectives import simulate

    one = _one_process_scores()
    ranks = simulate(
        2,
        lambda comm: train(
            audited(5, target_epsilon=None, noise_multiplier=SIGMA, process_group=comm, distributed_mode=mode)
        ).scores(),
    )
    for scores in ranks:
        np.testing.assert_allclose(scores, one, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_make_private_audit_on_two_gloo_processes_scores_as_one_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(HERE / "audit_worker.py"), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = _one_process_scores()
    for mode in ("sharded", "rank0", "replicated"):
        for r in (0, 1):
            np.testing.assert_allclose(np.load(tmp_path / f"{mode}.rank{r}.npy"), one, rtol=0, atol=1e-6)


# -- dpmf fl, client mode: canary clients ---------------------------------------------------------


def _fl(seed, **kw):
    from dpmf.federated.run import FLConfig

    base = dict(
        num_clients=4,
        rounds=5,
        privacy="client",
        strategy="fedavg",
        client_noise_multiplier=2.0,
        seed=seed,
        local_steps=1,
        hidden=8,
    )
    base.update(kw)
    return FLConfig(**base)


def _fl_audit(seed, **kw):
    from dpmf.audit.federated import audit_fl_clients

    return audit_fl_clients(_fl(seed, **kw), canaries=200, log=lambda *a: None)


@pytest.mark.slow
def test_canary_clients_over_20_seeds_raise_no_more_false_alarms_than_the_level():
    from dpmf.federated import local

    results = [_fl_audit(s) for s in range(20)]
    assert local.ClientLevelNoise.__name__ == "ClientLevelNoise"  # the hooks are removed
    claimed = results[0]["claimed"]["epsilon"]
    # 5 rounds at σ_c = 2: a Gaussian mechanism with μ = √5/2 (dp-accounting's PLD agrees)
    assert claimed == pytest.approx(4.9833, abs=1e-3)
    bounds = np.array([r["epsilon_lower_bound"] for r in results])
    flags = int((bounds > claimed).sum())
    assert stats.binom.sf(flags - 1, 20, 0.05) >= 0.05, (flags, bounds)
    assert np.mean([r["auroc"] for r in results]) > 0.6  # the canary clients are seen


def test_canary_clients_flag_a_run_whose_client_noise_is_below_the_claim(monkeypatch):
    from dpmf.federated import local

    real = local.ClientLevelNoise.next
    # σ_c = 10 claims ε ≈ 1; the noise released at 1/40 of it (200 canaries bound ε̂ ≤ 1.5 or so)
    monkeypatch.setattr(local.ClientLevelNoise, "next", lambda self: real(self) / 40)
    res = _fl_audit(0, client_noise_multiplier=10.0)
    assert res["epsilon_lower_bound"] > res["claimed"]["epsilon"]


def test_canary_clients_with_correlated_noise_are_whitened():
    # bisr:2 across the 5 rounds: the score whitens the correlated noise, so an "out" canary's
    # score is N(0, 1) up to the real clients' and the other canaries' projections (small in d ≈ 4000)
    res = _fl_audit(1, client_factorization="bisr:2", client_noise_multiplier=1.0, hidden=128)
    outs = res["scores"][~res["included"]]
    assert abs(outs.mean()) < 0.35 and 0.7 < outs.std() < 1.3
    assert res["auroc"] > 0.6


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(privacy="aggregator"), "privacy"),
        (dict(strategy="fedmedian"), "strategy"),
        (dict(client_sampling="poisson", clients_per_round=2), "client_sampling"),
    ],
)
def test_canary_client_audit_refuses_other_modes_before_any_work(kw, word):
    from dpmf.audit.federated import audit_fl_clients

    with pytest.raises(ValueError, match=word):
        audit_fl_clients(_fl(0, **kw), canaries=200, log=lambda *a: None)


def _fl_bound(res, method):
    s, inc = res["scores"], res["included"]
    return R.estimate(method, s[inc], s[~inc], delta=res["claimed"]["delta"], significance=0.05)


@pytest.mark.parametrize("strategy", ["fedadam", "fedyogi"])
def test_canary_clients_through_a_server_optimizer(strategy, monkeypatch):
    # the server optimizer acts on the noisy mean (post-processing); the canaries are scored on
    # that mean. Correct runs stay below the claim; the client noise at half its σ_c is caught
    # by the GDP fit of the canaries (μ doubles: ε ≈ 10.7 against the claimed 4.98), which the
    # one-run bound, capped by 200 canaries, cannot reach
    from flwr.serverapp.strategy import FedAvg

    from dpmf.federated import local

    aggregate = FedAvg.aggregate_train
    for seed in range(3):
        res = _fl_audit(seed, strategy=strategy)
        assert res["claimed"]["epsilon"] == pytest.approx(4.9833, abs=1e-3)
        for method in ("one-run", "one-run-fdp", "gdp"):
            assert _fl_bound(res, method) <= res["claimed"]["epsilon"], (seed, method)
        assert res["auroc"] > 0.7  # μ = √5/2: AUROC Φ(μ/√2) = 0.785
    assert FedAvg.aggregate_train is aggregate  # the hooks are removed
    real = local.ClientLevelNoise.next
    monkeypatch.setattr(local.ClientLevelNoise, "next", lambda self: real(self) / 2)
    for seed in range(2):
        res = _fl_audit(seed, strategy=strategy)
        assert _fl_bound(res, "gdp") > res["claimed"]["epsilon"], seed


# -- dpmf fl, aggregator mode: canary records in the server's DP-SGD ------------------------------


def _fl_aggregator(seed, sigma, canaries=200, **kw):
    from dpmf.audit.federated import audit_fl_aggregator
    from dpmf.federated.compliance import NoiseMap
    from dpmf.federated.run import FLConfig

    base = dict(
        num_clients=4,
        rounds=3,
        privacy="aggregator",
        seed=seed,
        hidden=128,
        aggregator_fraction=0.5,  # 228 aggregator records
        server_batch_size=220,  # q = 220/(228 + 200)
        noise_map=NoiseMap(sigma_min=sigma, sigma_max=sigma),
    )
    base.update(kw)
    return audit_fl_aggregator(FLConfig(**base), canaries=canaries, log=lambda *a: None)


def test_canary_aggregator_records_correct_runs_stay_below_the_claim():
    from dpmf.federated import local
    from dpmf.federated.local import aggregator_privacy

    for seed in range(4):
        res = _fl_aggregator(seed, 1.5)
        # 12 server steps (4 participants × 3 rounds), Poisson at q = 220/428, σ = 1.5
        claimed = aggregator_privacy([1.5] * 12, sampling_rate=220 / 428, delta=1e-5).epsilon
        assert res["claimed"]["epsilon"] == pytest.approx(claimed, rel=1e-9)
        assert res["canaries"]["count"] == 200
        for method in ("one-run", "one-run-fdp", "clopper-pearson", "gdp"):
            assert _fl_bound(res, method) <= claimed, (seed, method)
        assert res["auroc"] > 0.75
    assert local.AggregatorDPSGD.__name__ == "AggregatorDPSGD"  # the hooks are removed


def test_canary_aggregator_records_catch_the_server_noise_at_a_third_of_its_sigma(monkeypatch):
    # at σ/2 the one-run bound straddles the claim (6.2–7.1 over six seeds against 6.57): 200
    # canaries catch it about half the time; at σ/3 it is 9.9–12.6 (correct runs: 1.8–2.6)
    real = Privatizer.noise_std
    monkeypatch.setattr(Privatizer, "noise_std", property(lambda self: real.fget(self) / 3))
    for seed in range(2):
        res = _fl_aggregator(seed, 1.5)
        assert res["claimed"]["epsilon"] == pytest.approx(6.57, abs=0.01)  # ≤ 8
        assert _fl_bound(res, "gdp") > res["claimed"]["epsilon"], seed


def test_canary_aggregator_scores_are_the_mechanisms():
    # the other records' clipped sum is subtracted and the directions are orthonormal, so an
    # "out" canary's score is the Poisson likelihood ratio of pure noise: its mean is that of
    # the mechanism audit's out-canaries on the same plan
    from dpmf.audit import mechanism as M
    from dpmf.plan.plan import PrivatePlan

    res = _fl_aggregator(5, 1.5)
    plan = PrivatePlan(428, 220, steps=12, scheme="poisson").with_noise(1.5)
    ins, outs, _ = M.mechanism_scores(plan, runs=40, seed=1, canaries="all", score="likelihood")
    got = res["scores"][~res["included"]]
    assert abs(got.mean() - outs.mean()) < 4 * outs.std() / np.sqrt(got.size)
    assert got.std() == pytest.approx(outs.std(), rel=0.25)


@pytest.mark.parametrize(
    "kw, word", [(dict(privacy="record"), "privacy"), (dict(server_noise=False), "server_noise")]
)
def test_canary_aggregator_audit_refuses_before_any_work(kw, word):
    from dpmf.audit.federated import audit_fl_aggregator
    from dpmf.federated.run import FLConfig

    base = dict(num_clients=4, rounds=3, privacy="aggregator", seed=0)
    base.update(kw)
    with pytest.raises(ValueError, match=word):
        audit_fl_aggregator(FLConfig(**base), canaries=200, log=lambda *a: None)


# -- dpmf fl, record mode: canary records in one client's private run -----------------------------


def _fl_records(seed, **kw):
    from dpmf.audit.federated import audit_fl_records
    from dpmf.federated.run import FLConfig

    base = dict(num_clients=4, rounds=5, privacy="record", seed=seed, local_steps=4, hidden=128)
    base.update(kw)
    return audit_fl_records(FLConfig(**base), canaries=200, log=lambda *a: None)


@pytest.mark.slow
def test_canary_records_over_5_seeds_raise_no_more_false_alarms_than_the_level():
    # 5 seeds (≈ 5 s each): at most one flag is consistent with level 0.05 (P(Bin(5, .05) ≥ 2) = .023)
    from dpmf.federated import local

    results = [_fl_records(s) for s in range(5)]
    assert local.PrivateLocalRun.__name__ == "PrivateLocalRun"  # the hooks are removed
    claimed = results[0]["claimed"]["epsilon"]
    flags = sum(r["epsilon_lower_bound"] > claimed for r in results)
    assert stats.binom.sf(flags - 1, 5, 0.05) >= 0.05
    assert np.mean([r["auroc"] for r in results]) > 0.55


def test_canary_records_flag_a_client_whose_noise_is_below_the_claim(monkeypatch):
    from dpmf.federated.compliance import NoiseMap

    real = Privatizer.noise_std
    monkeypatch.setattr(Privatizer, "noise_std", property(lambda self: real.fget(self) / 40))
    res = _fl_records(0, noise_map=NoiseMap(sigma_min=6.0, sigma_max=6.0))
    assert res["claimed"]["epsilon"] < 1.2
    assert res["epsilon_lower_bound"] > res["claimed"]["epsilon"]


def test_canary_record_audit_refuses_another_mode_before_any_work():
    from dpmf.audit.federated import audit_fl_records

    with pytest.raises(ValueError, match="privacy='client' is invalid"):
        audit_fl_records(_fl(0), canaries=200, log=lambda *a: None)
