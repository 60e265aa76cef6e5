"""One private step of LoRA fine-tuning a GPT-2: dpmf against Opacus 1.6.0 and a non-private step.

Every method runs the same model (a GPT-2 built from a config, LoRA adapters of rank 8 on
``c_attn``/``c_proj`` from peft, only the adapters training; or, with ``--full``, every weight
training, the input and output embeddings tied), the same batch of token sequences
(right padding in some), the same loss (next-token cross-entropy, the mean over each
sequence's non-padding tokens, then the mean over the batch) and AdamW:

- ``dpmf``: ``dpmf.make_private(..., clipping="auto")`` (ghost norms + book-keeping), its
  ``backward(batch)`` and guarded ``step``;
- ``dpmf-ghost``: the same with ``clipping="ghost"`` (norms, then a second backward);
- ``dpmf-checkpointed``: ``dpmf`` on the model with non-reentrant activation checkpointing
  (``gradient_checkpointing_enable``), which recomputes each block's forward in the backward
  instead of keeping its activations;
- ``opacus-<mode>``: ``PrivacyEngine.make_private`` with ``grad_sample_mode`` = hooks, ghost
  (fast gradient clipping), functorch or ew — the modes that fail on the model are reported and
  skipped; the fastest working one is the baseline;
- ``non-private``: ``loss.backward()`` and the optimizer step.

Every step ends with ``zero_grad(set_to_none=True)``, so that no method carries gradients (or
Opacus its per-example gradients) from one step into the next: what a step holds at its peak
is counted in its peak. Times are medians over interleaved rounds (each method once per round,
in a shuffled order, so a load on a shared machine hits all alike), with one torch thread by
default; the process's CPU time of each step is reported beside the wall time (on a loaded
machine it varies less, since time spent waiting for a core is not in it), and the page faults
of each step (their median).

The methods share one process, so by default glibc's malloc is told to keep the memory it
frees (``--malloc steady``: ``mallopt`` with a trim threshold of 1 GiB and an mmap threshold
of 32 MiB, the policy of a caching allocator such as jemalloc or TCMalloc, which PyTorch's CPU
performance guide advises). With glibc's default policy (``--malloc default``) the top of the
heap is returned to the system whenever more than a threshold of it is free, and mapped again
at the next large allocation (here the 4 MB logits and their gradients): a step then takes
0–6 000 page faults (1–5 ms), a number set by the heap that the method run before it left,
which no interleaving cancels. Each method alone in its own process shows the same spread. Peak memory is
measured per method in fresh processes (the median of ``--memory-repeat`` of them, interleaved
across the methods): the increase of the peak resident set size (VmHWM,
reset through ``/proc/self/clear_refs``) over the process after setup and one warm-up step, through 2 steps,
with glibc's malloc returning every block of 64 KiB or more to the system when freed
(``MALLOC_MMAP_THRESHOLD_``), so that the resident set follows the live tensors (Linux only).

Usage:
    python benchmarks/bench_hf.py [--batch-size 32] [--seq-len 32] [--width 64] [--layers 2]
        [--vocab 1000] [--heads 4] [--full | --lora c_attn,c_proj] [--repeat 60] [--threads 1]
        [--no-memory] [--memory-repeat 3] [--malloc steady|default] [--methods a,b,…]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SIGMA, CLIP, LR = 1.0, 1.0, 1e-3
METHODS = (
    "non-private",
    "dpmf",
    "dpmf-ghost",
    "dpmf-checkpointed",
    "opacus-hooks",
    "opacus-ghost",
    "opacus-functorch",
    "opacus-ew",
)


def build(args):
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.seq_len,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg)  # tied input and output embeddings
    if args.full:
        return model
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=args.lora.split(","), lora_dropout=0.0, fan_in_fan_out=True
    )
    return peft.get_peft_model(model, lora)


def make_batch(args) -> dict:
    g = torch.Generator().manual_seed(0)
    b, t = args.batch_size, args.seq_len
    ids = torch.randint(1, args.vocab, (b, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = ids * mask
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class TokenMean:
    """The same loss for Opacus: per-example token mean (``reduction="none"``), batch mean."""

    def __init__(self):
        from dpmf.train.hf import causal_lm_loss

        self.loss = causal_lm_loss()
        self.reduction = "mean"

    def __call__(self, output, target):
        per = self.loss.per_example(output, target)
        return per if self.reduction == "none" else per.mean()


class Batches(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def setup(method, args, batch):
    """A function running one step of ``method``."""
    from dpmf.train.hf import causal_lm_loss

    model = build(args)
    if method == "dpmf-checkpointed":
        base = model if args.full else model.get_base_model()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing runs in training mode (dropout is 0 in this model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR)
    loss = causal_lm_loss()
    x, y = loss.split(batch)
    if method == "non-private":

        def step():
            loss(model(**x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    if method.startswith("dpmf"):
        import dpmf

        private = dpmf.make_private(
            model,
            opt,
            Batches(batch),
            loss_fn=loss,
            batch_size=args.batch_size,
            steps=args.repeat + 10,
            noise_multiplier=SIGMA,
            clip_norm=CLIP,
            factorization="identity",
            scheme="fixed_order",
            clipping="ghost" if method == "dpmf-ghost" else "auto",
            seed=0,
        )

        def drawn():  # backward takes only the plan's batches: drawn before the timed step
            while True:
                yield from private.data_loader

        batches = drawn()
        held = []

        def prepare():
            held[:] = [next(batches)]

        def step():
            private.backward(held.pop(), return_loss=False)
            private.optimizer.step()
            private.optimizer.zero_grad(set_to_none=True)

        step.prepare = prepare
        return step
    from opacus import PrivacyEngine

    mode = method.split("-", 1)[1]
    criterion = TokenMean()
    loader = torch.utils.data.DataLoader(Batches(batch), batch_size=args.batch_size)
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
    module, popt = out[0], out[1]
    if mode == "ghost":
        criterion = out[2]

    def step():
        criterion(module(**x), y).backward()
        popt.step()
        popt.zero_grad(set_to_none=True)  # also drops the per-example gradients

    return step


def memory_of(method, args) -> float:
    """Peak RSS increase (MB) of 2 steps of ``method`` after setup and a warm-up step: the
    high-water mark is reset (``/proc/self/clear_refs``) before the steps."""
    batch = make_batch(args)
    step = setup(method, args, batch)
    _prepare(step)
    step()  # warm-up: optimizer state, caches
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kb("VmRSS")
    for _ in range(2):
        _prepare(step)
        step()
    return (_status_kb("VmHWM") - before) / 1024


def _memory_run(method: str, argv) -> float:
    """One fresh process's ``memory_of(method)`` (NaN when it fails)."""
    cmd = [sys.executable, __file__, "--memory-of", method] + (argv if argv is not None else sys.argv[1:])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])["mb"]
    except (IndexError, ValueError, KeyError):
        return float("nan")


