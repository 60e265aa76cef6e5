"""The private step on a fully_shard (FSDP2) model: ranged noise keys, the sharded release over
W gloo processes against one process, and the refusals (checked at W = 1 in this process)."""

import os
import subprocess
import sys
from pathlib import Path

import fsdp_helpers as h
import numpy as np
import pytest
import torch
from test_distributed import STREAMS
from torch import nn

from dpmf.distributed import DistributedPrivatizer, TorchCollectives, simulate
from dpmf.optim.noise import ChunkedKeys

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = (7, 3, 12, 1, 5)


# -- noise keyed by coordinate ranges ------------------------------------------------------------


@pytest.mark.parametrize("make", [s[1] for s in STREAMS], ids=[s[0] for s in STREAMS])
def test_a_stream_over_coordinate_ranges_is_the_full_streams_slice(make):
    """Rows split as fully_shard splits them (chunk 4 cuts the ranges inside chunks): each
    ranged stream's 20 steps are exactly the full stream's entries at those coordinates, and its
    state is the share of the total."""
    full_keys = ChunkedKeys(SIZES, chunk=4)
    full = make(full_keys.dim, 5, full_keys)
    reference = torch.stack([full.next() for _ in range(20)])
    starts = np.cumsum((0,) + SIZES)
    for spans in (((0, 3), (1, 2), (2, 9), (0, 1), (1, 4)), ((3, 7), (0, 3), (9, 12), (1, 1), (4, 5))):
        keys = ChunkedKeys(SIZES, chunk=4, ranges=spans)
        part = make(keys.dim, 5, keys)
        got = torch.stack([part.next() for _ in range(20)])
        cols = np.concatenate([np.arange(starts[j] + a, starts[j] + b) for j, (a, b) in enumerate(spans)])
        assert torch.equal(got, reference[:, cols])
        assert part.state_numel() * full_keys.dim == full.state_numel() * keys.dim


