"""Labs are generated from solutions, stay in sync, and their checks fail on the unmodified lab."""
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from ._nb import LABS, ROOT, SOLUTIONS, is_check_cell, read, rel

sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402


def test_labs_are_up_to_date_with_solutions():
    out = subprocess.run([sys.executable, "tools/make_labs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_clear_solutions_keeps_indent_and_counts_lines():
    src = ("def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    y = x + 1\n    # a comment\n\n    return y\n"
           "    ### END SOLUTION\n")
    out, n = make_labs.clear_solutions(src, "t")
    assert n == 1
    assert out == "def f(x):\n    '''doc'''\n    # YOUR CODE HERE (≈2 lines)\n    raise NotImplementedError()\n"


def test_markdown_regions_become_your_answer_here():
    out, n = make_labs.clear_solutions("Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION", "t", markdown=True)
    assert (out, n) == ("Why?\nYOUR ANSWER HERE", 1)


@pytest.mark.parametrize("src, match", [
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "cannot nest"),
    ("x = 1\n### BEGIN SOLUTION\nx = 2\n", "never closed"),
    ("### END SOLUTION\n", "without a matching BEGIN"),
])
def test_nested_unterminated_or_stray_regions_are_rejected(src, match):
    with pytest.raises(make_labs.LabError, match=match):
        make_labs.clear_solutions(src, "t")


def _copy_course(tmp_path):
    for d in ("solutions", "labs"):
        shutil.copytree(ROOT / d, tmp_path / d)
    return tmp_path


def test_editing_a_solution_without_regenerating_makes_the_check_fail(tmp_path):
    root = _copy_course(tmp_path)
    sol = root / "solutions" / "lab00_warmup.ipynb"
    nb = nbformat.read(sol, as_version=4)
    nb.cells[-1].source += "\n# an edit"
    nbformat.write(nb, sol)
    assert make_labs.main(["--check", "--root", str(root)]) == 1
    assert make_labs.main(["--root", str(root)]) == 0 and make_labs.main(["--check", "--root", str(root)]) == 0


def _check_cells(nb):
    return [i for i, c in enumerate(nb.cells) if is_check_cell(c)]


def _execute(nb, path):
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True, shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def _errors(cell):
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def _shown(error) -> list:
    """The lines Jupyter shows for an error output (its traceback, ANSI colours removed)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback)).strip().splitlines()


@pytest.mark.notebooks
@pytest.mark.parametrize("path", LABS, ids=rel)
def test_every_check_fails_on_the_unmodified_lab_with_a_readable_message(path):
    nb = _execute(read(path), path)
    checks = _check_cells(nb)
    assert checks, f"{rel(path)} has no check cells"
    for i in checks:
        errs = _errors(nb.cells[i])
        assert errs, f"{rel(path)} cell {i}: the check passed on the unmodified lab — a check that cannot fail"
        assert errs[0].ename == "CheckFailed", f"{rel(path)} cell {i}: failed with {errs[0].ename}, not CheckFailed"
        assert errs[0].evalue.startswith("✘ "), f"{rel(path)} cell {i}: message should start with '✘ name:'"
        shown = _shown(errs[0])
        assert shown and shown[0].startswith("✘ ") and len(shown) <= 3, \
            f"{rel(path)} cell {i}: a failed check must show its ✘ line and hint only, not a traceback:\n" \
            + "\n".join(shown)
    others = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and i not in checks and _errors(c)]
    if _run_all_reaches_the_checks(path):
        _assert_run_all_ends_in_one_line(nb, path, checks, others)
    for i in others:   # before the checks only the stubs may raise
        assert _errors(nb.cells[i])[0].ename == "NotImplementedError", \
            f"{rel(path)} cell {i} raised {_errors(nb.cells[i])[0].ename} in the unmodified lab"


def _run_all_reaches_the_checks(path) -> bool:
    """Labs 05–11 guard every cell that runs the learner's code before the checks (`course_lib.checks.demo`)."""
    return int(re.match(r"lab(\d\d)_", path.name).group(1)) >= 5


def _assert_run_all_ends_in_one_line(nb, path, checks, others):
    """Run All stops at the first cell that raises: in an unmodified lab that must be the first check cell, showing
    its one ✘ line ("… not implemented yet") and hint — no traceback, no stub's NotImplementedError, nothing on
    stderr before it."""
    assert not others, f"{rel(path)}: cell(s) {others} raise before any check in the unmodified lab (Run All stops " \
        f"there): {[_errors(nb.cells[i])[0].ename for i in others]} — guard them with course_lib.checks.demo"
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and _errors(c))
    assert first == checks[0], f"{rel(path)}: Run All stops at cell {first}, not at the first check (cell {checks[0]})"
    shown = _shown(_errors(nb.cells[first])[0])
    assert "not implemented yet" in shown[0] and len(shown) <= 3, \
        f"{rel(path)}: Run All should end in the one ✘ line saying what is not implemented yet:\n" + "\n".join(shown)
    for i, cell in enumerate(nb.cells[:first]):
        err = [o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stderr"]
        assert not any("Traceback" in t or "Error" in t for t in err), \
            f"{rel(path)} cell {i} writes an error to stderr before the checks:\n" + "".join(err)[-2000:]


@pytest.mark.parametrize("path", SOLUTIONS, ids=rel)
def test_exercises_a_check_module_names_are_defined_by_its_lab(path):
    import importlib
    module = importlib.import_module(f"course_lib.checks.{path.name[:5]}")
    source = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    for name, where in getattr(module, "EXERCISES", {}).items():
        assert re.search(rf"^def {name}\(", source, re.M), f"{module.__name__}.EXERCISES names {name} ({where}), " \
            f"but {rel(path)} defines no such function"
        assert where.split(",")[0] in "\n".join(c.source for c in read(path).cells), \
            f"{module.__name__}.EXERCISES says {name} is in '{where}', which {rel(path)} does not mention"


@pytest.mark.notebooks
def test_a_check_run_before_its_exercise_cell_says_which_cell_to_run():
    """Run All stops at the first stub; a learner who then runs the check cells must not get a bare NameError."""
    path = ROOT / "labs" / "lab00_warmup.ipynb"
    nb = read(path)
    checks = _check_cells(nb)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True, shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):              # Run All: up to and including the first failing cell
            if cell.cell_type == "code":
                client.execute_cell(cell, i)
                if _errors(cell):
                    first_stub = i
                    break
        for i in checks:                                 # then the learner runs the checks
            client.execute_cell(nb.cells[i], i)
        nb.cells.append(nbformat.v4.new_code_cell("print(a_typo)"))    # not a check cell: the usual traceback
        client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
    assert _errors(nb.cells[first_stub])[0].ename == "NotImplementedError"
    not_run = [i for i in checks if _errors(nb.cells[i])[0].ename == "NameError"]
    assert len(not_run) == 2, "checks of exercises 2 and 3 should meet names that were never defined"
    for i in not_run:
        shown = _shown(_errors(nb.cells[i])[0])
        assert len(shown) <= 3 and shown[0].startswith("✘ "), "\n".join(shown)
        assert "run the exercise cell that defines" in shown[0] and "Exercise " in shown[0], shown[0]
    ordinary = _errors(nb.cells[-1])[0]
    assert ordinary.ename == "NameError" and ordinary.evalue == "name 'a_typo' is not defined"
    assert any("print(a_typo)" in line for line in _shown(ordinary)), "an ordinary NameError keeps its traceback"


