"""``ExecutionFlags``: how a private step is executed, never what it releases (no torch).

Every field here is privacy-neutral: changing it changes speed, memory or the split of the work
between processes, not the sensitivity, the noise's distribution or the accounting, which come
from the ``PrivatePlan`` alone. ``dpmf.step.build(plan, model, loss_fn, ExecutionFlags(…))``
takes them as one frozen object, separate from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpmf._validation import check_choice, check_int
from dpmf.distributed.modes import MODES
from dpmf.optim.choices import CLIPPING_MODES, NOISE_GENERATORS

__all__ = ["ExecutionFlags", "NOISE_KEYS"]

#: How the raw noise z_t is keyed: ``chunked`` per (step, parameter, chunk), the same noise at
#: any number of processes (the default); ``stream`` per step (the keying of earlier runs).
NOISE_KEYS = ("stream", "chunked")


@dataclass(frozen=True)
class ExecutionFlags:
    """The privacy-neutral settings of a private step.

    Attributes:
        clipping: ``auto`` (default), ``vmap``, ``ghost`` or ``bk``: how per-example norms and
            the clipped sum are computed (``dpmf.optim.clipping.clipped_sum``); the same sum up
            to rounding and the same sensitivity ζ.
        micro_batch_size: the most per-example gradients held at once (≥ 1), None: automatic.
        noise_keys: ``chunked`` (default) or ``stream`` (``NOISE_KEYS``).
        noise_generator: what makes the raw normals (``dpmf.optim.raw_noise``): ``device``
            (default: torch's generator on the parameters' device, CPU or CUDA), or
            ``torch-mt19937``, ``torch-philox-cuda``, ``numpy-philox`` (earlier versions').
            The same distribution; other numbers.
        distributed_mode: with a process group: ``sharded`` (default), ``replicated`` or
            ``rank0`` (``dpmf.distributed.step``).
        check_every: with a process group: compare per-parameter checksums every K steps
            (0: never).

    Raises:
        ValueError: a value outside the choices or ranges above.
    """

    clipping: str = "auto"
    micro_batch_size: int | None = None
    noise_keys: str = "chunked"
    noise_generator: str = "device"
    distributed_mode: str = "sharded"
    check_every: int = 50

    def __post_init__(self):
        check_choice("clipping", self.clipping, CLIPPING_MODES)
        if self.micro_batch_size is not None:
            object.__setattr__(
                self, "micro_batch_size", check_int("micro_batch_size", self.micro_batch_size, minimum=1)
            )
        check_choice("noise_keys", self.noise_keys, NOISE_KEYS)
        check_choice("noise_generator", self.noise_generator, NOISE_GENERATORS)
        check_choice("distributed_mode", self.distributed_mode, MODES)
        object.__setattr__(self, "check_every", check_int("check_every", self.check_every, minimum=0))
