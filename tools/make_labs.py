#!/usr/bin/env python3
"""Generate labs/ from solutions/: every `### BEGIN SOLUTION` … `### END SOLUTION` region becomes
`# YOUR CODE HERE (≈N lines)` + `raise NotImplementedError()` at the region's indent (nbgrader's ClearSolutions
rule, so instructors can also run nbgrader on solutions/). In markdown cells a region becomes `YOUR ANSWER HERE`.

    python tools/make_labs.py            write labs/labNN_*.ipynb
    python tools/make_labs.py --check    exit 1 if any lab is stale (the nbdev-ci pattern); CI runs this

Nested or unterminated regions are errors, as is a solution without any region or a lab without a solution.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
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
    """The lab notebook (as text) generated from one solution notebook."""
    nb = nbformat.read(solution, as_version=4)
    lab = copy.deepcopy(nb)
    rel = f"solutions/{solution.name}"
    total = 0
    for i, cell in enumerate(lab.cells):
        if cell.cell_type in ("code", "markdown"):
            cell.source, n = clear_solutions(cell.source, f"{rel} cell {i}", markdown=cell.cell_type == "markdown")
            total += n
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    if total == 0:
        raise LabError(f"{rel}: no '### BEGIN SOLUTION' region, so the lab would be the solution")
    note = f"<!-- GENERATED from {rel} by tools/make_labs.py: edit that file, then run `make labs` -->\n"
    first_md = next((c for c in lab.cells if c.cell_type == "markdown"), None)
    if first_md is None:
        raise LabError(f"{rel}: a lab needs a markdown title cell first")
    first_md.source = note + first_md.source
    lab.metadata["course"] = {"generated_from": rel, "generator": "tools/make_labs.py"}
    return nbformat.writes(lab) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if labs/ differs from what solutions/ generates")
    ap.add_argument("--root", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    sol_dir, lab_dir = args.root / "solutions", args.root / "labs"
    solutions = sorted(sol_dir.glob("lab*.ipynb"))
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
