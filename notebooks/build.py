"""Build the notebooks from their sources (src/*.py, jupytext percent format) and execute them
at full size so that the committed .ipynb files carry their outputs.

Usage (from the repository root): python notebooks/build.py [NAME ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def build(src: Path, size: str = "full", timeout: int = 3600) -> Path:
    nb = jupytext.read(src)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    os.environ["DPMF_NOTEBOOK_SIZE"] = size
    # the kernel imports dpmf from this checkout, installed or not
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
    ).execute()
    out = HERE / f"{src.stem}.ipynb"
    tmp = out.with_suffix(".ipynb.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    names = sys.argv[1:]
    sources = sorted((HERE / "src").glob("*.py"))
    if names:
        sources = [s for s in sources if any(s.stem.startswith(n) for n in names)]
    for src in sources:
        print("built", build(src))
