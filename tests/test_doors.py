"""Every public door into a private run, walked through the same hostile-user cases.

A **door** is a way a user starts a private run: ``dpmf train`` (the CLI and ``dpmf.train.train``
behind it), ``make_private`` (the user's own loop) in one process and over two simulated ranks
(``process_group=``), ``torchrun … dpmf train --distributed`` (two gloo processes),
``dpmf fl`` in its three privacy modes and ``dpmf audit`` (the run of ``dpmf train`` with
canaries). ``DOORS`` holds one object per door; each implements every method of ``Door`` (one
per case), and the tests below are ``DOORS × CASES``. A new entry
point without a door fails ``test_every_entry_point_is_a_door`` (CLI commands and public
functions are classified, door or not), and a door that leaves a case out cannot be built
(``Door`` is abstract). The cases:

* **foreign batches** — a batch the plan's sampler did not draw (another loader's, the whole data
  set or a bigger batch, a repeated batch, a second backward) is refused (``BatchCheckError``)
  before anything is released; where the library draws the batches itself, its privatizer is
  bound to the sampler and refuses the same calls made next to the loop's own;
* **secret key by default** — without a seed the results/ledger record no seed, two runs
  differ, and the key (decimal, hex, its pickled bytes) is in no output file, stdout or stderr;
* **given seed** — the one-line ``dpmf.seeds.NOTICE`` is printed and the run is reproducible;
* **forward-pass mutation** — a model whose forward writes a buffer (or ``Embedding(max_norm)``)
  is refused before any noise is released where a user model is accepted; doors with built-in
  models only: every built-in model passes the guard and no model can be passed in;
* **resume** — save, then resume in a fresh process with no seed (the key adopted from the
  checkpoint) gives the weights of an uninterrupted run;
* **secrets at rest** — every file a door writes is scanned: files holding the key
  (checkpoints) are owner-only (0600), shareable outputs (results, metrics, ledgers, exports)
  do not hold it.
"""

from __future__ import annotations

import abc
import inspect
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpmf
from dpmf import seeds
from dpmf.optim.batches import BatchCheckError
from dpmf.optim.model_guard import ModelStateChangedError
from dpmf.optim.privatize import Privatizer

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QUIET = dict(progress=False, log=lambda *a, **k: None)


