"""The notebooks: each runs top to bottom at small size, and matches its source."""

import os
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
SOURCES = sorted((NB_DIR / "src").glob("*.py"))


def code_cells(nb):
    return [c.source.strip() for c in nb.cells if c.cell_type == "code"]


def test_every_source_has_a_committed_notebook():
    assert SOURCES, "no notebook sources found"
    for src in SOURCES:
        assert (NB_DIR / f"{src.stem}.ipynb").exists(), src.stem


@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_committed_notebook_matches_source_and_has_outputs(src):
    nb = nbformat.read(NB_DIR / f"{src.stem}.ipynb", as_version=4)
    assert code_cells(nb) == code_cells(jupytext.read(src)), "rebuild with: python notebooks/build.py"
    assert any(
        "image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs
    ), "committed notebook has no figure output"


@pytest.mark.slow
@pytest.mark.parametrize("src", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_executes_at_small_size(src, monkeypatch):
    if "fl" in src.stem.split("_"):  # the federated notebook needs the optional extra
        pytest.importorskip("flwr")
    nb = jupytext.read(src)
    monkeypatch.setenv("DPMF_NOTEBOOK_SIZE", "small")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}}
    )
    client.execute()  # raises CellExecutionError if any cell raises
