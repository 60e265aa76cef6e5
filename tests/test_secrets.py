"""The run's noise key (dpmf.seeds): drawn from the operating system with ≥ 128 bits, derived
per purpose/step/parameter/chunk by the documented keyed hash into Philox, adopted on resume
(also in a fresh process), and never written to a message, an exception, a repr or a result."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpmf
from dpmf import seeds
from dpmf.mechanisms import factorize
from dpmf.optim.noise import ChunkedKeys, identity_noise, noise_for_factorization
from dpmf.plan import PrivatePlan
from dpmf.plan.samplers import PoissonSampler
from dpmf.step import build as build_step
from dpmf.train.build import sub_seed
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset
from dpmf.train.models import build_model
from dpmf.train.run import train
from dpmf.workloads import prefix_sum

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the documented derivation, written out independently -------------------------------------
def _subkey(key: int, purpose: str, *idx: int) -> int:
    raw = key.to_bytes(max(1, (key.bit_length() + 7) // 8), "big")
    root = hashlib.blake2b(raw, digest_size=32, person=b"dpmf-root-v1").digest()
    msg = purpose.encode() + b"\x00" + b"".join(i.to_bytes(8, "little") for i in idx)
    return int.from_bytes(
        hashlib.blake2b(msg, digest_size=16, key=root, person=b"dpmf-kdf-v1").digest(), "little"
    )


def _forms(k: int) -> list[str]:
    """Decimal and hex spellings of an integer, to look for in texts."""
    return [str(k), f"{k:x}", f"{k:X}", hex(k)]


def _leaks(text: str, values) -> list[int]:
    return [v for v in values if any(f in text for f in _forms(v))]


def test_default_key_is_os_entropy_of_at_least_128_bits(monkeypatch):
    a, b = seeds.SeedPolicy.of(None), seeds.SeedPolicy.of(None)
    assert a.is_secret and a.notice is None and a.public_seed is None
    assert a.key != b.key
    assert a.key.bit_length() > 128 and b.key.bit_length() > 128  # fails with probability 2^-127
    # the entropy is the operating system's (secrets.token_bytes, i.e. os.urandom), KEY_BITS of it
    asked = []

    def fake(n):
        asked.append(n)
        return bytes(range(n))

    monkeypatch.setattr(seeds.secrets, "token_bytes", fake)
    assert seeds.draw_key() == int.from_bytes(bytes(range(32)), "big") and asked == [32]
    assert seeds.KEY_BITS >= 128


def test_subkeys_differ_and_every_key_bit_changes_the_noise():
    key = seeds.draw_key()
    subs = {
        seeds.derive_int(key, p, *i)
        for p in ("noise", "sampler", "model")
        for i in [(), (0,), (1,), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]
    }
    assert len(subs) == 21  # every purpose, step, parameter and chunk its own subkey
    gen = identity_noise(50, seed=key, steps=3)
    z = gen.raw_noise(1)
    for bit in range(seeds.KEY_BITS):  # every bit of the key matters
        other = identity_noise(50, seed=key ^ (1 << bit), steps=3)
        assert not torch.equal(other.raw_noise(1), z), bit
    # torch's CPU generator uses only the low 32 bits of its seed: the new noise does not go through it
    assert torch.equal(
        torch.randn(3, generator=torch.Generator().manual_seed(1)),
        torch.randn(3, generator=torch.Generator().manual_seed(1 + 2**32)),
    )


def test_raw_noise_and_sampler_equal_the_documented_derivation():
    key = 2**200 + 12345
    gen = identity_noise(7, seed=key, steps=4, dtype=torch.float64)
    # the default generator's state: torch's twister words are the subkey's Philox stream
    raw = np.random.Generator(np.random.Philox(key=_subkey(key, "noise", 2))).bit_generator.random_raw(312)
    words = np.empty(624, dtype=np.uint64)
    words[0::2], words[1::2] = raw & np.uint64(0xFFFFFFFF), raw >> np.uint64(32)
    gen.raw_noise(2)
    assert gen.generator.name == "torch-mt19937" and np.array_equal(gen.generator._words, words)
    # numpy's generator (earlier versions'): its standard normals on the subkey
    gen.use_generator("numpy-philox")
    ref = np.random.Generator(np.random.Philox(key=_subkey(key, "noise", 2))).standard_normal(7)
    assert torch.equal(gen.raw_noise(2), torch.from_numpy(ref))
    sizes, chunk = (5, 3), 2
    keys = ChunkedKeys(sizes, chunk=chunk)
    cg = noise_for_factorization(factorize(prefix_sum(4), "identity"), keys.dim, seed=key, keys=keys)
    cg.use_generator("numpy-philox")
    parts = []
    for j, size in enumerate(sizes):
        for c in range(-(-size // chunk)):
            g = np.random.Generator(np.random.Philox(key=_subkey(key, "noise", 3, j, c)))
            parts.append(g.standard_normal(min(chunk, size - c * chunk), dtype=np.float32))
    assert torch.equal(cg.raw_noise(3), torch.from_numpy(np.concatenate(parts)))
    s = PoissonSampler(100, 10, 3, seed=key)
    rng = np.random.Generator(np.random.Philox(key=_subkey(key, "sampler")))
    assert np.array_equal(s.next(), np.flatnonzero(rng.random(100) < 0.1))
    # a given seed of any size is deterministic
    assert torch.equal(
        identity_noise(7, seed=key, steps=4).raw_noise(0), identity_noise(7, seed=key, steps=4).raw_noise(0)
    )


def test_policy_repr_notice_and_digest_hide_the_key():
    p = seeds.SeedPolicy.of(None)
    given = seeds.SeedPolicy.of(2**70 + 3)
    assert not given.is_secret and given.key == 2**70 + 3 and given.notice == seeds.NOTICE
    for text in (repr(p), str(p), repr(given)):
        assert not _leaks(text, [p.key, given.key])
    s1, s2 = seeds.new_salt(), seeds.new_salt()
    d1 = seeds.key_digest(p.key, s1)
    assert d1 == seeds.key_digest(p.key, s1) and d1 != seeds.key_digest(p.key, s2)
    assert d1 != seeds.key_digest(p.key ^ 1, s1) and not _leaks(d1, [p.key])
    from dpmf.distributed.step import seed_digest

    assert seed_digest(p.key, s1) != seed_digest(p.key, s2)  # salted: nothing to reuse


def test_noise_and_sampler_states_refuse_another_key_or_derivation_without_showing_it():
    k1, k2 = seeds.draw_key(), seeds.draw_key()
    gen = identity_noise(5, seed=k1, steps=4)
    gen.next()
    state = gen.state_dict()
    assert "seed" not in state["fingerprint"] and state["fingerprint"]["derivation"] == seeds.DERIVATION
    assert not _leaks(repr(state), [k1])
    other = identity_noise(5, seed=k2, steps=4)
    with pytest.raises(ValueError, match="another noise key") as exc:
        other.load_state_dict(state)
    assert not _leaks(str(exc.value), [k1, k2]) and "\n" not in str(exc.value)
    old = dict(state, fingerprint={k: v for k, v in state["fingerprint"].items() if k != "derivation"})
    old["fingerprint"]["seed"] = 7
    with pytest.raises(ValueError, match="derivation") as exc:
        identity_noise(5, seed=k1, steps=4).load_state_dict(old)
    assert "\n" not in str(exc.value)
    other.use_key(k1)  # adopting the key makes the state loadable
    other.load_state_dict(state)
    assert torch.equal(other.next(), gen.next())
    s = PoissonSampler(50, 5, 4, seed=k1)
    s.next()
    st = s.state_dict()
    assert "seed" not in st and not _leaks(repr(s), [k1])
    s2 = PoissonSampler(50, 5, 4, seed=k2)
    with pytest.raises(ValueError, match="another key") as exc:
        s2.load_state_dict(st)
    assert not _leaks(str(exc.value), [k1, k2])


# -- make_private -----------------------------------------------------------------------------
_SCRIPT = """
import sys, torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
import dpmf
from dpmf.train.data import load_dataset
from dpmf.train.models import build_model
from dpmf.train.build import sub_seed
torch.set_num_threads(1)
d = load_dataset("digits")
model = build_model("mlp", d.input_shape, d.num_classes, seed=sub_seed(3, 0))
private = dpmf.make_private(model, torch.optim.SGD(model.parameters(), lr=0.2),
    TensorDataset(d.train_x, d.train_y), loss_fn=F.cross_entropy, batch_size=128, steps=6,
    noise_multiplier=1.0, target_delta=1e-5, factorization="bsr:2", scheme="cyclic_poisson")