# -- what a leak looks like -------------------------------------------------------------------
def _key_patterns(key: int) -> list[bytes]:
    """Spellings of a key to look for in a file or a text: decimal, hex (both cases, 0x), and
    the first 16 bytes of its little- and big-endian forms (pickle stores ints little-endian)."""
    n = max(1, (key.bit_length() + 7) // 8)
    texts = [str(key), f"{key:x}", f"{key:X}"]
    raw = [key.to_bytes(n, "little")[:16], key.to_bytes(n, "big")[:16]]
    return [t.encode() for t in texts] + raw


def _holds(data: bytes | str, keys) -> bool:
    if isinstance(data, str):
        data = data.encode()
    return any(p in data for k in keys for p in _key_patterns(k))


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


class _Spy:
    """``dpmf.seeds.draw_key`` recorded: the secret keys a run drew (in this process)."""

    def __init__(self, monkeypatch):
        self.keys: list[int] = []
        real = seeds.draw_key

        def spy():
            self.keys.append(real())
            return self.keys[-1]

        monkeypatch.setattr(seeds, "draw_key", spy)


@dataclass
class Run:
    """What one run through a door left behind."""

    out: Path  # the folder of every file it wrote
    stdout: str
    stderr: str
    keys: list[int]  # the keys that must stay secret (the drawn key(s); the seed when given)
    weights: list[torch.Tensor]  # final parameters
    recorded_seed: list = field(default_factory=list)  # what results/ledgers say of the seed


class Door(abc.ABC):
    """One way into a private run; every hostile-user case is a method (all required)."""

    name: str
    #: the entry points this door covers: "cli:<command>" and dotted public function names
    entries: tuple[str, ...]
    #: the file that holds the run's key (its checkpoint); it and the files named after it
    #: (shards) are private, every other file the door writes is shareable
    secret_files: tuple[str, ...] = ()

    def is_private(self, path: Path) -> bool:
        return any(path.name == n or path.name.startswith(n + ".") for n in self.secret_files)

    slow: bool = False

    @abc.abstractmethod
    def run(self, tmp: Path, seed: int | None, ctx) -> Run:
        """A complete run (seed None: a secret key), stdout/stderr captured."""

    @abc.abstractmethod
    def foreign_batches(self, tmp: Path, ctx) -> None:
        """Assert batches the sampler did not draw are refused before any release."""

    @abc.abstractmethod
    def forward_mutation(self, tmp: Path, ctx) -> None:
        """Assert a forward that writes model state is refused before any noise (or that the
        door accepts no user model and its built-in models pass the guard)."""

    @abc.abstractmethod
    def resume(self, tmp: Path, ctx) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """(resumed in a fresh process, uninterrupted) weights, no seed given; None after
        asserting the door has no resume and writes nothing that holds the key."""

    def secret_record_ok(self, run: Run) -> bool:
        """The run's results/ledger say the seed was not given (``seed: null`` or equivalent)."""
        return bool(run.recorded_seed) and all(v is None for v in run.recorded_seed)

    def __repr__(self) -> str:
        return self.name


@dataclass
class Ctx:
    """The pytest fixtures a door uses."""

    capfd: object
    monkeypatch: object

    def output(self) -> tuple[str, str]:
        got = self.capfd.readouterr()
        return got.out, got.err


def _foreign_spy(monkeypatch) -> list:
    """``Privatizer.privatize`` wrapped: at the first step of each privatizer the hostile calls
    are made next to the door's own (the same batch with one example replaced, a batch twice as
    large, the batch without its ids, then the same batch again after it was privatized); the
    outcome of each is recorded as (what, exception type name or None, step moved?)."""
    real = Privatizer.privatize
    outcomes: list = []
    done: set = set()

    def attempt(what, self, *args, **kw):
        t = self.step
        try:
            real(self, *args, **kw)
            outcomes.append((what, None, self.step != t))
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to judge
            outcomes.append((what, type(exc).__name__, self.step != t))

    def spy(self, inputs, targets, *, example_ids=None, points=None):
        first = id(self) not in done
        done.add(id(self))
        if first:
            outcomes.append(("bound to the sampler", None if self.drawn is not None else "unbound", False))
            ids = None if example_ids is None else torch.as_tensor(example_ids).clone()
            if ids is not None and ids.numel():
                ids[0] = ids.max() + 1  # an example the sampler did not draw for this step
                attempt("one example replaced", self, inputs, targets, example_ids=ids)
            else:
                x2 = inputs.clone()
                x2[:1] = x2[:1] + 1.0
                attempt("one example replaced", self, x2, targets)
            big = torch.cat([inputs, inputs]), torch.cat([targets, targets])
            big_ids = None if example_ids is None else torch.cat([torch.as_tensor(example_ids)] * 2)
            attempt("a batch twice as large", self, *big, example_ids=big_ids)
            if example_ids is not None:
                attempt("the batch without its ids", self, inputs, targets)
        out = real(self, inputs, targets, example_ids=example_ids, points=points)
        if first:
            attempt("the same batch again", self, inputs, targets, example_ids=example_ids)
        return out

    monkeypatch.setattr(Privatizer, "privatize", spy)
    return outcomes


def _assert_all_refused(outcomes):
    assert outcomes, "the door never privatized a batch"
    for what, err, moved in outcomes:
        if what == "bound to the sampler":
            assert err is None, "the door's privatizer is not bound to its sampler (draw_from)"
        else:
            assert err == "BatchCheckError" and not moved, (what, err, moved)


# -- a model whose forward writes a buffer ------------------------------------------------------
class Counting(nn.Module):
    """An MLP whose forward adds the batch's mean input to a buffer: the batch leaks without noise."""

    def __init__(self, d=6, k=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, k))
        self.register_buffer("seen", torch.zeros(d))

    def forward(self, x):
        self.seen.add_(x.detach().mean(0))
        return self.net(x)


class Embedded(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.out = nn.Linear(4, k)

    def forward(self, x):
        return self.out(self.emb(x).mean(1))


# =============================================================================================
# make_private: one process, and two simulated ranks (process_group=)
# =============================================================================================
N, D, K, B = 96, 6, 3, 16


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)


def _mlp():
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))
    g = torch.Generator().manual_seed(0)  # not torch's global generator: simulated ranks are threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _make(model=None, *, seed=None, comm=None, data=None):
    model = _mlp() if model is None else model
    x, y = _data() if data is None else data
    return dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        TensorDataset(x, y),
        loss_fn=F.cross_entropy,
        batch_size=B,
        epochs=2,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="bsr:2",
        scheme="fixed_order",
        seed=seed,
        process_group=comm,
    )


def _take(private, k=None):
    """k private steps (default: to the end of the plan) through the private loader."""
    left = private.plan.steps - private.steps_taken if k is None else k
    while left:
        for x, y in private.data_loader:
            private.backward(x, target=y, return_loss=False)
            private.optimizer.step()
            private.optimizer.zero_grad()
            left -= 1
            if not left:
                break


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _untouched(private):
    return (
        private.steps_taken == 0
        and private.privatizer.noise.step == 0
        and all(p.grad is None for p in private.model.parameters())
    )


