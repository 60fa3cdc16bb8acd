"""A learner runs every notebook in JupyterLab (which saves outputs, counts and widget state into them), solves a
lab, and then `git pull`s the course's next version: with the filter `make install` sets up (tools/nbfmt.py), the
pull goes through — run notebooks are unchanged to git and take the new version, the learner's own answer is kept
beside the course's change. Without it the same pull stops with "would be overwritten"."""
import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402
import nbfmt  # noqa: E402

LECTURE, LAB = "notebooks/00_orientation.ipynb", "labs/lab00_warmup.ipynb"
ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode()


def git(repo: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=ENV, timeout=120)
    assert not ok or out.returncode == 0, f"git {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out


def run_in_jupyterlab(path: Path, python_version: str = "3.12.4") -> None:
    """What JupyterLab saves after Run All: outputs of every kind, execution counts, per-cell timing metadata,
    widget state, and the language_info of the learner's kernel (another Python patch version)."""
    nb = nbformat.read(path, as_version=4)
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        n += 1
        cell.execution_count = n
        cell.metadata["execution"] = {"iopub.execute_input": "2026-12-04T10:00:00.000Z"}
        cell.metadata["scrolled"] = True
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"cell {n}: 42.125 bytes\n"),
                        nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"}),
                        nbformat.v4.new_output("execute_result", data={"text/plain": "3"}, execution_count=n)]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    nb.metadata["language_info"]["version"] = python_version
    nbformat.write(nb, path)


def course_and_learner(tmp_path: Path, filtered: bool) -> tuple[Path, Path]:
    course, learner = tmp_path / "course", tmp_path / "learner"
    for rel in (LECTURE, LAB, "tools/nbfmt.py", ".gitattributes"):
        (course / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, course / rel)
    git(course, "init", "-q", "-b", "main")
    git(course, "add", ".")
    git(course, "commit", "-q", "-m", "the course")
    git(tmp_path, "clone", "-q", str(course), str(learner))
    if filtered:     # what `make install` runs in the learner's clone
        subprocess.run([sys.executable, "tools/nbfmt.py", "--install-git-filter"], cwd=learner, env=ENV, check=True)
    return course, learner


def edit_title(path: Path, words: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source = nb.cells[0].source.replace("\n", f" {words}\n", 1)
    path.write_text(nbfmt.text_of(nb))


def solve_first_exercise(path: Path) -> str:
    solution = make_labs.nbgrader_source(ROOT / "solutions" / Path(LAB).name)
    answer = next(c.source for c in solution.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "answer_01")
    nb = nbformat.read(path, as_version=4)
    next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "answer_01").source = answer
    nbformat.write(nb, path)
    return answer


@pytest.mark.parametrize("filtered", [True, False], ids=["with the filter", "without"])
def test_run_everything_solve_a_lab_then_git_pull(tmp_path, filtered):
    course, learner = course_and_learner(tmp_path, filtered)
    for rel in (LECTURE, LAB):
        run_in_jupyterlab(learner / rel)
    answer = solve_first_exercise(learner / LAB)
    edit_title(course / LECTURE, "(revised)")
    edit_title(course / LAB, "(revised)")
    git(course, "commit", "-q", "-am", "the course's next version")

    pull = git(learner, "pull", "-q", "--no-rebase", ok=False)
    if not filtered:
        assert pull.returncode != 0 and "would be overwritten" in pull.stderr, pull.stderr
        return
    assert pull.returncode == 0, f"git pull failed after running the notebooks:\n{pull.stderr}"
    assert git(learner, "rev-parse", "HEAD").stdout == git(course, "rev-parse", "HEAD").stdout
    lecture = nbformat.read(learner / LECTURE, as_version=4)
    assert "(revised)" in lecture.cells[0].source, "the run lecture should have taken the course's new version"
    lab = nbformat.read(learner / LAB, as_version=4)
    assert "(revised)" in lab.cells[0].source and any(c.source == answer for c in lab.cells), \
        "the lab should have the course's change and keep the learner's answer"
    assert git(learner, "status", "--porcelain").stdout.split() == ["M", LAB], "only the learner's answer is a change"


def test_the_filter_stores_every_notebook_as_it_is_and_a_run_one_as_it_was(tmp_path):
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "labs").glob("*.ipynb")):
        text = path.read_text()
        assert nbfmt.git_clean(text, text) == text, f"{path.name}: the filter would change a stored notebook"
    run = tmp_path / "run.ipynb"
    shutil.copyfile(ROOT / LECTURE, run)
    run_in_jupyterlab(run)
    stored = (ROOT / LECTURE).read_text()
    assert run.read_text() != stored and nbfmt.git_clean(run.read_text(), stored) == stored
    assert nbfmt.git_clean("<<<<<<< HEAD\n{", stored) == "<<<<<<< HEAD\n{", "a conflicted file passes through"
