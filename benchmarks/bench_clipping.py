"""Step time of per-example clipping: non-private training, Opacus 1.6.0 and dpmf, same run.

Three models at batch 256 on CPU: the small CNN of ``dpmf.train.models`` (2 conv + GroupNorm
+ linear), a wide MLP 784-1024-1024-10 (1.86 M parameters) and a small transformer encoder
(token and position embeddings, two pre-LayerNorm encoder layers whose attention is made of
``nn.Linear`` q/k/v/output projections and ``F.scaled_dot_product_attention``, a final
LayerNorm, mean pooling and a linear head; sequence 64). Every layer of the three has a ghost
norm or an instantiated per-example gradient, so dpmf's ``clipping="auto"`` runs book-keeping
on all of them.

One step on each side does the same work: per-example gradients (or their norms), global ℓ2
clipping, sum, Gaussian noise, division by the batch size and an SGD step. Non-private is
forward, mean cross-entropy, backward, SGD. Opacus runs its ``hooks`` and ``ghost`` modes;
the faster one is the baseline. Times are medians over interleaved rounds (every method once
per round), so a load on the machine hits all of them alike.

``--memory`` adds the peak memory of the wide-MLP step at batch 1024, non-private and dpmf,
each in a fresh subprocess: the rise of the resident set's high-water mark (``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs`` just before the step; Linux)
during one step, above the resident set just before it (model, optimizer, data and noise
stream already built).

``--load`` repeats the timing with a background load: a second process doing a 512×512
numpy matmul loop on one BLAS thread (stopped at the end, and after ``--load-seconds`` at the
latest), and prints the ratio dpmf / non-private with the load over the same ratio without.

Usage:
    python benchmarks/bench_clipping.py [--models cnn,mlp,encoder] [--batch-size 256]
        [--repeat 9] [--threads 1] [--memory] [--load] [--vmap]

Prints one line per method and model, and the ratios dpmf / fastest Opacus and dpmf /
non-private (< 1: dpmf faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from dpmf.step import noise_stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dpmf.optim.privatize import Privatizer  # noqa: E402
from dpmf.plan import PrivatePlan  # noqa: E402
from dpmf.train.models import MLP, build_model  # noqa: E402

SIGMA, CLIP = 1.0, 1.0


def _plan(batch_size, steps):
    """DP-SGD under Poisson sampling at rate 1/100: sensitivity 1, B̄ = the batch size."""
    return PrivatePlan(100 * batch_size, batch_size, steps=steps, noise_multiplier=SIGMA)


VOCAB, SEQ, DIM, HEADS = 1000, 64, 64, 4


class Attention(nn.Module):
    """Multi-head self-attention from four nn.Linear projections (each ghost-clippable)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape

        def split(z):
            return z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        h = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(h.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ff1, self.ff2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class Encoder(nn.Module):
    def __init__(self, classes=10, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(EncoderLayer(DIM, HEADS) for _ in range(layers))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, classes)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1).contiguous()
        h = self.tok(x) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln(h).mean(1))


def make_model(name):
    torch.manual_seed(0)
    if name == "cnn":
        return build_model("cnn", (1, 28, 28), 10, seed=0)
    if name == "mlp":
        return MLP((1, 28, 28), 10, hidden=(1024, 1024))
    if name == "encoder":
        return Encoder()
    raise ValueError(f"model={name!r} is invalid: must be cnn, mlp or encoder")


def make_batch(name, batch):
    g = torch.Generator().manual_seed(0)
    if name == "encoder":
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    else:
        x = torch.randn(batch, 1, 28, 28, generator=g)
    return x, torch.randint(0, 10, (batch,), generator=g)


