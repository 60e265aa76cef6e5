"""One-run white-box audits through each door of dpmf: tightness (lower bound / claimed ε).

    PYTHONPATH=. python benchmarks/bench_audit_doors.py [--seeds 3] [--canaries 1000]

Doors: ``dpmf audit`` (the ``dpmf train`` run) with DP-SGD/Poisson and bsr:4/cyclic Poisson,
``make_private`` in a user's loop (``dpmf.audit.private_audit``; its torchrun run has the same
scores to 1e-6, tests/test_audit_doors.py), ``dpmf fl`` client mode with canary clients and
record mode with canary records in one client's run, aggregator mode with canary records in the
server's DP-SGD (``dpmf.audit.federated``). digits / breast-cancer, claimed ε ≈ 4 (record mode:
3), δ = 1e-5, α = 0.05, one-run estimator (Steinke et al. 2023). Prints the median and range
over the seeds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from dpmf.audit.runner import run_audit
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset

EPS = 4.0


def _train_door(seed, m, data, **kw):
    cfg = TrainConfig(dataset="digits", epsilon=EPS, seed=seed, device="cpu", **kw)
    r = run_audit(
        cfg,
        f"/tmp/bench_audit_doors/{seed}",
        canaries=m,
        progress=False,
        log=lambda *a: None,
        data=data,
        overwrite=True,
    )
    return r["epsilon_lower_bound"], r["claimed"]["epsilon"]


def _make_private_door(seed, m, data):
    from dpmf.audit.private_audit import audit_make_private
    from dpmf.train.models import build_model

    torch.manual_seed(seed)
    model = build_model("mlp", data.input_shape, data.num_classes, seed=seed)
    audit = audit_make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        torch.utils.data.TensorDataset(data.train_x, data.train_y),
        canaries=m,
        loss_fn=F.cross_entropy,
        batch_size=128,
        epochs=4,
        target_epsilon=EPS,
        target_delta=1e-5,
        factorization="bsr:4",
        scheme="fixed_order",
        noise_keys="chunked",  # the noise of a torchrun run
        seed=seed,
    )
    run = audit.private
    while run.steps_taken < run.plan.steps:
        for xb, yb in run.data_loader:
            run.backward(xb, target=yb, return_loss=False)
            run.optimizer.step()
            run.optimizer.zero_grad()
    r = audit.result()
    return r["epsilon_lower_bound"], r["claimed"]["epsilon"]


def _fl_door(seed, m, strategy="fedavg"):
    from dpmf.audit.federated import audit_fl_clients
    from dpmf.federated.run import FLConfig

    # 20 rounds, σ_c = 4.9: client-level ε ≈ 4 at δ = 1e-5 (a Gaussian mechanism, μ = √20/4.9)
    cfg = FLConfig(
        num_clients=8,
        rounds=20,
        privacy="client",
        strategy=strategy,
        client_noise_multiplier=4.9,
        seed=seed,
        local_steps=2,
    )
    r = audit_fl_clients(cfg, canaries=m, log=lambda *a: None)
    return r["epsilon_lower_bound"], r["claimed"]["epsilon"]


def _fl_record_door(seed, m):
    from dpmf.audit.federated import audit_fl_records
    from dpmf.federated.compliance import NoiseMap
    from dpmf.federated.run import FLConfig

    cfg = FLConfig(
        num_clients=8,
        rounds=10,
        privacy="record",
        strategy="fedavg",
        noise_map=NoiseMap(sigma_min=0.8, sigma_max=0.8),
        local_batch_size=32,
        seed=seed,
        local_steps=5,
    )
    r = audit_fl_records(cfg, canaries=m, log=lambda *a: None)
    return r["epsilon_lower_bound"], r["claimed"]["epsilon"]


def _fl_aggregator_door(seed, m):
    from dpmf.audit.federated import audit_fl_aggregator
    from dpmf.federated.compliance import NoiseMap
    from dpmf.federated.run import FLConfig

    # 40 server steps (4 participants × 10 rounds) at q = 220/(228 + m), σ = 1.5: ε ≈ 4.2 (m = 1000)
    cfg = FLConfig(
        num_clients=4,
        rounds=10,
        privacy="aggregator",
        aggregator_fraction=0.5,
        server_batch_size=220,
        noise_map=NoiseMap(sigma_min=1.5, sigma_max=1.5),
        hidden=128,
        seed=seed,
    )
    r = audit_fl_aggregator(cfg, canaries=m, log=lambda *a: None)
    return r["epsilon_lower_bound"], r["claimed"]["epsilon"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--only", default="", help="run only the doors whose name contains this")
    args = ap.parse_args()
    data = load_dataset("digits", None)
    doors = {
        "dpmf train/audit, DP-SGD, Poisson": lambda s: _train_door(
            s, args.canaries, data, factorization="identity", scheme="poisson", epochs=2, batch_size=256
        ),
        "dpmf train/audit, bsr:4, cyclic Poisson": lambda s: _train_door(
            s, args.canaries, data, factorization="bsr:4", scheme="cyclic_poisson", epochs=4, batch_size=128
        ),
        "make_private (= torchrun), bsr:4, fixed order": lambda s: _make_private_door(s, args.canaries, data),
        "dpmf fl, client mode, canary clients": lambda s: _fl_door(s, args.canaries),
        "dpmf fl, client mode, canary clients, FedAdam": lambda s: _fl_door(s, args.canaries, "fedadam"),
        "dpmf fl, aggregator mode, canary aggregator records": lambda s: _fl_aggregator_door(
            s, args.canaries
        ),
        "dpmf fl, record mode, canary records (one client)": lambda s: _fl_record_door(s, args.canaries),
    }
    print("| door | claimed ε | lower bound (median, range) | bound / claimed | seconds per run |")
    print("|---|---|---|---|---|")
    for name, fn in doors.items():
        if args.only not in name:
            continue
        t0 = time.perf_counter()
        out = [fn(s) for s in range(args.seeds)]
        lb = np.array([o[0] for o in out])
        claimed = out[0][1]
        sec = (time.perf_counter() - t0) / args.seeds
        print(
            f"| {name} | {claimed:.3g} | {np.median(lb):.3f} ({lb.min():.3f}–{lb.max():.3f}) | "
            f"{np.median(lb) / claimed:.3f} | {sec:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
