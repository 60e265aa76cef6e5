"""Hostile-user reproducers (round 4): each test names a weakness found in the current code.

Every test asserts what the code should do. The weaknesses fixed are plain tests; one not fixed
is marked ``xfail(strict=True)``: a fix turns it into an unexpected pass, which then needs the
mark removed.
"""

import copy
import pickle

import pytest
import torch

import dpmf
from dpmf.optim.clipping import clipped_sum
from dpmf.train.hf import causal_lm_loss

pytestmark = pytest.mark.torch

VOCAB, T = 100, 8


def gpt2(lora=True):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra hf)")
    peft = pytest.importorskip("peft", reason="peft is not installed (extra hf)")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    if lora:
        config = peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True
        )
        model = peft.get_peft_model(model, config)
    return model.eval()


class DictData(torch.utils.data.Dataset):
    """A Hugging Face-style map-style data set of dicts (not a TensorDataset)."""

    def __init__(self, n=32, order=None):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (n, T), generator=g)
        self.order = list(range(n)) if order is None else list(order)

    def __len__(self):
        return len(self.order)

    def __getitem__(self, i):
        ids = self.ids[self.order[i]]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def private_run(model=None, data=None, **kw):
    model = gpt2() if model is None else model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    args = dict(
        loss_fn=causal_lm_loss(),
        batch_size=8,
        steps=4,
        noise_multiplier=1.0,
        factorization="identity",
        scheme="poisson",
        seed=3,
    )
    args.update(kw)
    return dpmf.make_private(model, opt, DictData() if data is None else data, **args)


# -- make_private: resume into another (reordered) data set -----------------------------------------
# Weakness: the run state's data digest is None for every data set that is not a TensorDataset
# (a dict data set, as Hugging Face data usually is), so load_state_dict/resume accept another
# data set of the same size — here the same examples in another order, which moves each person
# to another index and so to other steps of the sampler (under cyclic schemes, past min-sep).
# The docstring promises "ValueError: … another plan or data".
def test_resume_refuses_a_reordered_dict_data_set(tmp_path):
    first = private_run()
    first.backward(next(iter(first.data_loader)), return_loss=False)
    first.optimizer.step()
    path = str(tmp_path / "run.pt")
    first.save(path)
    reordered = private_run(data=DictData(order=range(31, -1, -1)))
    with pytest.raises(ValueError, match="data"):
        reordered.resume(path)


# -- clipping: ghost mode under bf16 autocast exceeds ζ ------------------------------------------------
# Weakness: clipped_sum's docstring says "the clipping bound is exact for the vectors whose norms
# are taken, so the sensitivity is ζ whatever the precision"; with clipping="ghost" under bf16
# autocast the sum comes from a second backward whose bf16 rounding differs from the vectors
# whose norms were taken, and one example's clipped gradient has norm ≈ 1.001·ζ (bk: 1 + 6e-8).
def test_ghost_clipping_under_bf16_autocast_keeps_each_example_within_zeta():
    model, loss, zeta = gpt2(), causal_lm_loss(), 1e-3
    data = DictData(8)
    worst = 0.0
    for i in range(6):
        x, y = loss.split(
            {k: v.unsqueeze(0) for k, v in data[i].items()}
        )  # one example: sum = its clipped grad
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = clipped_sum(model, loss, x, y, clip_norm=zeta, clipping="ghost")
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in out.grads)))
        worst = max(worst, norm / zeta)
    assert worst <= 1 + 1e-5  # float32 rounding of the sum, not bf16's


# -- make_private: the private optimizer cannot be copied -------------------------------------------
# Weakness: copy.deepcopy(run.optimizer) (and pickle.loads of its pickle, which pickle.dumps and
# torch.save write without complaint) crash inside torch with "AttributeError: 'PrivateOptimizer'
# object has no attribute 'original'" instead of a one-line TypeError naming the fix (as
# Privatizer and the sampler do).
def test_copying_the_private_optimizer_fails_with_a_one_line_type_error():
    private = private_run()
    with pytest.raises(TypeError, match="PrivateOptimizer"):
        copy.deepcopy(private.optimizer)
    with pytest.raises(TypeError, match="PrivateOptimizer"):
        pickle.loads(pickle.dumps(private.optimizer))