def _prepare(step) -> None:
    """Untimed work before a step (dpmf: drawing the plan's batch from its data loader)."""
    prepare = getattr(step, "prepare", None)
    if prepare is not None:
        prepare()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def steady_malloc() -> bool:
    """Tell glibc's malloc to keep what it frees (no trim below 1 GiB, no mmap below 32 MiB);
    False where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30)) and bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20))


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--full", action="store_true", help="full fine-tuning (every weight) instead of LoRA")
    ap.add_argument("--lora", default="c_attn,c_proj", help="the modules LoRA adapts (comma-separated)")
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--memory-repeat", type=int, default=3, help="fresh processes per method for the peak memory (median)"
    )
    ap.add_argument(
        "--methods", default=",".join(METHODS), help="a comma-separated subset of " + ", ".join(METHODS)
    )
    ap.add_argument(
        "--malloc",
        choices=("steady", "default"),
        default="steady",
        help="glibc's malloc policy for the timed steps: keep freed memory (steady) or its default",
    )
    ap.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    for name in ("repeat", "memory_repeat", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be ≥ 1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    if args.memory_of:
        print(json.dumps({"mb": memory_of(args.memory_of, args)}))
        return 0
    malloc = args.malloc
    if malloc == "steady" and not steady_malloc():
        malloc = "default (the C library is not glibc)"
    import opacus
    import peft
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
        f"opacus {opacus.__version__}; threads {torch.get_num_threads()}, CPU; GPT-2 {args.layers} layers, "
        f"width {args.width}, vocab {args.vocab}; batch {args.batch_size} × {args.seq_len} tokens; "
        f"{'full fine-tuning' if args.full else 'LoRA r=8 on ' + args.lora}; {args.repeat} interleaved "
        f"rounds; malloc {malloc}"
    )
    batch = make_batch(args)
    fns = {}
    for method in args.methods.split(","):
        try:
            fn = setup(method, args, batch)
            _prepare(fn)
            fn()  # warm-up, and a check that the mode supports the model
            fns[method] = fn
        except Exception as exc:  # an unsupported model in that mode
            print(f"  {method} unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    faults = {k: [] for k in fns}
    order = random.Random(0)
    for _ in range(args.repeat):
        keys = list(fns)
        order.shuffle(keys)  # no method always runs right after another
        for k in keys:
            fn = fns[k]
            _prepare(fn)
            f0, t0, c0 = _faults(), time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
            faults[k].append(_faults() - f0)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    mem = {}
    if not args.no_memory:
        runs: dict = {k: [] for k in fns}
        for _ in range(args.memory_repeat):  # interleaved: each round measures every method once
            for k in fns:
                runs[k].append(_memory_run(k, argv))
        mem = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in med.items():
        extra = f", peak +{mem[k]:7.1f} MB" if k in mem else ""
        flt = statistics.median(faults[k])
        cpu_ms = 1000 * med_cpu[k]
        print(f"  {k:<17} median {1000 * v:8.1f} ms (CPU {cpu_ms:7.1f} ms, {flt:5.0f} page faults){extra}")
    opacus_done = [k for k in med if k.startswith("opacus")]
    if opacus_done:
        best = min(opacus_done, key=med.get)
        print(f"  time   dpmf / {best} = {med['dpmf'] / med[best]:.2f}")
        best_cpu = min(opacus_done, key=med_cpu.get)
        print(f"  CPU    dpmf / {best_cpu} = {med_cpu['dpmf'] / med_cpu[best_cpu]:.2f}")
        if mem:
            best_mem = min(opacus_done, key=lambda k: mem[k])
            print(f"  memory dpmf / {best_mem} = {mem['dpmf'] / mem[best_mem]:.2f}")
    if "non-private" in med:
        print(f"  time   dpmf / non-private = {med['dpmf'] / med['non-private']:.2f}")
        if mem:
            print(f"  memory dpmf / non-private = {mem['dpmf'] / mem['non-private']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