private.resume(sys.argv[1])
it = iter(private.data_loader)
for _ in range(3):
    x, y = next(it)
    private.backward(x, target=y, return_loss=False)
    private.optimizer.step()
    private.optimizer.zero_grad()
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
"""


def _private(d, **kw):
    model = build_model("mlp", d.input_shape, d.num_classes, seed=sub_seed(3, 0))
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        TensorDataset(d.train_x, d.train_y),
        loss_fn=F.cross_entropy,
        batch_size=128,
        steps=kw.pop("steps", 6),
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="bsr:2",
        scheme="cyclic_poisson",
        **kw,
    )
    return model, private


def _steps(private, k):
    it = iter(private.data_loader)
    for _ in range(k):
        x, y = next(it)
        private.backward(x, target=y, return_loss=False)
        private.optimizer.step()
        private.optimizer.zero_grad()


@pytest.mark.slow
def test_make_private_secret_key_resumes_in_a_fresh_process(tmp_path):
    d = load_dataset("digits")
    model, private = _private(d)
    key = private.state_dict()["secret"]["seed"]
    assert key.bit_length() > 128 and not _leaks(repr(private), [key])
    _steps(private, 3)
    path = str(tmp_path / "state.pt")
    private.save(path)
    _steps(private, 3)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = str(tmp_path / "resumed.pt")
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, path, out], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert not _leaks(run.stdout + run.stderr, [key])
    resumed = torch.load(out, weights_only=True)
    for name, v in model.state_dict().items():
        assert torch.equal(resumed[name], v), name
    # a mismatching plan, or a given seed other than the key: refused, the key never shown
    for kw in (dict(steps=7), dict(seed=5)):
        _, other = _private(d, **kw)
        with pytest.raises(ValueError) as exc:
            other.resume(path)
        assert not _leaks(str(exc.value), [key]), kw


def test_make_private_given_seed_prints_the_notice(capsys):
    d = load_dataset("digits")
    _private(d, seed=2**65 + 1)  # any integer >= 0
    err = capsys.readouterr().err
    assert seeds.NOTICE in err and str(2**65 + 1) not in err


# -- dpmf train -------------------------------------------------------------------------------
class Kill(Exception):
    pass


def test_train_without_seed_records_null_and_resume_adopts_the_key(tmp_path):
    cfg = TrainConfig(
        dataset="digits",
        model="mlp",
        epochs=2,
        batch_size=256,
        epsilon=None,
        noise_multiplier=1.0,
        device="cpu",
    )

    def kill(epoch, row):
        if epoch == 1:
            raise Kill

    logs = []
    with pytest.raises(Kill):
        train(cfg, str(tmp_path / "run"), progress=False, on_epoch_end=[kill], log=logs.append)
    ckpt = torch.load(str(tmp_path / "run" / "checkpoint.pt"), weights_only=True)
    key = ckpt["secret"]["seed"]
    assert key.bit_length() > 128
    res = train(cfg, str(tmp_path / "run"), resume=True, progress=False, log=logs.append)
    results = json.load(open(tmp_path / "run" / "results.json"))
    assert results["config"]["seed"] is None and results["seed_given"] is False
    assert results["resumed_from_epoch"] == 1
    # the resumed run continued with the checkpoint's key: it equals an uninterrupted run keyed so
    ref_logs = []
    ref = train(cfg.replace(seed=key), str(tmp_path / "ref"), progress=False, log=ref_logs.append)
    assert seeds.NOTICE in ref_logs
    for a, b in zip(ref.model.parameters(), res.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for name in os.listdir(tmp_path / "run"):
        if name.endswith((".json", ".csv")):
            assert not _leaks((tmp_path / "run" / name).read_text(), [key]), name
    assert not _leaks("\n".join(map(str, logs)), [key])


# -- dpmf fl ----------------------------------------------------------------------------------
FAST = ["--clients", "4", "--rounds", "3", "--sigma-min", "2", "--sigma-max", "4", "--local-steps", "2"]


def test_fl_default_keys_are_secret_per_replica_and_never_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("flwr")
    from dpmf.cli import main

    drawn = []
    real = seeds.draw_key

    def spy():
        drawn.append(real())
        return drawn[-1]

    monkeypatch.setattr(seeds, "draw_key", spy)
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main(["fl", *FAST, "--privacy", "client", "--out", str(out)]) == 0
        outs.append(out)
    assert len(drawn) == 2 and drawn[0] != drawn[1]
    ledger = json.loads((outs[0] / "ledger.json").read_text())
    assert [s["seed"] for s in ledger["seeds"]] == [None] and ledger["noise_key"].startswith("secret")
    # two default runs differ (different noise), although everything public is the same
    assert (outs[0] / "metrics.csv").read_text() != (outs[1] / "metrics.csv").read_text()
    secrets_ = []
    for key in drawn:
        child = seeds.child_key(key, "fl-client-noise")
        secrets_ += [key, child] + [_subkey(child, "noise", t) for t in range(3)]
        for t in range(3):
            sub = _subkey(child, "noise", t)
            secrets_ += [sub & (2**64 - 1), sub >> 64]  # Philox's two key words
    text = capsys.readouterr()
    for out in outs:
        for name in os.listdir(out):
            assert not _leaks((out / name).read_text(), secrets_), name
    assert not _leaks(text.out + text.err, secrets_)
    assert seeds.NOTICE not in text.out


def test_fl_given_seeds_print_the_notice_and_the_ledger_states_the_composition(tmp_path, capsys):
    pytest.importorskip("flwr")
    from dpmf.cli import main

    out = tmp_path / "s"
    assert main(["fl", *FAST, "--privacy", "record", "--seeds", "0,1", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count(seeds.NOTICE) == 1
    ledger = json.loads((out / "ledger.json").read_text())
    assert [s["seed"] for s in ledger["seeds"]] == [0, 1] and "predictable" in ledger["noise_key"]
    comp = ledger["composition"]
    eps = [max(e["epsilon"] for e in s["entries"]) for s in ledger["seeds"]]
    assert comp["models"] == 2 and "2-fold composition" in comp["statement"]
    assert comp["epsilon_all_models"] == pytest.approx(sum(eps))
    assert all("does not know it" in e["note"] for s in ledger["seeds"] for e in s["entries"])
    assert main(["fl", *FAST, "--replicas", "2", "--seeds", "0", "--out", str(tmp_path / "x")]) == 2


def test_distributed_resume_adopts_rank_zeros_secret_key(tmp_path):
    from torch import nn

    from dpmf.distributed import simulate

    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)
    path = str(tmp_path / "run.pt")

    def make(comm):
        import copy

        model = copy.deepcopy(initial)
        return dpmf.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.2),
            TensorDataset(x, y),
            loss_fn=F.cross_entropy,
            batch_size=8,
            steps=10,
            noise_multiplier=0.8,
            target_delta=1e-5,
            factorization="bsr:2",
            scheme="fixed_order",
            process_group=comm,
        )

    def first(comm):
        run = make(comm)
        _steps(run, 5)
        run.save(path)
        _steps(run, 5)
        return [p.detach().clone() for p in run.model.parameters()], run.state_dict()["secret"]["seed"]

    done = simulate(2, first)
    key = done[0][1]
    assert done[1][1] == key and key.bit_length() > 128  # rank 0's key, shared in memory
    manifest = torch.load(path, weights_only=True)
    digest = manifest["distributed"]["seed_digest"]
    assert not _leaks(digest, [key]) and ":" in digest  # salted

    def second(comm):
        run = make(comm)  # a fresh secret key, replaced by the checkpoint's
        run.resume(path)
        _steps(run, 5)
        return [p.detach().clone() for p in run.model.parameters()]

    for a, b in zip(simulate(3, second)[1], done[0][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


SECRET = 98765432


@pytest.mark.parametrize(
    "bad, kind",
    [(-SECRET, ValueError), (SECRET + 0.5, ValueError), (str(SECRET), TypeError), (float("nan"), ValueError)],
    ids=["negative", "non-integral", "string", "nan"],
)
@pytest.mark.parametrize(
    "use",
    [
        lambda s: PrivatePlan(1000, 50, steps=20, seed=s),
        lambda s: PrivatePlan(1000, 50, steps=20).with_settings(seed=s),
        lambda s: PrivatePlan(1000, 50, steps=20).sampler(s),
        lambda s: __import__("dpmf.seeds").seeds.SeedPolicy.of(s),
    ],
    ids=["plan", "with_settings", "sampler", "SeedPolicy"],
)
def test_an_invalid_seed_is_refused_without_showing_it(bad, kind, use):
    # a seed meant as secret (a typo, a string from the environment) must not reach the logs
    with pytest.raises(kind, match=r"^seed \(value not shown: it is secret\) is invalid: got ") as info:
        use(bad)
    assert str(SECRET) not in str(info.value)


def test_the_shared_privacy_ledger_never_names_a_given_noise_seed():
    import json

    from dpmf.train.ledger import privacy_ledger

    # make_private/dpmf train sample the Monte Carlo accountant with the given seed (reproducible)
    plan = PrivatePlan(64, 16, steps=4, scheme="balls_in_bins", clip_norm=1.0, seed=SECRET).with_noise(3.0)
    res = plan.account(delta=1e-3, seed=SECRET)
    assert res.seed == SECRET and str(SECRET) in res.method  # the run's own result keeps it
    ledger = privacy_ledger(plan, res, steps_taken=4, clip_norm=1.0, seed_given=True)
    text = json.dumps(ledger)
    assert str(SECRET) not in text  # before: "…samples/direction, seed 98765432)" in privacy.json
    assert ledger["epsilon"] == res.epsilon and "seed withheld" in ledger["method"]


def test_a_misspelled_accountant_setting_is_refused_without_its_value():
    from dpmf.accountants.registry import MonteCarlo

    plan = PrivatePlan(64, 16, steps=4, scheme="balls_in_bins", clip_norm=1.0)
    for call in (
        lambda: plan.with_accountant(MonteCarlo(), confidnce=None),  # before: silently kept 0.99
        lambda: plan.calibrate(1.0, 1e-3, sead=SECRET),  # before: silently seed 0
    ):
        with pytest.raises(
            TypeError, match=r"^setting '(confidnce|sead)' is invalid: the accountant settings are "
        ) as info:
            call()
        assert str(SECRET) not in str(info.value)
    assert plan.with_accountant(confidence=0.95).accountant == MonteCarlo(confidence=0.95)


def test_objects_holding_the_key_refuse_pickling_so_it_never_reaches_a_world_readable_file():
    import copy
    import pickle

    import torch
    import torch.nn.functional as F

    from dpmf import seeds

    plan = PrivatePlan(100, 10, steps=20, strategy="bsr:4", scheme="fixed_order", noise_multiplier=1.0,
                       clip_norm=1.0)  # fmt: skip
    step = build_step(plan, torch.nn.Linear(3, 2), F.cross_entropy)
    holders = [step, step.policy, step.noise, step.sampler, step.privatizer, seeds.SeedPolicy.of(None)]
    for obj in holders:
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied: it holds the run's secret"):
            pickle.dumps(obj)
        with pytest.raises(TypeError, match="secret noise key"):
            copy.deepcopy(obj)
    # the plan itself holds no key and still pickles
    assert pickle.loads(pickle.dumps(plan)).to_dict() == plan.to_dict()
