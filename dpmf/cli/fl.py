"""``dpmf fl``: compliance-aware federated learning on Flower (the optional extra ``fl``); its
settings flags are the common ones and those of every registered privacy mode. Flower and torch
are imported when the command runs, not before.
"""

from __future__ import annotations

import os
import sys

from dpmf.cli._common import UsageError, _accountants, _csv_list

_FL_FLAGS = (
    # (flag, FLConfig field, type, help); defaults are FLConfig's
    ("--data-file", "data_file", str, "the MedMNIST .npz (pneumoniamnist[_S].npz, breastmnist[_S].npz, ...)"),
    ("--partition", "partition", str, "iid|dirichlet|shards (default iid)"),
    ("--alpha", "alpha", float, "Dirichlet concentration α > 0 (default 0.5)"),
    ("--shards", "shards", int, "label shards per client (default 2)"),
    ("--aggregator-fraction", "aggregator_fraction", float, "share of the stand-ins held out for the server"),
    ("--local-steps", "local_steps", int, "local steps per round L (default 5)"),
    ("--local-batch-size", "local_batch_size", int, "local (expected) batch size (default 16)"),
    ("--local-lr", "local_lr", float, "local learning rate (default 0.1)"),
    ("--clip-norm", "clip_norm", float, "per-example clip norm ζ (record and aggregator modes; default 1)"),
    ("--proximal-mu", "proximal_mu", float, "FedProx μ (default 0.01)"),
    ("--fedopt-eta", "fedopt_eta", float, "FedAdam/FedYogi server learning rate (default Flower's)"),
    ("--hidden", "hidden", int, "hidden width of the MLP (default 32)"),
    ("--delta", "delta", float, "δ of every ε (default 1e-5)"),
    (
        "--accountant",
        "accountant",
        str,
        lambda: (
            f"{'|'.join(_accountants(poisson=True))} (default pld). Cost per accounting (record "
            "mode: one per distinct σ and sampling rate, in background processes while the clients "
            "train), 250 steps at sampling rate 0.62: pld 0.1-0.5 s (a 1e-3 grid; 16 distinct clients "
            "add about nothing to the run), prv 4-14 s (30x pld; 16 distinct clients on 2 cores: "
            "0.5-2 min, the run waits for them), rdp 0.1 s with ε 13-30 %% larger"
        ),
    ),
    ("--max-epsilon", "max_epsilon", float, "privacy budget: stop before the round whose ε would exceed it"),
    ("--eval-fraction", "eval_fraction", float, "share of each client's records held out for evaluation"),
)


def _fl_flags() -> tuple:
    """``dpmf fl``'s settings flags: the common ones, then every registered privacy mode's
    options (``dpmf.federated.modes``), as (flag, FLConfig field, type, help)."""
    from dpmf.federated.modes import PRIVACY_MODES

    return _FL_FLAGS + tuple(tuple(o) for mode in PRIVACY_MODES.values() for o in mode.options)


def _privacy_help() -> str:
    from dpmf.federated.modes import PRIVACY_MODES

    modes = "; ".join(f"{name}: {mode.summary}" for name, mode in PRIVACY_MODES.items())
    return f"{'|'.join(PRIVACY_MODES)} (default aggregator). {modes}"


def _add_fl(sub):
    p = sub.add_parser(
        "fl",
        help="compliance-aware federated learning on Flower (needs the extra fl)",
        description="Federated training on Flower with compliance-dependent noise; every ε is "
        "reported with what it protects (aggregator-dataset records, records of client k, client).",
    )
    p.add_argument(
        "--dataset",
        default="breast-cancer",
        help="breast-cancer|fashion-mnist-2|pneumoniamnist|breastmnist|medmnist",
    )
    p.add_argument("--clients", type=int, default=16, help="number of clients K (default 16)")
    p.add_argument("--rounds", type=int, default=50, help="rounds R (default 50)")
    p.add_argument("--strategy", default="fedavg", help="fedavg|fedmedian|fedprox|fedadam|fedyogi")
    p.add_argument("--privacy", default="aggregator", help=_privacy_help())
    p.add_argument(
        "--compliance", default=None, help="YAML of the clients' compliance profiles (default: example)"
    )
    p.add_argument(
        "--criteria-weights",
        default=None,
        help="weights of the five criteria, e.g. hipaa=0.3,gdpr=0.3,nist=0.2,iso=0.1,hl7_fhir=0.1 "
        "(default: the file's, else equal)",
    )
    p.add_argument("--compliant-only", action="store_true", help="train with the compliant clients only")
    p.add_argument(
        "--allocation", default="weighted", help="weighted (σ_k from scores) | uniform (equal mean)"
    )
    p.add_argument("--noise-map", default="linear", help="linear|exponential|table (score -> σ)")
    p.add_argument("--sigma-min", type=float, default=0.8, help="σ at score 1 (default 0.8)")
    p.add_argument("--sigma-max", type=float, default=2.0, help="σ at score 0 (default 2.0)")
    p.add_argument("--noise-table", default=None, help="for --noise-map table: 0:2.0,0.5:1.2,0.8:0.8")
    p.add_argument(
        "--seeds",
        default=None,
        help="reproducible seeds, a range 0-4 or a list 0,1,2 (their noise is predictable to whoever "
        "knows them); default: secret keys",
    )
    p.add_argument(
        "--replicas", type=int, default=None, help="replicas with secret keys, numbered 0..N-1 (default 1)"
    )
    p.add_argument("--backend", default="local", help="local (in-process, deterministic) | ray")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1; with 1, record mode steps its clients in one process "
        "per usable core, the same results)",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run's files in --out (its ledger is lost)",
    )
    for flag, _, kind, text in _fl_flags():
        p.add_argument(flag, type=kind, default=None, help=text() if callable(text) else text)
    return p


