"""Flower's own strategy classes, by name.

``make_strategy`` returns an instance of ``flwr.serverapp.strategy.FedAvg``, ``FedMedian``,
``FedProx``, ``FedAdam`` or ``FedYogi``: dpmf drives them through their ``configure_train`` /
``aggregate_train`` and never re-implements their arithmetic. Every strategy trains on all
participating nodes each round (``fraction_train = 1``); the server evaluates the global model
itself (no federated evaluation).

Sources: McMahan et al. 2017 (FedAvg); Yin et al. 2018 (coordinate-wise median); Li et al. 2020
(FedProx); Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (FedAdam, FedYogi).
"""

from __future__ import annotations

import logging

from dpmf._validation import check_choice, check_real

__all__ = ["STRATEGIES", "MEAN_STRATEGIES", "make_strategy"]

STRATEGIES = ("fedavg", "fedmedian", "fedprox", "fedadam", "fedyogi")
MEAN_STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedyogi")  # aggregate a weighted mean


def make_strategy(
    name: str,
    num_nodes: int,
    *,
    proximal_mu: float = 0.01,
    server_lr: float | None = None,
    tau: float = 1e-3,
):
    """A Flower strategy object.

    Args:
        name: one of ``STRATEGIES``.
        num_nodes: the participating nodes (all train every round).
        proximal_mu: FedProx's μ ≥ 0.
        server_lr: η > 0 of FedAdam/FedYogi; None: Flower's defaults (0.1 and 0.01).
        tau: their adaptivity τ > 0.

    Raises:
        ValueError: unknown name or parameter out of range.
    """
    from flwr.serverapp import strategy as fs

    check_choice("strategy", name, STRATEGIES)
    mu = check_real("proximal_mu", proximal_mu, low=0.0)
    eta = (
        {} if server_lr is None else {"eta": check_real("server_lr", server_lr, low=0.0, low_inclusive=False)}
    )
    tau = check_real("tau", tau, low=0.0, low_inclusive=False)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    common = dict(
        fraction_train=1.0,
        fraction_evaluate=1.0,
        min_train_nodes=num_nodes,
        min_evaluate_nodes=num_nodes,
        min_available_nodes=num_nodes,
    )
    if name == "fedavg":
        return fs.FedAvg(**common)
    if name == "fedmedian":
        return fs.FedMedian(**common)
    if name == "fedprox":
        return fs.FedProx(**common, proximal_mu=mu)
    if name == "fedadam":
        return fs.FedAdam(**common, **eta, tau=tau)
    return fs.FedYogi(**common, **eta, tau=tau)
