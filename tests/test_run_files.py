"""The files of a run: secrets are private (0600 from creation), an earlier run is never
replaced silently, a corrupted checkpoint is refused by name, a failed write or a SIGTERM
leaves every file agreeing with the last checkpoint written, and ``--resume`` needs a
checkpoint."""

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpmf
from dpmf.cli import main
from dpmf.train.checkpoint import load_checkpoint, save_checkpoint
from dpmf.train.config import TrainConfig
from dpmf.train.data import load_dataset
from dpmf.train.metrics import read_metrics_csv
from dpmf.train.models import build_model
from dpmf.train.run import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
QUIET = {"progress": False, "log": lambda *a: None}
TRAIN = ["train", "--dataset", "digits", "--model", "mlp", "--batch-size", "256", "--no-progress"]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-epoch run at ε = 3, written under umask 0o022."""
    old = os.umask(0o022)
    try:
        out = tmp_path_factory.mktemp("done") / "run"
        assert main([*TRAIN, "--epochs", "1", "--epsilon", "3", "--seed", "5", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    return out


# --- 1. files holding secrets are 0600; shareable outputs follow the umask ---------------------


def test_checkpoint_is_0600_and_shareable_outputs_follow_the_umask(finished):
    assert _mode(finished / "checkpoint.pt") == 0o600
    for name in ("results.json", "metrics.csv", "curves.png", "model.pt", "privacy.json"):
        assert _mode(finished / name) == 0o644, name


def test_checkpoint_is_private_while_it_is_written_and_after_a_replace(tmp_path, umask_022, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    path.write_text("an older world-readable file")
    os.chmod(path, 0o644)
    seen = []
    real_save = torch.save

    def spy(obj, f, *a, **k):
        seen.append(_mode(f.fileno()) if hasattr(f, "fileno") else _mode(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", spy)
    save_checkpoint(path, {"secret": {"seed": 12345}, "x": torch.ones(3)})
    assert seen == [0o600]  # the temporary file, while the secret is being written
    assert _mode(path) == 0o600  # the replaced file too (a new inode)


def test_make_private_save_is_0600(tmp_path, umask_022):
    d = load_dataset("digits")
    model = build_model("mlp", d.input_shape, d.num_classes, seed=0)
    private = dpmf.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TensorDataset(d.train_x, d.train_y),
        loss_fn=F.cross_entropy,
        batch_size=256,
        epochs=1,
        noise_multiplier=1.0,
        target_delta=1e-5,
        factorization="identity",
    )
    private.save(str(tmp_path / "state.pt"))
    assert _mode(tmp_path / "state.pt") == 0o600


def test_distributed_shards_and_manifest_are_0600(tmp_path, umask_022):
    from dpmf.train.shards import save_sharded

    class One:  # the collectives of a one-process group
        rank, world_size = 0, 1

        def barrier(self):
            pass

    state = {
        "step": 4,
        "noise": [{"buffer": torch.randn(3)}],
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": []},
        "secret": {"seed": 77},
    }
    save_sharded(str(tmp_path / "checkpoint.pt"), state, One(), mode="sharded", seed_digest="d")
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["checkpoint.pt", "checkpoint.pt.rank0-of-1.step4"]
    assert all(_mode(f) == 0o600 for f in files)


def test_per_step_figures_are_private(tmp_path, umask_022):
    from dpmf.train.metrics import StepLog

    log = StepLog(str(tmp_path), 1)
    log.record(1, 1, 0.5, 0.25, 0.1)
    log.flush()
    log.close()
    assert _mode(tmp_path / "steps.csv") == 0o600  # the un-noised training loss
    if (tmp_path / "tensorboard").exists():
        assert _mode(tmp_path / "tensorboard") == 0o700


# --- 2. an earlier run's outputs are not replaced silently -----------------------------------


def test_a_finished_run_without_its_checkpoint_is_not_overwritten(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "checkpoint.pt").unlink()  # natural before sharing the folder
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([*TRAIN, "--epochs", "1", "--epsilon", "8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "results.json" in err and str(out) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # ε = 3 kept
    assert main([*TRAIN, "--epochs", "1", "--epsilon", "8", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "privacy.json").read_text())["epsilon"] == pytest.approx(8, abs=1e-3)
    assert json.loads((out / "results.json").read_text())["status"] == "complete"


def test_overwrite_replaces_a_checkpointed_run_and_resume_with_overwrite_is_refused(
    finished, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    assert (
        main([*TRAIN, "--epochs", "1", "--epsilon", "8", "--out", str(out), "--resume", "--overwrite"]) == 2
    )
    assert "--overwrite" in capsys.readouterr().err
    assert main([*TRAIN, "--epochs", "1", "--epsilon", "8", "--out", str(out), "--overwrite"]) == 0
    assert load_checkpoint(str(out / "checkpoint.pt"))["run_identity"]["epsilon"] == 8
    assert _mode(out / "checkpoint.pt") == 0o600


def test_a_run_stopped_before_its_first_epoch_may_be_restarted(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"status": "interrupted", "completed_epochs": 0}))
    cfg = TrainConfig(
        dataset="digits", model="mlp", epochs=1, batch_size=256, noise_multiplier=1.0, epsilon=None
    )
    assert train(cfg, str(out), **QUIET).steps == 6


# --- 3. a checkpoint's entries are checked against their SHA-256 -----------------------------


def _flip_a_bit_in_the_largest_tensor(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        assert info.compress_type == zipfile.ZIP_STORED
    raw = bytearray(path.read_bytes())
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    raw[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_in_a_tensor_is_refused_naming_the_entry(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    _flip_a_bit_in_the_largest_tensor(out / "checkpoint.pt")
    torch.load(out / "checkpoint.pt", weights_only=True)  # torch itself does not notice
    before = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert (
        main([*TRAIN, "--epochs", "1", "--epsilon", "3", "--seed", "5", "--out", str(out), "--resume"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint.pt" in err and "does not match its digest" in err
    assert "entry 'model/" in err or "entry 'optimizer/" in err or "entry 'noise" in err
    assert (out / "results.json").read_bytes() == before  # nothing re-exported


def test_changed_plain_data_are_refused_without_printing_the_secret(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"secret": {"seed": 987654321}, "step": 3, "w": torch.arange(4.0)})
    state = torch.load(path, weights_only=True)
    state["secret"]["seed"] = 987654320  # one bit of the seed
    torch.save(state, path)
    with pytest.raises(ValueError, match="plain data") as err:
        load_checkpoint(str(path))
    assert "98765432" not in str(err.value)
    state["secret"]["seed"] = 987654321
    state["w"][1] = 5.0
    torch.save(state, path)
    with pytest.raises(ValueError, match="entry 'w' does not match"):
        load_checkpoint(str(path))


def test_a_checkpoint_without_digests_is_refused(tmp_path):
    torch.save({"format": 1, "w": torch.ones(2)}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="no digests"):
        load_checkpoint(str(tmp_path / "c.pt"))


# --- 4. a failed checkpoint write (disk full) -------------------------------------------------


def test_disk_full_while_checkpointing_is_one_line_and_the_files_agree(tmp_path, monkeypatch, capsys):
    from dpmf.train import checkpoint as ckpt

    real_save, calls = torch.save, {"n": 0}

    def full_disk(obj, f, *a, **k):
        if isinstance(obj, dict) and "run_identity" in obj:
            calls["n"] += 1
            if calls["n"] == 2:  # the second epoch's checkpoint: half written, then ENOSPC
                f.write(b"\x00" * 1000)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    out = tmp_path / "run"
    assert main([*TRAIN, "--epochs", "3", "--noise-multiplier", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "checkpoint.pt" in err and os.strerror(errno.ENOSPC) in err
    res = json.loads((out / "results.json").read_text())
    state = load_checkpoint(str(out / "checkpoint.pt"))
    assert res["status"] == "failed" and res["completed_epochs"] == 1 == state["epoch"]
    assert res["checkpoint_step"] == state["step"] == 6
    assert len(read_metrics_csv(out / "metrics.csv")) == len(state["metrics"]) == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temporary file


def test_disk_full_during_the_export_is_not_complete_and_resume_exports(tmp_path, monkeypatch, capsys):
    real_save = torch.save

    def full_for_the_model(obj, f, *a, **k):
        if isinstance(obj, dict) and "run_identity" not in obj and "digests" not in obj:  # model.pt
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_for_the_model)
    out = tmp_path / "run"
    argv = [*TRAIN, "--epochs", "1", "--noise-multiplier", "1", "--seed", "3", "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.pt" in err and "Traceback" not in err
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "failed" and "model.pt" in res["error"] and "final" not in res
    assert res["completed_epochs"] == 1 and not (out / "model.pt").exists()
    monkeypatch.setattr(torch, "save", real_save)
    assert main([*argv, "--resume"]) == 0  # the checkpoint holds the whole run: export it
    assert json.loads((out / "results.json").read_text())["status"] == "complete"
    assert (out / "model.pt").exists() and (out / "privacy.json").exists()


# --- 5. SIGTERM stops like Ctrl-C --------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_at_a_checkpoint_and_says_interrupted(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    argv = [*TRAIN, "--epochs", "200", "--batch-size", "64", "--noise-multiplier", "1", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpmf", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143
    err = err.decode()
    assert "terminated (SIGTERM)" in err and "--resume" in err and "Traceback" not in err
    res = json.loads((out / "results.json").read_text())
    state = load_checkpoint(str(out / "checkpoint.pt"))
    assert res["status"] == "interrupted" and res["signal"] == "SIGTERM"
    assert res["completed_epochs"] == state["epoch"] >= 1 and res["checkpoint_step"] == state["step"]
    assert len(read_metrics_csv(out / "metrics.csv")) == state["epoch"]


def test_a_sigterm_right_after_a_checkpoint_is_written_counts_that_epoch(tmp_path, monkeypatch, capsys):
    from dpmf.train import loop

    real_remove, calls = loop.remove_shards, {"n": 0}

    def signal_after_the_write(path, keep=()):  # between the checkpoint on disk and the epoch counted
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_remove(path, keep)

    def interrupt(signum, frame):  # the test runner survives a build that ignores SIGTERM handling
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "remove_shards", signal_after_the_write)
    previous = signal.signal(signal.SIGTERM, interrupt)
    sigint = signal.getsignal(signal.SIGINT)  # the test process's (another test may have changed it)
    try:
        out = tmp_path / "run"
        assert main([*TRAIN, "--epochs", "3", "--noise-multiplier", "1", "--out", str(out)]) == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGINT) is sigint  # restored
    res = json.loads((out / "results.json").read_text())
    state = load_checkpoint(str(out / "checkpoint.pt"))
    assert state["epoch"] == 2 == res["completed_epochs"] and res["checkpoint_step"] == state["step"] == 12
    assert res["status"] == "interrupted" and len(read_metrics_csv(out / "metrics.csv")) == 2


def test_a_stop_inside_a_critical_section_is_raised_at_its_end():
    from dpmf.train.loop import critical_section, deliver_stop

    done = []
    with pytest.raises(KeyboardInterrupt):
        with critical_section():
            deliver_stop(KeyboardInterrupt())
            done.append("written")
            done.append("counted")
    assert done == ["written", "counted"]
    with pytest.raises(KeyboardInterrupt):
        deliver_stop(KeyboardInterrupt())  # outside: at once
    with pytest.raises(OSError):  # the block's own error wins; the stop is not kept for later
        with critical_section():
            deliver_stop(KeyboardInterrupt())
            raise OSError("disk full")
    with critical_section():
        pass


# --- 6. --resume needs a checkpoint ------------------------------------------------------------


def test_resume_without_a_checkpoint_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "new"
    assert main([*TRAIN, "--epochs", "1", "--noise-multiplier", "1", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint.pt" in err and "without --resume" in err
    assert not out.exists()