def nonprivate(name, x, y, steps):
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def dpmf_step(name, x, y, steps, clipping="auto"):
    model = make_model(name)
    d = sum(p.numel() for p in model.parameters())
    priv = Privatizer(
        model,
        F.cross_entropy,
        plan=_plan(x.shape[0], steps),
        clip_norm=CLIP,
        noise=noise_stream(_plan(x.shape[0], steps), d, 0),
        clipping=clipping,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        priv.privatize(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def opacus_step(name, x, y, mode):
    from opacus import PrivacyEngine

    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    criterion = nn.CrossEntropyLoss()
    out = PrivacyEngine().make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=False,
        grad_sample_mode=mode,
        criterion=criterion,
    )
    model, opt = out[0], out[1]
    if mode == "ghost":
        criterion = out[2]

    def step():
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()

    return step


def time_models(models, batch, repeat, with_vmap, label=""):
    """Median seconds per method per model, interleaved rounds."""
    results = {}
    for name in models:
        x, y = make_batch(name, batch)
        methods = {
            "non-private": nonprivate(name, x, y, repeat + 2),
            "dpmf": dpmf_step(name, x, y, repeat + 2),
        }
        if with_vmap:
            methods["dpmf-vmap"] = dpmf_step(name, x, y, repeat + 2, clipping="vmap")
        for mode in ("hooks", "ghost"):
            try:
                fn = opacus_step(name, x, y, mode)
                fn()  # warm-up, and a check that the mode supports the model
                methods[f"opacus-{mode}"] = fn
            except Exception as exc:  # an unsupported layer in that mode
                print(f"  {name}: opacus-{mode} unavailable ({type(exc).__name__}: {str(exc)[:80]})")
        for k, fn in methods.items():
            if not k.startswith("opacus"):
                fn()  # warm-up
        times = {k: [] for k in methods}
        for _ in range(repeat):
            for k, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        params = sum(p.numel() for p in make_model(name).parameters())
        print(f"model {name} ({params} parameters){label}")
        for k, v in med.items():
            print(f"  {k:<14} median {1000 * v:9.1f} ms")
        opacus = [k for k in med if k.startswith("opacus")]
        if opacus:
            best = min(opacus, key=med.get)
            print(f"  ratio dpmf / {best} = {med['dpmf'] / med[best]:.3f}")
        print(f"  ratio dpmf / non-private = {med['dpmf'] / med['non-private']:.3f}")
        results[name] = med
    return results


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_child(method, batch):
    """One step in this fresh process; prints the peak rise of the resident set, in MB."""
    x, y = make_batch("mlp", batch)
    fn = nonprivate("mlp", x, y, 4) if method == "non-private" else dpmf_step("mlp", x, y, 4)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the high-water mark VmHWM to the current resident set
    before = _status_kb("VmRSS")
    fn()
    print(f"{(_status_kb('VmHWM') - before) / 1024:.1f}")


def measure_memory(batch, threads):
    out = {}
    for method in ("non-private", "dpmf"):
        cmd = [sys.executable, __file__, "--memory-child", method, "--batch-size", str(batch)]
        cmd += ["--threads", str(threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[method] = float(res.stdout.strip().splitlines()[-1])
    print(f"memory: wide MLP step at batch {batch} (rise of VmHWM during one step, fresh process)")
    for k, v in out.items():
        print(f"  {k:<14} {v:8.1f} MB")
    print(f"  ratio dpmf / non-private = {out['dpmf'] / out['non-private']:.3f}")


_LOAD = """
import os, sys, time
import numpy as np
a = np.random.default_rng(0).standard_normal((512, 512))
stop = time.time() + float(sys.argv[1])
while time.time() < stop:
    a = np.tanh(a @ a)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn,mlp,encoder", help="comma-separated: cnn, mlp, encoder")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--memory", action="store_true", help="peak memory of the wide MLP at batch 1024")
    ap.add_argument("--memory-batch-size", type=int, default=1024)
    ap.add_argument("--load", action="store_true", help="repeat the timing with a background load")
    ap.add_argument("--load-seconds", type=float, default=600.0, help="the load stops after this at most")
    ap.add_argument("--vmap", action="store_true", help="also time dpmf with clipping='vmap'")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.memory_child:
        memory_child(args.memory_child, args.batch_size)
        return 0
    import opacus

    models = args.models.split(",")
    print(
        f"torch {torch.__version__}, opacus {opacus.__version__}, threads {torch.get_num_threads()}, "
        f"batch {args.batch_size}, {args.repeat} interleaved rounds, CPU"
    )
    quiet = time_models(models, args.batch_size, args.repeat, args.vmap)
    if args.memory:
        measure_memory(args.memory_batch_size, args.threads)
    if args.load:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        load = subprocess.Popen([sys.executable, "-c", _LOAD, str(args.load_seconds)], env=env)
        try:
            time.sleep(1.0)
            loaded = time_models(models, args.batch_size, args.repeat, False, label=" with a background load")
        finally:
            load.terminate()
            load.wait()
        print("background load: (dpmf / non-private with load) / (dpmf / non-private without)")
        for name in models:
            r0 = quiet[name]["dpmf"] / quiet[name]["non-private"]
            r1 = loaded[name]["dpmf"] / loaded[name]["non-private"]
            print(f"  {name:<8} {r1:.3f} / {r0:.3f} = {r1 / r0:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
