"""The federated model and its non-private pieces (torch): weights as named numpy arrays,
plain local SGD (optionally with FedProx's proximal term), and evaluation.

The model is dpmf's ``MLP`` (flatten → linear → tanh → linear; no layer couples examples, so
the per-example clipping of the private steps applies). Weights cross the Flower boundary as an
ordered ``{name: ndarray}`` of float32 arrays.

Source of the proximal term: Li et al., "Federated Optimization in Heterogeneous Networks"
(FedProx), MLSys 2020, Eq. (2): the local objective ℓ(w) + (μ/2)·‖w − w_global‖².
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpmf._validation import check_int, check_real
from dpmf.train.models import MLP

__all__ = ["build_model", "get_weights", "set_weights", "evaluate", "local_sgd", "add_proximal_gradient"]


def build_model(input_shape, num_classes: int, *, hidden: int = 32, seed: int = 0) -> nn.Module:
    """A seeded ``MLP(input_shape, num_classes, hidden=(hidden,))``; ``input_shape`` (C, H, W)."""
    hidden = check_int("hidden", hidden, minimum=1)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(check_int("seed", seed, minimum=0))
    try:
        return MLP(tuple(input_shape), int(num_classes), hidden=(hidden,))
    finally:
        torch.random.set_rng_state(gen_state)


def get_weights(model: nn.Module) -> OrderedDict:
    """The model's parameters as ``{name: float32 ndarray}`` (copies), in parameter order."""
    return OrderedDict((k, p.detach().cpu().numpy().copy()) for k, p in model.named_parameters())


def set_weights(model: nn.Module, weights) -> None:
    """Load ``{name: ndarray}`` into the model's parameters (same names and shapes).

    Raises:
        ValueError: missing, extra or misshapen arrays.
    """
    params = dict(model.named_parameters())
    if set(params) != set(weights):
        raise ValueError(
            f"weights are invalid: names {sorted(weights)} differ from the model's {sorted(params)}"
        )
    with torch.no_grad():
        for k, p in params.items():
            w = np.asarray(weights[k])
            if w.shape != tuple(p.shape):
                raise ValueError(f"weights[{k!r}] has shape {w.shape}: the model expects {tuple(p.shape)}")
            p.copy_(torch.from_numpy(w.astype(np.float32, copy=False)))


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 2048) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    model.eval()
    correct, loss, n = 0, 0.0, int(y.shape[0])
    with torch.no_grad():
        for i in range(0, n, batch_size):
            xb = torch.from_numpy(x[i : i + batch_size])
            yb = torch.from_numpy(y[i : i + batch_size])
            out = model(xb)
            loss += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    model.train()
    return correct / max(n, 1), loss / max(n, 1)


def add_proximal_gradient(model: nn.Module, anchor, mu: float) -> None:
    """p.grad += μ·(p − anchor[p]) for every parameter: the gradient of (μ/2)‖w − w_global‖².

    It depends on the weights and the global model only, never on an example, so after a
    private gradient it is post-processing.
    """
    if mu == 0.0:
        return
    with torch.no_grad():
        for k, p in model.named_parameters():
            g = mu * (p - torch.from_numpy(np.asarray(anchor[k], dtype=np.float32)))
            p.grad = g if p.grad is None else p.grad + g


def local_sgd(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    proximal_mu: float = 0.0,
    rng: np.random.Generator,
) -> float:
    """``steps`` steps of minibatch SGD (no privacy) from the model's current weights.

    Batches are drawn uniformly without replacement within a step from ``rng``. Returns the
    mean training loss over the steps.
    """
    steps = check_int("steps", steps, minimum=1)
    lr = check_real("lr", lr, low=0.0, low_inclusive=False)
    anchor = get_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = int(y.shape[0])
    b = min(int(batch_size), n)
    total = 0.0
    for _ in range(steps):
        idx = np.sort(rng.choice(n, size=b, replace=False))
        out = model(torch.from_numpy(x[idx]))
        loss = F.cross_entropy(out, torch.from_numpy(y[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        add_proximal_gradient(model, anchor, proximal_mu)
        opt.step()
        total += float(loss.detach())
    return total / steps
