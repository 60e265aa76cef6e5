"""Parameter routing and learning-rate schedules of the DP optimizers."""

import numpy as np
import pytest
import torch
from torch import nn

from dpmf.optim import (
    DPSGD,
    DPAdam,
    DPMuon,
    DPMuonBC,
    LearningRateSchedule,
    lr_scheduler,
    route_parameters,
    rule_of,
)
from dpmf.workloads import SCHEDULES, Schedule, lr_scheduled


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.hidden = nn.Linear(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 5)

    def forward(self, x, tokens):
        h = self.norm(self.conv(x)).flatten(1)[:, :16] + self.embed(tokens).repeat(1, 4)
        return self.head(torch.relu(self.frozen(self.hidden(h))))


def _rules(groups):
    return {name: g["rule"] for g in groups for name, _ in g["params"]}


def test_default_routing_uses_placeholders_by_shape():
    rules = _rules(route_parameters(Net()))
    assert rules == {
        "embed.weight": "matrix",
        "conv.weight": "matrix",
        "conv.bias": "vector",
        "norm.weight": "vector",
        "norm.bias": "vector",
        "hidden.weight": "matrix",
        "hidden.bias": "vector",
        "head.weight": "matrix",
        "head.bias": "vector",
    }  # frozen.* left out


def test_routing_embeddings_head_and_explicit_rules():
    net = Net()
    groups = route_parameters(
        net,
        embeddings="adam",
        head="sgd",
        rules={"hidden.bias": "adam"},
        options={"adam": {"lr": 1e-3}, "sgd": {"momentum": 0.5}},
    )
    rules = _rules(groups)
    assert rules["embed.weight"] == "adam"
    assert rules["head.weight"] == "sgd" and rules["head.bias"] == "sgd"
    assert rules["conv.weight"] == rules["hidden.weight"] == "matrix"
    assert rules["norm.weight"] == "vector" and rules["hidden.bias"] == "adam"
    by_rule = {g["rule"]: g for g in groups}
    assert by_rule["adam"]["lr"] == 1e-3 and by_rule["sgd"]["momentum"] == 0.5
    # A matrix rule for the head keeps its bias on the vector rule.
    rules = _rules(route_parameters(net, head="muon_s", embeddings="muon"))
    assert rules["head.weight"] == "muon_s" and rules["head.bias"] == "vector"
    assert rules["embed.weight"] == "muon"


def test_optimizers_resolve_the_placeholders():
    net = Net()
    groups = route_parameters(net, embeddings="adam")
    expected = {
        DPMuon: ("muon", "sgd"),
        DPMuonBC: ("muon_bc", "sgd"),
        DPSGD: ("sgd", "sgd"),
        DPAdam: ("adam", "adam"),
    }
    for cls, (matrix, vector) in expected.items():
        opt = cls(route_parameters(net, embeddings="adam"), lr=0.1, allow_unprivatized=True)
        assert rule_of(opt.param_groups, "conv.weight") == matrix
        assert rule_of(opt.param_groups, "head.weight") == matrix
        assert rule_of(opt.param_groups, "norm.weight") == vector
        assert rule_of(opt.param_groups, "embed.weight") == "adam"
        trainable = {n for n, p in net.named_parameters() if p.requires_grad}
        assert {n for g in opt.param_groups for n in g["param_names"]} == trainable
    assert len(groups) == 3


def test_dp_muon_vector_lr_and_auto_split():
    net = Net()
    opt = DPMuon(
        net.parameters(), lr=0.02, vector_lr=0.5, allow_unprivatized=True
    )  # frozen ones included, as torch
    assert [(g["rule"], g["lr"], len(g["params"])) for g in opt.param_groups] == [
        ("muon", 0.02, 5),
        ("sgd", 0.5, 6),
    ]
    assert len(DPSGD(net.parameters(), lr=0.1, allow_unprivatized=True).param_groups) == 1


