"""Cost of one optimizer step (post-processing only), as a ratio to DP-SGD measured in the same run.

Parameters: the 3-block CNN of the LR-scheduling paper for 32×32 inputs (convolutions 32-32 /
64-64 / 128-128 with 3×3 kernels, GroupNorm, a linear head), with random privatized gradients.
Also Newton–Schulz against the exact polar factor U·Vᵀ from torch.linalg.svd on the largest
kernel's matrix view.

    python benchmarks/optimizer_step.py [--repeats 30] [--device cpu|cuda]

Prints medians (ms) and ratios; no assertion (timings on shared machines are noisy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpmf.optim import (  # noqa: E402
    DPSGD,
    DPAdam,
    DPMuon,
    DPMuonBC,
    DPMuonS,
    matrix_view,
    newton_schulz,
)


def cnn() -> nn.Module:
    layers, c_in = [], 3
    for c in (32, 32, 64, 64, 128, 128):
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.GroupNorm(8, c), nn.Tanh()]
        c_in = c
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 4 * 4, 10))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats, device) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = cnn().to(device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    print(f"{sum(p.numel() for p in params)} parameters on {device}, {args.repeats} repeats")

    def make(cls, **kw):
        # gradients written by hand above: opt out of the privatized-gradient check
        return cls(model.parameters(), lr=1e-6, allow_unprivatized=True, **kw)

    optimizers = {
        "dp-sgd (momentum 0.9)": make(DPSGD, momentum=0.9),
        "dp-adam": make(DPAdam),
        "dp-muon": make(DPMuon),
        "dp-muon-s": make(DPMuonS),
        "dp-muon-bc (order 1, 1 probe pair)": make(DPMuonBC, noise_std=1e-3),
        "dp-muon-bc (order 2, 1 probe pair)": make(DPMuonBC, order=2, noise_std=1e-3),
    }
    base = None
    for name, opt in optimizers.items():
        ms = median_ms(opt.step, args.repeats, device)
        base = base or ms
        print(f"{name:38s} {ms:9.2f} ms   ratio to dp-sgd {ms / base:6.2f}")

    W = matrix_view(torch.randn(128, 128, 3, 3, device=device))

    def polar_svd():
        U, _, Vh = torch.linalg.svd(W, full_matrices=False)
        return U @ Vh

    ns = median_ms(lambda: newton_schulz(W), args.repeats, device)
    svd = median_ms(polar_svd, args.repeats, device)
    print(f"newton_schulz 128×1152 {ns:.2f} ms, exact polar by SVD {svd:.2f} ms, ratio {ns / svd:.2f}")


if __name__ == "__main__":
    main()
