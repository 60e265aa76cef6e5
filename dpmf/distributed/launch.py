"""Start a process group from ``torchrun``'s environment (loopback or a cluster).

``torchrun --nproc-per-node W -m dpmf train … --distributed`` sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; ``init_from_env`` reads them, picks the backend
(NCCL for CUDA devices, gloo otherwise) and the device of this process (``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from dpmf.distributed.collectives import TorchCollectives

__all__ = ["ENV_VARS", "init_from_env", "shutdown"]

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(device: torch.device, *, timeout_s: float = 300.0) -> tuple[TorchCollectives, torch.device]:
    """Initialize the default process group from the environment (once per process).

    Args:
        device: the run's device type (``cpu`` or ``cuda``).
        timeout_s: how long a collective may wait for the other processes.

    Returns:
        (collectives, device): the group's collectives and this process's device.

    Raises:
        ValueError: a variable of ``ENV_VARS`` is missing (not started by torchrun).
    """
    import torch.distributed as dist

    missing = [v for v in ENV_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"--distributed is invalid here: {', '.join(missing)} not set; start the run with "
            "torchrun --nproc-per-node W -m dpmf train … --distributed"
        )
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return TorchCollectives(), device


def shutdown() -> None:
    """Wait for every process, then destroy the default process group (if one exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
