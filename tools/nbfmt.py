#!/usr/bin/env python3
"""Normalise notebooks the way the repository stores them, and convert to/from py:percent for editing.

    python tools/nbfmt.py notebooks/*.ipynb solutions/*.ipynb      strip outputs, counts, stray metadata; set kernel
                                                                    and language_info as JupyterLab would
    python tools/nbfmt.py --check notebooks/*.ipynb                 exit 1 if any file is not normalised
    python tools/nbfmt.py --from-py draft.py notebooks/05_x.ipynb   py:percent draft -> stored notebook
    python tools/nbfmt.py --to-py notebooks/05_x.ipynb draft.py     stored notebook -> py:percent for editing
    python tools/nbfmt.py --install-git-filter                      (make install) git compares notebooks in
                                                                    stored form: running one is not a change

Stored form: nbformat 4.5, no outputs, no execution counts, sequential cell ids, cell metadata limited to `tags` (and
`nbgrader`, which labs/ carries), notebook metadata limited to kernelspec, language_info and `course`. kernelspec and
language_info are exactly what JupyterLab writes into a notebook once its kernel (the standard `python3`) starts
(the kernelspec's name, display name and language; the kernel's whole kernel_info language_info): JupyterLab
compares them with the stored values, and any difference marks an untouched notebook modified. language_info's
`version` is the Python that first normalised the file and is kept from then on, so normalising on another Python
does not rewrite every notebook; only there, JupyterLab still updates that one string on open.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The standard kernel every Jupyter has (ipykernel's own `python3`), not the course's named one: a notebook that names
# a kernel only `make lab` registers fails under papermill/nbclient elsewhere (NoSuchKernel) and makes hosted notebooks
# ask for a kernel. `make lab` runs JupyterLab from .venv, whose python3 is the course's Python (one OpenMP thread:
# `course_lib.lab` sets it for every kernel the server starts).
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def kernel_language_info() -> dict:
    """The language_info the course kernel (ipykernel, this Python) sends in kernel_info, as JupyterLab stores it."""
    from ipykernel.ipkernel import IPythonKernel
    return dict(IPythonKernel.language_info)


def normal_form(nb: dict, language_info: dict) -> dict:
    """The stored form of a notebook given as plain JSON data, with this language_info (the one rule, used by
    `normalise` and by the git filter, which must not wait for nbformat and ipykernel to import)."""
    meta = nb.get("metadata", {})
    cells = []
    for i, cell in enumerate(nb.get("cells", [])):
        cell = dict(cell, id=f"cell-{i:03d}")
        kept = cell.get("metadata", {})      # tags; labs/ cells carry nbgrader's (tools/make_labs.py)
        cell["metadata"] = {k: kept[k] for k in ("tags", "nbgrader") if kept.get(k)}
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        if cell["cell_type"] != "markdown":
            cell.pop("attachments", None)
        source = cell.get("source", "")
        cell["source"] = ("".join(source) if isinstance(source, list) else source).rstrip("\n")
        cells.append(cell)
    return {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": dict(KERNELSPEC), "language_info": dict(language_info),
                         **{k: meta[k] for k in ("course",) if k in meta}}}


def normalise(nb):
    """The notebook (a NotebookNode) in stored form, as a new NotebookNode."""
    import nbformat
    language_info = kernel_language_info()
    stored_version = nb.get("metadata", {}).get("language_info", {}).get("version")
    if stored_version:
        language_info["version"] = stored_version
    return nbformat.from_dict(normal_form(nb, language_info))


def text_of(nb) -> str:
    import nbformat
    return nbformat.writes(normalise(nb)) + "\n"


# ------------------------------------------------------------------------------------------------- git filter
# JupyterLab saves outputs, execution counts and widget state into the notebook a learner runs; tracked, that file
# would count as changed and stop the next `git pull`. `make install` sets this clean filter for *.ipynb
# (.gitattributes): git then compares the stored form of the learner's file with the repository's, so a notebook
# that was only run is unchanged to git, and `git pull` updates it (its outputs go; running it again brings them).
FILTER = "course-notebook"


def git_clean(text: str, stored: str | None) -> str:
    """What git stores for a notebook saved as `text`: its normal form, in nbformat's JSON layout, with the
    language_info of the repository's copy `stored` (the kernel's, with the Python version the file was first
    normalised on; a learner's other Python version is not a change). Text that is not a notebook passes through."""
    try:
        nb = json.loads(text)
        language_info = (json.loads(stored) if stored else nb).get("metadata", {}).get("language_info", {})
        clean = normal_form(nb, language_info)
    except (ValueError, KeyError, AttributeError, TypeError):
        return text       # a merge conflict's markers, a half-written file: git shows it as it is
    for cell in clean["cells"]:          # nbformat's split_lines: sources as lists of lines
        cell["source"] = cell["source"].splitlines(True)
    return json.dumps(clean, indent=1, sort_keys=True, separators=(",", ": "), ensure_ascii=False) + "\n"


def install_git_filter(root: Path) -> str:
    """Configure the clean filter (and autostash, so a learner's own edits ride along a pull) in the clone at root;
    what was done, in one line."""
    if not (root / ".git").exists():
        return f"{root} is not a git clone: no notebook filter to install"
    settings = {f"filter.{FILTER}.clean": "python3 tools/nbfmt.py --git-clean %f",
                # A learner's own edits (knobs, lab answers) are stashed around a pull and put back after it.
                "merge.autoStash": "true", "rebase.autoStash": "true"}
    for key, value in settings.items():
        subprocess.run(["git", "-C", str(root), "config", "--local", key, value], check=True)
    return f"git: notebooks' outputs no longer count as changes ({FILTER} filter), and `git pull` autostashes"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--from-py", nargs=2, type=Path, metavar=("DRAFT_PY", "NOTEBOOK"))
    ap.add_argument("--to-py", nargs=2, type=Path, metavar=("NOTEBOOK", "DRAFT_PY"))
    ap.add_argument("--git-clean", metavar="PATH", help="git's clean filter: the notebook on stdin, stored form out")
    ap.add_argument("--install-git-filter", action="store_true", help="set the clean filter up in this clone")
    a = ap.parse_args(argv)
    if a.git_clean:
        shown = subprocess.run(["git", "cat-file", "blob", f":{a.git_clean}"], capture_output=True, text=True)
        sys.stdout.write(git_clean(sys.stdin.read(), shown.stdout if shown.returncode == 0 else None))
        return 0
    if a.install_git_filter:
        print(install_git_filter(Path(__file__).resolve().parent.parent))
        return 0
    import jupytext
    import nbformat
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