# -- mechanisms: a Factorization subclass whose noise layout is not C⁻¹ --------------------------------
# Weakness: PrivatePlan checks a given Factorization's ``noise`` field against C⁻¹, but the noise
# stream comes from ``noise_layout()``, which a subclass may override (BLT does). A subclass whose
# layout streams 0.1·C⁻¹Z is accepted: the plan reports the sensitivity and ε of C⁻¹Z while the
# run adds a tenth of that noise.
def test_a_factorization_whose_noise_layout_is_not_c_inverse_is_refused():
    from dpmf.mechanisms.factorizations import Factorization
    from dpmf.mechanisms.registry import factorize
    from dpmf.mechanisms.streaming import ToeplitzInverseLayout
    from dpmf.plan.plan import PrivatePlan
    from dpmf.workloads.workload import prefix_sum

    n = 16
    base = factorize(prefix_sum(n), "sqrt_prefix")

    class Quiet(Factorization):
        def noise_layout(self, mode=None):
            lay = super().noise_layout(mode)
            return ToeplitzInverseLayout(lay.steps, lay.coeffs * 0.1, lay.row_scale, lay.col_scale, lay.mode)

    quiet = Quiet(base.name, base.bands, base.workload, base.C)
    kw = dict(dataset_size=160, batch_size=10, steps=n, scheme="fixed_order", noise_multiplier=1.0)
    honest = PrivatePlan(strategy=base, **kw).noise(4000, 7).next()
    try:
        plan = PrivatePlan(strategy=quiet, **kw)
    except ValueError:
        return
    got = plan.noise(4000, 7).next()
    # the first step's noise is Z_0·(C⁻¹)_00 for both: the accounting's noise would be equal
    assert float(got.std()) == pytest.approx(float(honest.std()), rel=1e-6)


# -- workloads: an inverse-power γ so small that the schedule is NaN ----------------------------------
# Weakness: Schedule("inverse_power", gamma=1e-17) is accepted (γ > 0), but values() divides
# 0/0 ((t^−γ − n^−γ)/(1 − n^−γ) with n^−γ == 1.0 in float64): χ is NaN with a RuntimeWarning,
# and `dpmf curves --schedule inverse_power --gamma 1e-17` fails later with "chi is invalid:
# contains NaN or infinite entries", which names neither gamma nor the allowed range.
def test_inverse_power_with_a_tiny_gamma_is_refused_or_finite():
    import numpy as np

    from dpmf.workloads.schedules import Schedule

    try:
        sched = Schedule("inverse_power", beta=0.5, gamma=1e-17)
    except ValueError as err:
        assert "gamma" in str(err)
        return
    chi = sched.values(5)
    assert np.all(np.isfinite(chi)) and np.all(np.diff(chi) <= 0)


# -- federated: CorrelatedClientDP releases the clients' metrics without noise -------------------------
def _flower_app(reply):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg, context):
        j = int(context.node_config["partition-id"])
        w = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        arrays, metrics = reply(j, w)
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                              "metrics": MetricRecord(metrics)})  # fmt: skip
        return Message(content=content, reply_to=msg)

    return app


def _one_round(dp, app, clients):
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from dpmf.federated.grid import LocalGrid, server_identity

    grid = LocalGrid(app, clients)
    shapes = {"w": (2, 3), "b": (3,)}
    with server_identity():
        arrays = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in shapes.items()})
        return dp.aggregate_train(
            1, grid.send_and_receive(dp.configure_train(1, arrays, ConfigRecord({}), grid))
        )


def _fedavg(p):
    from flwr.serverapp import strategy as fs

    return fs.FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=p, min_available_nodes=p)


# Weakness: aggregate_train passes every client's MetricRecord to the wrapped FedAvg, which returns
# their (weighted) mean next to dp-client-epsilon: a client statistic (here a training loss, one
# client's 1e6 sets it alone) is released with no clipping or noise, outside the reported ε.
def test_client_level_wrapper_does_not_release_the_clients_metrics_without_noise():
    pytest.importorskip("flwr")
    from dpmf.federated.wrappers import EPSILON_KEY, CorrelatedClientDP

    losses = [3.25, 7.5, 1e6]
    app = _flower_app(lambda j, w: (w, {"num-examples": 10, "train-loss": losses[j]}))
    dp = CorrelatedClientDP(_fedavg(3), num_clients=3, rounds=2, noise_multiplier=1.0, clip_norm=0.5)
    _, metrics = _one_round(dp, app, 3)
    assert EPSILON_KEY in metrics
    assert "train-loss" not in metrics, f"released without noise: train-loss={metrics['train-loss']}"


# Weakness: each reply's update is flattened in the order of the reply's own ArrayRecord keys and
# gets noise[off:off+size] in that order. A client that sends its arrays in another key order
# (its right: an ArrayRecord is a mapping) gets other noise coordinates on each array than the
# others, so the mean's noise is an average of different slices: here 0.61× the norm of the
# plan's noise (less private than the ε reported). The noise must follow the global model's keys.
def test_client_level_noise_does_not_depend_on_a_replys_key_order():
    pytest.importorskip("flwr")
    import numpy as np

    from dpmf import seeds
    from dpmf.federated.local import ClientLevelNoise
    from dpmf.federated.wrappers import CorrelatedClientDP

    def reply(j, w):  # no update; client 0 lists its arrays in reverse order
        keys = list(w)[::-1] if j == 0 else list(w)
        return {k: w[k].copy() for k in keys}, {"num-examples": 10}

    dp = CorrelatedClientDP(_fedavg(3), num_clients=3, rounds=2, noise_multiplier=1.0, clip_norm=0.5, seed=7)
    agg, _ = _one_round(dp, _flower_app(reply), 3)
    ref = ClientLevelNoise(3, 2, noise_multiplier=1.0, clip_norm=0.5, delta=1e-5, factorization="identity",
                           dim=9, seed=seeds.child_key(7, "fl-client-noise"))  # fmt: skip
    want = ref.next() / 3
    got = np.concatenate([agg["w"].numpy().ravel(), agg["b"].numpy().ravel()])
    np.testing.assert_allclose(got, want, atol=1e-6)


