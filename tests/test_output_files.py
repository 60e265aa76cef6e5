"""Output folders and written files: a bad --out is refused before any work, check_out_dir creates
nothing, and written files get the mode the umask gives."""

import os
import stat

import numpy as np
import pytest
from cli_helpers import _one_line_error

from dpmf import cli
from dpmf._io import atomic_write_csv, atomic_write_text, check_out_dir

# --- a bad --out is refused before any work ------------------------------------------------


@pytest.mark.parametrize("where", ["file", "under_file", "unwritable"])
def test_bad_out_folder_is_refused_before_any_work(where, tmp_path, capsys, monkeypatch):
    f = tmp_path / "a_file"
    f.write_text("x")
    out = {"file": f, "under_file": f / "sub", "unwritable": "/proc/dpmf-out"}[where]

    def boom(*a, **k):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr("dpmf.mechanisms.sweeps.error_curves", boom)
    monkeypatch.setattr("dpmf.mechanisms.sweeps.gain_grid", boom)
    monkeypatch.setattr("dpmf.train.run.train", boom)
    argvs = {
        "curves": ["curves", "--schedule", "cosine", "--n", "16", "--factorizations", "sqrt_prefix"],
        "colormap": ["colormap", "--numerator", "lr_aware", "--denominator", "sqrt_prefix"]
        + ["--metric", "max_se", "--schedule", "cosine", "--n", "16", "--beta", "0.1"],
        "train": ["train", "--dataset", "digits", "--epochs", "1"],
    }
    for command, argv in argvs.items():
        assert cli.main([*argv, "--out", str(out)]) == 2
        line = _one_line_error(capsys, command)
        assert "--out=" in line
    with pytest.raises(ValueError, match="is a file|under the file|cannot write"):
        check_out_dir(out)


def test_check_out_dir_accepts_new_and_existing_folders_without_creating(tmp_path):
    new = tmp_path / "a" / "b"
    assert check_out_dir(new) == new
    assert not (tmp_path / "a").exists()
    assert check_out_dir(tmp_path) == tmp_path
    assert list(tmp_path.iterdir()) == []  # the write probe is removed


# --- written files respect the umask -----------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_umask_mode(umask, tmp_path):
    old = os.umask(umask)
    try:
        a = atomic_write_text(tmp_path / "a.txt", "x")
        b = atomic_write_csv(tmp_path / "b.csv", ("n",), [(1,)])
        plain = tmp_path / "plain.txt"
        with open(plain, "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert stat.S_IMODE(plain.stat().st_mode) == want
    for p in (a, b):
        assert stat.S_IMODE(os.stat(p).st_mode) == want
    assert np.array_equal(sorted(os.listdir(tmp_path)), ["a.txt", "b.csv", "plain.txt"])
