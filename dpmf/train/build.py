"""The parts of a run built from a ``TrainConfig``: the device, the optimizer and its temporal
filter, and the per-purpose seeds derived from the run's key."""

from __future__ import annotations

import torch
from torch import nn

from dpmf import seeds
from dpmf.optim import Transform, make_filter, matrix_shape, route_parameters
from dpmf.optim.clipping import trainable_parameters
from dpmf.optim.optimizers import make_optimizer
from dpmf.optim.registry import get_optimizer
from dpmf.train.config import TrainConfig

__all__ = ["build_filter", "build_optimizer", "draw_seed", "resolve_device", "sub_seed"]


_PURPOSES = ("model", "sampler", "noise", "probes")


def sub_seed(seed: int, purpose: int) -> int:
    """A 63-bit seed for one purpose (0 model, 1 sampler, 2 noise, 3 probes) derived from the
    run's key by ``dpmf.seeds.derive_int`` (for ``torch.manual_seed``-style consumers: the
    model's initial weights, DP-MuonBC's public probes; the sampler and the noise derive their
    own 128-bit subkeys from the key itself)."""
    return seeds.derive_int(int(seed), _PURPOSES[purpose], bits=63)


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU.

    Raises:
        ValueError: ``cuda`` requested but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid: CUDA is not available here (use cpu or auto)")
    return torch.device(name)


def build_filter(config: TrainConfig) -> Transform | None:
    """The temporal filter stage of ``config`` (``dpmf.optim.filters``), or None."""
    return make_filter(
        config.filter,
        a=config.doppler_a,
        b=config.doppler_b,
        kappa=config.disk_kappa,
        gamma=config.disk_gamma,
    )


def build_optimizer(
    config: TrainConfig, model: nn.Module, *, log=print, seed: int | None = None
) -> torch.optim.Optimizer:
    """The DP optimizer of ``config`` over the model's trainable parameters.

    The optimizer is the registry's entry ``config.optimizer`` (``dpmf.optim.registry``),
    built by ``dpmf.optim.optimizers.make_optimizer`` with the learning rate ``base_lr``,
    ``weight_decay``, heavy-ball ``momentum`` and the ``filter`` (``build_filter``: run first in
    every group, before the optimizer's own momentum: DOPPLER-SGD, DiSK-Muon, …). A
    Newton–Schulz optimizer (``dp-muon``, ``dp-muon-s``, ``dp-muon-bc``) orthogonalizes the
    matrix parameters (conv kernels as out × in·kh·kw, EMA momentum ``muon_beta``) and updates
    the 1-D ones by DP-SGD with momentum ``momentum`` (``vector_lr``); a parameter of two or
    more dimensions whose matrix view has a single row or column — e.g. a per-channel scale of
    shape (C, 1, 1) — is a vector, not a matrix: it is routed to the 1-D rule, with a notice.
    An optimizer that draws random probes gets the seed ``sub_seed(seed, 3)``.
    """
    spec = get_optimizer(config.optimizer)
    filt = build_filter(config)
    kwargs = dict(lr=config.base_lr, weight_decay=config.weight_decay, momentum=config.momentum, filter=filt)
    if spec.probes:
        master = seed if seed is not None else config.seed
        kwargs["probe_seed"] = sub_seed(0 if master is None else master, 3)
    if not spec.newton_schulz:
        return make_optimizer(spec.name, model.parameters(), **kwargs)
    vectors = {}
    for name, p in trainable_parameters(model):
        if p.ndim >= 2 and 1 in matrix_shape(tuple(p.shape)):
            vectors[name] = "sgd"
    if vectors:
        log(
            f"note: {', '.join(f'{k} {tuple(dict(model.named_parameters())[k].shape)}' for k in vectors)} "
            "has a degenerate matrix view (a per-channel vector): updated by the 1-D rule (DP-SGD "
            "with momentum), not Newton–Schulz"
        )
    groups = route_parameters(model, rules=vectors or None)
    return make_optimizer(spec.name, groups, beta=config.muon_beta, vector_lr=config.vector_lr, **kwargs)


def draw_seed() -> int:
    """A secret key of ``dpmf.seeds.KEY_BITS`` bits from the operating system's entropy."""
    return seeds.draw_key()
