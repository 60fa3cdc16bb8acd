#!/usr/bin/env python3
"""Generate labs/ from solutions/: every `### BEGIN SOLUTION` … `### END SOLUTION` region becomes
`# YOUR CODE HERE (≈N lines)` + `raise NotImplementedError()` at the region's indent (nbgrader's ClearSolutions
rule). Regions live in code cells only (nbgrader would want a markdown answer graded by hand).

    python tools/make_labs.py            write labs/labNN_*.ipynb
    python tools/make_labs.py --check    exit 1 if any lab is stale (the nbdev-ci pattern); CI runs this
    python tools/make_labs.py --nbgrader COURSE_DIR [lab00 lab05 …]
                                         an nbgrader course: COURSE_DIR/source/labNN/labNN_*.ipynb (the solution
                                         with its cells marked for nbgrader) and COURSE_DIR/nbgrader_config.py
    python tools/make_labs.py --collect COURSE_DIR STUDENT NOTEBOOK…
                                         hand in a learner's lab(s): COURSE_DIR/submitted/STUDENT/labNN/ with the
                                         file's time as nbgrader's timestamp; a notebook that is not a lab from
                                         labs/ (no nbgrader cells, or not all of them) is refused, saying why

For nbgrader, each code cell holding a solution region becomes an answer cell ("Autograded answer"), and each check
cell (a cell that calls `check_…(`) an autograded test worth one point per check it calls: a check that fails raises
`CheckFailed`, so nbgrader scores it 0; a stub fails every check ("not implemented yet"). labs/ carries the same
cell metadata (with nbgrader's checksums), so it IS the student version: the notebook a learner solves in labs/ is
the one that grades, and nbgrader's Validate fails on it until every check passes. In COURSE_DIR,
`nbgrader generate_assignment labNN` records the lab in the gradebook (and writes release/, the same exercises as
labs/), and `nbgrader autograde labNN` grades submitted/STUDENT/labNN/ in the course kernel (`make lab` registers it).

Nested or unterminated regions are errors, as is a solution without any region or a lab without a solution.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^([ \t]*)#{3} BEGIN SOLUTION\s*$")
END = re.compile(r"^[ \t]*#{3} END SOLUTION\s*$")


class LabError(ValueError):
    pass


def clear_solutions(source: str, where: str, markdown: bool = False) -> tuple[str, int]:
    """Replace each solution region; return (new source, number of regions)."""
    out, regions, start, indent, body = [], 0, None, "", 0
    for lineno, line in enumerate(source.split("\n"), 1):
        m = BEGIN.match(line)
        if m:
            if start is not None:
                raise LabError(f"{where}: line {lineno}: '### BEGIN SOLUTION' inside the region opened at line {start} "
                               f"(regions cannot nest)")
            start, indent, body = lineno, m.group(1), 0
            continue
        if END.match(line):
            if start is None:
                raise LabError(f"{where}: line {lineno}: '### END SOLUTION' without a matching BEGIN")
            if markdown:
                out.append(f"{indent}YOUR ANSWER HERE")
            else:
                out.append(f"{indent}# YOUR CODE HERE (≈{body} line{'s' if body != 1 else ''})")
                out.append(f"{indent}raise NotImplementedError()")
            start, regions = None, regions + 1
            continue
        if start is not None:
            body += bool(line.strip()) and not line.strip().startswith("#")
            continue
        out.append(line)
    if start is not None:
        raise LabError(f"{where}: '### BEGIN SOLUTION' at line {start} is never closed by '### END SOLUTION'")
    return "\n".join(out), regions


def make_lab(solution: Path) -> str:
    """The lab notebook (as text) generated from one solution notebook: the release copy nbgrader grades.

    Its cells carry the nbgrader metadata `nbgrader_source` gives the solution (answer cells, autograded check cells)
    with the checksums nbgrader's generate_assignment would store, so the copy a learner solves in labs/ is the one
    an instructor autogrades, and nbgrader's Validate runs its checks (a stub fails them) instead of finding no test
    to fail."""
    from nbgrader.utils import compute_checksum
    lab = nbgrader_source(solution)
    rel = f"solutions/{solution.name}"
    for i, cell in enumerate(lab.cells):
        if cell.cell_type in ("code", "markdown"):
            cell.source, _ = clear_solutions(cell.source, f"{rel} cell {i}", markdown=cell.cell_type == "markdown")
        if "nbgrader" in cell.metadata:      # as generate_assignment's ComputeChecksums leaves them
            cell.metadata["nbgrader"]["cell_type"] = cell.cell_type
            cell.metadata["nbgrader"]["checksum"] = compute_checksum(cell)
    note = f"<!-- GENERATED from {rel} by tools/make_labs.py: edit that file, then run `make labs` -->\n"
    first_md = next((c for c in lab.cells if c.cell_type == "markdown"), None)
    if first_md is None:
        raise LabError(f"{rel}: a lab needs a markdown title cell first")
    first_md.source = note + first_md.source
    lab.metadata["course"] = {"generated_from": rel, "generator": "tools/make_labs.py"}
    return nbformat.writes(lab) + "\n"


# ------------------------------------------------------------------------------------------------------ nbgrader
CHECK_CALL = re.compile(r"^(?:lab\d\d\.)?(check_\w+)\(", re.M)     # as course_lib.checks names a check cell
NBGRADER_CONFIG = """\
# GENERATED by tools/make_labs.py --nbgrader: the course's labs as an nbgrader course.
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "llm-systems-course"
# The checks launch real ranks: give each cell minutes, not nbgrader's default seconds.
c.Execute.timeout = 600
# nbgrader 0.9's gradebook trips SQLAlchemy 2's autoflush ("Object of type <SubmittedAssignment> not in session …")
# three times per autograde; the grades it stores are unaffected (tests/test_nbgrader.py reads them back).
import warnings  # noqa: E402
from sqlalchemy.exc import SAWarning  # noqa: E402
warnings.filterwarnings("ignore", category=SAWarning, message=r"Object of type <\\w+> not in session")
"""


def _nbgrader(kind: str, grade_id: str, points: int = 0) -> dict:
    meta = {"grade": kind == "check", "grade_id": grade_id, "locked": kind == "check", "schema_version": 3,
            "solution": kind == "answer", "task": False}
    if kind == "check":
        meta["points"] = points
    return meta


def nbgrader_source(solution: Path) -> nbformat.NotebookNode:
    """The solution notebook with nbgrader's cell metadata: answer cells and autograded check cells."""
    nb = nbformat.read(solution, as_version=4)
    rel, answers, checks, ids = f"solutions/{solution.name}", 0, 0, set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            if "### BEGIN SOLUTION" in cell.source:   # nbgrader would want it graded by hand
                raise LabError(f"{rel} cell {i}: --nbgrader handles solution regions in code cells only")
            continue
        called = CHECK_CALL.findall(cell.source)
        if "### BEGIN SOLUTION" in cell.source:
            if called:
                raise LabError(f"{rel} cell {i}: a cell is either an exercise or a check, not both")
            clear_solutions(cell.source, f"{rel} cell {i}")          # the same errors as for labs/
            answers += 1
            cell.metadata["nbgrader"] = _nbgrader("answer", f"answer_{answers:02d}")
        elif called:
            grade_id = "_".join(called) if len(called) <= 2 else f"{called[0]}_and_{len(called) - 1}_more"
            while grade_id in ids:
                grade_id += "_"
            ids.add(grade_id)
            checks += len(called)
            cell.metadata["nbgrader"] = _nbgrader("check", grade_id, points=len(called))
        cell.outputs, cell.execution_count = [], None
    if answers == 0 or checks == 0:
        raise LabError(f"{rel}: a lab needs at least one exercise (a code cell with a '### BEGIN SOLUTION' region) "
                       f"and one check cell (found {answers} and {checks})")
    return nb