def _noise_table(text: str) -> tuple:
    rows = []
    for item in _csv_list(text, name="--noise-table"):
        t, _, s = item.partition(":")
        try:
            rows.append((float(t), float(s)))
        except ValueError:
            raise UsageError(
                f"--noise-table {text!r} is invalid: give threshold:sigma pairs, e.g. 0:2,0.8:0.8"
            ) from None
    return tuple(rows)


def _criteria_weights(text: str) -> dict:
    out = {}
    for item in _csv_list(text, name="--criteria-weights"):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UsageError(
                f"--criteria-weights {text!r} is invalid: give name=weight pairs, e.g. hipaa=0.3"
            ) from None
    return out


def _run_fl(args) -> int:
    from dpmf._validation import check_int
    from dpmf.federated.report import parse_seeds

    threads = _fl_preflight(args)
    noise_map = _fl_noise_map(args)
    if args.seeds is not None and args.replicas is not None:
        raise UsageError(
            "--seeds and --replicas are exclusive: give seeds (reproducible) or replicas (secret keys)"
        )
    seeds = None if args.seeds is None else parse_seeds(args.seeds)
    replicas = 1 if args.replicas is None else check_int("replicas", args.replicas, minimum=1)
    weights = None
    if args.criteria_weights is not None:
        from dpmf.federated.compliance import check_weights

        weights = check_weights(_criteria_weights(args.criteria_weights))
    _fl_files(args)
    config = _fl_config(args, noise_map)
    compliance = _fl_compliance(args, weights, config.num_clients)
    from dpmf.federated.run import start_ahead

    # the first run's background work (record mode: its accountings) runs while torch loads
    start_ahead(config.replace(seed=None if seeds is None else seeds[0], replica=0), compliance,
                backend=args.backend)  # fmt: skip
    import torch

    torch.set_num_threads(threads)
    from dpmf.federated.report import run_seeds, summarize

    try:
        results = run_seeds(
            config, seeds, replicas=replicas, out_dir=args.out, compliance=compliance, backend=args.backend
        )
    except (ImportError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    print(summarize(results))
    print(f"wrote {args.out}/{{metrics.csv, ledger.json, summary.csv}}")
    return 0


def _fl_preflight(args) -> int:
    """The backend's name and the thread count (returned) of ``dpmf fl``."""
    from dpmf._validation import check_choice, check_int

    check_choice("backend", args.backend, ("local", "ray"))
    return check_int("threads", args.threads, minimum=1)


def _fl_noise_map(args):
    """The score → σ map of ``--noise-map``/``--sigma-min``/``--sigma-max``/``--noise-table``."""
    from dpmf.federated.compliance import NoiseMap

    if args.noise_map == "table":
        if args.noise_table is None:
            raise UsageError("--noise-map table needs --noise-table (e.g. 0:2.0,0.5:1.2,0.8:0.8)")
        return NoiseMap("table", table=_noise_table(args.noise_table))
    if args.noise_table is not None:
        raise UsageError("--noise-table needs --noise-map table")
    return NoiseMap(args.noise_map, args.sigma_min, args.sigma_max)


def _fl_files(args) -> None:
    """The input files exist, Flower is installed, and ``--out`` holds no earlier ledger (unless
    ``--overwrite``)."""
    if args.compliance is not None and not os.path.isfile(args.compliance):
        raise UsageError(f"--compliance {args.compliance!r} is invalid: no such file")
    if args.data_file is not None and not os.path.isfile(args.data_file):
        raise UsageError(f"--data-file {args.data_file!r} is invalid: no such file")
    import importlib.util

    # found, not imported (the run imports it; a module set to None in sys.modules is absent)
    if sys.modules.get("flwr", ...) is None or importlib.util.find_spec("flwr") is None:
        raise UsageError("Flower is not installed: pip install 'dpmf[fl]' (flwr==1.42.0, Python >= 3.11)")
    if not args.overwrite and os.path.exists(os.path.join(args.out, "ledger.json")):
        raise UsageError(
            f"--out {args.out!r} is invalid: it holds an earlier federated run (ledger.json), whose "
            "privacy ledger would be lost; choose another folder, or pass --overwrite"
        )


def _fl_config(args, noise_map):
    """The ``FLConfig`` of the flags (the settings flags given override its defaults; options that
    the partition or strategy ignores are refused first)."""
    from dpmf.federated.checks import flag_conflicts
    from dpmf.federated.run import FLConfig

    overrides = {
        field: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, field, _, _ in _fl_flags()
    }
    flag_conflicts(
        [k for k, v in overrides.items() if v is not None],
        partition=overrides["partition"] or "iid",
        strategy=args.strategy,
    )
    return FLConfig(
        dataset=args.dataset,
        num_clients=args.clients,
        rounds=args.rounds,
        strategy=args.strategy,
        privacy=args.privacy,
        compliant_only=args.compliant_only,
        allocation=args.allocation,
        noise_map=noise_map,
        **{k: v for k, v in overrides.items() if v is not None},
    )


def _fl_compliance(args, weights, num_clients: int):
    """The clients' profiles: ``--compliance``'s file, the example's with ``--criteria-weights``,
    or None (the example)."""
    if args.compliance is not None:
        from dpmf.federated.compliance import load_profiles

        return load_profiles(args.compliance, weights=weights)
    if weights is None:
        return None
    from dpmf.federated.compliance import ComplianceSet, example_profiles

    ex = example_profiles(num_clients)
    return ComplianceSet(ex.profiles, weights, ex.compliant_threshold, source="example")


COMMANDS = [("fl", _add_fl, _run_fl)]
