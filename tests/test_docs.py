"""The course carries its own references: every formula a docstring or notebook cites is in docs/formulas.md, and
nothing points at files a learner does not have."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHEET = ROOT / "docs" / "formulas.md"
COURSE_FILES = sorted(p for pattern in ("course_lib/**/*.py", "notebooks/*.ipynb", "solutions/*.ipynb",
                                        "labs/*.ipynb", "tools/*.py", "docs/*.md", "*.md")
                      for p in ROOT.glob(pattern))
OUTSIDE = ("FACTS", "PLATFORM.md", "PEERS.md", "shared/reference")
CITE = re.compile(r"formulas(?:\.md)? §(\d+)(?:\.(\d+))?")


def _sections() -> set:
    heads = re.findall(r"^#{2,3} §?(\d+)(?:\.(\d+))?\b", SHEET.read_text(), flags=re.M)
    return {(int(a), int(b)) if b else (int(a), None) for a, b in heads}


@pytest.mark.parametrize("path", COURSE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_to_files_outside_the_course(path):
    text = path.read_text()
    found = [w for w in OUTSIDE if w in text]
    assert not found, f"{path.relative_to(ROOT)} mentions {found}: cite the paper or docs/formulas.md §N instead"


def test_every_formula_citation_names_a_section_of_the_sheet():
    sections = _sections()
    assert {(n, None) for n in range(1, 11)} <= sections, "docs/formulas.md needs sections §1 … §10"
    bad = []
    for path in COURSE_FILES:
        for m in CITE.finditer(path.read_text()):
            key = (int(m.group(1)), int(m.group(2)) if m.group(2) else None)
            if key not in sections:
                bad.append(f"{path.relative_to(ROOT)}: '{m.group(0)}'")
    assert not bad, "citations of sections docs/formulas.md does not have:\n" + "\n".join(bad)
    cited = sum(len(CITE.findall(p.read_text())) for p in COURSE_FILES)
    assert cited >= 10, f"only {cited} citations of the formula sheet found: is the pattern still right?"


def test_no_merge_conflict_markers_anywhere():
    tracked = [ROOT / p for p in __import__("subprocess").run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                                               text=True).stdout.split()]
    bad = [str(p.relative_to(ROOT)) for p in tracked if p.is_file() and p.suffix in (".py", ".md", ".ipynb", ".toml",
                                                                                     ".yml", ".sh", "")
           and re.search(r"^(<<<<<<< |>>>>>>> )", p.read_text(errors="replace"), re.M)]
    assert not bad, f"merge conflict markers in {bad}"