def _check_refusals(private, x_all, y_all):
    """The foreign batches of the user's loop, all refused with nothing released."""
    own = next(iter(DataLoader(TensorDataset(x_all, y_all), batch_size=B, shuffle=True)))
    with pytest.raises(BatchCheckError):
        private.backward(own[0], target=own[1])  # another loader's batch
    with pytest.raises(BatchCheckError):
        private.backward(x_all, target=y_all)  # the whole data set
    assert _untouched(private)
    it = iter(private.data_loader)
    xb, yb = next(it)
    with pytest.raises(BatchCheckError):
        private.backward(own[0][: len(xb)], target=own[1][: len(xb)])  # same size, other examples
    assert _untouched(private)
    private.backward(xb, target=yb, return_loss=False)
    with pytest.raises(BatchCheckError):
        private.backward(xb, target=yb)  # a second backward on the batch
    private.optimizer.step()
    private.optimizer.zero_grad()
    next(it)
    with pytest.raises(BatchCheckError):
        private.backward(xb, target=yb)  # the previous batch re-used at the next step
    assert private.steps_taken == 1


class MakePrivateDoor(Door):
    name = "make_private"
    entries = ("dpmf.make_private",)
    secret_files = ("state.pt",)

    def run(self, tmp, seed, ctx):
        spy = _Spy(ctx.monkeypatch)
        private = _make(seed=seed)
        _take(private)
        private.save(str(tmp / "state.pt"))
        private.export(str(tmp / "export"))
        out, err = ctx.output()
        ledger = json.loads((tmp / "export" / "privacy.json").read_text())
        rec = [None if ledger["noise_seed"] == "drawn from OS entropy" else ledger["noise_seed"]]
        keys = spy.keys if seed is None else [seed]
        return Run(tmp, out, err, keys, _weights(private.model), rec)

    def foreign_batches(self, tmp, ctx):
        _check_refusals(_make(), *_data())

    def forward_mutation(self, tmp, ctx):
        private = _make(Counting())
        x, y = next(iter(private.data_loader))
        with pytest.raises(ModelStateChangedError):
            private.backward(x, target=y)
        assert _untouched(private)
        tokens = torch.randint(0, 10, (N, 5), generator=torch.Generator().manual_seed(1))
        with pytest.raises(ValueError, match="max_norm"):
            _make(Embedded(), data=(tokens, _data()[1]))

    def resume(self, tmp, ctx):
        ctx.monkeypatch.setattr(seeds, "draw_key", seeds.draw_key)
        private = _make()
        _take(private, 5)  # mid-epoch
        private.save(str(tmp / "state.pt"))
        _take(private)
        resumed = _fresh_process("make_private", tmp / "state.pt", tmp / "resumed.pt")
        return resumed, _weights(private.model)


def _resume_make_private(state, out, world=1):
    if world == 1:
        private = _make()
        private.resume(str(state))
        _take(private)
        torch.save(_weights(private.model), out)
        return
    from dpmf.distributed import simulate

    def second(comm):
        private = _make(comm=comm)
        private.resume(str(state))
        _take(private)
        return _weights(private.model)

    torch.save(simulate(world, second)[0], out)


