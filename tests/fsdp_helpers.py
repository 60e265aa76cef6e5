"""Models, cases and the one-process reference of the fully_shard (FSDP2) tests (imported by
tests/test_fsdp.py and by tests/fsdp_worker.py, which torchrun starts)."""

import torch
from test_distributed import _private, _steps
from torch import nn

from dpmf.optim import DPSGD, DPAdam, DPMuon, route_parameters
from dpmf.optim.noise import ChunkedKeys
from dpmf.optim.privatize import Privatizer
from dpmf.plan import PrivatePlan
from dpmf.step import noise_stream

SEED = 21


def build(dtype=torch.float32):
    """An MLP whose rows do not split evenly over 2 or 4 ranks (5, 4 and 3 outputs), with a
    LayerNorm that falls in the root unit."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    )
    return model.to(dtype)


def shard(model):
    """fully_shard on every Linear, then on the root (FSDP2's usual wrapping)."""
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(40, 6, generator=g, dtype=dtype), torch.randint(0, 3, (40,), generator=g)


def optimizer(kind, model):
    if kind == "dp-sgd":
        return DPSGD(model.parameters(), lr=0.3, momentum=0.9)
    if kind == "dp-adam":
        return DPAdam(model.parameters(), lr=0.05)
    return DPMuon(route_parameters(model), lr=0.05, beta=0.9, vector_momentum=0.9)


def cases():
    """(name, optimizer, plan): DP-SGD, DP-Adam and DP-Muon with a banded strategy and a BLT."""
    banded = PrivatePlan(40, 8, steps=5, scheme="fixed_order", strategy="bsr:4").with_noise(0.7)
    blt = PrivatePlan(40, 8, steps=5, scheme="fixed_order", strategy="blt:2").with_noise(0.7)
    return [
        (f"{kind}-{label}", kind, plan)
        for kind in ("dp-sgd", "dp-adam", "dp-muon")
        for label, plan in (("banded", banded), ("blt", blt))
    ]


def batches(plan, seed=3):
    sampler = plan.sampler(seed)
    return [sampler.next() for _ in range(plan.steps)]


def one_process(plan, kind, dtype=torch.float32):
    """The final weights of the same steps in one process (chunked noise keys)."""
    model = build(dtype)
    params = list(model.parameters())
    keys = ChunkedKeys(tuple(p.numel() for p in params))
    noise = noise_stream(plan, keys.dim, SEED, dtype=dtype, keys=keys)
    priv = Privatizer(model, nn.functional.cross_entropy, plan=plan, clip_norm=1.0, noise=noise)
    opt = optimizer(kind, model)
    opt.bind(priv)
    x, y = data(dtype)
    for idx in batches(plan):
        priv.privatize(x[idx], y[idx])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


# ranks of unequal batches: rank 0 takes the first 3 examples of each step's slice of the data,
# rank 1 the next one (the first step's probes then see 3 and 1 examples)
UNEVEN = PrivatePlan(40, 8, steps=3, scheme="fixed_order", strategy="bsr:2").with_noise(0.7)


def uneven_slice(t, rank):
    """Rank ``rank``'s examples of step ``t`` (W = 2): 3 on rank 0, 1 on rank 1."""
    start = 4 * t + (0 if rank == 0 else 3)
    return slice(start, start + (3 if rank == 0 else 1))


def uneven_one_process(micro_batch_size=None):
    """The final weights of UNEVEN's steps in one process, each batch the ranks' slices."""
    model = build(torch.float64)
    params = list(model.parameters())
    keys = ChunkedKeys(tuple(p.numel() for p in params))
    noise = noise_stream(UNEVEN, keys.dim, SEED, dtype=torch.float64, keys=keys)
    priv = Privatizer(
        model, nn.functional.cross_entropy, plan=UNEVEN, clip_norm=1.0, noise=noise,
        micro_batch_size=micro_batch_size,
    )  # fmt: skip
    opt = optimizer("dp-sgd", model)
    opt.bind(priv)
    x, y = data(torch.float64)
    for t in range(UNEVEN.steps):
        priv.privatize(x[4 * t : 4 * t + 4], y[4 * t : 4 * t + 4])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


# make_private over the same data as tests/test_distributed.py's runs (SGD with momentum,
# bsr:3, a given seed) and its steps
make_private_run = _private
take_steps = _steps


def tiny_batches_run(model, process_group=None, **kw):
    """make_private with Poisson batches of expected size 1 (DP-SGD's identity strategy): over
    W ≥ 2 ranks most batches have fewer examples than ranks (some none at all)."""
    import dpmf

    x, y = data(torch.float64)
    return dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        torch.utils.data.TensorDataset(x, y),
        loss_fn=nn.functional.cross_entropy,
        batch_size=1,
        steps=8,
        noise_multiplier=0.8,
        target_delta=1e-5,
        factorization="identity",
        scheme="poisson",
        seed=13,
        process_group=process_group,
        **kw,
    )


def all_steps(run):
    """Every step of ``run``'s plan through its loader; the global batch sizes seen."""
    sizes = []
    for xb, yb in run.data_loader:
        run.backward(xb, target=yb, return_loss=False)
        sizes.append(run.privatizer.last_step.batch_size)
        run.optimizer.step()
        run.optimizer.zero_grad()
    return sizes
