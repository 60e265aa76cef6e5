"""The private step of a run, built in one place (``build``) from a ``PrivatePlan``.

``build(plan, model, loss_fn, flags, comm)`` returns a frozen ``DPStep``: the plan's batch
sampler, its noise stream, the privatizer bound to that sampler's batches (a
``DistributedPrivatizer`` with a process group) and the plan's DP event. ``ExecutionFlags``
holds the privacy-neutral settings (clipping mode, micro-batches, noise keys, distributed mode).
Every door — ``dpmf.make_private``, ``dpmf train`` (one process or torchrun), the federated
modes' private runs and ``dpmf audit`` — builds its step here.
"""

from dpmf.step.build import DPStep, build, noise_stream
from dpmf.step.flags import NOISE_KEYS, ExecutionFlags

__all__ = ["DPStep", "ExecutionFlags", "NOISE_KEYS", "build", "noise_stream"]