def write_nbgrader(course: Path, solutions: list[Path]) -> list[str]:
    """Write COURSE/source/labNN/labNN_*.ipynb for each solution, and COURSE/nbgrader_config.py; the problems."""
    problems = []
    for sol in solutions:
        try:
            nb = nbgrader_source(sol)
        except LabError as e:
            problems.append(str(e))
            continue
        target = course / "source" / sol.name.split("_")[0] / sol.name     # source/lab00/lab00_warmup.ipynb
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(nbformat.writes(nb) + "\n")
        print(f"wrote {target}")
    config = course / "nbgrader_config.py"
    if not config.exists():     # an instructor's own settings (exchange, students) are kept
        config.write_text(NBGRADER_CONFIG)
        print(f"wrote {config}")
    return problems


def collect(course: Path, student: str, notebooks: list[Path], root: Path = ROOT) -> list[str]:
    """Copy each learner's notebook to COURSE/submitted/STUDENT/labNN/ with a timestamp.txt (the file's time, as
    `nbgrader submit` writes it, so grades.csv has it); the problems. A notebook without every nbgrader cell its lab
    has (a copy made before labs/ carried them, a lecture, a renamed file) is refused: autograde would score it 0."""
    problems = []
    for path in notebooks:
        solution = root / "solutions" / path.name
        if not solution.exists():
            problems.append(f"{path}: no lab is called {path.name}; hand in labs/labNN_topic.ipynb under its own name")
            continue
        want = {c.metadata["nbgrader"]["grade_id"] for c in nbgrader_source(solution).cells if "nbgrader" in c.metadata}
        have = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nbformat.read(path, as_version=4).cells}
        missing = sorted(want - have)
        if missing:
            what = "has no nbgrader cells" if not have - {None} else f"lacks the nbgrader cells {', '.join(missing)}"
            problems.append(f"{path}: refused, it {what}, so autograde would score it 0: it is not labs/{path.name} as "
                            f"the course gives it out. Copy the answers into a fresh labs/{path.name} (git pull) and "
                            f"hand that in")
            continue
        target = course / "submitted" / student / path.name.split("_")[0] / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        when = datetime.fromtimestamp(path.stat().st_mtime, UTC)
        (target.parent / "timestamp.txt").write_text(when.strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
        print(f"wrote {target} (handed in {when:%Y-%m-%d %H:%M} UTC)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if labs/ differs from what solutions/ generates")
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--nbgrader", type=Path, metavar="COURSE_DIR", help="write an nbgrader course instead of labs/")
    ap.add_argument("--collect", nargs=2, metavar=("COURSE_DIR", "STUDENT"),
                    help="hand in the NOTEBOOKs given as arguments for STUDENT")
    ap.add_argument("labs", nargs="*", help="with --nbgrader: only these labs, e.g. lab00 (default: all); "
                                            "with --collect: the learner's notebooks")
    args = ap.parse_args(argv)
    sol_dir, lab_dir = args.root / "solutions", args.root / "labs"
    solutions = sorted(sol_dir.glob("lab*.ipynb"))
    if args.collect:
        if not args.labs:
            ap.error("--collect COURSE_DIR STUDENT needs the learner's notebook(s), e.g. lab00_warmup.ipynb")
        problems = collect(Path(args.collect[0]), args.collect[1], [Path(p) for p in args.labs], args.root)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 1 if problems else 0
    if args.labs and not args.nbgrader:
        ap.error("naming labs is for --nbgrader or --collect; labs/ is always generated whole")
    if args.nbgrader:
        unknown = sorted(set(args.labs) - {s.name.split("_")[0] for s in solutions})
        if unknown:
            ap.error(f"no solution for {', '.join(unknown)} in {sol_dir}")
        chosen = [s for s in solutions if not args.labs or s.name.split("_")[0] in args.labs]
        problems = write_nbgrader(args.nbgrader, chosen)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 1 if problems else 0
    stale, problems = [], []
    for sol in solutions:
        try:
            text = make_lab(sol)
        except LabError as e:
            problems.append(str(e))
            continue
        target = lab_dir / sol.name
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.relative_to(args.root).as_posix())
        else:
            lab_dir.mkdir(exist_ok=True)
            if not target.exists() or target.read_text() != text:
                target.write_text(text)
                print(f"wrote {target.relative_to(args.root)}")
    orphans = sorted(p.name for p in lab_dir.glob("lab*.ipynb") if not (sol_dir / p.name).exists())
    for name in orphans:
        problems.append(f"labs/{name} has no solutions/{name}: labs are generated from solutions, add or remove both")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if stale:
        print("labs/ is stale (solutions changed without regenerating): " + ", ".join(stale) +
              "\nrun `make labs` and commit the result", file=sys.stderr)
    if args.check and not (stale or problems):
        print(f"labs/ is up to date with solutions/ ({len(solutions)} lab(s))")
    return 1 if (stale or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
