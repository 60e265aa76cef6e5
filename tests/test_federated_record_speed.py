"""What keeps ``dpmf fl --privacy record`` fast without changing its results: each client's DP
optimizer is built once and reset to a fresh one's state every round; the clients' accountings
are shared per distinct setting and run in the background while the clients train; no
torch._dynamo or scikit-learn import; the breast-cancer data read from scikit-learn's CSV."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from dpmf import seeds  # noqa: E402
from dpmf.federated import local, prefetch  # noqa: E402
from dpmf.federated.models import add_proximal_gradient, build_model, get_weights, set_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(n=30):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 1, 1, 6)).astype(np.float32), rng.integers(0, 2, size=n).astype(np.int64)


def _run(optimizer, x, y):
    return local.PrivateLocalRun(
        x, y, build_model((1, 1, 6), 2, hidden=8, seed=0), noise_multiplier=1.2, clip_norm=0.5, batch_size=6,
        steps=9, delta=1e-5, optimizer=optimizer, lr=0.05, seed=seeds.child_key(11, "fl-record", 0),
    )  # fmt: skip


def _fresh_each_round(run, weights, steps, mu):
    """A round as record mode ran it before the optimizer was kept: a new optimizer, bound anew."""
    set_weights(run.model, weights)
    anchor = get_weights(run.model)
    opt = local.local_optimizer(run.optimizer, run.model, lr=run.lr, key=run._key)
    opt.bind(run.privatizer)
    for _ in range(steps):
        drawn_at, batch = run.step.batches.draw()
        run.step.batches.record(drawn_at, ids=batch, n=len(batch))
        idx = torch.from_numpy(batch)
        run.privatizer.privatize(torch.from_numpy(run.x)[idx], torch.from_numpy(run.y)[idx], example_ids=idx)
        run.privatizer.post_process(lambda: add_proximal_gradient(run.model, anchor, mu))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return get_weights(run.model)


@pytest.mark.parametrize("optimizer", ["dp-adam", "dp-muon-bc"])
def test_the_kept_optimizer_steps_as_a_fresh_one_every_round_bit_for_bit(optimizer):
    # Adam's moments and DP-MuonBC's EMA and probe generator would carry over between rounds if the
    # kept optimizer were not reset: the second round would differ
    x, y = _data()
    kept, fresh = _run(optimizer, x, y), _run(optimizer, x, y)
    w = w_ref = get_weights(build_model((1, 1, 6), 2, hidden=8, seed=3))
    opts = []
    for _ in range(3):
        w, _ = kept.train_round(w, 3, proximal_mu=0.1)
        w_ref = _fresh_each_round(fresh, w_ref, 3, 0.1)
        opts.append(kept._opt)
        for k in w_ref:
            np.testing.assert_array_equal(w[k], w_ref[k])
    assert opts[0] is opts[1] is opts[2]  # one optimizer for the whole run
    assert kept.steps_taken == 9
    with pytest.raises(RuntimeError, match="exceed what was accounted"):
        kept.train_round(w, 1)


def test_a_reset_optimizer_has_no_state_and_stays_bound():
    x, y = _data()
    run = _run("dp-adam", x, y)
    run.train_round(get_weights(run.model), 2)
    opt = run._opt
    assert len(opt.state) == len(list(run.model.parameters()))
    opt.reset_state()
    assert len(opt.state) == 0 and not opt._chains and not opt._generators
    assert opt._source is run.privatizer  # still bound: step() still refuses an unprivatized gradient
    for p in run.model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="no private gradient"):
        opt.step()


def test_invalid_accounting_settings_are_refused_when_the_run_is_built():
    x, y = _data()
    kw = dict(clip_norm=1.0, batch_size=6, steps=4, seed=1)
    with pytest.raises(ValueError, match="delta"):
        local.PrivateLocalRun(
            x, y, build_model((1, 1, 6), 2, hidden=8), noise_multiplier=1.0, delta=1.5, **kw
        )
    with pytest.raises(ValueError, match="noise_multiplier"):
        local.PrivateLocalRun(
            x, y, build_model((1, 1, 6), 2, hidden=8), noise_multiplier=0.0, delta=1e-5, **kw
        )
    with pytest.raises(ValueError, match="accountant='nope'"):
        local.PrivateLocalRun(x, y, build_model((1, 1, 6), 2, hidden=8), noise_multiplier=1.0, delta=1e-5,
                              accountant="nope", **kw)  # fmt: skip


# -- the accountings -------------------------------------------------------------------------


def _uniform_config(**kw):
    from dpmf.federated.run import FLConfig

    return FLConfig(
        privacy="record", num_clients=16, rounds=2, local_steps=2, allocation="uniform", seed=4, **kw
    )


def test_clients_with_the_same_setting_share_one_accounting(monkeypatch):
    from dpmf.federated.run import run_federated

    calls = []
    real, measure = local._record_privacy, local.pld_measurement

    def counting(event, delta):
        calls.append((event.noise_multiplier, event.sampling_rate, event.steps, delta))
        return measure(event, delta)

    monkeypatch.setattr(local, "pld_measurement", counting)
    monkeypatch.setattr(prefetch, "_can_fork", lambda: False)  # in this process, so the calls are seen
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    result = run_federated(_uniform_config(), log=lambda *_: None)
    entries = [e for e in result.ledger if e.mode == "record"]
    assert len(entries) == 16
    sizes = sorted({e.dataset_size for e in entries})
    # uniform allocation: one σ; the 16 clients hold 25 or 26 records: two sampling rates, two
    # accountings
    assert len(calls) == len(sizes) == 2 and len({c[0] for c in calls}) == 1
    assert sorted(c[1] for c in calls) == [16 / 26, 16 / 25]
    for n in sizes:
        eps = {e.epsilon for e in entries if e.dataset_size == n}
        (sigma,) = {c[0] for c in calls}
        want = real(sigma, n, 16, 4, 1e-5, "poisson", "identity", None).epsilon  # B = 16, n = R·L = 4
        assert eps == {want}


def test_background_accountings_give_the_in_process_ledger_bit_for_bit(monkeypatch):
    from dpmf.federated.run import FLConfig, run_federated

    cfg = FLConfig(privacy="record", num_clients=4, rounds=2, local_steps=2, seed=9, local_batch_size=8)
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    background = run_federated(cfg, log=lambda *_: None)
    assert not local.RECORD_PENDING  # every started accounting was collected
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    monkeypatch.setattr(prefetch, "_can_fork", lambda: False)
    serial = run_federated(cfg, log=lambda *_: None)
    assert [e.to_dict() for e in background.ledger] == [e.to_dict() for e in serial.ledger]
    assert [e.epsilon for e in serial.ledger] == [
        local._record_privacy(
            e.noise_multiplier, e.dataset_size, 8, 4, 1e-5, "poisson", "identity", None
        ).epsilon
        for e in serial.ledger
    ]


def test_the_record_part_starts_its_accountings_and_waits_only_when_asked(monkeypatch):
    from dpmf.federated.compliance import example_profiles
    from dpmf.federated.data import load_federated
    from dpmf.federated.run import participants

    cfg = _uniform_config()
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    monkeypatch.setattr(local, "RECORD_PENDING", {})
    idx, sigmas = participants(cfg, example_profiles(16))
    data = load_federated("breast-cancer", 16, seed=cfg.public_seed)
    part = cfg.mode.client(cfg, data, idx, sigmas, [str(i) for i in idx], 123)
    assert part.entries == []  # nothing awaited yet
    assert len(local.RECORD_PENDING) == 2 and not local.RECORD_CACHE  # started, in the background
    entries = part.complete_entries()
    assert len(entries) == 16 and not local.RECORD_PENDING and len(local.RECORD_CACHE) == 2
    assert part.complete_entries() is entries


def test_start_record_privacy_counts_each_distinct_setting_once(monkeypatch):
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    monkeypatch.setattr(local, "RECORD_PENDING", {})
    settings = [(s, 20, 4, 6, 1e-5, "poisson", "identity", None) for s in (2.0, 3.0, 2.0, 2.0)]
    assert prefetch.start_record_privacy(settings, workers=1) == 2
    assert prefetch.start_record_privacy(settings, workers=1) == 0  # started already
    got = [local.record_privacy(2.0, dataset_size=20, batch_size=4, steps=6, delta=1e-5).epsilon,
           local.record_privacy(3.0, dataset_size=20, batch_size=4, steps=6, delta=1e-5).epsilon]  # fmt: skip
    assert got == [local._record_privacy(*settings[0]).epsilon, local._record_privacy(*settings[1]).epsilon]
    assert prefetch.start_record_privacy(settings, workers=0) == 0  # cached


def test_settings_with_the_same_event_share_one_pld_measurement(monkeypatch):
    # σ, q = B/N and the steps make the Poisson event: N = 20, B = 4 and N = 40, B = 8 are one
    # accounting; each result keeps its own N and B
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    monkeypatch.setattr(local, "PLD_CACHE", {})
    monkeypatch.setattr(local, "RECORD_PENDING", {})
    a, b = (
        (1.5, 20, 4, 6, 1e-5, "poisson", "identity", None),
        (1.5, 40, 8, 6, 1e-5, "poisson", "identity", None),
    )
    c = (1.5, 40, 4, 6, 1e-5, "poisson", "identity", None)  # another q
    assert prefetch.start_record_privacy([a, b, c], workers=1) == 2
    ra = local.record_privacy(*a[:1], dataset_size=20, batch_size=4, steps=6, delta=1e-5)
    rb = local.record_privacy(*b[:1], dataset_size=40, batch_size=8, steps=6, delta=1e-5)
    rc = local.record_privacy(*c[:1], dataset_size=40, batch_size=4, steps=6, delta=1e-5)
    assert ra.epsilon == rb.epsilon != rc.epsilon
    assert (ra.dataset_size, ra.batch_size, rb.dataset_size, rb.batch_size) == (20, 4, 40, 8)
    assert ra.sampling_rate == rb.sampling_rate == 0.2
    monkeypatch.setattr(local, "PLD_CACHE", {})
    alone = local._record_privacy(*b)  # measured on its own: the same result
    assert alone == rb
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    # the fresh PLD cache holds b's event (measured alone above): only c's is measured again
    assert prefetch.prefetch_record_privacy([a, b, c], workers=1) == 1
    assert local.RECORD_CACHE[a] == ra and local.RECORD_CACHE[b] == rb and local.RECORD_CACHE[c] == rc


# -- imports and data ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_record_run_imports_neither_dynamo_nor_scikit_learn_here():
    # dp-accounting is imported with the privacy events (they are its DpEvents); torch._dynamo
    # and scikit-learn stay out of the client's process
    code = (
        "import sys, json\n"
        "from dpmf.federated.run import FLConfig, run_federated\n"
        "cfg = FLConfig(privacy='record', num_clients=4, rounds=1, local_steps=2, seed=1,\n"
        "               local_batch_size=8)\n"
        "run_federated(cfg, log=lambda *_: None)\n"
        "names = ['torch._dynamo', 'sklearn']\n"
        "print(json.dumps([n in sys.modules for n in names]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False] * 2


def test_the_breast_cancer_csv_gives_scikit_learns_arrays_bit_for_bit():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    from dpmf.federated.data import load_breast_cancer_arrays

    x, y = load_breast_cancer_arrays()
    ref = sklearn_datasets.load_breast_cancer()
    assert x.dtype == np.float64 and y.dtype == np.int64 and x.shape == (569, 30)
    assert x.tobytes() == ref.data.astype(np.float64).tobytes()
    np.testing.assert_array_equal(y, ref.target)


def test_a_truncated_breast_cancer_csv_is_refused(tmp_path, monkeypatch):
    from dpmf.federated import data as data_mod

    path = tmp_path / "breast_cancer.csv"
    path.write_text("3,2,malignant,benign\n1.0,2.0,0\n3.0,4.0,1\n")
    monkeypatch.setattr(data_mod, "_breast_cancer_csv", lambda: str(path))
    with pytest.raises(ValueError, match="2 rows, its header says 3"):
        data_mod.load_breast_cancer_arrays()


# -- participants stepped in forked worker processes -----------------------------------------


def _final_model(monkeypatch, cfg):
    from dpmf.federated import run as run_mod

    seen = {}
    evaluate = run_mod._Server._evaluate

    def spy(self, weights):
        seen["w"] = {k: np.asarray(v).copy() for k, v in weights.items()}
        return evaluate(self, weights)

    monkeypatch.setattr(run_mod._Server, "_evaluate", spy)
    result = run_mod.run_federated(cfg, log=lambda *_: None)
    return seen["w"], result


def test_forked_participants_give_the_sequential_run_bit_for_bit(monkeypatch):
    from dpmf.federated import parallel
    from dpmf.federated.run import FLConfig

    cfg = FLConfig(privacy="record", num_clients=5, rounds=3, local_steps=2, seed=13, local_batch_size=8,
                   strategy="fedprox", local_optimizer="dp-adam")  # fmt: skip
    built = []
    real_init = parallel.ForkedRuns.__init__

    def spy(self, runs, workers):
        built.append(workers)
        real_init(self, runs, workers)

    monkeypatch.setattr(parallel.ForkedRuns, "__init__", spy)
    monkeypatch.setattr(parallel, "parallel_workers", lambda n: 1)
    w_seq, seq = _final_model(monkeypatch, cfg)
    assert built == []
    monkeypatch.setattr(parallel, "parallel_workers", lambda n: 3)  # this process and two workers
    w_par, par = _final_model(monkeypatch, cfg)
    assert built == [3]
    for k in w_seq:
        np.testing.assert_array_equal(w_par[k], w_seq[k])
    assert json.dumps(par.metrics) == json.dumps(seq.metrics)  # (train_loss is NaN: compared as text)
    assert [e.to_dict() for e in par.ledger] == [e.to_dict() for e in seq.ledger]


def test_a_failure_in_a_worker_is_raised_here_with_its_type_and_message(monkeypatch):
    from dpmf.federated import parallel
    from dpmf.federated.run import FLConfig, run_federated

    real = local.PrivateLocalRun.train_round
    here = os.getpid()

    def failing(self, weights, steps, proximal_mu=0.0):
        if self.steps_taken >= 2 and os.getpid() != here:  # the second round, in a worker only
            raise ValueError("the round cannot run")
        return real(self, weights, steps, proximal_mu)

    monkeypatch.setattr(local.PrivateLocalRun, "train_round", failing)
    monkeypatch.setattr(parallel, "parallel_workers", lambda n: 2)
    cfg = FLConfig(privacy="record", num_clients=4, rounds=2, local_steps=2, seed=1, local_batch_size=8)
    with pytest.raises(RuntimeError, match="failed in a worker process: ValueError: the round cannot run"):
        run_federated(cfg, log=lambda *_: None)


def test_forked_runs_keep_the_first_participant_here_and_refuse_an_unsubmitted_round():
    from dpmf.federated.parallel import ForkedRuns

    x, y = _data()
    runs = {j: _run("dp-sgd", x, y) for j in range(5)}
    with pytest.raises(ValueError, match="workers=1 is invalid"):
        ForkedRuns(runs, 1)
    forked = ForkedRuns(runs, 2)
    try:
        assert [forked.is_remote(j) for j in range(5)] == [False, True, False, True, False]
        with pytest.raises(RuntimeError, match="has no submitted round"):
            forked.result(1)
        w = get_weights(runs[1].model)
        forked.submit([(1, w, 2, 0.0), (0, w, 2, 0.0)])  # participant 0 is not sent anywhere
        with pytest.raises(RuntimeError, match="before its last one was answered"):
            forked.submit([(1, w, 2, 0.0)])
        got = forked.result(1)
        assert runs[1].steps_taken == 0  # the worker's copy advanced, not this one
        want, _ = runs[1].train_round(w, 2)  # the same key and state here: the same round
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    finally:
        forked.close()


# -- the accountings started ahead of the run ------------------------------------------------


@pytest.mark.slow
def test_the_accountings_start_before_torch_is_imported_and_the_run_finds_them_started():
    # ``dpmf fl`` starts them before it imports torch; the run starts none again and its ledger
    # is the in-process computation's
    code = (
        "import sys, json\n"
        "from dpmf.federated import local, prefetch\n"
        "from dpmf.federated.run import FLConfig, run_federated, start_ahead\n"
        "cfg = FLConfig(privacy='record', num_clients=4, rounds=1, local_steps=2, seed=1,\n"
        "               local_batch_size=8, allocation='uniform')\n"
        "start_ahead(cfg)\n"
        "before = ['torch' in sys.modules, len(local.RECORD_PENDING)]\n"
        "started, real = [], prefetch.start_record_privacy\n"
        "prefetch.start_record_privacy = lambda *a, **k: started.append(real(*a, **k)) or started[-1]\n"
        "res = run_federated(cfg, log=lambda *_: None)\n"
        "want = [local._record_privacy(e.noise_multiplier, e.dataset_size, 8, 2, 1e-5, 'poisson',\n"
        "                              'identity', None).epsilon for e in res.ledger]\n"
        "print(json.dumps([before, started, [e.epsilon for e in res.ledger] == want, len(want)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    before, started, same, entries = json.loads(out.stdout.strip().splitlines()[-1])
    # uniform allocation: one σ; 4 clients of 2 sizes → 2 accountings, started before torch
    assert before == [False, 2] and started == [0] and same and entries == 4


def test_settings_the_run_refuses_start_nothing_ahead(monkeypatch):
    from dpmf.federated.run import FLConfig, run_federated, start_ahead

    monkeypatch.setattr(local, "RECORD_PENDING", {})
    monkeypatch.setattr(local, "RECORD_CACHE", {})
    cfg = FLConfig(privacy="record", num_clients=4, rounds=1, local_steps=2, seed=1, local_batch_size=500)
    start_ahead(cfg)  # no error here: the run refuses it itself
    assert local.RECORD_PENDING == {} and local.RECORD_CACHE == {}
    with pytest.raises(ValueError, match="local_batch_size=500 is invalid in record mode"):
        run_federated(cfg, log=lambda *_: None)
    start_ahead(_uniform_config(), backend="ray")  # another backend: nothing ahead
    assert local.RECORD_PENDING == {}


def test_forked_runs_can_keep_fewer_participants_here():
    # record mode's keeps one fewer here (this process also serves the rounds); the first stays
    from dpmf.federated.parallel import ForkedRuns, ServingForkedRuns

    x, y = _data()
    runs = {j: _run("dp-sgd", x, y) for j in range(5)}

    class NineFewer(ForkedRuns):
        fewer_here = 9

    cases = [(ServingForkedRuns, 2, [0, 1, 0, 1, 1]), (ServingForkedRuns, 3, [0, 1, 2, 1, 2]),
             (NineFewer, 2, [0, 1, 1, 1, 1]), (ForkedRuns, 3, [0, 1, 2, 0, 1])]  # fmt: skip
    for cls, workers, want in cases:
        forked = cls(runs, workers)
        try:
            assert [forked.owner[j] for j in range(5)] == want
        finally:
            forked.close()
