"""Federated evaluation on the clients' held-out splits: the per-round federated accuracy is
the held-out-count-weighted mean of each client's accuracy of the global model (recomputed
here), reported beside the central test accuracy; the default run is unchanged."""

import numpy as np
import pytest

pytest.importorskip("flwr")

from dpmf.federated.run import FLConfig, run_federated  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_federated_accuracy_is_the_weighted_mean_of_the_clients_held_out_accuracies():
    import dpmf.federated.run as run_mod
    from dpmf.federated.data import load_federated
    from dpmf.federated.evaluation import split_held_out
    from dpmf.federated.models import build_model, evaluate, set_weights

    cfg = FLConfig(num_clients=4, rounds=2, local_steps=1, privacy="client", eval_fraction=0.2, seed=1)
    seen = []
    orig = run_mod._Server._federated_evaluation

    def spy(self, r, arrays, grid):
        seen.append({k: a.numpy().copy() for k, a in arrays.items()})
        return orig(self, r, arrays, grid)

    run_mod._Server._federated_evaluation = spy
    try:
        res = run_federated(cfg, log=lambda *_: None)
    finally:
        run_mod._Server._federated_evaluation = orig
    data = split_held_out(load_federated("breast-cancer", 4, seed=1), 0.2, 1)
    sizes = [int(y.shape[0]) for y in data.eval_y]
    assert sizes == [int(np.ceil(0.2 * (n + m))) for n, m in zip(data.client_sizes(), sizes, strict=True)]
    for r, weights in enumerate(seen, start=1):
        model = build_model(data.input_shape, data.num_classes, hidden=cfg.hidden, seed=cfg.public_seed)
        set_weights(model, weights)
        accs = [evaluate(model, x, y)[0] for x, y in zip(data.eval_x, data.eval_y, strict=True)]
        want = float(np.dot(accs, sizes) / sum(sizes))
        assert res.metrics[r]["federated_accuracy"] == pytest.approx(want, abs=1e-12)
        assert "test_accuracy" in res.metrics[r]
    assert "held-out records" in res.ledger[0].note
    # the default (no held-out split) trains on all records: record-mode N_k unchanged
    plain = run_federated(FLConfig(num_clients=4, rounds=1, local_steps=1, seed=1), log=lambda *_: None)
    assert "federated_accuracy" not in plain.metrics[1]
