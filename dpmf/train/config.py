"""The configuration of a training run: one frozen dataclass, loadable from YAML or JSON.

``TrainConfig.from_file(path)`` reads a mapping whose keys are the field names (``-`` and
``_`` both accepted); ``config.replace(**overrides)`` applies command-line flags on top.
Every field is validated when the config is built, before any data is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields

from dpmf._validation import check_choice, check_int, check_real
from dpmf.accountants.registry import ACCOUNTANTS
from dpmf.distributed.modes import MODES
from dpmf.mechanisms.registry import parse_factorization
from dpmf.optim.choices import CLIPPING_MODES, NOISE_GENERATORS
from dpmf.optim.registry import DEFAULT_LR, optimizer_names
from dpmf.plan.schemes import SCHEMES, Poisson, scheme_names
from dpmf.step.flags import NOISE_KEYS, ExecutionFlags
from dpmf.train.choices import DATASETS, MODELS
from dpmf.workloads.schedules import SCHEDULES

__all__ = ["ACCOUNTANTS", "DEFAULT_LR", "TrainConfig"]

DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED_MODES = MODES


def __getattr__(name):
    # the optimizer names follow the registry (``dpmf.optim.registry``)
    if name == "OPTIMIZERS":
        return optimizer_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run (the same config and seed give the same run).

    Attributes:
        dataset: ``fashion-mnist``, ``cifar10`` or ``digits``.
        data_dir: folder with the data set's files; None for its default place (digits as the
            fallback when absent).
        model: ``cnn``, ``cnn3``, ``mlp`` or ``wrn16-4``.
        optimizer: a name of the optimizer registry (``dpmf.optim.registry``): ``dp-sgd``,
            ``dp-adam``, ``dp-muon``, ``dp-muon-s``, ``dp-muon-bc`` or one registered since.
        factorization: the strategy, as for ``factorize`` (``identity`` = plain DP-SGD noise,
            ``bisr:16``, ``bsr:8``, ``lr_aware``, ``bsr_opt:32``, ``blt:4``, ``dense``, …;
            the optimized ones are optimized for the participation of ``scheme``), or ``auto``:
            the recommendation of ``dpmf.pick.pick`` for this run (needs ``epsilon``), which
            also sets the scheme.
        scheme: batch sampling and its accounting (``poisson``, ``cyclic_poisson``,
            ``balls_in_bins``, ``epoch_balls_in_bins``, ``fixed_order``, ``single_release``).
            With ``factorization="auto"``: ``poisson`` (the default) or ``auto`` let ``pick``
            choose per candidate (its ``auto``); ``cyclic_poisson``, ``fixed_order``,
            ``balls_in_bins`` and ``single_release`` restrict it to that scheme.
        max_bands: with ``factorization="auto"``, the memory budget of ``pick``: at most this
            many bands (or BLT buffers), ≥ 1.
        epochs: E ≥ 1; the run has E·⌈N/B⌉ steps.
        batch_size: B, the expected (logical) batch size, 1 ≤ B ≤ N.
        epsilon: target ε > 0 (σ is calibrated); exactly one of epsilon / noise_multiplier.
        noise_multiplier: σ > 0 given directly (ε is then computed).
        delta: δ in (0, 1).
        clip_norm: ζ > 0.
        lr: base learning rate η > 0 (step t uses η·χ_t); None: the optimizer's default
            (``DEFAULT_LR``, the registry's ``default_lr``; for DP-Muon the rate of the matrix
            updates).
        momentum: heavy-ball momentum in [0, 1) of DP-SGD, and of DP-Muon's 1-D parameters.
        muon_beta: the EMA momentum β in [0, 1) of DP-Muon's matrix updates.
        vector_lr: DP-Muon's learning rate of the 1-D parameters (None: ``lr``).
        weight_decay: ≥ 0 (post-processing; decoupled as the optimizer defines it).
        filter: temporal filter run first on the private gradient (post-processing): ``none``,
            ``doppler`` (low-pass IIR, ``dpmf.optim.filters.Doppler``) or ``disk`` (simplified
            Kalman filter; each step then evaluates the per-example gradients at two points,
            combined before clipping, so ε is unchanged).
        doppler_a, doppler_b: DOPPLER's feedback and feed-forward coefficients.
        disk_kappa, disk_gamma: DiSK's Kalman gain κ in (0, 1] and extrapolation length γ > 0.
        schedule, beta, gamma: the learning-rate schedule χ (also the workload A_χ).
        seed: seeds the model's initial weights, the sampler and the noise; None (the default)
            draws it from the operating system's entropy (never written to results.json or an
            export; a checkpoint keeps it, to resume). A given seed makes the noise predictable
            to whoever knows it: use it for reproducible experiments, not for released models.
        device: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``.
        micro_batch_size: per-example gradients held at once (None: the whole batch).
        clipping: how per-example gradients are clipped and summed: ``auto`` (book-keeping
            ghost clipping when every layer allows it, else ``vmap``), ``vmap``, ``ghost`` or
            ``bk`` (``dpmf.optim.clipping.clipped_sum``). The same sum up to rounding, so not
            part of the run's identity.
        accountant: a name of ``dpmf.accountants.ACCOUNTANTS`` the scheme supports (``pld``,
            ``rdp``, ``prv``, ``monte_carlo``, ``allocation_pld``); None: the scheme's default
            (Monte Carlo for the balls-in-bins schemes, PLD otherwise).
        samples: Monte Carlo samples for balls-in-bins accounting (None: the accountant's default).
        eval_batch_size: batch size of the test evaluation (no privacy cost).
        epsilon_each_epoch: account ε after every epoch (True) or only for the whole run
            (False); None: True except for the balls-in-bins schemes, whose Monte Carlo
            accounting is costly (their final ε is always reported).
        log_every: K ≥ 1: every K steps, the training loss, the fraction of clipped examples
            and the learning rate go to ``steps.csv`` and, where ``tensorboard`` is installed,
            TensorBoard event files (computed from the private batches without noise: not
            covered by (ε, δ), keep them private). None: per-epoch metrics only.
        noise_keys: ``chunked`` (default: raw noise keyed by step, parameter and chunk,
            ``dpmf.optim.noise.ChunkedKeys``; the same noise in any number of processes, so a
            one-process run equals a distributed one and their checkpoints interchange; it
            costs ≤ 5 % of a private step, ``benchmarks/bench_noise_keys_default.py``) or
            ``stream`` (one raw-noise stream keyed by step: the keying of earlier runs, to
            resume their checkpoints). Distributed runs always use ``chunked``.
        noise_generator: what makes the raw normals (``dpmf.optim.raw_noise``): ``device``
            (default: torch's generator on the training device, no host-to-device copy),
            ``torch-mt19937``, ``torch-philox-cuda`` or ``numpy-philox`` (earlier versions'). A
            resumed run continues with its checkpoint's generator.
        distributed_mode: with ``train(..., distributed=True)``: ``sharded`` (each parameter's
            noise and update on one owner process), ``replicated``, ``rank0``, or ``fsdp`` (the
            model sharded with ``fully_shard``: each process holds 1/W of the weights,
            gradients, optimizer and noise state) (``dpmf.distributed.step``). The same
            trajectory up to rounding, so not part of the run's identity.
    """

    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    model: str = "cnn"
    optimizer: str = "dp-sgd"
    factorization: str = "identity"
    scheme: str = Poisson.name
    max_bands: int = 64
    epochs: int = 10
    batch_size: int = 512
    epsilon: float | None = 3.0
    noise_multiplier: float | None = None
    delta: float = 1e-5
    clip_norm: float = 1.0
    lr: float | None = None
    momentum: float = 0.9
    muon_beta: float = 0.95
    vector_lr: float | None = None
    weight_decay: float = 0.0
    filter: str = "none"
    doppler_a: tuple = (1.0, -0.9)
    doppler_b: tuple = (0.1,)
    disk_kappa: float = 0.7
    disk_gamma: float = 0.5
    schedule: str = "constant"
    beta: float = 1.0
    gamma: float | None = None
    seed: int | None = None
    device: str = "auto"
    micro_batch_size: int | None = None
    clipping: str = "auto"
    accountant: str | None = None
    samples: int | None = None
    eval_batch_size: int = 1024
    epsilon_each_epoch: bool | None = None
    log_every: int | None = None
    noise_keys: str = "chunked"
    noise_generator: str = "device"
    distributed_mode: str = "sharded"

    def __post_init__(self):
        self._check_run_choices()
        self._check_budget()
        self._check_optimizer_settings()
        self._check_schedule()
        self._check_execution()

    def _check_run_choices(self) -> None:
        """The data set, model, optimizer and strategy/scheme choices."""
        check_choice("dataset", self.dataset, DATASETS)
        if self.data_dir is not None and not isinstance(self.data_dir, str):
            raise TypeError(f"data_dir={self.data_dir!r} is invalid: must be a folder path")
        model = "wrn16-4" if self.model == "wrn16_4" else self.model
        object.__setattr__(self, "model", check_choice("model", model, MODELS))
        check_choice("optimizer", self.optimizer, optimizer_names())
        object.__setattr__(self, "max_bands", check_int("max_bands", self.max_bands, minimum=1))
        if self.factorization == "auto":
            from dpmf.plan.pick import PICK_SCHEMES

            check_choice("scheme", self.scheme, (Poisson.name,) + PICK_SCHEMES)
            if self.epsilon is None:
                raise ValueError(
                    "factorization='auto' is invalid with noise_multiplier: the choice needs a target epsilon"
                )
        else:
            name, _ = parse_factorization(self.factorization)
            check_choice("scheme", self.scheme, scheme_names())
            if name != "identity" and not SCHEMES[self.scheme].matrix_mechanism:
                raise ValueError(
                    f"factorization={self.factorization!r} is invalid for scheme={self.scheme!r}: it "
                    "accounts DP-SGD (C = I) only; use cyclic_poisson, balls_in_bins, fixed_order or "
                    "single_release for a matrix mechanism"
                )

    def _check_budget(self) -> None:
        """The length, the batch size and the privacy budget (ε or σ, δ, ζ)."""
        object.__setattr__(self, "epochs", check_int("epochs", self.epochs, minimum=1))
        object.__setattr__(self, "batch_size", check_int("batch_size", self.batch_size, minimum=1))
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "epsilon and noise_multiplier are invalid together: give exactly one "
                f"(got epsilon={self.epsilon!r}, noise_multiplier={self.noise_multiplier!r})"
            )
        if self.epsilon is not None:
            object.__setattr__(
                self, "epsilon", check_real("epsilon", self.epsilon, low=0.0, low_inclusive=False)
            )
        if self.noise_multiplier is not None:
            object.__setattr__(
                self,
                "noise_multiplier",
                check_real("noise_multiplier", self.noise_multiplier, low=0.0, low_inclusive=False),
            )
        object.__setattr__(
            self,
            "delta",
            check_real("delta", self.delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False),
        )
        object.__setattr__(
            self, "clip_norm", check_real("clip_norm", self.clip_norm, low=0.0, low_inclusive=False)
        )

    def _check_optimizer_settings(self) -> None:
        """The optimizer's numbers and the temporal filter."""
        if self.lr is not None:
            object.__setattr__(self, "lr", check_real("lr", self.lr, low=0.0, low_inclusive=False))
        object.__setattr__(
            self,
            "muon_beta",
            check_real("muon_beta", self.muon_beta, low=0.0, high=1.0, high_inclusive=False),
        )
        if self.vector_lr is not None:
            object.__setattr__(
                self, "vector_lr", check_real("vector_lr", self.vector_lr, low=0.0, low_inclusive=False)
            )
        object.__setattr__(
            self, "momentum", check_real("momentum", self.momentum, low=0.0, high=1.0, high_inclusive=False)
        )
        object.__setattr__(self, "weight_decay", check_real("weight_decay", self.weight_decay, low=0.0))
        self._check_filter()

    def _check_schedule(self) -> None:
        """The learning-rate schedule χ (its final multiplier β, γ)."""
        check_choice("schedule", self.schedule, SCHEDULES)
        object.__setattr__(
            self, "beta", check_real("beta", self.beta, low=0.0, high=1.0, low_inclusive=False)
        )
        if self.schedule == "constant" and self.beta != 1.0:
            raise ValueError(f"beta={self.beta!r} is invalid with schedule='constant': it must be 1")
        if self.schedule != "constant" and self.beta == 1.0:
            raise ValueError(
                f"beta=1.0 is invalid with schedule={self.schedule!r}: it makes the schedule constant; "
                "give the final learning-rate multiplier in (0, 1), or schedule='constant'"
            )
        if self.gamma is not None:
            object.__setattr__(self, "gamma", check_real("gamma", self.gamma, low=0.0, low_inclusive=False))

    def _check_execution(self) -> None:
        """The seed, device, clipping, accounting, logging and process settings."""
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))
        check_choice("device", self.device, DEVICES)
        if self.micro_batch_size is not None:
            object.__setattr__(
                self, "micro_batch_size", check_int("micro_batch_size", self.micro_batch_size, minimum=1)
            )
        check_choice("clipping", self.clipping, CLIPPING_MODES)
        if self.accountant is not None:
            check_choice("accountant", self.accountant, ACCOUNTANTS)
        if self.samples is not None:
            object.__setattr__(self, "samples", check_int("samples", self.samples, minimum=1))
        object.__setattr__(
            self, "eval_batch_size", check_int("eval_batch_size", self.eval_batch_size, minimum=1)
        )
        if self.log_every is not None:
            object.__setattr__(self, "log_every", check_int("log_every", self.log_every, minimum=1))
        check_choice("noise_keys", self.noise_keys, NOISE_KEYS)
        check_choice("noise_generator", self.noise_generator, NOISE_GENERATORS)
        check_choice("distributed_mode", self.distributed_mode, DISTRIBUTED_MODES)
        if self.epsilon_each_epoch is not None and not isinstance(self.epsilon_each_epoch, bool):
            raise TypeError(
                f"epsilon_each_epoch={self.epsilon_each_epoch!r} is invalid: must be true or false"
            )

    @property
    def per_epoch_epsilon(self) -> bool:
        """Whether ε is accounted after every epoch (``epsilon_each_epoch`` or its default)."""
        if self.epsilon_each_epoch is None:
            cls = SCHEMES.get(self.scheme)
            return True if cls is None else cls.epsilon_each_epoch
        return self.epsilon_each_epoch

    def _check_filter(self) -> None:
        from dpmf.optim.filters import FILTERS, Disk, Doppler

        check_choice("filter", self.filter, FILTERS)
        coefficients = {}
        for key in ("doppler_a", "doppler_b"):
            value = getattr(self, key)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(f"{key}={value!r} is invalid: must be a list of reals")
            coefficients[key] = tuple(value)
            object.__setattr__(self, key, coefficients[key])
        try:
            Doppler(coefficients["doppler_a"], coefficients["doppler_b"])
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"doppler_a={coefficients['doppler_a']!r}, doppler_b={coefficients['doppler_b']!r} "
                f"are invalid: {exc}"
            ) from None
        try:
            disk = Disk(self.disk_kappa, self.disk_gamma)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"disk_{exc}") from None
        object.__setattr__(self, "disk_kappa", disk.kappa)
        object.__setattr__(self, "disk_gamma", disk.gamma)

    @property
    def base_lr(self) -> float:
        """η: ``lr``, or the optimizer's default when ``lr`` is None."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, mapping: dict) -> TrainConfig:
        """Build from a mapping of field names (``-`` or ``_``).

        Raises:
            ValueError: an unknown key, or any invalid value.
        """
        if not isinstance(mapping, dict):
            raise TypeError(f"config is invalid: must be a mapping, got {type(mapping).__name__}")
        known = set(cls.field_names())
        clean = {}
        for key, value in mapping.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise ValueError(f"config key {key!r} is invalid: must be one of {', '.join(sorted(known))}")
            clean[name] = value
        if clean.get("noise_multiplier") is not None and "epsilon" not in clean:
            clean["epsilon"] = None  # σ given: ε is computed, not targeted
        return cls(**clean)

    @classmethod
    def from_file(cls, path: str) -> TrainConfig:
        """Read a YAML (``.yaml``/``.yml``) or JSON file holding a mapping of fields.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a mapping, unparsable, an unknown key or an invalid value.
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config={path!r} is invalid: no such file")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            if path.endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:
            raise ValueError(f"config={path!r} is invalid: cannot parse it ({exc})") from None
        return cls.from_dict(data or {})

    def replace(self, **overrides) -> TrainConfig:
        """A copy with ``overrides`` applied (None values are ignored, except to clear
        ``epsilon`` when ``noise_multiplier`` is given and vice versa)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if changes.get("noise_multiplier") is not None and "epsilon" not in changes:
            changes["epsilon"] = None
        if changes.get("epsilon") is not None and "noise_multiplier" not in changes:
            changes["noise_multiplier"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def execution_flags(self) -> ExecutionFlags:
        """The privacy-neutral settings of the run's private step (``ExecutionFlags``)."""
        return ExecutionFlags(
            clipping=self.clipping,
            micro_batch_size=self.micro_batch_size,
            noise_keys=self.noise_keys,
            noise_generator=self.noise_generator,
            distributed_mode=self.distributed_mode,
        )

    def run_identity(self) -> dict:
        """The fields that define the run's trajectory (a resumed run must match them)."""
        d = self.to_dict()
        d["lr"] = self.base_lr
        for k in (
            "device",
            "eval_batch_size",
            "epsilon_each_epoch",
            "data_dir",
            "log_every",
            "clipping",
            "distributed_mode",
            "noise_generator",  # the checkpoint's noise state names its generator
        ):
            d.pop(k)
        if d["noise_keys"] == "stream":  # the original keying: older checkpoints keep matching
            d.pop("noise_keys")
        return d
