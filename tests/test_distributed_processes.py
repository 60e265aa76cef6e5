"""The distributed private step on real gloo processes (loopback, started by torchrun)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import CASES_ON_PROCESSES, _batches, _model, _one_process, _private, _steps

from dpmf.train.config import TrainConfig
from dpmf.train.run import train

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _torchrun(args, tmp_path, nproc=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_gloo_processes_take_the_one_process_step(tmp_path):
    _torchrun([str(HERE / "distributed_worker.py"), "steps", str(tmp_path)], tmp_path)
    for name, kind, plan, dtype in CASES_ON_PROCESSES():
        ranks = [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=True) for r in (0, 1)]
        for a, b in zip(*ranks, strict=True):
            assert torch.equal(a, b), name  # identical on both ranks
        reference = _one_process(plan, kind, dtype, _batches(plan))
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        for a, b in zip(ranks[0], reference, strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    one = _private(_model(torch.float64), noise_keys="chunked")  # make_private(process_group=WORLD)
    _steps(one, 5)
    ranks = [torch.load(tmp_path / f"make_private.rank{r}.pt", weights_only=True) for r in (0, 1)]
    for a, b, c in zip(*ranks, one.model.parameters(), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c.detach(), rtol=1e-12, atol=1e-12)
    for r in (0, 1):
        assert "rank 1 differs from rank 0 in seed" in (tmp_path / f"seed.rank{r}.txt").read_text()


BASE = dict(
    dataset="digits",
    model="mlp",
    optimizer="dp-muon",
    factorization="bsr:4",
    scheme="fixed_order",
    batch_size=128,
    epsilon=3.0,
    seed=5,
    device="cpu",
)  # no noise_keys: chunked keys are the default, so one process and torchrun agree as they are


def _params(folder):
    return torch.load(Path(folder) / "model.pt", weights_only=True)


def test_torchrun_dpmf_train_equals_the_one_process_run(tmp_path):
    flags = [
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--optimizer",
        "dp-muon",
        "--factorization",
        "bsr:4",
        "--scheme",
        "fixed_order",
        "--batch-size",
        "128",
        "--epochs",
        "1",
        "--epsilon",
        "3",
        "--seed",
        "5",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--no-progress",
    ]
    _torchrun(["-m", "dpmf", "train", *flags, "--out", "two", "--distributed"], tmp_path)
    one = train(TrainConfig(**BASE, epochs=1), str(tmp_path / "one"), progress=False, log=lambda *a: None)
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["status"] == "complete"
    assert one.config.noise_keys == "chunked" and two["noise"]["keys"] == "chunked"
    assert two["processes"]["world_size"] == 2 and two["processes"]["mode"] == "sharded"
    assert two["privacy"]["epsilon"] == one.privacy.epsilon
    assert two["privacy"]["noise_multiplier"] == one.privacy.noise_multiplier
    a, b = _params(tmp_path / "two"), _params(tmp_path / "one")
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    # the noise state is split between the ranks: together that of one process
    per_rank = two["processes"]["noise_state_numel_per_rank"]
    assert sum(per_rank) == 3 * sum(v.numel() for v in b.values()) and max(per_rank) < sum(per_rank)
    assert two["noise"]["state_numel"] == sum(per_rank)  # the whole run's state, not rank 0's


def test_a_checkpoint_at_two_processes_resumes_in_one(tmp_path):
    config = TrainConfig(**BASE, epochs=2)
    _torchrun([str(HERE / "distributed_worker.py"), "train", "two", json.dumps(config.to_dict())], tmp_path)
    manifest = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert manifest["distributed"]["world_size"] == 2 and manifest["epoch"] == 1
    assert len(list((tmp_path / "two").glob("checkpoint.pt.rank*"))) == 2
    stream = config.replace(noise_keys="stream")
    with pytest.raises(ValueError, match="resume it with --noise-keys chunked"):
        train(stream, str(tmp_path / "two"), resume=True, progress=False, log=lambda *a: None)
    resumed = train(config, str(tmp_path / "two"), resume=True, progress=False, log=lambda *a: None)
    assert not list((tmp_path / "two").glob("checkpoint.pt.rank*"))  # replaced by one process's
    assert resumed.metrics[0]["epoch"] == 1 and len(resumed.metrics) == 2
    straight = train(config, str(tmp_path / "one"), progress=False, log=lambda *a: None)
    a, b = _params(tmp_path / "two"), _params(tmp_path / "one")
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    assert resumed.metrics[-1]["test_accuracy"] == pytest.approx(
        straight.metrics[-1]["test_accuracy"], abs=2e-3
    )