def _fresh_process(kind, state, out):
    script = (
        "import sys, torch; torch.set_num_threads(1); sys.path.insert(0, sys.argv[4]); "
        "import test_doors as t; t._resume_make_private(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    )
    world = "2" if kind == "simulated" else "1"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(state), str(out), world, str(HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seeds.NOTICE not in proc.stderr  # the adopted key is secret: no notice
    return torch.load(out, weights_only=True)


class SimulatedRanksDoor(Door):
    name = "make_private(process_group=) x2 simulated"
    entries = ("dpmf.make_private:process_group",)
    secret_files = ("state.pt",)  # and its shards

    def run(self, tmp, seed, ctx):
        from dpmf.distributed import simulate

        spy = _Spy(ctx.monkeypatch)

        def fn(comm):
            private = _make(seed=seed, comm=comm)
            _take(private)
            private.save(str(tmp / "state.pt"))
            if comm.rank == 0:
                private.export(str(tmp / "export"))
            return _weights(private.model), private.state_dict()["secret"]["seed"]

        done = simulate(2, fn)
        assert done[0][1] == done[1][1]  # one key (rank 0's) on every rank
        for a, b in zip(done[0][0], done[1][0], strict=True):
            assert torch.equal(a, b)
        out, err = ctx.output()
        ledger = json.loads((tmp / "export" / "privacy.json").read_text())
        rec = [None if ledger["noise_seed"] == "drawn from OS entropy" else ledger["noise_seed"]]
        keys = spy.keys if seed is None else [seed]
        if seed is None:
            assert done[0][1] in spy.keys
        return Run(tmp, out, err, keys, done[0][0], rec)

    def foreign_batches(self, tmp, ctx):
        from dpmf.distributed import simulate

        def fn(comm):
            _check_refusals(_make(comm=comm), *_data())
            return True

        assert simulate(2, fn) == [True, True]

    def forward_mutation(self, tmp, ctx):
        from dpmf.distributed import simulate

        def fn(comm):
            private = _make(Counting(), comm=comm)
            x, y = next(iter(private.data_loader))
            with pytest.raises(ModelStateChangedError):
                private.backward(x, target=y)
            assert _untouched(private)
            return True

        assert simulate(2, fn) == [True, True]

    def resume(self, tmp, ctx):
        from dpmf.distributed import simulate

        def fn(comm):
            private = _make(comm=comm)
            _take(private, 5)
            private.save(str(tmp / "state.pt"))
            _take(private)
            return _weights(private.model)

        straight = simulate(2, fn)[0]
        return _fresh_process("simulated", tmp / "state.pt", tmp / "resumed.pt"), straight


# =============================================================================================
# dpmf train (the CLI) and dpmf.train.train behind it
# =============================================================================================
TRAIN_FLAGS = [
    "--dataset",
    "digits",
    "--model",
    "mlp",
    "--batch-size",
    "256",
    "--noise-multiplier",
    "1",
    "--device",
    "cpu",
    "--threads",
    "1",
    "--no-progress",
]


def _train_config(**kw):
    from dpmf.train.config import TrainConfig

    args = dict(
        dataset="digits",
        model="mlp",
        batch_size=256,
        epsilon=None,
        noise_multiplier=1.0,
        device="cpu",
        epochs=1,
    )
    args.update(kw)
    return TrainConfig(**args)


def _model_pt(folder):
    return list(torch.load(Path(folder) / "model.pt", weights_only=True).values())


def _builtin_models_pass_the_guard(entry):
    """A door with built-in models only: no parameter takes a model, and each built-in model
    passes the up-front check and writes nothing during a forward."""
    from dpmf.optim.clipping import check_per_example_safe
    from dpmf.optim.model_guard import check_state_unchanged, state_versions

    assert "model" not in inspect.signature(entry).parameters  # else: a case with a user model
    from dpmf.train.models import MODELS, build_model

    for name in MODELS:
        model = build_model(name, (1, 8, 8), 10, seed=0)
        check_per_example_safe(model)
        before = state_versions(model)
        with torch.no_grad():
            model(torch.randn(4, 1, 8, 8))
        check_state_unchanged(model, before, "a forward pass")


class TrainCliDoor(Door):
    name = "dpmf train"
    entries = ("cli:train", "dpmf.train.train")
    secret_files = ("checkpoint.pt",)

    def run(self, tmp, seed, ctx):
        from dpmf.cli import main

        spy = _Spy(ctx.monkeypatch)
        extra = [] if seed is None else ["--seed", str(seed)]
        assert main(["train", *TRAIN_FLAGS, "--epochs", "1", "--out", str(tmp), *extra]) == 0
        out, err = ctx.output()
        res = json.loads((tmp / "results.json").read_text())
        rec = [res["config"]["seed"], None if res["seed_given"] is False else True]
        keys = spy.keys if seed is None else [seed]
        return Run(tmp, out, err, keys, _model_pt(tmp), rec)

    def foreign_batches(self, tmp, ctx):
        from dpmf.train.run import train

        outcomes = _foreign_spy(ctx.monkeypatch)
        train(_train_config(seed=1), str(tmp), **QUIET)
        _assert_all_refused(outcomes)
        assert {o[0] for o in outcomes} >= {"one example replaced", "the same batch again"}

    def forward_mutation(self, tmp, ctx):
        from dpmf.train.run import train

        _builtin_models_pass_the_guard(train)

    def resume(self, tmp, ctx):
        from dpmf.train.run import train

        spy = _Spy(ctx.monkeypatch)

        class Stop(Exception):
            pass

        def stop(epoch, row):
            raise Stop

        with pytest.raises(Stop):
            train(_train_config(epochs=2), str(tmp / "run"), on_epoch_end=[stop], **QUIET)
        (key,) = spy.keys
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "dpmf", "train", *TRAIN_FLAGS, "--epochs", "2"]
        proc = subprocess.run(
            [*cmd, "--out", str(tmp / "run"), "--resume"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not _holds(proc.stdout + proc.stderr, [key]) and seeds.NOTICE not in proc.stdout
        assert json.loads((tmp / "run" / "results.json").read_text())["config"]["seed"] is None
        straight = train(_train_config(epochs=2, seed=key), str(tmp / "straight"), **QUIET)
        return _model_pt(tmp / "run"), _weights(straight.model)


# =============================================================================================
# torchrun --nproc-per-node 2 -m dpmf train --distributed (gloo, loopback)
# =============================================================================================
def _torchrun(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


class TorchrunDoor(Door):
    name = "torchrun dpmf train --distributed"
    entries = ("cli:train:distributed",)
    secret_files = ("checkpoint.pt",)  # and its shards
    slow = True

    def _config(self, **kw):
        return _train_config(noise_keys="chunked", **kw)

    def run(self, tmp, seed, ctx):
        from dpmf.train.checkpoint import load_checkpoint

        if seed is None:  # stopped after epoch 1, resumed by the CLI: both launches' output
            first = _torchrun(
                [
                    str(HERE / "distributed_worker.py"),
                    "train",
                    "two",
                    json.dumps(self._config(epochs=2).to_dict()),
                ],
                tmp,
            )
            second = _torchrun(
                [
                    "-m",
                    "dpmf",
                    "train",
                    *TRAIN_FLAGS,
                    "--epochs",
                    "2",
                    "--out",
                    "two",
                    "--resume",
                    "--distributed",
                ],
                tmp,
            )
            out, err = first.stdout + second.stdout, first.stderr + second.stderr
        else:
            proc = _torchrun(
                [
                    "-m",
                    "dpmf",
                    "train",
                    *TRAIN_FLAGS,
                    "--epochs",
                    "1",
                    "--seed",
                    str(seed),
                    "--out",
                    "two",
                    "--distributed",
                ],
                tmp,
            )
            out, err = proc.stdout, proc.stderr
        folder = tmp / "two"
        key = load_checkpoint(str(folder / "checkpoint.pt"))["secret"]["seed"]
        res = json.loads((folder / "results.json").read_text())
        assert res["status"] == "complete" and res["processes"]["world_size"] == 2
        rec = [res["config"]["seed"], None if res["seed_given"] is False else True]
        return Run(folder, out, err, [key], _model_pt(folder), rec)

    def foreign_batches(self, tmp, ctx):
        # the loop and privatizer are those of dpmf train (the cli-train door's case) with
        # ids of this rank's slice; checked here on the distributed privatizer over 2 ranks
        from dpmf.distributed import DistributedPrivatizer, rank_slice, simulate
        from dpmf.plan import PrivatePlan

        plan = PrivatePlan(N, B, steps=4, scheme="fixed_order", strategy="identity").with_noise(1.0)
        x, y = _data()

        def fn(comm):
            model = _mlp()
            priv = DistributedPrivatizer(
                model, F.cross_entropy, collectives=comm, plan=plan, clip_norm=1.0, seed=3
            )
            drawn = priv.draw_from(plan.sampler(3))
            t, idx = drawn.draw()
            mine = rank_slice(idx, comm.rank, comm.world_size)
            drawn.record(t, ids=mine, n=len(mine))
            other = mine.copy()
            other[0] = (set(range(N)) - set(idx.tolist())).pop()
            with pytest.raises(BatchCheckError):
                priv.privatize(x[other], y[other], example_ids=torch.from_numpy(other))
            with pytest.raises(BatchCheckError):
                priv.privatize(x, y, example_ids=torch.arange(N))
            assert priv.step == 0
            priv.privatize(x[mine], y[mine], example_ids=torch.from_numpy(mine))
            with pytest.raises(BatchCheckError):
                priv.privatize(x[mine], y[mine], example_ids=torch.from_numpy(mine))
            return priv.step

        assert simulate(2, fn) == [1, 1]

    def forward_mutation(self, tmp, ctx):
        from dpmf.train.run import train

        _builtin_models_pass_the_guard(train)

    def resume(self, tmp, ctx):
        from dpmf.train.run import train

        run = self._cached(tmp, ctx)
        (key,) = run.keys
        straight = train(self._config(epochs=2, seed=key), str(tmp / "straight"), **QUIET)
        return run.weights, _weights(straight.model)

    def _cached(self, tmp, ctx):
        return _RUNS.get((self.name, None)) or self.run(tmp, None, ctx)


# =============================================================================================
# dpmf fl in its three privacy modes
# =============================================================================================
FL_FAST = ["--clients", "4", "--rounds", "3", "--sigma-min", "2", "--sigma-max", "4", "--local-steps", "2"]


class FederatedDoor(Door):
    entries: tuple[str, ...]

    def __init__(self, mode):
        self.mode = mode
        self.name = f"dpmf fl --privacy {mode}"
        self.entries = (f"cli:fl:{mode}",)

    def _main(self, tmp, *extra):
        pytest.importorskip("flwr")
        from dpmf.cli import main

        assert main(["fl", *FL_FAST, "--privacy", self.mode, "--out", str(tmp), *extra]) == 0

    def run(self, tmp, seed, ctx):
        spy = _Spy(ctx.monkeypatch)
        self._main(tmp, *([] if seed is None else ["--seeds", str(seed)]))
        out, err = ctx.output()
        ledger = json.loads((tmp / "ledger.json").read_text())
        rec = [s["seed"] for s in ledger["seeds"]]
        keys = spy.keys if seed is None else [seed]
        if seed is None:  # the components' keys are secret as well
            keys = keys + [
                seeds.child_key(k, p) for k in spy.keys for p in ("fl-aggregator", "fl-client-noise")
            ]
            keys += [seeds.child_key(k, "fl-record", i) for k in spy.keys for i in range(4)]
        return Run(tmp, out, err, keys, [torch.tensor(_metric_values(tmp))], rec)

    def foreign_batches(self, tmp, ctx):
        if self.mode == "client":
            # no record batches: every participating client is in every round (fixed order,
            # batch = population), so there is no drawn batch to replace
            from dpmf.federated.local import ClientLevelNoise

            noise = ClientLevelNoise(4, 3, noise_multiplier=2.0, clip_norm=1.0, delta=1e-5, dim=5, seed=1)
            assert noise.privacy.dataset_size == noise.privacy.batch_size == 4
            return
        outcomes = _foreign_spy(ctx.monkeypatch)
        self._main(tmp, "--seeds", "1")
        _assert_all_refused(outcomes)

    def forward_mutation(self, tmp, ctx):
        from dpmf.federated.models import build_model
        from dpmf.federated.run import run_federated
        from dpmf.optim.clipping import check_per_example_safe
        from dpmf.optim.model_guard import check_state_unchanged, state_versions

        assert "model" not in inspect.signature(run_federated).parameters
        model = build_model((1, 1, 30), 2, hidden=32, seed=0)
        check_per_example_safe(model)
        before = state_versions(model)
        with torch.no_grad():
            model(torch.randn(4, 1, 1, 30))
        check_state_unchanged(model, before, "a forward pass")

    def resume(self, tmp, ctx):
        from dpmf.cli import build_parser

        flags = {
            a
            for act in build_parser("fl")._subparsers._group_actions[0].choices["fl"]._actions
            for a in act.option_strings
        }
        assert "--resume" not in flags
        run = _RUNS.get((self.name, None)) or self.run(tmp, None, ctx)
        for path in _files(run.out):  # no checkpoint: nothing written holds a key
            assert not _holds(path.read_bytes(), run.keys), path
        return None


def _metric_values(folder) -> list[float]:
    rows = (Path(folder) / "metrics.csv").read_text().strip().splitlines()[1:]
    return [float(v) for r in rows for v in r.split(",") if v != "nan"]


# =============================================================================================
# dpmf audit: the run of dpmf train with canaries (dpmf.audit.runner.run_audit behind it)
# =============================================================================================
AUDIT_FLAGS = [*TRAIN_FLAGS, "--epochs", "1", "--canaries", "20"]


class AuditDoor(Door):
    name = "dpmf audit"
    entries = ("cli:audit",)
    secret_files = ()  # no checkpoint: nothing it writes may hold the key

    def run(self, tmp, seed, ctx):
        from dpmf.cli import main
        from dpmf.train import models

        spy = _Spy(ctx.monkeypatch)
        built = []
        real = models.build_model

        def capture(*args, **kwargs):  # the audited run's model, for its final weights
            built.append(real(*args, **kwargs))
            return built[-1]

        ctx.monkeypatch.setattr(models, "build_model", capture)
        extra = [] if seed is None else ["--seed", str(seed)]
        assert main(["audit", *AUDIT_FLAGS, "--out", str(tmp), *extra]) == 0
        ctx.monkeypatch.setattr(models, "build_model", real)
        out, err = ctx.output()
        res = json.loads((tmp / "audit.json").read_text())
        assert sorted(p.name for p in _files(tmp)) == ["audit.json", "audit.png"]
        rec = [res["config"].get("seed"), None if res["seed_given"] is False else True]
        keys = spy.keys if seed is None else [seed]
        (model,) = built
        return Run(tmp, out, err, keys, _weights(model), rec)

    def foreign_batches(self, tmp, ctx):
        from dpmf.audit.runner import run_audit

        for kind in ("white-box", "input"):
            outcomes = _foreign_spy(ctx.monkeypatch)
            run_audit(_train_config(seed=1), str(tmp / kind), canaries=20, kind=kind, **QUIET)
            _assert_all_refused(outcomes)
            assert {o[0] for o in outcomes} >= {"one example replaced", "the same batch again"}
            ctx.monkeypatch.undo()

    def forward_mutation(self, tmp, ctx):
        from dpmf.audit.runner import run_audit

        _builtin_models_pass_the_guard(run_audit)

    def resume(self, tmp, ctx):
        from dpmf.cli import main

        assert main(["audit", *AUDIT_FLAGS, "--out", str(tmp / "r"), "--resume"]) == 2
        assert "--resume" in ctx.output()[1] and not (tmp / "r").exists()
        run = _RUNS.get((self.name, None)) or self.run(tmp, None, ctx)
        for path in _files(run.out):  # no checkpoint: nothing written holds a key
            assert not _holds(path.read_bytes(), run.keys), path
        return None


# =============================================================================================
# the table, the entry points, the cases
# =============================================================================================
DOORS: list[Door] = [
    TrainCliDoor(),
    MakePrivateDoor(),
    SimulatedRanksDoor(),
    TorchrunDoor(),
    FederatedDoor("aggregator"),
    FederatedDoor("record"),
    FederatedDoor("client"),
    AuditDoor(),
]

#: CLI commands that start no private training (accounting, plots, choices)
NOT_TRAINING_COMMANDS = {
    "curves": "error curves of factorizations",
    "colormap": "gain of one factorization over another",
    "epsilon": "accounting only",
    "calibrate": "accounting only",
    "pick": "ranks strategies: accounting only",
}
#: training commands without a door yet (each keeps test_uncovered_doors_are_closed failing)
UNCOVERED_COMMANDS: dict[str, str] = {}
#: public names that are not doors (no private run starts through them), and why
NOT_DOORS = {
    "dpmf.PrivatePlan": "a plan: accounting only",
    "dpmf.account": "accounting only",
    "dpmf.calibrate": "accounting only",
    "dpmf.account_segments": "accounting only",
    "dpmf.max_steps": "accounting only",
    "dpmf.max_batch_size": "accounting only",
    "dpmf.PrivateTraining": "returned by make_private (its door)",
    "dpmf.register_clipping_layer": "a layer's clipping rule, used inside every door's private step",
    "dpmf.clipping_layer": "the decorator form of register_clipping_layer",
    "dpmf.step.build": "the one constructor of every door's step (each door above builds through it)",
    "dpmf.step.DPStep": "what dpmf.step.build returns",
    "dpmf.step.ExecutionFlags": "privacy-neutral settings of the step",
    "dpmf.step.NOISE_KEYS": "names",
    "dpmf.step.noise_stream": "a plan's unit-scale noise (the step's stream)",
    "dpmf.ClippingHandler": "the type of a clipping rule",
    "dpmf.train.DATASETS": "names",
    "dpmf.train.MODELS": "names",
    "dpmf.train.SCHEMES": "names",
    "dpmf.train.Dataset": "data",
    "dpmf.train.TrainConfig": "configuration",
    "dpmf.train.TrainOutcome": "a result",
    "dpmf.train.TrainResult": "a result",
    "dpmf.train.Trainer": "the loop of dpmf.train.train (binds its privatizer to the sampler itself)",
    "dpmf.train.build_model": "a model",
    "dpmf.train.evaluate": "test metrics",
    "dpmf.train.load_dataset": "data",
    "dpmf.train.steps_per_epoch": "arithmetic",
    "dpmf.federated.ComplianceProfile": "compliance data (dpmf fl's doors use it)",
    "dpmf.federated.ComplianceSet": "compliance data",
    "dpmf.federated.NoiseMap": "compliance score to σ",
    "dpmf.federated.PrivacyEntry": "a ledger row",
    "dpmf.federated.PrivacyMode": "a privacy mode's class: it runs through dpmf fl (its door cli:fl:<name>)",
    "dpmf.federated.privacy_modes": "names",
    "dpmf.federated.register_privacy_mode": "registration: every registered mode needs a cli:fl:<name> door",
    "dpmf.federated.example_profiles": "compliance data",
    "dpmf.federated.format_entry": "text",
    "dpmf.federated.load_profiles": "compliance data",
    "dpmf.federated.uniform_control": "compliance data",
}


def test_every_entry_point_is_a_door():
    """Every CLI command and public name is classified: a door in DOORS, or not a door (with
    the reason); a new command or public function fails here until it gets its door."""
    from dpmf import cli
    from dpmf import federated as fl_pkg
    from dpmf import step as step_pkg
    from dpmf import train as train_pkg

    covered = {e for d in DOORS for e in d.entries}
    commands = {name for name, _, _ in cli._COMMANDS}
    training = commands - set(NOT_TRAINING_COMMANDS) - set(UNCOVERED_COMMANDS)
    assert {f"cli:{c}" for c in training} <= covered | {"cli:fl"} and "cli:fl:record" in covered
    known = {"train", "fl", "audit"}
    assert training == known, f"new training command(s) {training - known}: add a door"
    from dpmf.cli import build_parser
    from dpmf.federated.modes import privacy_modes

    assert {f"cli:fl:{m}" for m in privacy_modes()} <= covered, "a privacy mode of dpmf fl without a door"
    (dist,) = [
        a
        for a in build_parser("train")._subparsers._group_actions[0].choices["train"]._actions
        if "--distributed" in a.option_strings
    ]
    assert dist and "cli:train:distributed" in covered
    public = {f"dpmf.{n}" for n in dpmf.__all__} | {f"dpmf.train.{n}" for n in train_pkg.__all__}
    public |= {f"dpmf.federated.{n}" for n in fl_pkg.__all__ if callable(getattr(fl_pkg, n, None))}
    public |= {f"dpmf.step.{n}" for n in step_pkg.__all__}
    for name in sorted(public):
        if name in NOT_DOORS:
            continue
        assert name in covered, f"{name} is public and not classified: give it a door in DOORS (or NOT_DOORS)"
    assert "process_group" in inspect.signature(dpmf.make_private).parameters
    assert "dpmf.make_private:process_group" in covered and "dpmf.make_private" in covered


def _uncovered_now() -> set:
    from dpmf import cli

    return set(UNCOVERED_COMMANDS) & {name for name, _, _ in cli._COMMANDS}


@pytest.mark.xfail(
    bool(_uncovered_now()), strict=True, reason="a training command without a door (UNCOVERED_COMMANDS)"
)
def test_uncovered_doors_are_closed():
    assert not _uncovered_now()


# -- the cases ---------------------------------------------------------------------------------
_RUNS: dict = {}


def _door_params():
    return [pytest.param(d, id=d.name, marks=[pytest.mark.slow] if d.slow else []) for d in DOORS]


@pytest.fixture
def ctx(capfd, monkeypatch):
    return Ctx(capfd, monkeypatch)


def _run(door, tmp_path_factory, seed, ctx, tag=""):
    key = (door.name, seed) if not tag else (door.name, seed, tag)
    if key not in _RUNS:
        _RUNS[key] = door.run(tmp_path_factory.mktemp("door"), seed, ctx)
    return _RUNS[key]


@pytest.mark.parametrize("door", _door_params())
def test_secret_key_by_default(door, tmp_path_factory, ctx):
    a = _run(door, tmp_path_factory, None, ctx)
    assert door.secret_record_ok(a), a.recorded_seed
    assert a.keys and all(k.bit_length() > 128 for k in a.keys[:1])
    assert seeds.NOTICE not in a.stdout + a.stderr
    assert not _holds(a.stdout + a.stderr, a.keys)
    if door.slow:  # one seedless run through torchrun (two launches); its key is rank 0's draw
        return
    b = _run(door, tmp_path_factory, None, ctx, tag="again")
    assert a.keys[0] != b.keys[0]
    assert any(not torch.equal(u, v) for u, v in zip(a.weights, b.weights, strict=True))


@pytest.mark.parametrize("door", _door_params())
def test_given_seed_prints_the_notice_and_reproduces(door, tmp_path_factory, ctx):
    a = _run(door, tmp_path_factory, 11, ctx)
    assert seeds.NOTICE in a.stdout + a.stderr
    assert not door.secret_record_ok(a)
    if door.slow:  # reproducible: equal to the one-process run of the same seed
        from dpmf.train.run import train

        ref = train(door._config(epochs=1, seed=11), str(tmp_path_factory.mktemp("ref")), **QUIET)
        for u, v in zip(a.weights, _weights(ref.model), strict=True):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
        return
    b = _run(door, tmp_path_factory, 11, ctx, tag="again")
    for u, v in zip(a.weights, b.weights, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("door", _door_params())
def test_foreign_batches_are_refused(door, tmp_path, ctx):
    door.foreign_batches(tmp_path, ctx)


@pytest.mark.parametrize("door", _door_params())
def test_forward_pass_mutation_is_refused(door, tmp_path, ctx):
    door.forward_mutation(tmp_path, ctx)


@pytest.mark.parametrize("door", [pytest.param(d, id=d.name, marks=[pytest.mark.slow]) for d in DOORS])
def test_resume_in_a_fresh_process_adopts_the_key(door, tmp_path, ctx):
    got = door.resume(tmp_path, ctx)
    if got is None:
        return
    resumed, straight = got
    assert len(resumed) == len(straight)
    for u, v in zip(resumed, straight, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("door", _door_params())
def test_shareable_files_hold_no_key(door, tmp_path_factory, ctx):
    run = _run(door, tmp_path_factory, None, ctx)
    files = _files(run.out)
    assert files
    for path in files:
        if door.is_private(path):
            continue
        assert not _holds(path.read_bytes(), run.keys), f"{path.name} holds the key"
    if door.secret_files:  # the scanner sees the key where it is (the checkpoint)
        assert _holds((run.out / door.secret_files[0]).read_bytes(), run.keys)


@pytest.mark.parametrize(
    "door",
    [pytest.param(d, id=d.name, marks=[pytest.mark.slow] if d.slow else []) for d in DOORS if d.secret_files],
)
def test_files_holding_the_key_are_owner_only(door, tmp_path_factory, ctx):
    run = _run(door, tmp_path_factory, None, ctx)
    private = [p for p in _files(run.out) if door.is_private(p)]
    assert private and (run.out / door.secret_files[0]) in private
    for path in private:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path.name} is {oct(mode)}"