def test_routing_with_named_parameters_and_its_errors():
    net = Net()
    named = list(net.named_parameters())
    rules = _rules(
        route_parameters(
            named,
            head="adam",
            head_names=["head.weight", "head.bias"],
            embeddings="sgd",
            embedding_names=["embed.weight"],
        )
    )
    assert rules["head.weight"] == rules["head.bias"] == "adam"
    assert rules["embed.weight"] == "sgd"
    with pytest.raises(ValueError, match="head_names"):
        route_parameters(named, head="adam")
    with pytest.raises(ValueError, match="not parameters"):
        route_parameters(net, rules={"nope.weight": "sgd"})
    with pytest.raises(ValueError, match="matrix_rule='lion'"):
        route_parameters(net, matrix_rule="lion")
    with pytest.raises(ValueError, match="vector_rule='muon'"):
        route_parameters(net, vector_rule="muon")
    with pytest.raises(TypeError, match="nn.Module"):
        route_parameters([torch.ones(3)])
    with pytest.raises(ValueError, match="no nn.Linear"):
        route_parameters(nn.Conv2d(1, 2, 3), head="adam")


def test_routing_refuses_degenerate_matrix_for_explicit_matrix_rule():
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(6, 1, 1))
    model.weight = nn.Parameter(torch.ones(6, 4))
    with pytest.raises(ValueError, match=r"'scale'.*\(6, 1, 1\)"):
        route_parameters(model, matrix_rule="muon")
    groups = route_parameters(model, matrix_rule="muon", rules={"scale": "sgd"})
    assert _rules(groups) == {"scale": "sgd", "weight": "muon"}
    with pytest.raises(ValueError, match=r"'scale'.*\(6, 1, 1\)"):  # placeholder: the optimizer
        DPMuon(route_parameters(model), lr=0.1, allow_unprivatized=True)


# --- learning-rate schedules ------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_drives_steps_as_the_workload_a_chi(name):
    n, eta = 9, 0.3
    schedule = Schedule(name, beta=0.2)
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = DPSGD([p], lr=eta, allow_unprivatized=True)
    sched = lr_scheduler(opt, schedule, n)
    grads = torch.randn(n, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    chi = schedule.values(n)
    A = lr_scheduled(chi).dense()  # A_χ = A₁·diag(χ) from the workloads module
    for t in range(n):
        assert opt.param_groups[0]["lr"] == pytest.approx(eta * chi[t], rel=1e-15)
        p.grad = grads[t].clone()
        opt.step()
        sched.step()
        expected = -eta * (A[t] @ grads.numpy())  # θ_t = θ₀ − η·(A_χ G)_t
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(LearningRateSchedule(schedule, n).workload().schedule_values, chi)


def test_learning_rate_schedule_bounds_and_state_dict(tmp_path):
    schedule = LearningRateSchedule(Schedule("cosine", beta=0.1), 5)
    np.testing.assert_array_equal(schedule.multipliers, Schedule("cosine", beta=0.1).values(5))
    assert schedule(0) == 1.0 and schedule(4) == pytest.approx(0.1) and schedule(5) == schedule(4)
    with pytest.raises(ValueError, match="step=6"):
        schedule(6)
    with pytest.raises(TypeError, match="Schedule"):
        LearningRateSchedule("cosine", 5)
    with pytest.raises(ValueError, match="steps"):
        LearningRateSchedule(Schedule("linear", beta=0.5), 0)
    p = nn.Parameter(torch.zeros(2))
    opt = DPSGD([p], lr=1.0, allow_unprivatized=True)
    with pytest.raises(ValueError, match="steps is required"):
        lr_scheduler(opt, Schedule("linear", beta=0.5))
    with pytest.raises(ValueError, match="steps=4"):
        lr_scheduler(opt, schedule, 4)
    sched = lr_scheduler(opt, schedule)
    for _ in range(2):
        opt.step()
        sched.step()
    path = tmp_path / "sched.pt"
    torch.save(sched.state_dict(), path)
    saved = torch.load(path, weights_only=True)  # plain data only
    opt2 = DPSGD([p], lr=1.0, allow_unprivatized=True)
    sched2 = lr_scheduler(opt2, LearningRateSchedule(Schedule("cosine", beta=0.1), 5))
    sched2.load_state_dict(saved)
    sched2.step()
    sched.step()
    assert sched2.get_last_lr() == sched.get_last_lr()
