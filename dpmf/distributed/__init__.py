"""Training across processes with the noise of one process (``torch.distributed``).

``DistributedPrivatizer`` (``step``) is the private step over W ranks in the modes
``sharded``, ``replicated`` and ``rank0`` (one ``DistributedMode`` object each, owning what
differs between them: ``DISTRIBUTED_MODES``; their names in ``modes``, importable without
torch); ``sharding`` assigns parameters to owner ranks and batches to ranks; ``collectives``
wraps a process group (or simulates one with threads); ``checkpoint`` saves one shard per rank
with a manifest, resumable at another W; ``launch`` initializes a process group from
``torchrun``'s environment. The step itself is built by ``dpmf.step.build``.
"""

from dpmf.distributed.collectives import Collectives, ThreadCollectives, TorchCollectives, simulate
from dpmf.distributed.sharding import RankSlices, assign_owners, owned_by, parameter_cost, rank_slice
from dpmf.distributed.step import (
    DISTRIBUTED_MODES,
    MODES,
    DistributedMode,
    DistributedPrivatizer,
    DivergenceError,
    seed_digest,
)

__all__ = [
    "MODES",
    "DISTRIBUTED_MODES",
    "DistributedMode",
    "Collectives",
    "DistributedPrivatizer",
    "DivergenceError",
    "RankSlices",
    "ThreadCollectives",
    "TorchCollectives",
    "assign_owners",
    "owned_by",
    "parameter_cost",
    "rank_slice",
    "seed_digest",
    "simulate",
]
