"""The distributed private step without processes: coordinate-keyed noise, owners, and the
simulated reduce/owner/broadcast pipeline against the one-process privatizer."""

import copy
import itertools

import numpy as np
import pytest
import torch
from torch import nn

import dpmf
from dpmf.distributed import (
    DistributedPrivatizer,
    DivergenceError,
    assign_owners,
    owned_by,
    parameter_cost,
    rank_slice,
    simulate,
)
from dpmf.mechanisms import factorize
from dpmf.optim import DPSGD, DPMuon, route_parameters
from dpmf.optim.batches import BatchCheckError
from dpmf.optim.clipping import NonFiniteGradientError, trainable_parameters
from dpmf.optim.noise import ChunkedKeys, DenseInverseNoise, noise_for_factorization, raw_generator
from dpmf.optim.privatize import Privatizer
from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream
from dpmf.workloads import Schedule, from_schedule, prefix_sum

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 20
SIZES = (7, 3, 12, 1, 5)  # five "parameters"
CHUNK = 4


@pytest.mark.parametrize("generator", ["numpy-philox", "torch-mt19937"])
def test_chunked_raw_noise_is_keyed_by_parameter_and_chunk(generator):
    keys = ChunkedKeys(SIZES, chunk=CHUNK)
    gen = noise_for_factorization(factorize(prefix_sum(STEPS), "identity"), keys.dim, seed=11, keys=keys)
    gen.use_generator(generator)
    z = gen.raw_noise(5)
    if generator == "numpy-philox":
        # construction chunk by chunk: chunk c of parameter j from the key (11, 5, j, c)
        expected = []
        for j, size in enumerate(SIZES):
            for c in range(-(-size // CHUNK)):
                g = raw_generator(11, 5, j, c)
                expected.append(
                    torch.from_numpy(g.standard_normal(min(CHUNK, size - c * CHUNK), dtype=np.float32))
                )
        assert torch.equal(z, torch.cat(expected))
    # a generator for parameters 1 and 3 only draws exactly their coordinates
    part = ChunkedKeys(SIZES, (1, 3), CHUNK)
    sub = noise_for_factorization(factorize(prefix_sum(STEPS), "identity"), part.dim, seed=11, keys=part)
    sub.use_generator(generator)
    off = np.cumsum((0,) + SIZES)
    assert torch.equal(sub.raw_noise(5), torch.cat([z[off[1] : off[2]], z[off[3] : off[4]]]))


def test_chunked_keys_refuse_bad_input():
    with pytest.raises(ValueError, match="owned"):
        ChunkedKeys(SIZES, (2, 1))
    with pytest.raises(ValueError, match="owned"):
        ChunkedKeys(SIZES, (5,))
    with pytest.raises(ValueError, match="sizes"):
        ChunkedKeys((3, 0))
    keys = ChunkedKeys(SIZES, (0,))
    with pytest.raises(ValueError, match="dim=8"):
        noise_for_factorization(factorize(prefix_sum(STEPS), "identity"), 8, seed=0, keys=keys)
    flat = noise_for_factorization(factorize(prefix_sum(STEPS), "identity"), 8, seed=0)
    with pytest.raises(ValueError, match="ChunkedKeys"):
        flat.parameter_state()


def _streams():
    """(label, make(dim, seed, keys)) for every generator family and mode."""
    w_exp = from_schedule(Schedule("exponential", 0.2), STEPS)
    fz = {
        "identity": factorize(prefix_sum(STEPS), "identity"),
        "bisr:3": factorize(prefix_sum(STEPS), "bisr:3"),
        "bsr:3": factorize(prefix_sum(STEPS), "bsr:3"),
        "sqrt_prefix": factorize(prefix_sum(STEPS), "sqrt_prefix"),
        "blt:2": factorize(prefix_sum(STEPS), "blt:2"),
        "lcgd:0.5": factorize(prefix_sum(STEPS), "lcgd:0.5"),
        "sqrt": factorize(w_exp, "sqrt"),
    }

    def make(spec, mode=None):
        return lambda dim, seed, keys: noise_for_factorization(fz[spec], dim, seed=seed, mode=mode, keys=keys)

    m = np.tril(np.random.default_rng(3).normal(size=(STEPS, STEPS)))
    return [
        ("identity", make("identity")),
        ("toeplitz inverse bisr:3 buffer", make("bisr:3", "buffer")),
        ("toeplitz inverse bisr:3 regenerate", make("bisr:3", "regenerate")),
        ("banded sqrt bsr:3", make("bsr:3")),
        ("full toeplitz inverse regenerate", make("sqrt_prefix")),
        ("full toeplitz inverse buffer", make("sqrt_prefix", "buffer")),
        ("blt:2", make("blt:2")),
        ("lcgd:0.5", make("lcgd:0.5")),
        ("dense sqrt of A_chi", make("sqrt")),
        ("dense inverse", lambda dim, seed, keys: DenseInverseNoise(m, dim, seed=seed, keys=keys)),
    ]


STREAMS = _streams()


@pytest.mark.parametrize("make", [s[1] for s in STREAMS], ids=[s[0] for s in STREAMS])
def test_sharded_noise_concatenates_to_the_full_chunked_stream(make):
    full_keys = ChunkedKeys(SIZES, chunk=CHUNK)
    full = make(full_keys.dim, 5, full_keys)
    reference = torch.stack([full.next() for _ in range(STEPS)])
    off = np.cumsum((0,) + SIZES)
    for world in (1, 2, 3, 4):
        owners = assign_owners(SIZES, world)
        parts = [make(sum(SIZES[j] for j in o), 5, full_keys.restricted(o)) for o in owned_by(owners, world)]
        got = torch.zeros_like(reference)
        for t in range(STEPS):
            for o, gen in zip(owned_by(owners, world), parts, strict=True):
                y = gen.next()
                pos = 0
                for j in o:
                    got[t, off[j] : off[j + 1]] = y[pos : pos + SIZES[j]]
                    pos += SIZES[j]
        assert torch.equal(got, reference), world
        # each part holds only its own coordinates' state: the states add up to the full one
        assert sum(g.state_numel() for g in parts) == full.state_numel()


@pytest.mark.parametrize("make", [s[1] for s in STREAMS[1:7]], ids=[s[0] for s in STREAMS[1:7]])
def test_parameter_state_moves_between_splits(make):
    full_keys = ChunkedKeys(SIZES, chunk=CHUNK)
    straight = make(full_keys.dim, 9, full_keys)
    ys = [straight.next() for _ in range(STEPS)]
    # 7 steps at W = 3, then resume at W = 1 and at W = 2
    owners3 = owned_by(assign_owners(SIZES, 3), 3)
    at3 = [make(sum(SIZES[j] for j in o), 9, full_keys.restricted(o)) for o in owners3]
    for _ in range(7):
        for g in at3:
            g.next()
    saved = [g.parameter_state() for g in at3]
    one = make(full_keys.dim, 9, full_keys)
    one.load_parameter_state(saved)
    assert torch.equal(torch.stack([one.next() for _ in range(7, STEPS)]), torch.stack(ys[7:]))
    owners2 = owned_by(assign_owners(SIZES, 2), 2)
    at2 = [make(sum(SIZES[j] for j in o), 9, full_keys.restricted(o)) for o in owners2]
    for g in at2:
        g.load_parameter_state(saved)
    off = np.cumsum((0,) + SIZES)
    y = [g.next() for g in at2]
    got = torch.zeros_like(ys[7])
    for o, part in zip(owners2, y, strict=True):
        pos = 0
        for j in o:
            got[off[j] : off[j + 1]] = part[pos : pos + SIZES[j]]
            pos += SIZES[j]
    assert torch.equal(got, ys[7])
    other_seed = make(full_keys.dim, 10, full_keys)
    with pytest.raises(ValueError, match="invalid for this generator"):
        other_seed.load_parameter_state(saved)
    with pytest.raises(ValueError, match="incomplete"):
        make(full_keys.dim, 9, full_keys).load_parameter_state(saved[:2])


def test_owners_balance_cost_and_cover_every_parameter():
    costs = [100, 60, 50, 40, 30, 20, 1]
    owners = assign_owners(costs, 3)
    loads = [sum(c for c, r in zip(costs, owners, strict=True) if r == k) for k in range(3)]
    # LPT by hand: 100→0, 60→1, 50→2, 40→2, 30→1, 20→1 (tie 90/90: lower rank), 1→2
    assert loads == [100, 110, 91]
    best = min(
        max(sum(c for c, r in zip(costs, a, strict=True) if r == k) for k in range(3))
        for a in itertools.product(range(3), repeat=len(costs))
    )
    assert best == 101 and max(loads) <= 4 / 3 * best  # Graham's bound against brute force
    assert assign_owners(costs, 3) == owners  # deterministic
    assert assign_owners(costs, 1) == (0,) * 7
    assert parameter_cost((64, 3, 3, 3), newton_schulz=True) == (64 * 27, 64 * 27 * 27)
    assert parameter_cost((64, 3, 3, 3)) == (64 * 27, 0)
    with pytest.raises(ValueError, match="world_size"):
        assign_owners(costs, 0)
    # two costs: sizes and Newton–Schulz work are balanced together (brute force on 4^6)
    two = [(100, 0), (90, 9000), (50, 500), (40, 4000), (30, 0), (10, 100)]
    owners = assign_owners(two, 2)
    tot = np.sum(two, axis=0)

    def worst(a):
        return max(
            (np.sum([c for c, r in zip(two, a, strict=True) if r == k], axis=0) / tot).max() for k in (0, 1)
        )

    best = min(worst(a) for a in itertools.product(range(2), repeat=len(two)))
    assert worst(owners) <= 4 / 3 * best and worst(owners) < 0.75


def test_rank_slices_partition_the_batch():
    idx = np.arange(11) * 3
    for world in (1, 2, 3, 4, 12):
        parts = [rank_slice(idx, r, world) for r in range(world)]
        assert np.array_equal(np.concatenate(parts), idx)
    assert rank_slice(np.arange(0), 1, 2).shape == (0,)


# -- the simulated pipeline -------------------------------------------------------------------


def _initial_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


_INITIAL = _initial_model()  # built once: simulated ranks are threads sharing torch's global RNG


def _model(dtype):
    return copy.deepcopy(_INITIAL).to(dtype)


def _data(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 6, generator=g, dtype=dtype), torch.randint(0, 3, (40,), generator=g)


def _optimizer(kind, model):
    if kind == "dp-sgd":
        return DPSGD(model.parameters(), lr=0.3, momentum=0.9)
    return DPMuon(route_parameters(model), lr=0.05, beta=0.9, vector_momentum=0.9)


def _batches(plan, seed=3):
    sampler = plan.sampler(seed)
    return [sampler.next() for _ in range(plan.steps)]


def _one_process(plan, kind, dtype, batches):
    model = _model(dtype)
    params = [p for _, p in trainable_parameters(model)]
    keys = ChunkedKeys(tuple(p.numel() for p in params))
    noise = noise_stream(plan, keys.dim, 21, dtype=dtype, keys=keys)
    priv = Privatizer(model, nn.functional.cross_entropy, plan=plan, clip_norm=1.0, noise=noise)
    opt = _optimizer(kind, model)
    opt.bind(priv)
    x, y = _data(dtype)
    for idx in batches:
        priv.privatize(x[idx], y[idx])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


def _distributed(plan, kind, dtype, batches, mode, world):
    def rank_fn(comm):
        model = _model(dtype)
        if comm.rank:  # a different initialization elsewhere: rank 0's is broadcast
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = _optimizer(kind, model)
        priv = DistributedPrivatizer(
            model,
            nn.functional.cross_entropy,
            collectives=comm,
            plan=plan,
            clip_norm=1.0,
            seed=21,
            mode=mode,
            optimizer=opt,
            check_every=2,
        )
        opt.bind(priv)
        x, y = _data(dtype)
        for idx in batches:
            mine = rank_slice(idx, comm.rank, comm.world_size)
            step = priv.privatize(x[mine], y[mine])
            assert step.batch_size == len(idx)  # the global count, for logging
            opt.step()
            priv.after_step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], priv.noise_state_numel()

    return simulate(world, rank_fn)


PIPELINES = [
    ("dp-sgd", "bsr:4", "sharded"),
    ("dp-muon", "bsr:4", "sharded"),
    ("dp-muon", "blt:2", "sharded"),
    ("dp-sgd", "bisr:4", "replicated"),
    ("dp-muon", "blt:2", "rank0"),
]


@pytest.mark.parametrize("kind,strategy,mode", PIPELINES)
def test_simulated_ranks_equal_the_one_process_privatizer(kind, strategy, mode):
    plan = PrivatePlan(40, 8, steps=6, scheme="fixed_order", strategy=strategy).with_noise(0.7)
    batches = _batches(plan)
    reference = _one_process(plan, kind, torch.float64, batches)
    for world in (1, 2, 3):
        results = _distributed(plan, kind, torch.float64, batches, mode, world)
        for params, _ in results:  # identical on every rank
            for a, b in zip(params, results[0][0], strict=True):
                assert torch.equal(a, b)
        for a, b in zip(results[0][0], reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        states = [s for _, s in results]
        if mode == "sharded" and strategy != "identity":
            one = _one_process_state(plan, torch.float64)
            assert sum(states) == one and max(states) < one or world == 1


def _one_process_state(plan, dtype):
    model = _model(dtype)
    dim = sum(p.numel() for p in model.parameters())
    return noise_stream(
        plan, dim, 0, dtype=dtype, keys=ChunkedKeys(tuple(p.numel() for p in model.parameters()))
    ).state_numel()


def test_float32_ranks_agree_with_one_process_to_rounding():
    plan = PrivatePlan(40, 8, steps=6, scheme="fixed_order", strategy="bsr:4").with_noise(0.7)
    batches = _batches(plan)
    reference = _one_process(plan, "dp-muon", torch.float32, batches)
    results = _distributed(plan, "dp-muon", torch.float32, batches, "sharded", 2)
    for a, b in zip(results[0][0], reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_different_seed_on_one_rank_is_refused():
    plan = PrivatePlan(40, 8, steps=6, scheme="fixed_order", strategy="bsr:4").with_noise(0.7)

    def rank_fn(comm):
        model = _model(torch.float64)
        DistributedPrivatizer(
            model,
            nn.functional.cross_entropy,
            collectives=comm,
            plan=plan,
            clip_norm=1.0,
            seed=21 + comm.rank,
        )

    with pytest.raises(DivergenceError, match="rank 1 differs from rank 0 in seed"):
        simulate(2, rank_fn)


@pytest.mark.parametrize("mode", ["sharded", "replicated", "rank0"])
def test_a_check_that_fails_on_one_rank_stops_every_rank_with_its_error(mode):
    """A NaN in rank 1's slice only: both ranks raise the same NonFiniteGradientError before
    the release (no gradient written, the step not advanced), and the run then goes on to the
    one-process weights."""
    plan = PrivatePlan(40, 8, steps=4, scheme="fixed_order", strategy="bsr:2").with_noise(0.7)
    batches = _batches(plan)

    def rank_fn(comm):
        model = _model(torch.float64)
        opt = _optimizer("dp-sgd", model)
        priv = DistributedPrivatizer(
            model, nn.functional.cross_entropy, collectives=comm, plan=plan, clip_norm=1.0, seed=21,
            mode=mode, optimizer=opt,
        )  # fmt: skip
        opt.bind(priv)
        x, y = _data(torch.float64)
        refused = None
        for t, idx in enumerate(batches):
            mine = rank_slice(idx, comm.rank, comm.world_size)
            if t == 1:
                bad = x[mine].clone()
                bad[0, 0] = float("nan") if comm.rank == 1 else bad[0, 0]
                with pytest.raises(NonFiniteGradientError) as err:
                    priv.privatize(bad, y[mine])
                refused = (str(err.value), priv.noise.step, [p.grad for p in model.parameters()])
            priv.privatize(x[mine], y[mine])
            opt.step()
            priv.after_step()
            opt.zero_grad(set_to_none=True)
        return refused, [p.detach().clone() for p in model.parameters()]

    (r0, weights), (r1, _) = simulate(2, rank_fn)
    assert r0[0] == r1[0] and r0[0].startswith(
        "rank 1 of 2 refused step 1, so every rank stops before the release: non-finite per-example"
    )
    assert r0[1] == r1[1] == 1 and all(g is None for g in r0[2] + r1[2])
    for a, b in zip(weights, _one_process(plan, "dp-sgd", torch.float64, batches), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_batch_other_than_the_drawn_one_on_one_rank_stops_every_rank():
    def ranks(comm):
        run = _private(_model(torch.float64), process_group=comm)
        xb, yb = next(iter(run.data_loader))
        with pytest.raises(BatchCheckError) as err:
            run.backward(xb.flip(0) if comm.rank == 1 else xb, target=yb, return_loss=False)
        run.backward(xb, target=yb, return_loss=False)  # the drawn batch still goes through
        return str(err.value), run.privatizer.step

    (a, step), (b, _) = simulate(2, ranks)
    assert a == b and a.startswith("rank 1 of 2 refused step 0, so every rank stops before the release")
    assert step == 1


def test_diverged_parameters_are_detected():
    plan = PrivatePlan(40, 8, steps=6, scheme="fixed_order", strategy="bsr:4").with_noise(0.7)

    def rank_fn(comm):
        model = _model(torch.float64)
        priv = DistributedPrivatizer(
            model, nn.functional.cross_entropy, collectives=comm, plan=plan, clip_norm=1.0, seed=21
        )
        priv.verify()
        if comm.rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] += 1e-9
        priv.verify()

    with pytest.raises(DivergenceError, match="rank 1 differs from rank 0 in parameters"):
        simulate(2, rank_fn)


def CASES_ON_PROCESSES():
    """(name, optimizer, plan, dtype) run on real processes by tests/distributed_worker.py."""
    banded = PrivatePlan(40, 8, steps=5, scheme="fixed_order", strategy="bsr:4").with_noise(0.7)
    blt = PrivatePlan(40, 8, steps=5, scheme="fixed_order", strategy="blt:2").with_noise(0.7)
    return [
        ("sgd-banded-f64", "dp-sgd", banded, torch.float64),
        ("muon-banded-f64", "dp-muon", banded, torch.float64),
        ("muon-blt-f64", "dp-muon", blt, torch.float64),
        ("sgd-blt-f32", "dp-sgd", blt, torch.float32),
        ("muon-banded-f32", "dp-muon", banded, torch.float32),
    ]


# -- make_private over simulated ranks -----------------------------------------------------------


def _private(model, process_group=None, **kw):
    import dpmf

    x, y = _data(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return dpmf.make_private(
        model,
        opt,
        torch.utils.data.TensorDataset(x, y),
        loss_fn=nn.functional.cross_entropy,
        batch_size=8,
        epochs=2,
        noise_multiplier=0.8,
        target_delta=1e-5,
        factorization="bsr:3",
        scheme="fixed_order",
        seed=13,
        process_group=process_group,
        **kw,
    )


def _steps(run, k):
    it = iter(run.data_loader)
    for _ in range(k):
        xb, yb = next(it)
        run.backward(xb, target=yb, return_loss=False)
        run.optimizer.step()
        run.optimizer.zero_grad()


def test_make_private_over_ranks_equals_one_process_and_resumes_at_another_count(tmp_path):
    one = _private(_model(torch.float64), noise_keys="chunked")
    _steps(one, 5)  # one epoch (40 examples, B = 8)
    _steps(one, 5)
    reference = [p.detach().clone() for p in one.model.parameters()]
    path = str(tmp_path / "run.pt")

    def ranks(comm):
        run = _private(_model(torch.float64), process_group=comm)
        assert len(run.data_loader) == 5
        _steps(run, 5)
        run.save(path)  # one shard per rank and a manifest
        _steps(run, 5)
        assert run.get_epsilon() == one.get_epsilon()
        return [p.detach().clone() for p in run.model.parameters()]

    results = simulate(2, ranks)
    for a, b, c in zip(results[0], results[1], reference, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    # the W = 2 checkpoint, resumed in one process and at three ranks, continues the same run
    again = _private(_model(torch.float64), noise_keys="chunked")
    again.resume(path)
    _steps(again, 5)
    for a, c in zip(again.model.parameters(), reference, strict=True):
        torch.testing.assert_close(a.detach(), c, rtol=1e-12, atol=1e-12)

    def three(comm):
        run = _private(_model(torch.float64), process_group=comm)
        run.resume(path)
        _steps(run, 5)
        return [p.detach().clone() for p in run.model.parameters()]

    for a, c in zip(simulate(3, three)[2], reference, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    default = _private(_model(torch.float64))  # chunked keys by default: resumes without a flag
    default.resume(path)
    _steps(default, 5)
    for a, c in zip(default.model.parameters(), reference, strict=True):
        torch.testing.assert_close(a.detach(), c, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="holds coordinate-keyed noise"):
        _private(_model(torch.float64), noise_keys="stream").resume(path)  # a single-stream run cannot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["bisr:3", "bsr:3", "blt:2", "sqrt_prefix", "lcgd:0.5"])
def test_sharded_noise_on_cuda_concatenates_to_the_full_stream(spec):
    fz = factorize(prefix_sum(STEPS), spec)
    full_keys = ChunkedKeys(SIZES, chunk=CHUNK)
    full = noise_for_factorization(fz, full_keys.dim, seed=5, keys=full_keys, device="cuda")
    owners = owned_by(assign_owners(SIZES, 3), 3)
    parts = [
        noise_for_factorization(
            fz, full_keys.restricted(o).dim, seed=5, keys=full_keys.restricted(o), device="cuda"
        )
        for o in owners
    ]
    off = np.cumsum((0,) + SIZES)
    for _ in range(STEPS):
        y = full.next()
        for o, gen in zip(owners, parts, strict=True):
            part, pos = gen.next(), 0
            for j in o:
                assert torch.equal(part[pos : pos + SIZES[j]], y[off[j] : off[j + 1]])
                pos += SIZES[j]


def test_bad_distributed_settings_are_refused_before_any_work():
    from dpmf.distributed import TorchCollectives

    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        TorchCollectives()
    with pytest.raises(ValueError, match="noise_keys"):
        _private(_model(torch.float64), noise_keys="per-rank")
    with pytest.raises(ValueError, match="distributed_mode"):
        _private(_model(torch.float64), distributed_mode="zero")
    plan = PrivatePlan(40, 8, steps=6, scheme="fixed_order", strategy="bsr:4").with_noise(0.7)

    def bad_mode(comm):
        DistributedPrivatizer(
            _model(torch.float64),
            nn.functional.cross_entropy,
            collectives=comm,
            plan=plan,
            clip_norm=1.0,
            seed=1,
            mode="zero",
        )

    with pytest.raises(ValueError, match="mode"):
        simulate(2, bad_mode)


def test_a_torchrun_environment_without_a_process_group_is_refused(monkeypatch, capsys):
    from dpmf.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        _private(_model(torch.float64))
    rc = main(["train", "--dataset", "digits", "--epochs", "1", "--out", "unused"])
    assert rc == 2 and "add --distributed" in capsys.readouterr().err


def test_each_mode_is_one_object_that_decides_which_noise_a_rank_draws():
    from dpmf.distributed import DISTRIBUTED_MODES, MODES

    assert tuple(DISTRIBUTED_MODES) == MODES == ("sharded", "replicated", "rank0", "fsdp")
    owned_by = ((0, 2), (1,), ())
    noised = {
        name: [tuple(cls().noised(owned_by, r, 3)) for r in range(3)]
        for name, cls in DISTRIBUTED_MODES.items()
    }
    assert noised == {
        "sharded": [(0, 2), (1,), ()],  # each owner its parameters: one copy of the noise
        "replicated": [(0, 1, 2)] * 3,
        "rank0": [(0, 1, 2), (), ()],
        "fsdp": [(0, 1, 2)] * 3,  # every rank its shard (a range) of every parameter
    }


def test_a_model_sharded_by_fully_shard_is_refused_without_a_process_group(tmp_path):
    """FSDP2 parameters are DTensors: only the sharded step (make_private with the process
    group they are sharded over) noises them shard by shard, so make_private without one refuses
    the model in one line, before drawing a batch."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        fully_shard(model[0])
        fully_shard(model)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
        with pytest.raises(
            ValueError, match=r"parameters 0\.weight, 0\.bias, 2\.weight are sharded DTensors.*process_group="
        ):
            dpmf.make_private(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                data,
                loss_fn=torch.nn.functional.cross_entropy,
                batch_size=8,
                steps=2,
                noise_multiplier=1.0,
                target_delta=1e-5,
                factorization="identity",
            )
    finally:
        dist.destroy_process_group()
