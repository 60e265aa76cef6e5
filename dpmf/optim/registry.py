"""The optimizer registry: one entry per DP optimizer, read by every consumer.

An ``OptimizerSpec`` holds everything the rest of dpmf needs to know about an optimizer: its
command-line name (``dp-muon-bc``), the parameter-group rule it stands for (``muon_bc``), the
factory of its stage chain (``dpmf.optim.optimizers.dp_muon_bc``), the group hyperparameters
that factory takes, its default learning rate, and whether it applies Newton–Schulz (then it
updates matrices only, the 1-D parameters by the DP-SGD rule) or draws random probes (then
``dpmf train`` gives it a seed of its own). ``DPOptimizer`` builds a group's chain from the
entry of its rule; ``TrainConfig`` takes its choices and default learning rates from here;
``dpmf.train.build.build_optimizer``, ``dpmf.federated`` and the command line read the same
entries. Adding an optimizer is one ``register_optimizer`` call.

This module imports no torch: the built-in entries name their factories as
``"module:function"``, resolved on first use, so that a configuration can be validated without
loading torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dpmf._validation import check_choice, check_real

__all__ = [
    "OptimizerSpec",
    "OPTIMIZERS",
    "register_optimizer",
    "unregister_optimizer",
    "get_optimizer",
    "optimizer_names",
    "spec_of_rule",
    "rule_names",
    "matrix_rule_names",
    "default_lr",
    "DEFAULT_LR",
]

_FACTORIES = "dpmf.optim.optimizers"


@dataclass(frozen=True)
class OptimizerSpec:
    """One DP optimizer.

    Attributes:
        name: the command-line and ``TrainConfig.optimizer`` name, e.g. ``"dp-muon-bc"``.
        rule: the parameter-group rule, e.g. ``"muon_bc"`` (a group with ``rule=...``).
        transform: the factory of the stage chain, called as
            ``transform(weight_decay=…, filter=…, **{k: group[k] for k in hyperparameters})``
            and returning a ``dpmf.optim.transforms.Transform``; a callable, or
            ``"module:function"`` imported on first use.
        hyperparameters: the group keys passed to ``transform`` besides ``weight_decay`` and
            ``filter``, when the group has them (otherwise the factory's own defaults apply).
        default_lr: the base learning rate of ``dpmf train`` when ``lr`` is not given, > 0.
        newton_schulz: True: the rule orthogonalizes matrices (parameters with a proper
            matrix view); a model's other parameters get the DP-SGD rule with heavy-ball
            momentum, and ``dpmf train`` passes ``muon_beta`` as ``beta``.
        probes: True: the chain draws random probes (DP-MuonBC), seeded by ``probe_seed``.
        summary: one line for help texts.
    """

    name: str
    rule: str
    transform: Callable | str
    hyperparameters: tuple[str, ...] = ()
    default_lr: float = 0.1
    newton_schulz: bool = False
    probes: bool = False
    summary: str = ""

    def __post_init__(self):
        for key in ("name", "rule"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key}={value!r} is invalid: must be a non-empty string")
        if not (callable(self.transform) or (isinstance(self.transform, str) and ":" in self.transform)):
            raise TypeError(
                f"transform={self.transform!r} is invalid: must be a callable or 'module:function'"
            )
        object.__setattr__(self, "hyperparameters", tuple(self.hyperparameters))
        object.__setattr__(
            self,
            "default_lr",
            check_real("default_lr", self.default_lr, low=0.0, low_inclusive=False),
        )

    def factory(self) -> Callable:
        """The stage-chain factory (imported on first use when given as a path)."""
        if callable(self.transform):
            return self.transform
        module, _, attr = self.transform.partition(":")
        return getattr(importlib.import_module(module), attr)

    def make_transform(self, group: dict, filter=None):
        """The stage chain of a parameter group of this rule.

        Raises:
            ValueError / TypeError: invalid hyperparameters (from the factory).
        """
        kwargs = {k: group[k] for k in self.hyperparameters if k in group}
        return self.factory()(weight_decay=group.get("weight_decay", 0.0), filter=filter, **kwargs)


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec, *, replace: bool = False) -> OptimizerSpec:
    """Add ``spec`` to the registry (by its name; its rule must be new too).

    Returns:
        ``spec`` (so the call can be used as an expression).

    Raises:
        TypeError: not an ``OptimizerSpec``.
        ValueError: the name or the rule is taken (unless ``replace``), or the rule is one of
            the placeholders ``auto``/``matrix``/``vector``.
    """
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(f"spec={spec!r} is invalid: must be a dpmf.optim.registry.OptimizerSpec")
    if spec.rule in ("auto", "matrix", "vector"):
        raise ValueError(f"rule={spec.rule!r} is invalid: it is a placeholder rule; choose another name")
    if not replace:
        if spec.name in OPTIMIZERS:
            raise ValueError(f"optimizer {spec.name!r} is already registered (pass replace=True)")
        taken = {s.rule: s.name for s in OPTIMIZERS.values()}
        if spec.rule in taken:
            raise ValueError(f"rule={spec.rule!r} is invalid: optimizer {taken[spec.rule]!r} already has it")
    OPTIMIZERS[spec.name] = spec
    return spec


def unregister_optimizer(name: str) -> OptimizerSpec:
    """Remove and return the entry ``name`` (for tests and plug-ins).

    Raises:
        ValueError: no such optimizer.
    """
    return OPTIMIZERS.pop(check_choice("optimizer", name, OPTIMIZERS))


def get_optimizer(name: str) -> OptimizerSpec:
    """The entry of the optimizer ``name``.

    Raises:
        ValueError: an unknown name (listing the registered ones).
    """
    return OPTIMIZERS[check_choice("optimizer", name, OPTIMIZERS)]


def optimizer_names() -> tuple[str, ...]:
    """The registered optimizer names, in registration order."""
    return tuple(OPTIMIZERS)


def default_lr(name: str) -> float:
    """The default base learning rate of optimizer ``name``."""
    return get_optimizer(name).default_lr


class _DefaultLearningRates(Mapping):
    """name → default learning rate of every registered optimizer (a live, read-only view)."""

    def __getitem__(self, name):
        if name not in OPTIMIZERS:
            raise KeyError(name)
        return OPTIMIZERS[name].default_lr

    def __iter__(self):
        return iter(tuple(OPTIMIZERS))

    def __len__(self):
        return len(OPTIMIZERS)

    def __repr__(self):
        return repr(dict(self))


#: name → default learning rate, read from the registry.
DEFAULT_LR: Mapping[str, float] = _DefaultLearningRates()


def rule_names() -> tuple[str, ...]:
    """The parameter-group rules of the registered optimizers."""
    return tuple(s.rule for s in OPTIMIZERS.values())


def matrix_rule_names() -> tuple[str, ...]:
    """The rules that apply Newton–Schulz (matrices only)."""
    return tuple(s.rule for s in OPTIMIZERS.values() if s.newton_schulz)


def spec_of_rule(rule: str) -> OptimizerSpec:
    """The entry whose group rule is ``rule``.

    Raises:
        ValueError: an unknown rule (listing the registered ones).
    """
    check_choice("rule", rule, rule_names())
    return next(s for s in OPTIMIZERS.values() if s.rule == rule)


_MUON = ("beta", "lookahead", "ns_steps", "ns_coefficients")

# Base learning rates that work for the small CNN on Fashion-MNIST with ζ = 1 (the private
# gradient is a mean of clipped gradients, so its norm is at most ≈ ζ): DP-SGD with momentum
# 0.9 and B = 512 reaches 86 % at ε = 3 in 10 epochs; DP-Muon with B = 1024 likewise.
register_optimizer(
    OptimizerSpec(
        "dp-sgd",
        "sgd",
        f"{_FACTORIES}:dp_sgd",
        ("momentum", "nesterov"),
        default_lr=0.5,
        summary="DP-SGD with heavy-ball momentum",
    )
)
register_optimizer(
    OptimizerSpec(
        "dp-adam",
        "adam",
        f"{_FACTORIES}:dp_adam",
        ("betas", "eps", "decoupled_weight_decay"),
        default_lr=2e-3,
        summary="DP-Adam",
    )
)
register_optimizer(
    OptimizerSpec(
        "dp-muon",
        "muon",
        f"{_FACTORIES}:dp_muon",
        _MUON,
        default_lr=0.05,
        newton_schulz=True,
        summary="DP-Muon (Newton–Schulz on matrices)",
    )
)
register_optimizer(
    OptimizerSpec(
        "dp-muon-s",
        "muon_s",
        f"{_FACTORIES}:dp_muon_s",
        _MUON + ("power_iterations",),
        default_lr=0.05,
        newton_schulz=True,
        summary="DP-Muon scaled by the momentum's spectral norm",
    )
)
register_optimizer(
    OptimizerSpec(
        "dp-muon-bc",
        "muon_bc",
        f"{_FACTORIES}:dp_muon_bc",
        _MUON + ("order", "probes", "antithetic"),
        default_lr=0.05,
        newton_schulz=True,
        probes=True,
        summary="DP-MuonBC (bias-corrected Newton–Schulz)",
    )
)