# -- dpmf fl: --seeds with a huge range is expanded before any check ----------------------------------
# Weakness: parse_seeds("0-1000000000") builds the whole list: `dpmf fl --seeds 0-1000000000`
# was killed by the OOM killer (rc 137) instead of exiting 2 with a one-line error. Run here in a
# subprocess under a 4 GB address-space limit with 10¹² seeds (MemoryError at once).
def test_a_huge_seed_range_is_refused_with_a_value_error():
    import subprocess
    import sys

    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from dpmf.federated.report import parse_seeds\n"
        "try:\n    parse_seeds('0-1000000000000')\n"
        "except ValueError as e:\n    print('ValueError', e)\n"
        "except BaseException as e:\n    print(type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("ValueError") and "seeds" in out.stdout, out.stdout + out.stderr[-300:]


# -- make_private: a trainable parameter the forward does not use, under the default clipping -----------
# Weakness: with clipping="auto" (the default) or "bk", a trainable parameter that the forward never
# uses (an unused head, a LoRA adapter after peft's merge_adapter()) makes backward crash inside
# clipped_sum with a bare "KeyError: 'unused.weight'"; "ghost" and "vmap" give it a zero
# per-example gradient (then noise), as every mode should (or refuse it in one line up front).
@pytest.mark.parametrize("clipping", ["auto", "bk"])
def test_an_unused_trainable_parameter_gets_noise_only_under_bk(clipping):
    import torch.nn.functional as F
    from torch import nn

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    torch.manual_seed(0)
    model = TwoHeads()
    private = dpmf.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy, batch_size=8,
        steps=2, noise_multiplier=1.0, factorization="identity", scheme="poisson", seed=1, clipping=clipping,
    )  # fmt: skip
    x, y = next(iter(private.data_loader))
    private.backward(x, target=y, return_loss=False)
    grad = model.unused.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and float(grad.abs().max()) > 0  # the noise


# -- Flower run config: values converted with int()/bool() before any check ---------------------------
# Weakness: config_from_run_config converts each key with its type's constructor: bool("false") is
# True (compliant-only silently inverted), int(2.9) is 2 (rounds silently truncated), and
# int("abc") / int(nan) raise "invalid literal for int() with base 10: 'abc'" naming no key.
@pytest.mark.parametrize(
    "key, value",
    [("compliant-only", "false"), ("rounds", 2.9), ("rounds", "abc"), ("seed", float("nan"))],
)
def test_flower_run_config_refuses_values_that_int_or_bool_would_coerce(key, value):
    pytest.importorskip("flwr")
    from dpmf.federated.app import config_from_run_config

    cfg = {"dataset": "breast-cancer", "clients": 2, "rounds": 2, key: value}
    try:
        config = config_from_run_config(cfg)
    except ValueError as err:
        assert key in str(err) or key.replace("-", "_") in str(err), str(err)
        return
    if key == "compliant-only":
        assert config.compliant_only is False
    else:
        pytest.fail(f"{key}={value!r} was accepted as {config.rounds!r}")


# -- make_private: a collate_fn that couples the examples of a batch -----------------------------------
# Weakness: make_private refuses BatchNorm because it couples examples, but accepts a collate_fn
# that does the same to the inputs (here: centring each batch on its mean; in-batch mixup is
# another). Every example's input then depends on every other example of the batch, so one
# example moves all B clipped gradients: the sensitivity is no longer ζ. backward accepts the
# batch (its fingerprints are those of the coupled batch the loader yielded). A check such as
# collate_fn([dataset[i]]) against row i of the batch would see it.
def test_a_collate_fn_that_couples_the_examples_is_refused():
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data._utils.collate import default_collate

    def centred(batch):
        x, y = default_collate(batch)
        return x - x.mean(0, keepdim=True), y

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with pytest.raises((ValueError, RuntimeError), match="collate"):
        private = dpmf.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.cross_entropy, batch_size=8,
            steps=2, noise_multiplier=1.0, factorization="identity", scheme="poisson", seed=1,
            collate_fn=centred,
        )  # fmt: skip
        x, y = next(iter(private.data_loader))
        private.backward(x, target=y, return_loss=False)
