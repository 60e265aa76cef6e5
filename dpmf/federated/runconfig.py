"""The Flower run config (``[tool.flwr.app.config]``) of a federated run: the keys, named as
``dpmf fl``'s flags, and the run config of an ``FLConfig`` (``run_config_from_config``; the
inverse, ``dpmf.federated.app.config_from_run_config``, builds the ``FLConfig``)."""

from __future__ import annotations

import math
import re

__all__ = ["parse_run_config_value", "run_config_from_config", "run_config_keys"]

# run-config key → (FLConfig field, type), besides the privacy modes' own (``run_config_keys``)
_COMMON_KEYS = {
    "dataset": ("dataset", str),
    "data-file": ("data_file", str),
    "clients": ("num_clients", int),
    "rounds": ("rounds", int),
    "strategy": ("strategy", str),
    "privacy": ("privacy", str),
    "allocation": ("allocation", str),
    "compliant-only": ("compliant_only", bool),
    "partition": ("partition", str),
    "alpha": ("alpha", float),
    "local-steps": ("local_steps", int),
    "local-batch-size": ("local_batch_size", int),
    "local-lr": ("local_lr", float),
    "clip-norm": ("clip_norm", float),
    "proximal-mu": ("proximal_mu", float),
    "fedopt-eta": ("fedopt_eta", float),
    "hidden": ("hidden", int),
    "delta": ("delta", float),
    "accountant": ("accountant", str),
    "max-epsilon": ("max_epsilon", float),
    "shards": ("shards", int),
    "aggregator-fraction": ("aggregator_fraction", float),
    "replica": ("replica", int),
    "eval-fraction": ("eval_fraction", float),
}


def run_config_keys() -> dict:
    """Run-config key → (``FLConfig`` field, type): the common keys and every registered privacy
    mode's options (``dpmf.federated.modes``; the key is the option's flag without ``--``)."""
    from dpmf.federated.modes import PRIVACY_MODES

    keys = dict(_COMMON_KEYS)
    for mode in PRIVACY_MODES.values():
        keys.update({o.key: (o.field, o.kind) for o in mode.options})
    return keys


_MAP_KEYS = ("noise-map", "sigma-min", "sigma-max")
_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def parse_run_config_value(key: str, value, kind: type):
    """The run-config ``value`` of ``key`` as ``kind`` (int, float, bool or str), strictly.

    A Flower run config is TOML (or ``flwr run --run-config``): its values arrive typed. An int
    key takes an int or the text of one ("3"), never a float (2.9 is not truncated to 2) or a
    bool; a bool key takes a bool or "true"/"false" (any case), never another text (``bool``
    of "false" is True); a float key takes a finite int or float, or the text of one (NaN and
    ±∞ are refused: no key's range holds them); a str key takes a str.

    Raises:
        ValueError: a value of another type or out of that range (one line naming the key, the
            value, what is allowed and the fix).
    """
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        allowed = "a bool: true or false (TOML booleans, or the strings 'true'/'false')"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
            return int(value.strip())
        allowed = "an integer (e.g. 3, or the string '3'; not a float, a bool or other text)"
    elif kind is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if number is not None and math.isfinite(number):
            return number
        allowed = "a finite number (not NaN, ±inf, a bool or other text)"
    elif kind is str:
        if isinstance(value, str):
            return value
        allowed = "a string (quote it in the TOML)"
    else:  # pragma: no cover - the registry's kinds are these four
        return kind(value)
    raise ValueError(f"run config {key}={value!r} is invalid: must be {allowed}; set {key} to such a value")


def run_config_from_config(config) -> dict:
    """The Flower run config of an ``FLConfig`` (the inverse of ``config_from_run_config``).

    Raises:
        ValueError: a table noise map (the run config holds linear/exponential maps only).
    """
    if config.noise_map.kind == "table":
        raise ValueError(
            "noise_map kind 'table' is invalid in a Flower run config: use linear or exponential"
        )
    out = {}
    for key, (field, _) in run_config_keys().items():
        value = getattr(config, field)
        if value is not None:
            out[key] = value
    out["noise-map"] = config.noise_map.kind
    out["sigma-min"], out["sigma-max"] = config.noise_map.sigma_min, config.noise_map.sigma_max
    out["seed"] = -1 if config.seed is None else config.seed
    if config.data_file is not None:  # the app runs in another folder
        import os

        out["data-file"] = os.path.abspath(config.data_file)
    return out
