"""The registry of federated privacy modes: a new mode is one registered class, and the built-in
modes give the models and ε recorded before they became registry objects."""

import ast
import json
import math
import pathlib
import re

import numpy as np
import pytest
from recorded import assert_recorded, distance, fingerprint

pytest.importorskip("flwr")

from dpmf.federated.compliance import NoiseMap  # noqa: E402
from dpmf.federated.modes import (  # noqa: E402
    PRIVACY_MODES,
    ClientPart,
    PrivacyMode,
    ServerPart,
    privacy_modes,
    register_privacy_mode,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- a toy mode, registered for one test -------------------------------------------------------


class _Shift(ClientPart):
    """Every client replies w + 1, whatever its data."""

    def train(self, j, weights, steps, proximal_mu, server_round):
        return {k: np.asarray(v, dtype=np.float32) + 1 for k, v in weights.items()}, 1, float("nan")


class _Halve(ServerPart):
    """The server halves the aggregate; the released models never read a client's data: ε = 0."""

    def __init__(self, mode, server, key):
        super().__init__(mode, server, key)
        self.released = []
        self.entries = [
            mode.entry(
                self.config,
                subject="every client",
                epsilon=0.0,
                accountant="none",
                guarantee="upper_bound",
                noise_multiplier=0.0,
                steps=self.config.rounds,
                dataset_size=len(server.idx),
            )
        ]
        mode.parts.append(self)

    def after_aggregate(self, weights):
        out = {k: np.asarray(v, dtype=np.float32) / 2 for k, v in weights.items()}
        self.released.append(out)
        return out


class _Toy(PrivacyMode):
    name = "toy-halve"
    summary = "a test mode: clients reply w + 1, the server halves the mean"
    protects = "toy clients"
    note = "the released models do not depend on the clients' data"
    parts: list = []

    def server(self, server, key):
        return _Halve(self, server, key)

    def client(self, config, data, idx, sigmas, ids, key):
        return _Shift(self, config, data, idx, sigmas, ids, key)


@pytest.fixture
def toy():
    _Toy.parts = []
    register_privacy_mode(_Toy)
    try:
        yield _Toy
    finally:
        PRIVACY_MODES.pop(_Toy.name, None)


def test_a_registered_mode_runs_through_run_federated_and_its_model_is_the_hand_computation(toy):
    from dpmf.federated.run import FLConfig, run_federated

    cfg = FLConfig(num_clients=4, rounds=2, local_steps=1, privacy=toy.name, seed=5)
    result = run_federated(cfg, log=lambda *_: None)
    (part,) = toy.parts
    w0 = part.server.initial
    # FedAvg of four replies w + 1 is w + 1; halved: w_r = (w_{r-1} + 1)/2, so w_2 = w_0/4 + 3/4
    assert len(part.released) == 2
    for k, w in part.released[-1].items():
        np.testing.assert_allclose(w, np.asarray(w0[k], dtype=np.float64) / 4 + 0.75, rtol=1e-6, atol=1e-6)
    (entry,) = result.ledger
    assert (entry.mode, entry.protects, entry.epsilon, entry.steps, entry.dataset_size) == (
        "toy-halve", "toy clients", 0.0, 2, 4
    )  # fmt: skip
    assert entry.note.startswith("the released models do not depend")
    assert math.isnan(result.metrics[-1]["train_loss"])  # the toy's clients send no loss
    assert [m["round"] for m in result.metrics] == [0, 1, 2]


def test_a_registered_mode_is_a_choice_of_dpmf_fl_and_of_the_run_config(toy, tmp_path, capsys):
    from dpmf.cli import build_parser, main
    from dpmf.federated.app import config_from_run_config
    from dpmf.federated.run import FLConfig
    from dpmf.federated.runconfig import run_config_from_config

    fl = build_parser("fl")._subparsers._group_actions[0].choices["fl"]
    (privacy,) = [a for a in fl._actions if a.dest == "privacy"]
    assert privacy.help.startswith("aggregator|record|client|toy-halve")
    assert "toy-halve: a test mode" in privacy.help
    cfg = FLConfig(num_clients=4, rounds=1, privacy=toy.name, seed=2)
    assert config_from_run_config(run_config_from_config(cfg)) == cfg
    out = tmp_path / "run"
    args = ["fl", "--clients", "4", "--rounds", "1", "--privacy", toy.name, "--seeds", "0"]
    assert main([*args, "--out", str(out)]) == 0
    (seed,) = json.loads((out / "ledger.json").read_text())["seeds"]
    got = [(e["mode"], e["protects"], e["epsilon"]) for e in seed["entries"]]
    assert got == [("toy-halve", "toy clients", 0.0)]
    assert "ε = 0 at δ = 1e-05 for toy clients" in capsys.readouterr().out


def test_other_modes_refuse_their_settings_in_a_registered_mode_and_registration_is_checked(toy):
    from dpmf.federated.run import FLConfig

    with pytest.raises(ValueError, match="client_factorization/client_noise_multiplier are invalid with "
                       "privacy='toy-halve': they set client mode's noise"):  # fmt: skip
        FLConfig(num_clients=4, privacy=toy.name, client_factorization="bsr:2")
    with pytest.raises(ValueError, match="they set record mode's private local step"):
        FLConfig(num_clients=4, privacy=toy.name, local_scheme="cyclic_poisson")
    with pytest.raises(ValueError, match="server_noise=False is invalid"):
        FLConfig(num_clients=4, privacy=toy.name, server_noise=False)
    with pytest.raises(ValueError, match="toy-halve"):  # the allowed names come from the registry
        FLConfig(privacy="nope")
    with pytest.raises(ValueError, match="name='toy-halve' is invalid: must be non-empty and not yet"):
        register_privacy_mode(_Toy)
    with pytest.raises(TypeError, match="must be a PrivacyMode subclass"):
        register_privacy_mode(object)
    unitless = type("Unitless", (PrivacyMode,), {"name": "unitless"})
    with pytest.raises(ValueError, match="protects=''"):
        register_privacy_mode(unitless)
    assert "unitless" not in privacy_modes()


# -- the built-in modes: the models and ε recorded before the registry ---------------------------

# case → settings; (the fingerprint of the final model (tests/recorded.py, its weights in the
# order of their names), last test loss, ε per entry, rounds run, (protects, subject, steps) of
# the first entry). Recorded with seed 7, 4 clients, 2 rounds, 2 local steps from the code before
# the modes became registry objects (identical, bit for bit, after: the same sha256 of every final
# model), the fingerprints since (torch 2.13 on CPU, AVX2 kernels; Σw and ‖w‖₂ within 7e-8 ‖w‖₂
# of those first recorded on another CPU).
REFERENCE = {
    "aggregator-budget": (
        dict(privacy="aggregator", max_epsilon=7.0, rounds=4),
        ([3.6338517679012954, -1.5002247643860755, -0.301345897621759,
          -0.08265937914248206, 0.09611018568989259, 0.1452206641592277],
         0.21311107434724508, [6.489985762339637], 2,
         ("aggregator-dataset records", "aggregator dataset (N=46)", 8)),
    ),
    "aggregator-nonoise": (
        dict(privacy="aggregator", server_noise=False),
        ([3.5682524971029377, -1.6524285738978506, -0.31789048827515964,
          -0.0977341402433314, 0.10754682387292343, 0.14420178968583214],
         0.20522823668362802, [math.inf], 2,
         ("aggregator-dataset records", "aggregator dataset (N=46)", 8)),
    ),
    "record": (
        dict(privacy="record", local_batch_size=8),
        ([3.5374646491169854, -1.2636128023732454, -0.318197686419681,
          -0.13176755577375024, 0.1214166723786542, 0.14789431146439963],
         0.3847056271737082,
         [2.5936951005481834, 1.253206730269941, 1.0128701007744219, 1.3427736906088925], 2,
         ("records of client compliant-01", "compliant-01", 4)),
    ),
    "record-budget": (
        dict(privacy="record", local_batch_size=8, max_epsilon=0.45, rounds=4,
             noise_map=NoiseMap("linear", 2.0, 4.0)),
        ([3.6988220977775432, -1.6464968576910906, -0.32650819418029525,
          -0.1619083004087743, 0.1286738385375272, 0.17522729354873035],
         0.37224358006527547,
         [0.3969682661014891, 0.27437358480102836, 0.24568262995261053, 0.28427346315522384], 2,
         ("records of client compliant-01", "compliant-01", 4)),
    ),
    "client": (
        dict(privacy="client", strategy="fedadam", client_clip=0.5),
        ([4.998254822718554, 0.03362972591244695, -0.12354014771270355,
          -0.2800010832507587, 0.10994678249491575, -0.06824095448262074],
         0.43032264709472656, [4.758577373475432], 2,
         ("client", "each of the 4 participating clients", 2)),
    ),
    "client-poisson": (
        dict(privacy="client", client_sampling="poisson", clients_per_round=2, client_noise_multiplier=1.0,
             rounds=3),
        ([29.125803434763306, -20.237168554915115, 0.5238704958315485,
          -0.6359472352962674, -0.9106147572998716, -0.4678034447501524],
         0.5462086995442709, [5.84084363713471], 3,
         ("client", "each of the 4 participating clients", 3)),
    ),
    "client-budget": (
        dict(privacy="client", max_epsilon=8.0, rounds=4, client_noise_multiplier=1.0),
        ([11.821238591130465, 6.86390800990921, -0.0556196442050959,
          -0.5974802761923612, 0.5661469042062846, -0.166169211766174],
         0.7286680790415981, [6.572970067036906], 2,
         ("client", "each of the 4 participating clients", 2)),
    ),
    "client-bisr": (
        dict(privacy="client", client_factorization="bsr:2", eval_fraction=0.2),
        ([15.418476401395395, 9.780888653593138, 0.09269710064594794,
          -0.6640557768914385, 1.0608175781385039, -0.0733927978377383],
         1.6923861587256717, [4.758577373475432], 2,
         ("client", "each of the 4 participating clients", 2)),
    ),
}  # fmt: skip


# Measured with ``distance``: the fingerprints' spread between the AVX2 and the scalar kernels
# (ATEN_CPU_CAPABILITY=default), at one and two threads, is at most 1.1e-7 (aggregator-budget);
# perturbed runs move them by: one local step fewer 5.4e-4 (client-bisr) to 0.12, σ × 1.1 7.7e-3
# (client) to 0.31 (aggregator-nonoise has no noise), seed 8 0.52 to 2.7. The tolerance is 45× the
# largest spread, 100× below the nearest perturbed run. The test loss: spread 8.6e-8 relative.
TOLERANCE = 5e-6


def _final_model(settings, monkeypatch):
    """The fingerprint of the final global model of a 4-client run with ``settings``, and the run."""
    from dpmf.federated import run as run_mod
    from dpmf.federated.run import FLConfig, run_federated

    seen = {}
    evaluate = run_mod._Server._evaluate

    def spy(self, weights):
        seen["w"] = {k: np.asarray(v, dtype=np.float64).copy() for k, v in weights.items()}
        return evaluate(self, weights)

    monkeypatch.setattr(run_mod._Server, "_evaluate", spy)
    cfg = FLConfig(**{"num_clients": 4, "rounds": 2, "local_steps": 2, "seed": 7, **settings})
    result = run_federated(cfg, log=lambda *_: None)
    return fingerprint({k: seen["w"][k] for k in sorted(seen["w"])}), result


@pytest.mark.recorded
@pytest.mark.parametrize("case", sorted(REFERENCE))
def test_each_mode_gives_the_recorded_model_and_epsilon(case, monkeypatch):
    settings, (recorded, loss, eps, rounds, first) = REFERENCE[case]
    got, result = _final_model(settings, monkeypatch)
    assert_recorded(got, recorded, TOLERANCE)
    assert result.metrics[-1]["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert len(result.metrics) - 1 == rounds
    got = [e.epsilon for e in result.ledger]
    if settings["privacy"] == "record":  # since recorded: each client's PLD on a 1e-3 grid, an upper
        # bound of the recorded (1e-4 grid) value, within 1e-4 of it
        assert all(r <= g <= r * (1 + 1e-4) for g, r in zip(got, eps, strict=True)), (got, eps)
    else:
        assert got == pytest.approx(eps, rel=1e-9)
    e = result.ledger[0]
    assert (e.mode, e.protects, e.subject, e.steps) == (settings["privacy"], *first)


@pytest.mark.parametrize("case, change", [("client-bisr", dict(local_steps=1)), ("client", dict(seed=8))])
def test_one_step_fewer_or_another_seed_is_outside_the_recorded_tolerance(case, change, monkeypatch):
    settings, (recorded, *_) = REFERENCE[case]
    got, _ = _final_model({**settings, **change}, monkeypatch)
    assert distance(got, recorded) > 10 * TOLERANCE


# -- the shape of the code ---------------------------------------------------------------------


def _sources():
    return [
        *sorted((ROOT / "dpmf" / "federated").glob("*.py")),
        *sorted((ROOT / "dpmf" / "cli").glob("*.py")),
    ]


def test_no_function_of_train_federated_or_the_cli_is_longer_than_80_lines():
    long = []
    for path in [*sorted((ROOT / "dpmf" / "train").glob("*.py")), *_sources()]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.name}:{node.name} ({n} lines)")
    assert not long, long


def test_no_code_outside_the_mode_objects_switches_on_a_modes_name():
    pattern = re.compile(r"""(privacy|mode)\s*(==|!=|\bin\b|\bnot in\b)\s*[\(\["']""")
    hits = []
    for path in _sources():
        if path.name == "modes.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.name}:{i}: {line.strip()}")
    assert not hits, hits


