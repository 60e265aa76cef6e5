"""dpmf pick on worker processes: the same ranking, σ, errors and skips for every ``jobs``."""

import json

import pytest

from dpmf.cli import main
from dpmf.pick import default_jobs, pick
from dpmf.workloads import Schedule

# N = 1000, B = 100: 10 steps per epoch, 3 epochs; at most 2 bands, so that the optimized
# bsr_opt:2, bisr_opt:2, blt:2 and lcgd_opt are built in the workers (dense left out: slow)
RUN = dict(dataset_size=1000, batch_size=100, steps=30, epsilon=4.0, delta=1e-5, max_bands=2)
SCHED = Schedule("exponential", 0.1)
ARGV = ["pick", "--dataset-size", "1000", "--batch-size", "100", "--steps", "30", "--epsilon", "4"]
ARGV += ["--delta", "1e-5", "--schedule", "exponential", "--beta", "0.1", "--max-bands", "2"]
ARGV += ["--dense-max-steps", "1", "--no-progress"]


def _without_seconds(d: dict) -> dict:
    d = dict(d)
    d.pop("seconds")
    d["ranking"] = [{k: v for k, v in e.items() if k != "seconds"} for e in d["ranking"]]
    d["recommendation"] = {k: v for k, v in d["recommendation"].items() if k != "seconds"}
    return d


@pytest.fixture(scope="module")
def in_process():
    return pick(**RUN, schedule=SCHED, dense_max_steps=1, progress=False, jobs=1)


def test_two_workers_give_the_in_process_result(in_process):
    two = pick(**RUN, schedule=SCHED, dense_max_steps=1, progress=False, jobs=2)
    assert _without_seconds(two.to_dict()) == _without_seconds(in_process.to_dict())
    names = {e.factorization for e in two.ranking}
    assert {"bsr_opt:2", "bisr_opt:2", "blt:2", "lcgd_opt", "identity"} <= names
    # one σ per event: cyclic Poisson's is fixed by the bands, fixed order's by the run
    sigmas: dict = {}
    for e in two.ranking:
        sigmas.setdefault((e.scheme, e.bands if e.scheme == "cyclic_poisson" else 0), set()).add(
            e.noise_multiplier
        )
    assert all(len(s) == 1 for s in sigmas.values())
    assert len(sigmas[("cyclic_poisson", 2)] | sigmas[("fixed_order", 0)]) == 2


def test_cli_jobs_two_prints_the_in_process_json(in_process, capsys):
    assert main(ARGV + ["--json", "--jobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = json.loads(json.dumps(in_process.to_dict()))  # tuples as JSON lists
    assert _without_seconds(out) == _without_seconds(expected)


def test_jobs_validated_before_work(capsys):
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises((ValueError, TypeError), match="jobs"):
            pick(**RUN, schedule=SCHED, jobs=bad)
    assert main(ARGV + ["--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert "jobs=0" in err and len(err.strip().splitlines()) == 1
    assert default_jobs() >= 1
