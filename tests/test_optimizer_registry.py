"""The optimizer registry: one entry per optimizer, read by the config, the builder and the CLI.

An optimizer registered here (sign descent, p ← p − lr·sign(g)) becomes usable by ``dpmf
train``'s configuration and optimizer construction without editing any other file.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dpmf.optim import optimizers as optimizers_module
from dpmf.optim.registry import (
    DEFAULT_LR,
    OPTIMIZERS,
    OptimizerSpec,
    get_optimizer,
    optimizer_names,
    register_optimizer,
    unregister_optimizer,
)
from dpmf.optim.transforms import AddDecayedWeights, Transform, chain
from dpmf.train.build import build_optimizer
from dpmf.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class Sign(Transform):
    def update(self, update, state, param, ctx):
        return torch.sign(update), state


def sign_descent(weight_decay=0.0, filter=None):
    return chain(filter, Sign(), AddDecayedWeights(weight_decay))


@pytest.fixture
def sign_registered():
    spec = register_optimizer(
        OptimizerSpec("dp-sign", "sign", sign_descent, default_lr=0.25, summary="sign descent")
    )
    try:
        yield spec
    finally:
        unregister_optimizer("dp-sign")


def test_the_builtin_entries_hold_the_four_names_of_each_optimizer():
    assert optimizer_names() == ("dp-sgd", "dp-adam", "dp-muon", "dp-muon-s", "dp-muon-bc")
    bc = get_optimizer("dp-muon-bc")
    assert (bc.rule, bc.factory(), bc.newton_schulz, bc.probes) == (
        "muon_bc",
        optimizers_module.dp_muon_bc,
        True,
        True,
    )
    assert dict(DEFAULT_LR) == {
        "dp-sgd": 0.5,
        "dp-adam": 2e-3,
        "dp-muon": 0.05,
        "dp-muon-s": 0.05,
        "dp-muon-bc": 0.05,
    }
    assert optimizers_module.RULES == ("sgd", "adam", "muon", "muon_s", "muon_bc")
    assert optimizers_module.MATRIX_RULES == ("muon", "muon_s", "muon_bc")


def test_a_registered_optimizer_is_usable_by_the_train_config_and_builder(sign_registered):
    model = nn.Sequential(nn.Linear(3, 2))
    cfg = TrainConfig(dataset="digits", optimizer="dp-sign", weight_decay=0.0, seed=0)
    assert cfg.base_lr == 0.25  # the registry's default learning rate
    opt = build_optimizer(cfg, model)
    assert {g["rule"] for g in opt.param_groups} == {"sign"}
    before = [p.detach().clone() for p in model.parameters()]
    grads = [torch.tensor([[1.0, -2.0, 0.5], [-0.1, 0.0, 3.0]]), torch.tensor([-4.0, 0.2])]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    opt.bind(SimpleNamespace(fresh_noise_std=0.0, check_gradients=lambda *_: None, consume=lambda: None))
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.25 * torch.sign(g))


def test_unregistered_names_are_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match="optimizer='dp-sign' is invalid: must be one of dp-sgd, dp-adam"):
        TrainConfig(dataset="digits", optimizer="dp-sign")


def test_the_cli_help_lists_a_registered_optimizer(sign_registered, capsys):
    from dpmf.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    assert "dp-sgd|dp-adam|dp-muon|dp-muon-s|dp-muon-bc|dp-sign" in capsys.readouterr().out.replace("\n", "")


def test_registering_a_taken_name_or_rule_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer(OptimizerSpec("dp-sgd", "other", sign_descent))
    with pytest.raises(ValueError, match="rule='muon' is invalid: optimizer 'dp-muon' already has it"):
        register_optimizer(OptimizerSpec("dp-other", "muon", sign_descent))
    with pytest.raises(ValueError, match="placeholder"):
        register_optimizer(OptimizerSpec("dp-other", "auto", sign_descent))
    with pytest.raises(ValueError, match="default_lr"):
        OptimizerSpec("dp-other", "other", sign_descent, default_lr=0.0)
    assert "dp-other" not in OPTIMIZERS
