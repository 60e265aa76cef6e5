"""One private step at LLM size: GPT-2 124M (12 layers, width 768, 12 heads, vocabulary 50257,
tied embeddings, built from its config — no download), full fine-tuning and LoRA (rank 8 on the
attention projections ``c_attn``), against Opacus 1.6.0 (its modes that run) and the
non-private step; then a DP-Muon step against a DP-SGD step on the full model.

The first two parts are ``benchmarks/bench_hf.py`` at this size (same methods, loss, medians of
interleaved rounds, peak memory in fresh processes); see it for the method. The third times
``make_private`` with ``dpmf.optim.DPMuon`` (Newton–Schulz on every weight matrix, batched
over same-shape matrices; the tied embedding table takes SGD, as Muon is used in practice)
and with ``dpmf.optim.DPSGD`` on the same model and batch, interleaved.

It runs on the CPU, in float32, at batch 4 × 128 tokens by default.

Usage:
    python benchmarks/bench_llm_step.py [--batch-size 4] [--seq-len 128] [--repeat 5]
        [--memory-repeat 1] [--parts lora,full,muon] [--layers 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_hf  # noqa: E402
import torch  # noqa: E402

GPT2 = ["--width", "768", "--layers", "12", "--heads", "12", "--vocab", "50257"]
METHODS = "non-private,dpmf,opacus-hooks,opacus-ghost"


def _muon_vs_sgd(args) -> None:
    """Median time of one make_private step with DP-Muon and with DP-SGD (full model)."""
    import dpmf
    from dpmf.optim import DPSGD, DPMuon, route_parameters
    from dpmf.train.hf import causal_lm_loss

    hf_args = argparse.Namespace(
        vocab=50257,
        seq_len=args.seq_len,
        width=768,
        layers=args.layers,
        heads=12,
        full=True,
        lora="c_attn",
        batch_size=args.batch_size,
    )
    batch = bench_hf.make_batch(hf_args)
    steps = {}
    for name, make in (
        ("dp-sgd", lambda ps: DPSGD(ps, lr=0.1, momentum=0.9)),
        # Muon's practice: the embedding tables (tied with the head) take the vector rule
        ("dp-muon", lambda m: DPMuon(route_parameters(m, embeddings="sgd"), lr=0.02)),
    ):
        model = bench_hf.build(hf_args)
        opt = make(model.parameters() if name == "dp-sgd" else model)
        private = dpmf.make_private(
            model,
            opt,
            bench_hf.Batches(batch),
            loss_fn=causal_lm_loss(),
            batch_size=args.batch_size,
            steps=args.repeat + 5,
            noise_multiplier=1.0,
            clip_norm=1.0,
            factorization="identity",
            scheme="fixed_order",
            seed=0,
        )

        def drawn(private=private):  # the plan's batches, epoch after epoch
            while True:
                yield from private.data_loader

        loader = drawn()

        def step(private=private, loader=loader):
            private.backward(next(loader), return_loss=False)
            private.optimizer.step()
            private.optimizer.zero_grad(set_to_none=True)

        step()  # warm-up
        steps[name] = step
    times = {k: [] for k in steps}
    for _ in range(args.repeat):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    size = f"batch {args.batch_size} × {args.seq_len}, {args.repeat} rounds"
    print(f"DP-Muon vs DP-SGD, full fine-tuning, {size}:")
    for k, v in med.items():
        print(f"  {k:<8} median {1000 * v:8.1f} ms")
    print(f"  time   dp-muon / dp-sgd = {med['dp-muon'] / med['dp-sgd']:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--memory-repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", default="lora,full,muon")
    ap.add_argument("--methods", default=METHODS)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"lora", "full", "muon"})
    if unknown:
        ap.error(f"--parts={args.parts} is invalid: {unknown} not among lora, full, muon")
    common = GPT2 + [
        "--layers",
        str(args.layers),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--repeat",
        str(args.repeat),
        "--memory-repeat",
        str(args.memory_repeat),
        "--threads",
        str(args.threads),
        "--methods",
        args.methods,
    ]
    if "lora" in parts:
        bench_hf.main(common + ["--lora", "c_attn"])
    if "full" in parts:
        bench_hf.main(common + ["--full"])
    if "muon" in parts:
        torch.set_num_threads(args.threads)
        warnings.filterwarnings("ignore")
        _muon_vs_sgd(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
