"""Time of one private step: dpmf (torch.func per-example gradients) against Opacus 1.6.0.

Both sides do the same work on the same model, batch and clip norm: per-example gradients,
global ℓ2 clipping, sum, Gaussian noise, division by the batch size and an SGD step. Opacus is
run in each of its per-sample-gradient modes (``hooks``, ``functorch``, ``ew``, ``ghost``
clipping); the fastest one that works for the model is the baseline. Times are medians over
interleaved repetitions (every method once per round), so load on a shared machine hits all of
them alike.

Usage:
    python benchmarks/bench_private_step.py [--models cnn,cnn3,mlp] [--batch-size 256]
        [--repeat 15] [--threads 2]

Prints one line per method and, per model, ratio = ours / fastest Opacus (< 1: ours faster),
the overhead of ``dpmf.make_private`` (its step on batches its loader drew beforehand:
backward with the batch check, guarded step) over the bare privatizer, and the README's loop
(``loss = backward(…)``, the loss read) against the fastest Opacus mode and against the
non-private step (forward, backward, SGD step) on the same model and batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dpmf.optim.privatize import Privatizer  # noqa: E402
from dpmf.plan import PrivatePlan  # noqa: E402
from dpmf.step import noise_stream  # noqa: E402
from dpmf.train.models import build_model  # noqa: E402

SHAPES = {"cnn": (1, 28, 28), "cnn3": (3, 32, 32), "mlp": (1, 28, 28), "wrn16-4": (3, 32, 32)}
OPACUS_MODES = ("hooks", "functorch", "ew", "ghost")
SIGMA, CLIP = 1.0, 1.0


def _plan(batch_size, steps):
    """DP-SGD under Poisson sampling at rate 1/100: sensitivity 1, B̄ = the batch size."""
    return PrivatePlan(100 * batch_size, batch_size, steps=steps, noise_multiplier=SIGMA)


def ours(name, x, y, steps):
    model = build_model(name, SHAPES[name], 10, seed=0)
    d = sum(p.numel() for p in model.parameters())
    priv = Privatizer(
        model,
        F.cross_entropy,
        plan=_plan(x.shape[0], steps),
        clip_norm=CLIP,
        noise=noise_stream(_plan(x.shape[0], steps), d, 0),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        priv.privatize(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def through_make_private(name, x, y, steps, return_loss=False):
    """The same private step through ``dpmf.make_private`` (its guarded optimizer included);
    ``return_loss``: the README's loop, which takes the batch's loss from ``backward``."""
    import dpmf

    model = build_model(name, SHAPES[name], 10, seed=0)
    data = torch.utils.data.TensorDataset(x, y)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        loss_fn=F.cross_entropy,
        batch_size=x.shape[0],
        steps=steps,
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        factorization="identity",
        scheme="fixed_order",
        seed=0,
    )

    # the loader's batches, drawn beforehand (backward accepts only those, in order): the timed
    # step is backward (with its batch check) and the guarded optimizer step
    batches = iter([next(iter(private.data_loader)) for _ in range(steps)])

    def step():
        xb, yb = next(batches)
        loss = private.backward(xb, target=yb, return_loss=return_loss)
        if return_loss:
            float(loss)  # the loop reads it, as a logging loop would
        private.optimizer.step()
        private.optimizer.zero_grad(set_to_none=True)

    return step


def non_private(name, x, y):
    """The same model, batch and SGD step without privacy: one forward, one backward."""
    model = build_model(name, SHAPES[name], 10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def opacus_step(name, x, y, mode):
    from opacus import PrivacyEngine

    model = build_model(name, SHAPES[name], 10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    engine = PrivacyEngine()
    criterion = nn.CrossEntropyLoss()
    out = engine.make_private(
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
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn", help="comma-separated: cnn, cnn3, mlp, wrn16-4")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import opacus

    print(
        f"torch {torch.__version__}, opacus {opacus.__version__}, threads {torch.get_num_threads()}, "
        f"batch {args.batch_size}, {args.repeat} interleaved rounds, CPU"
    )
    for name in args.models.split(","):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, *SHAPES[name], generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        methods = {
            "dpmf": ours(name, x, y, args.repeat + 2),
            "dpmf-make_private": through_make_private(name, x, y, args.repeat + 2),
            "dpmf-readme-loop": through_make_private(name, x, y, args.repeat + 2, return_loss=True),
            "non-private": non_private(name, x, y),
        }
        for mode in OPACUS_MODES:
            try:
                fn = opacus_step(name, x, y, mode)
                fn()  # warm-up, and a check that the mode supports the model
                methods[f"opacus-{mode}"] = fn
            except Exception as exc:  # an unsupported layer in that mode
                print(f"  {name}: opacus-{mode} unavailable ({type(exc).__name__}: {str(exc)[:80]})")
        methods["dpmf"]()
        methods["dpmf-make_private"]()
        methods["dpmf-readme-loop"]()
        methods["non-private"]()
        times = {k: [] for k in methods}
        for _ in range(args.repeat):
            for k, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        params = sum(p.numel() for p in build_model(name, SHAPES[name], 10).parameters())
        print(f"model {name} ({params} parameters)")
        for k, v in med.items():
            print(f"  {k:<18} median {1000 * v:8.1f} ms")
        best = min((k for k in med if k.startswith("opacus")), key=med.get)
        print(f"  ratio dpmf / {best} = {med['dpmf'] / med[best]:.3f}")
        print(f"  ratio make_private / bare privatizer = {med['dpmf-make_private'] / med['dpmf']:.3f}")
        print(f"  ratio README loop (loss returned) / {best} = {med['dpmf-readme-loop'] / med[best]:.3f}")
        print(f"  ratio README loop / non-private step = {med['dpmf-readme-loop'] / med['non-private']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