def test_ranged_noise_states_load_at_another_split():
    """A banded stream's state saved by 2 ranges per parameter loads into 3 ranges (resharding)
    and continues with the full stream's noise; a missing piece is refused."""
    from dpmf.mechanisms import factorize
    from dpmf.optim.noise import noise_for_factorization
    from dpmf.workloads import prefix_sum

    fz = factorize(prefix_sum(12), "bsr:3")

    def stream(spans):
        keys = ChunkedKeys(SIZES, chunk=4, ranges=spans)
        return noise_for_factorization(fz, keys.dim, seed=9, keys=keys)

    halves = [tuple((0, s // 2) for s in SIZES), tuple((s // 2, s) for s in SIZES)]
    whole = stream(None)
    parts = [stream(sp) for sp in halves]
    for _ in range(4):
        whole.next()
        for g in parts:
            g.next()
    thirds = [tuple((s * k // 3, s * (k + 1) // 3) for s in SIZES) for k in range(3)]
    later = [stream(sp) for sp in thirds]
    saved = [g.parameter_state() for g in parts]
    for g in later:
        g.load_parameter_state(saved)
    nxt = whole.next()
    starts = np.cumsum((0,) + SIZES)
    for g, spans in zip(later, thirds, strict=True):
        cols = np.concatenate([np.arange(starts[j] + a, starts[j] + b) for j, (a, b) in enumerate(spans)])
        assert torch.equal(g.next(), nxt[cols])
    with pytest.raises(ValueError, match="incomplete"):
        stream(thirds[2]).load_parameter_state(saved[:1])


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="ranges"):
        ChunkedKeys(SIZES, ranges=((0, 8), (0, 3), (0, 12), (0, 1), (0, 5)))  # 8 > 7
    with pytest.raises(ValueError, match="ranges"):
        ChunkedKeys(SIZES, (0, 1), ranges=((0, 7),))


def test_reduce_scatter_on_simulated_ranks_sums_and_splits():
    def fn(comm):
        t = torch.arange(6.0) * (comm.rank + 1)
        out = torch.empty(2)
        comm.reduce_scatter(out, t)
        return out

    got = simulate(3, fn)
    total = torch.arange(6.0) * 6
    for r in range(3):
        assert torch.equal(got[r], total[2 * r : 2 * r + 2])
    with pytest.raises(ValueError, match="do not split into 3 parts"):
        simulate(3, lambda comm: comm.reduce_scatter(torch.empty(2), torch.arange(5.0)))


# -- one process group of one rank, in this process ----------------------------------------------


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _privatizer(model, **kw):
    plan = h.cases()[0][2]
    return DistributedPrivatizer(
        model,
        nn.functional.cross_entropy,
        collectives=TorchCollectives(),
        plan=plan,
        clip_norm=1.0,
        seed=h.SEED,
        **kw,
    )


def test_one_rank_fully_shard_takes_the_one_process_step(world_of_one):
    """W = 1 (one GPU's FSDP): DP-Muon on a banded strategy gives the one-process weights."""
    name, kind, plan = h.cases()[4]
    model = h.shard(h.build(torch.float64))
    opt = h.optimizer(kind, model)
    priv = _privatizer(model, optimizer=opt)
    assert priv.mode == "fsdp"
    opt.bind(priv)
    x, y = h.data(torch.float64)
    for idx in h.batches(plan):
        priv.privatize(x[idx], y[idx])
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = [p.full_tensor() for p in model.parameters()]
    for a, b in zip(got, h.one_process(plan, kind, torch.float64), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_what_the_sharded_step_cannot_take_is_refused_in_one_line(world_of_one):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with pytest.raises(ValueError, match="mode='replicated' is invalid for a fully_shard model"):
        _privatizer(h.shard(h.build()), mode="replicated")
    with pytest.raises(ValueError, match="clipping='vmap' is invalid for a fully_shard model"):
        _privatizer(h.shard(h.build()), clipping="vmap")
    with pytest.raises(ValueError, match="mode='fsdp' is invalid: the model's parameters are not sharded"):
        _privatizer(h.build(), mode="fsdp")
    half = h.build()
    fully_shard(half[0])  # the root not sharded: its LayerNorm and other Linears are whole
    with pytest.raises(ValueError, match="not sharded; apply fully_shard to the root"):
        _privatizer(half)
    cast = h.build()
    fully_shard(cast, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="mp_policy=.* casts the parameters"):
        _privatizer(cast)
    from dpmf.audit.private_audit import audit_make_private

    model = h.shard(h.build(torch.float64))
    x, y = h.data(torch.float64)
    with pytest.raises(ValueError, match="the white-box audit is invalid for a fully_shard model"):
        audit_make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
            canaries=10, loss_fn=nn.functional.cross_entropy, batch_size=8, epochs=1, noise_multiplier=1.0,
            target_delta=1e-5, factorization="identity", process_group=world_of_one,
        )  # fmt: skip


class _Scaled(nn.Module):
    """A layer without a clipping handler."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x):
        return x * self.scale


class _Outside(nn.Module):
    """Reads a Linear's weight outside that Linear's forward (a tied use)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        return self.head(h) + (x @ self.inner.weight.T).sum(1, keepdim=True)


def test_layers_the_sharded_step_cannot_clip_by_handler_are_refused(world_of_one):
    """A layer without a handler is refused when the step is built; a parameter used outside its
    module (seen through the unsharded parameter FSDP2 registers during the forward) stops the
    step before any release."""
    from torch.distributed.fsdp import fully_shard

    x, y = h.data()
    odd = nn.Sequential(nn.Linear(6, 5), _Scaled(), nn.Linear(5, 3))
    no_handler = r"layer 1 \(no clipping handler is registered for _Scaled\).*register one"
    with pytest.raises(ValueError, match=no_handler):
        _privatizer(h.shard(odd))

    outside = _Outside()
    fully_shard(outside)
    priv = _privatizer(outside)
    outside_use = r"inner \(a trainable parameter is used outside its module's forward\)"
    with pytest.raises(ValueError, match=outside_use):
        priv.privatize(x[:8], y[:8])
    assert priv.step == 0


# -- W gloo processes ----------------------------------------------------------------------------


def _torchrun(args, tmp_path, nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_over_processes_equals_one_process(tmp_path, world):
    """DP-SGD, DP-Adam and DP-Muon, banded and BLT, float32: the whole final weights of W ranks
    equal one process's to 1e-5; each rank holds ⌈rows/W⌉-row shards and the noise state of its
    coordinates only (together the one-process state); make_private's run and ε likewise."""
    _torchrun([str(HERE / "fsdp_worker.py"), "steps", str(tmp_path)], tmp_path, world)
    for name, kind, plan in h.cases():
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)["weights"]
        for a, b in zip(got, h.one_process(plan, kind), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        held = [tuple(map(int, (tmp_path / f"{name}.rank{r}.txt").read_text().split())) for r in range(world)]
        # DP-Muon's 3 matrices of each of the 5 steps were orthogonalised by their owners
        assert [n for *_, n in held] == [15 if kind == "dp-muon" else 0] * world
        held = [(local, state) for local, state, _ in held]
        rows = [5, 5, 4, 4, 3, 3]  # the shapes' rows: weight and bias of each Linear
        own = [sum(-(-r // world) * (p.numel() // r) for r, p in zip(rows, _linear_params(), strict=True))]
        assert max(local for local, _ in held) <= own[0] + 2 * 5  # + the LayerNorm's shard
        whole_state = _state_numel(plan)
        assert sum(state for _, state in held) == whole_state
    mp = torch.load(tmp_path / "make_private.pt", weights_only=True)
    one = h.make_private_run(h.build(torch.float64), noise_keys="chunked")
    h.take_steps(one, 5)
    for a, b in zip(mp["weights"], one.model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
    assert mp["epsilon"] == one.get_epsilon()
    # batches of fewer examples than ranks: a rank without one runs its forward on padding
    tiny = torch.load(tmp_path / "tiny.pt", weights_only=True)
    alone = h.tiny_batches_run(h.build(torch.float64), noise_keys="chunked")
    assert tiny["sizes"] == h.all_steps(alone) and any(0 < n < world for n in tiny["sizes"])
    for a, b in zip(tiny["weights"], alone.model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)


def _linear_params():
    m = h.build()
    return [p for layer in m if isinstance(layer, nn.Linear) for p in layer.parameters()]


def _state_numel(plan):
    from dpmf.step import noise_stream

    d = sum(p.numel() for p in h.build().parameters())
    keys = ChunkedKeys(tuple(p.numel() for p in h.build().parameters()))
    return noise_stream(plan, d, h.SEED, keys=keys).state_numel()


def test_matrices_go_to_the_least_loaded_owner_largest_first():
    from dpmf.optim.fsdp import owners_by_cost

    # costs m·n·min(m, n): 8·8·8 = 512, 4·8·4 = 128, 8·4·4 = 128, 2·2·2 = 8, 4·4·4 = 64
    shapes = [(8, 8), (4, 8), (8, 2, 2), (2, 2), (4, 4)]
    assert owners_by_cost(shapes, 2) == [0, 1, 1, 1, 1]  # 512 | 128 + 128 + 64 + 8
    assert owners_by_cost(shapes, 3) == [0, 1, 2, 2, 1]  # 512 | 128 + 64 | 128 + 8 (ties: lowest)
    assert owners_by_cost(shapes, 1) == [0] * 5


@pytest.mark.slow
def test_ranks_of_unequal_batches_keep_in_step_and_a_rank_that_fails_a_check_stops_every_rank(tmp_path):
    """The forward and backward of a fully_shard model are collectives: with 3 examples on one
    rank and 1 on the other (the first step's batch-independence and layer probes then differ
    per rank; micro-batches of 2 make the ranks' pass counts differ) every rank still issues the
    same collectives and the weights equal one process's. A NaN (also inside the first step's
    batch-independence probe), a batch other than the drawn one or an empty slice on rank 1
    only makes both ranks raise the same error before any release, and the run then goes on."""
    _torchrun([str(HERE / "fsdp_worker.py"), "agree", str(tmp_path)], tmp_path, 2)
    for micro in (None, 2):
        got = torch.load(tmp_path / f"uneven-{micro}.pt", weights_only=True)
        for a, b in zip(got, h.uneven_one_process(micro), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    expected = {
        "nan": "NonFiniteGradientError 1 rank 1 of 2 refused step 1, so every rank stops before the release: "
        "non-finite per-example gradient at step 1",
        "batch": "BatchCheckError rank 1 of 2 refused step 0, so every rank stops before the release: "
        "backward refused at step 0: the batch is not the one the plan's sampler drew",
        "empty": "ValueError step 3's batch is invalid for a fully_shard model: rank 1 has no example",
        "nan-probe": "NonFiniteGradientError 0 rank 1 of 2 refused step 0, so every rank stops before the "
        "release: non-finite per-example gradient at step 0",
    }
    for case, start in expected.items():
        texts = [(tmp_path / f"{case}.rank{r}.txt").read_text() for r in range(2)]
        assert texts[0] == texts[1] and texts[0].startswith(start), texts
    assert texts[0].endswith(" | probed True step 1")  # the NaN inside the first step's probe
    # the clipped sums went to the shards bucket by bucket: with buckets of 16 entries the most
    # held at once is one layer's, the first Linear's weight (2 padded row blocks: 2·3·6) and the
    # bucket its bias opens (2·(3 + 3)), not the model's d = 84 (one bucket of everything by
    # default: 2·Σ⌈rows/2⌉·width = 98)
    peaks = [int((tmp_path / f"peak-{m}.rank0.txt").read_text()) for m in ("None", "2")]
    assert peaks == [98, 48]


@pytest.mark.slow
def test_a_fully_shard_checkpoint_resumes_at_another_world_size(tmp_path):
    """make_private's run saved at W = 2 (DCP shards of weights and momentum, noise by
    coordinate ranges) resumes at W = 4 and ends where ten one-process steps end; its files are
    private; a whole-model run refuses the file in one line."""
    _torchrun([str(HERE / "fsdp_worker.py"), "save", str(tmp_path)], tmp_path, 2)
    (folder,) = tmp_path.glob("checkpoint.pt.dcp.step5.*")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in folder.iterdir()} == {0o600}
    _torchrun([str(HERE / "fsdp_worker.py"), "resume", str(tmp_path)], tmp_path, 4)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    one = h.make_private_run(h.build(torch.float64), noise_keys="chunked")
    h.take_steps(one, 5)
    h.take_steps(one, 5)
    assert got["step"] == one.steps_taken == 10
    for a, b in zip(got["weights"], one.model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
    whole = h.make_private_run(h.build(torch.float64), noise_keys="chunked")
    with pytest.raises(
        ValueError, match="holds a fully_shard-parameter run and this run's parameters are whole"
    ):
        whole.resume(str(tmp_path / "checkpoint.pt"))


def test_a_whole_model_checkpoint_is_refused_by_a_fully_shard_run(world_of_one, tmp_path):
    import torch.distributed as dist

    one = h.make_private_run(h.build(torch.float64), noise_keys="chunked")
    h.take_steps(one, 2)
    one.save(str(tmp_path / "one.pt"))
    sharded = h.make_private_run(h.shard(h.build(torch.float64)), process_group=dist.group.WORLD)
    with pytest.raises(
        ValueError, match="holds a whole-parameter run and this run's parameters are fully_shard"
    ):
        sharded.resume(str(tmp_path / "one.pt"))


@pytest.mark.slow
def test_gpt2_with_lora_fully_shard_at_two_processes_equals_one_process(tmp_path):
    """A GPT-2 configuration with LoRA adapters, its blocks and root fully_shard-ed, through
    make_private at W = 2 on gloo: the adapters after 4 Poisson steps equal one process's; its
    checkpoint refuses another frozen base."""
    import gpt2_helpers as g

    _torchrun([str(HERE / "fsdp_worker.py"), "gpt2", str(tmp_path)], tmp_path, 2)
    got = torch.load(tmp_path / "gpt2.pt", weights_only=True)
    model = g.gpt2()
    run = g.private_run(model, noise_multiplier=0.5, noise_keys="chunked")
    for batch in run.data_loader:
        run.backward(batch)
        run.optimizer.step()
        run.optimizer.zero_grad()
    lora = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert got["steps"] == run.steps_taken == 4 and sorted(got["lora"]) == sorted(lora) and len(lora) == 2
    for n, p in lora.items():
        torch.testing.assert_close(got["lora"][n], p, rtol=1e-5, atol=1e-5)
    # the frozen base's digest does not depend on the split: W = 2's is one whole model's
    from dpmf.train.dcp import frozen_rows_digest

    (whole,) = simulate(1, lambda comm: frozen_rows_digest(g.gpt2(), comm))
    for r in range(2):
        digest, refused = (tmp_path / f"gpt2-frozen.rank{r}.txt").read_text().split("\n", 1)
        assert digest == whole and len(whole) == 32
        assert "its frozen weights differ from the saved run's" in refused


@pytest.mark.slow
def test_dpmf_train_fsdp_stopped_at_two_processes_resumes_at_four(tmp_path):
    """``dpmf train --distributed --fsdp``: stopped after epoch 1 of 2 at W = 2, resumed with
    ``--resume`` at W = 4, its model.pt equals the one-process run's (DP-Muon, bsr:4)."""
    import json

    from dpmf.train.config import TrainConfig
    from dpmf.train.run import train

    base = dict(dataset="digits", model="mlp", optimizer="dp-muon", factorization="bsr:4")
    base.update(scheme="fixed_order", batch_size=128, epsilon=3.0, seed=5, device="cpu", epochs=2)
    config = TrainConfig(**base, distributed_mode="fsdp")
    worker = [str(HERE / "distributed_worker.py"), "train", "two", json.dumps(config.to_dict())]
    _torchrun(worker, tmp_path, 2)
    manifest = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert manifest["epoch"] == 1 and manifest["model"] == {}
    assert manifest["fsdp"]["folder"].startswith("checkpoint.pt.dcp.step12.")
    flags = ["--dataset", "digits", "--model", "mlp", "--optimizer", "dp-muon", "--factorization", "bsr:4"]
    flags += ["--scheme", "fixed_order", "--batch-size", "128", "--epsilon", "3", "--seed", "5"]
    flags += ["--epochs", "2"]
    cmd = ["-m", "dpmf", "train", "--distributed", "--fsdp", "--resume", "--no-progress", "--out", "two"]
    _torchrun([*cmd, *flags], tmp_path, 4)
    train(TrainConfig(**base), str(tmp_path / "one"), progress=False, log=lambda *a: None)
    a = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    assert sorted(a) == sorted(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)


def test_a_plain_backward_on_a_fully_shard_model_does_not_step(world_of_one):
    """FSDP2's own backward writes reduce-scattered gradients into p.grad: the guarded optimizer
    refuses them, alone or added to a private gradient (no clipping, no noise); after a private
    backward alone it steps."""
    import torch.distributed as dist

    run = h.make_private_run(h.shard(h.build(torch.float64)), process_group=dist.group.WORLD)
    batches = iter(run.data_loader)
    xb, yb = next(batches)
    nn.functional.cross_entropy(run.model(xb), yb).backward()
    with pytest.raises(RuntimeError, match="no private gradient for this step"):
        run.optimizer.step()
    run.optimizer.zero_grad()
    run.backward(xb, target=yb)
    nn.functional.cross_entropy(run.model(xb), yb).backward()  # onto the private gradient
    with pytest.raises(RuntimeError, match="p.grad was replaced or modified"):
        run.optimizer.step()
    run.optimizer.zero_grad()
    xb, yb = next(batches)
    run.backward(xb, target=yb)
    before = [p.to_local().clone() for p in run.model.parameters()]
    run.optimizer.step()
    assert all(not torch.equal(a, p.to_local()) for a, p in zip(before, run.model.parameters(), strict=True))


def test_fsdp_flag_needs_distributed(capsys):
    from dpmf.cli import main

    assert main(["train", "--dataset", "digits", "--fsdp", "--out", "unused"]) == 2
    assert "--fsdp is invalid without --distributed" in capsys.readouterr().err
    rc = main(
        [
            "train",
            "--dataset",
            "digits",
            "--distributed",
            "--fsdp",
            "--distributed-mode",
            "rank0",
            "--out",
            "x",
        ]
    )
    assert rc == 2 and "--fsdp and --distributed-mode=rank0 are invalid together" in capsys.readouterr().err


@pytest.mark.parametrize("tensors", [6, 20, 68])
def test_the_sharded_steps_host_synchronisations_do_not_grow_with_the_model(world_of_one, tensors):
    """A fully_shard step (make_private, W = 1) hands tensor values to Python in ≤ 3 counted ops
    (the dispatch mode of tests/test_host_syncs.py), at every model size; its two agreements
    read their all-reduced figures in one copy each."""
    from test_host_syncs import _mlp, _syncs_of_a_step
    from torch.distributed.fsdp import fully_shard

    model = _mlp(tensors)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    assert len(list(model.parameters())) == tensors
    assert _syncs_of_a_step(model, (16,), "auto", process_group=world_of_one) <= 3
