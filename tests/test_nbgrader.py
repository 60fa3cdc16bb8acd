"""nbgrader grades the course's labs (README, "Teaching with it"): `make_labs.py --nbgrader` writes an nbgrader
course, and the notebooks learners solve in labs/ carry nbgrader's cell metadata, so the copy a learner hands in is
the copy that grades: autograded in the course kernel, an unmodified lab scores 0, one exercise its points, the
solution full marks; nbgrader's Validate fails on the unmodified lab; a copy without the metadata is refused."""
import csv
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


def _nbgrader_output(cwd: Path, *args: str) -> str:
    """Run nbgrader as an instructor or the Validate button would; its stdout + stderr. Exits 0 or fails the test."""
    # The kernel nbgrader starts inherits PYTHONPATH, so it grades with this checkout's course_lib; nbgrader runs
    # `alembic` (its database migrations) from PATH, which has the venv's bin only where the venv is activated.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    out = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def _learners_copy(tmp: Path, name: str, answers: set[str]) -> Path:
    """labs/lab00 as a learner leaves it: these answer cells written as in the solution (by grade id), the rest
    untouched; saved under the lab's own name in a folder of its own."""
    solved = {_nbg(c)["grade_id"]: c.source for c in make_labs.nbgrader_source(ROOT / "solutions" / NAME).cells
              if _nbg(c).get("solution")}
    nb = nbformat.read(ROOT / "labs" / NAME, as_version=4)
    for c in nb.cells:
        if _nbg(c).get("grade_id") in answers:
            c.source = solved[_nbg(c)["grade_id"]]
    path = tmp / name / NAME
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    return path


def _assert_labs_carry_the_metadata_nbgrader_releases(release) -> None:
    """labs/ is the student version: every nbgrader field of every cell as generate_assignment writes it, the
    checksums of the locked check cells included (Validate compares them); only the answer stubs' text differs
    ("≈N lines"), and with it their checksums."""
    lab = nbformat.read(ROOT / "labs" / NAME, as_version=4)
    assert len(release.cells) == len(lab.cells)
    for r, mine in zip(release.cells, lab.cells):
        want, have = dict(_nbg(r)), dict(_nbg(mine))
        if want.get("solution"):
            assert "raise NotImplementedError()" in mine.source
            want.pop("checksum"), have.pop("checksum")
        assert have == want, f"labs/{NAME}: {have} differs from nbgrader's release {want}"


def test_a_copy_without_nbgraders_cells_is_refused_when_handed_in(tmp_path, capsys):
    nb = nbformat.read(ROOT / "labs" / NAME, as_version=4)
    for c in nb.cells:
        c.metadata.pop("nbgrader", None)            # what every labs/ notebook was before it carried them
    path = tmp_path / NAME
    nbformat.write(nb, path)
    assert make_labs.main(["--collect", str(tmp_path / "course"), "ann", str(path)]) == 1
    err = capsys.readouterr().err
    assert "refused, it has no nbgrader cells, so autograde would score it 0" in err, err
    assert not (tmp_path / "course" / "submitted").exists()


def _graded_cells(path: Path) -> int:
    return sum(bool(_nbg(c).get("grade")) for c in nbformat.read(path, as_version=4).cells)


def test_validate_fails_on_the_unmodified_lab_and_passes_the_solved_one(tmp_path):
    """nbgrader's Validate button on a learner's labs/ copy: it said "Success!" on every unmodified lab (the report
    found it on lab 13, whose unmodified copy is validated here); the solved lab 00 passes."""
    lab13 = tmp_path / "lab13" / "lab13_choose_a_plan.ipynb"
    lab13.parent.mkdir()
    lab13.write_text((ROOT / "labs" / lab13.name).read_text())
    stub = _nbgrader_output(ROOT, "validate", str(lab13))
    assert f"VALIDATION FAILED ON {_graded_cells(lab13)} CELL(S)" in stub, stub
    assert "not implemented yet" in stub and "Success" not in stub, stub
    solved = _nbgrader_output(ROOT, "validate", str(_learners_copy(tmp_path, "solved", {"answer_01", "answer_02",
                                                                                        "answer_03"})))
    assert "Success! Your notebook passes all the tests." in solved, solved


def test_nbgrader_scores_learners_labs_copies_stub_zero_one_exercise_its_points_solution_full_marks(tmp_path):
    """The grading recipe of the README end to end, on notebooks made from labs/ as learners hand them in."""
    from nbgrader.api import Gradebook
    course = tmp_path / "course"
    assert make_labs.main(["--nbgrader", str(course), LAB]) == 0
    assert (course / "source" / LAB / NAME).exists() and (course / "nbgrader_config.py").exists()
    _nbgrader_output(course, "generate_assignment", LAB, "--force")
    source = nbformat.read(course / "source" / LAB / NAME, as_version=4)
    release = nbformat.read(course / "release" / LAB / NAME, as_version=4)
    assert not any("BEGIN SOLUTION" in c.source for c in release.cells), "the student version shows a solution"
    _assert_labs_carry_the_metadata_nbgrader_releases(release)
    solved = [_nbg(c)["grade_id"] for c in source.cells if _nbg(c).get("solution")]
    points = {_nbg(c)["grade_id"]: _nbg(c)["points"] for c in release.cells if _nbg(c).get("grade")}
    total = _checks_called(source)
    assert len(solved) == 3 and sum(points.values()) == total == 3

    hand_in = {"stub": set(), "first": {"answer_01"}, "solution": set(solved)}   # first: the parameter count only
    for student, answers in hand_in.items():
        path = _learners_copy(tmp_path, student, answers)
        os.utime(path, (1_767_225_600, 1_767_225_600))                         # 2026-01-01 00:00 UTC
        assert make_labs.main(["--collect", str(course), student, str(path)]) == 0
    log = _nbgrader_output(course, "autograde", LAB)
    assert "SAWarning" not in log, "the generated config should keep nbgrader's SQLAlchemy warnings out"

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        score = {s: gb.find_submission(LAB, s).score for s in hand_in}
        assert gb.find_assignment(LAB).max_score == total
    assert score == {"stub": 0, "first": points["check_param_count"], "solution": total}, score
    graded = (course / "autograded" / "stub" / LAB / NAME).read_text()
    assert re.search(r"not implemented yet", graded), "the stub's checks should fail with the lab's own message"
    _nbgrader_output(course, "export")
    rows = list(csv.DictReader((course / "grades.csv").open()))
    assert {r["student_id"]: float(r["score"]) for r in rows} == score
    assert {r["timestamp"] for r in rows} == {"2026-01-01 00:00:00"}, "grades.csv should say when each was handed in"
