"""nbgrader grades the course's labs (README, "Teaching with it"): `make_labs.py --nbgrader` writes an nbgrader
course, nbgrader itself generates the student version and autogrades it in the course kernel — the unmodified
student version scores 0, the solution full marks, and a submission that solves one exercise gets that exercise's
points only."""
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
LAB, NAME = "lab00", "lab00_warmup.ipynb"       # the quickest checks: seconds, no ranks


def _nbg(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _checks_called(nb) -> int:
    return sum(len(make_labs.CHECK_CALL.findall(c.source)) for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_every_lab_passes_nbgraders_own_metadata_checks(solution):
    """What `nbgrader generate_assignment` runs on a source notebook, in-process: regions only in answer cells
    (the error every lab used to stop with), valid and unique cell metadata; then the points add up."""
    from nbgrader.preprocessors import CheckCellMetadata, ClearSolutions
    nb = make_labs.nbgrader_source(solution)
    CheckCellMetadata().preprocess(nb, {})
    student, _ = ClearSolutions(enforce_metadata=True).preprocess(nb, {})
    assert not any("BEGIN SOLUTION" in c.source for c in student.cells)
    answers = [c for c in student.cells if _nbg(c).get("solution")]
    assert answers and all("raise NotImplementedError()" in c.source for c in answers)
    assert sum(_nbg(c).get("points", 0) for c in student.cells) == _checks_called(nb) > 0
    lab = nbformat.read(ROOT / "labs" / solution.name, as_version=4)      # the same exercises as labs/ gives out
    assert [c.cell_type for c in student.cells] == [c.cell_type for c in lab.cells]


def test_naming_labs_without_nbgrader_or_an_unknown_lab_says_what_to_change(tmp_path, capsys):
    for argv, message in ((["lab00"], "naming labs is for --nbgrader"),
                          (["--nbgrader", str(tmp_path), "lab99"], "no solution for lab99")):
        with pytest.raises(SystemExit):
            make_labs.main(argv)
        assert message in capsys.readouterr().err


def _nbgrader(course: Path, *args: str) -> None:
    # The kernel nbgrader starts inherits PYTHONPATH, so it grades with this checkout's course_lib; nbgrader runs
    # `alembic` (its database migrations) from PATH, which has the venv's bin only where the venv is activated.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    out = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def _submit(course: Path, student: str, nb) -> None:
    target = course / "submitted" / student / LAB / NAME
    target.parent.mkdir(parents=True)
    nbformat.write(nb, target)


def test_nbgrader_scores_the_stub_zero_one_exercise_its_points_and_the_solution_full_marks(tmp_path):
    from nbgrader.api import Gradebook
    course = tmp_path / "course"
    assert make_labs.main(["--nbgrader", str(course), LAB]) == 0
    assert (course / "source" / LAB / NAME).exists() and (course / "nbgrader_config.py").exists()
    _nbgrader(course, "generate_assignment", LAB, "--force")

    release = nbformat.read(course / "release" / LAB / NAME, as_version=4)
    source = nbformat.read(course / "source" / LAB / NAME, as_version=4)
    assert not any("BEGIN SOLUTION" in c.source for c in release.cells), "the student version shows a solution"
    solved = {_nbg(c)["grade_id"]: c.source for c in source.cells if _nbg(c).get("solution")}
    points = {_nbg(c)["grade_id"]: _nbg(c)["points"] for c in release.cells if _nbg(c).get("grade")}
    total = _checks_called(source)
    assert len(solved) == 3 and sum(points.values()) == total == 3

    def filled(answers):      # the student version with these answer cells written as in the solution
        nb = copy.deepcopy(release)
        for c in nb.cells:
            if _nbg(c).get("grade_id") in answers:
                c.source = solved[_nbg(c)["grade_id"]]
        return nb

    _submit(course, "stub", release)                        # handed in untouched
    _submit(course, "first", filled({"answer_01"}))          # only Exercise 1 (the parameter count) done
    _submit(course, "solution", filled(set(solved)))
    _nbgrader(course, "autograde", LAB)

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        score = {s: gb.find_submission(LAB, s).score for s in ("stub", "first", "solution")}
        assert gb.find_assignment(LAB).max_score == total
    assert score == {"stub": 0, "first": points["check_param_count"], "solution": total}, score
    graded = (course / "autograded" / "stub" / LAB / NAME).read_text()
    assert re.search(r"not implemented yet", graded), "the stub's checks should fail with the lab's own message"