@pytest.mark.notebooks
def test_a_solution_with_an_emptied_region_fails_its_checks(tmp_path):
    """Deleting the body of a solution region must make the solution's checks fail (and so `make test`)."""
    src = ROOT / "solutions" / "lab00_warmup.ipynb"
    nb = read(src)
    emptied = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source and emptied == 0:
            cell.source = re.sub(r"(### BEGIN SOLUTION\n)(.*?)(\n[ \t]*### END SOLUTION)",
                                 lambda m: m.group(1) + re.match(r"[ \t]*", m.group(2)).group(0) + "pass" + m.group(3),
                                 cell.source, count=1, flags=re.S)
            emptied += 1
    target = tmp_path / src.name
    nbformat.write(nb, target)
    nb = _execute(read(target), src)
    failed = [i for i in _check_cells(nb) if _errors(nb.cells[i])]
    assert failed and _errors(nb.cells[failed[0]])[0].ename == "CheckFailed"


def test_a_demo_cell_turns_a_stub_a_failed_expectation_and_a_crash_into_one_line_each(capsys):
    """checks.demo never stops Run All: each way a demo can go wrong prints one line, then the checks run."""
    from course_lib.checks import demo
    with demo("stub"):
        raise NotImplementedError()
    with demo("expectation") as d:
        d.expect(False, "measured 3, the formula says 4", hint="look at the warm-up")
    with demo("crash"):
        [][1]
    with demo("fine") as d:
        d.expect(True, "never shown")
        print("shown")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "(stub: not implemented yet — the checks below say what to write)"
    assert out[1:4] == ["✘ expectation: measured 3, the formula says 4", "  hint: look at the warm-up",
                        "  (the checks below name the cause)"]
    assert out[4:6] == ["✘ crash: your code raised IndexError: list index out of range",
                        "  (the checks below name the cause)"]
    assert out[6:] == ["shown"]
