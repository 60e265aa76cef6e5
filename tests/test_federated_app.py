"""The Flower app (``dpmf.federated.app``: module-level ServerApp and ClientApp) on Flower's
in-process grid gives what ``dpmf fl`` gives with the same settings: the same ε and, with a
seed, the same test accuracies round by round."""

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from dpmf.federated.app import app, clientapp, config_from_run_config  # noqa: E402
from dpmf.federated.grid import LocalGrid, server_identity  # noqa: E402
from dpmf.federated.run import run_federated  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {"clients": 4, "rounds": 2, "local-steps": 1, "sigma-min": 2.0, "sigma-max": 4.0, "seed": 0}


def _run_app(run_config):
    grid = LocalGrid(clientapp, run_config["clients"], run_config=run_config)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with server_identity():
        app(grid, ctx)
    return ctx.state.config_records["dpmf-ledger"]


@pytest.mark.parametrize(
    "extra",
    [
        {"privacy": "client", "strategy": "fedadam", "client-factorization": "bisr:2"},
        {"privacy": "record", "local-batch-size": 8},
    ],
)
def test_the_app_equals_dpmf_fl_with_the_same_settings(extra):
    rc = {**BASE, **extra}
    got = _run_app(rc)
    ref = run_federated(config_from_run_config(rc), log=lambda *_: None)
    assert list(got["epsilon"]) == [e.epsilon for e in ref.ledger]
    assert list(got["protects"]) == [e.protects for e in ref.ledger]
    assert list(got["test-accuracy"]) == [m["test_accuracy"] for m in ref.metrics]


def test_unknown_run_config_keys_are_named():
    with pytest.raises(ValueError, match=r"run config keys \['num-rounds'\] are invalid"):
        config_from_run_config({"num-rounds": 3})


def test_run_config_values_are_parsed_strictly_for_their_keys_type():
    import pathlib

    import tomllib

    example = pathlib.Path(__file__).parents[1] / "examples" / "flower" / "pyproject.toml"
    rc = tomllib.loads(example.read_text())["tool"]["flwr"]["app"]["config"]
    cfg = config_from_run_config(rc)  # the example's values parse as they are
    assert (cfg.rounds, cfg.num_clients, cfg.seed, cfg.client_factorization) == (
        rc["rounds"],
        rc["clients"],
        0,
        "bisr:4",
    )
    # the forms a typed TOML value or a `--run-config` string may take
    cfg = config_from_run_config(
        {"rounds": "3", "compliant-only": "TRUE", "alpha": "0.25", "sigma-min": 1, "seed": "-1"}
    )
    assert (cfg.rounds, cfg.compliant_only, cfg.alpha, cfg.noise_map.sigma_min, cfg.seed) == (
        3,
        True,
        0.25,
        1.0,
        None,
    )
    assert config_from_run_config({"compliant-only": "False"}).compliant_only is False
    for key, value, allowed in [
        ("compliant-only", 1, "a bool"),
        ("compliant-only", "no", "a bool"),
        ("rounds", True, "an integer"),
        ("rounds", 3.0, "an integer"),
        ("alpha", float("inf"), "a finite number"),
        ("sigma-max", float("nan"), "a finite number"),
        ("dataset", 3, "a string"),
    ]:
        with pytest.raises(
            ValueError, match=rf"^run config {key}={value!r} is invalid: must be {allowed}"
        ) as err:
            config_from_run_config({key: value})
        assert "\n" not in str(err.value)


# -- Flower run config: values checked for their key's type, not converted with int()/bool() ----------
# config_from_run_config refuses, naming the key, what its type's constructor would coerce:
# bool("false") is True (compliant-only silently inverted), int(2.9) is 2 (rounds silently
# truncated), and int("abc") / int(nan) raise "invalid literal for int() with base 10: 'abc'" naming
# no key.
@pytest.mark.torch
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
