"""The modes of a distributed run, importable without torch (``dpmf.train.config`` validates
``distributed_mode`` against them); their behaviour is in ``dpmf.distributed.step``."""

__all__ = ["MODES"]

#: sharded: each parameter's noise and update on its owner; replicated: every rank adds the
#: full noise (a cross-check); rank0: rank 0 adds the noise before the all-reduce; fsdp: a
#: fully_shard (FSDP2) model's own shards, each rank its shard's noise (chosen for a model whose
#: parameters are DTensors).
MODES = ("sharded", "replicated", "rank0", "fsdp")
