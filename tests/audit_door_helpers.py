"""Shared by tests/test_audit_doors.py and tests/audit_worker.py (not a test module itself):
a tiny make_private run with white-box canaries."""

import torch
from torch import nn

SIGMA = 1.0811618495213209  # the tiny run's σ for ε = 4, δ = 1e-5 (calibrated by make_private)


def tiny_data(n=300, width=32, classes=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, width, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g)


def audited(seed, *, canaries=200, dtype=torch.float64, process_group=None, **kw):
    """``audit_make_private`` on a linear model (32 → 4) over 300 random examples."""
    from dpmf.audit.private_audit import audit_make_private

    model = nn.Linear(32, 4).to(dtype)
    g = torch.Generator().manual_seed(0)  # not torch's global generator: ranks run as threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=dtype))
    x, y = tiny_data(dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = dict(
        loss_fn=nn.functional.cross_entropy,
        batch_size=50,
        steps=12,
        target_epsilon=4.0,
        target_delta=1e-5,
        factorization="identity",
        scheme="fixed_order",
        seed=seed,
        process_group=process_group,
    )
    args.update(kw)
    return audit_make_private(model, opt, torch.utils.data.TensorDataset(x, y), canaries=canaries, **args)


def train(audit):
    """The user's loop over every step of the plan."""
    run = audit.private
    while run.steps_taken < run.plan.steps:
        for xb, yb in run.data_loader:
            run.backward(xb, target=yb, return_loss=False)
            run.optimizer.step()
            run.optimizer.zero_grad()
    return audit
