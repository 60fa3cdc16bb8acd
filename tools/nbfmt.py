#!/usr/bin/env python3
"""Normalise notebooks the way the repository stores them, and convert to/from py:percent for editing.

    python tools/nbfmt.py notebooks/*.ipynb solutions/*.ipynb      strip outputs, counts, stray metadata; set kernel
                                                                    and language_info as JupyterLab would
    python tools/nbfmt.py --check notebooks/*.ipynb                 exit 1 if any file is not normalised
    python tools/nbfmt.py --from-py draft.py notebooks/05_x.ipynb   py:percent draft -> stored notebook
    python tools/nbfmt.py --to-py notebooks/05_x.ipynb draft.py     stored notebook -> py:percent for editing

Stored form: nbformat 4.5, no outputs, no execution counts, sequential cell ids, cell metadata limited to `tags`,
notebook metadata limited to kernelspec, language_info and `course`. kernelspec and language_info are exactly what
JupyterLab writes into a notebook once its kernel (the standard `python3`) starts (the kernelspec's name, display name and language;
the kernel's whole kernel_info language_info): JupyterLab compares them with the stored values, and any difference
marks an untouched notebook modified. language_info's `version` is the Python that first normalised the file and
is kept from then on, so normalising on another Python does not rewrite every notebook; only there, JupyterLab
still updates that one string on open.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

# The standard kernel every Jupyter has (ipykernel's own `python3`), not the course's named one: a notebook that names
# a kernel only `make lab` registers fails under papermill/nbclient elsewhere (NoSuchKernel) and makes hosted notebooks
# ask for a kernel. `make lab` runs JupyterLab from .venv, whose python3 is the course's Python (one OpenMP thread:
# `course_lib.lab` sets it for every kernel the server starts).
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def kernel_language_info() -> dict:
    """The language_info the course kernel (ipykernel, this Python) sends in kernel_info, as JupyterLab stores it."""
    from ipykernel.ipkernel import IPythonKernel
    return dict(IPythonKernel.language_info)


def normalise(nb) -> "nbformat.NotebookNode":
    nb.nbformat, nb.nbformat_minor = 4, 5
    keep = {k: nb.metadata[k] for k in ("course",) if k in nb.metadata}
    language_info = kernel_language_info()
    stored_version = nb.metadata.get("language_info", {}).get("version")
    if stored_version:
        language_info["version"] = stored_version
    nb.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC, "language_info": language_info, **keep})
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:03d}"
        tags = cell.get("metadata", {}).get("tags", [])
        cell.metadata = nbformat.from_dict({"tags": tags} if tags else {})
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.pop("attachments", None) if cell.cell_type != "markdown" else None
        cell.source = cell.source.rstrip("\n")
    return nb


def text_of(nb) -> str:
    return nbformat.writes(normalise(nb)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--from-py", nargs=2, type=Path, metavar=("DRAFT_PY", "NOTEBOOK"))
    ap.add_argument("--to-py", nargs=2, type=Path, metavar=("NOTEBOOK", "DRAFT_PY"))
    a = ap.parse_args(argv)
    import jupytext
    if a.from_py:
        src, dst = a.from_py
        nb = jupytext.read(src, fmt="py:percent")
        dst.write_text(text_of(nb))
        print(f"wrote {dst}")
        return 0
    if a.to_py:
        src, dst = a.to_py
        nb = nbformat.read(src, as_version=4)
        nb.metadata["jupytext"] = {"notebook_metadata_filter": "course"}   # keep the papermill matrix in the draft
        jupytext.write(nb, dst, fmt="py:percent")
        print(f"wrote {dst}")
        return 0
    bad = []
    for p in a.paths:
        want = text_of(nbformat.read(p, as_version=4))
        if p.read_text() != want:
            if a.check:
                bad.append(str(p))
            else:
                p.write_text(want)
                print(f"normalised {p}")
    if bad:
        print("not in stored form (outputs or stray metadata): " + ", ".join(bad) +
              "\nrun: python tools/nbfmt.py " + " ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