def test_client_mode_noise_follows_the_global_models_key_order_not_a_replys():
    # dpmf fl --privacy client: a reply listing its arrays in another order gets the same noise
    # coordinates on each array as the others (else the mean's noise shrinks); other keys are refused
    from types import SimpleNamespace

    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    from dpmf.federated.grid import server_identity
    from dpmf.federated.hooks import AuditHooks
    from dpmf.federated.modes import _ClientServer

    shapes = {"w": (2, 3), "b": (3,)}
    nu = np.arange(1.0, 10.0)  # the round's noise on the sum, 9 coordinates
    fake = SimpleNamespace(
        config=SimpleNamespace(client_clip=1.0),
        noise=SimpleNamespace(next=lambda: nu.copy()),
        audit=AuditHooks(),  # no audit: the hooks change nothing
    )
    arrays = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in shapes.items()})

    def reply(keys):
        rec = ArrayRecord({k: Array(np.zeros(shapes[k], np.float32)) for k in keys})
        content = RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": 7})})
        return Message(content=content, dst_node_id=0, message_type="train")

    with server_identity():
        out = _ClientServer.privatize(fake, [reply(["w", "b"]), reply(["b", "w"])], arrays, 1)
        for msg in out:  # every reply: w gets ν[0:6]/2, b gets ν[6:9]/2
            np.testing.assert_array_equal(msg.content["arrays"]["w"].numpy(), (nu[:6] / 2).reshape(2, 3))
            np.testing.assert_array_equal(msg.content["arrays"]["b"].numpy(), nu[6:] / 2)
        bad = [reply(["w", "b"]), reply(["w"])]
        with pytest.raises(
            ValueError, match=r"round 1: the reply of node \d+ is invalid: .*missing arrays \['b'\]"
        ):
            _ClientServer.privatize(fake, bad, arrays, 1)
