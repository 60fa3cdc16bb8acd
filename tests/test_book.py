"""`make book` (tools/book.py): the static site builds from executed notebooks, and every page, link and image in
it resolves inside the book, so it opens from disk or any web server. Built here from a small course (one executed
lecture with a figure and a printed number, one lab, a formula sheet); the real course's links are checked too."""
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import book  # noqa: E402

LECTURE = [
    nbformat.v4.new_markdown_cell("# 00 · A tiny lecture\n\nDo [the lab](../labs/lab00_tiny.ipynb) next (its "
                                  "[answers](../solutions/lab00_tiny.ipynb) stay out of the book); the formula is in "
                                  "[the sheet](../docs/formulas.md#1-the-one-formula)."),
    nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\n"
                              "print(f'measured {6.0 * 7 + 1 / 8:.3f} bytes')\n"
                              "fig, ax = plt.subplots(figsize=(2, 2)); ax.plot([0, 1], [1, 0]); plt.show()"),
]
LAB = [nbformat.v4.new_markdown_cell("# Lab 00 · Tiny\n\nBack to [the lecture](../notebooks/00_tiny.ipynb)."),
       nbformat.v4.new_code_cell("def f():\n    # YOUR CODE HERE (≈1 line)\n    raise NotImplementedError()")]


@pytest.fixture(scope="module")
def small_course(tmp_path_factory):
    from nbclient import NotebookClient
    root = tmp_path_factory.mktemp("course")
    for folder in ("notebooks", "labs", "docs", "executed/notebooks"):
        (root / folder).mkdir(parents=True)
    lecture = nbformat.v4.new_notebook(cells=LECTURE)
    nbformat.write(lecture, root / "notebooks" / "00_tiny.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=LAB), root / "labs" / "lab00_tiny.ipynb")
    (root / "docs" / "formulas.md").write_text("# Formulas\n\n## 1. The one formula\n\n$M = 16\\Psi$ bytes\n")
    NotebookClient(lecture, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    nbformat.write(lecture, root / "executed" / "notebooks" / "00_tiny.ipynb")
    out = root / "book"
    pages = book.build(out, root / "executed", root=root)
    return out, pages


def test_the_book_has_every_page_and_every_link_and_image_resolves(small_course):
    out, pages = small_course
    assert pages == ["docs/formulas.html", "index.html", "labs/lab00_tiny.html", "notebooks/00_tiny.html"]
    assert all((out / p).is_file() for p in pages)
    assert book.check_book(out) == []
    lecture = (out / "notebooks" / "00_tiny.html").read_text()
    assert 'href="../labs/lab00_tiny.html"' in lecture, "a link to a lab should lead to the lab's page"
    # written for GitHub (formulas.md#1-the-one-formula), it leads to the heading's id in the book's page
    assert 'href="../docs/formulas.html#1.-The-one-formula"' in lecture
    assert "solutions/" not in lecture, "the book has no solutions: a link to one leads to the lab"
    index = (out / "index.html").read_text()
    for page in ("notebooks/00_tiny.html", "labs/lab00_tiny.html", "docs/formulas.html"):
        assert f'href="{page}"' in index, f"the contents page does not link {page}"


def test_lectures_show_what_they_printed_and_drew_and_labs_are_not_run(small_course):
    out, _ = small_course
    lecture = (out / "notebooks" / "00_tiny.html").read_text()
    assert "measured 42.125 bytes" in lecture
    assert re.search(r'<img[^>]+src="data:image/png;base64,', lecture), "the figure should be in the page"
    lab = (out / "labs" / "lab00_tiny.html").read_text()
    outputs = re.compile(r'class="[^"]*jp-OutputArea-output')
    assert outputs.search(lecture) and "NotImplementedError" in lab and not outputs.search(lab), \
        "a lab page shows the stub, not a run"
    assert "16\\Psi" in (out / "docs" / "formulas.html").read_text()


def test_a_broken_link_or_missing_anchor_is_reported(small_course, tmp_path):
    out, _ = small_course
    stray = out / "notebooks" / "stray.html"
    stray.write_text('<a href="../labs/missing.html">x</a> <a href="00_tiny.html#no-such-heading">y</a>'
                     '<img src="figure.png">')
    try:
        problems = book.check_book(out)
    finally:
        stray.unlink()
    assert len(problems) == 3 and all(p.startswith("notebooks/stray.html") for p in problems), problems


def test_a_lecture_that_did_not_run_is_refused(tmp_path):
    with pytest.raises(book.BookError, match="no executed copy of 00_orientation.ipynb"):
        book.build(tmp_path / "book", tmp_path / "nothing-executed")


def test_every_relative_link_in_the_course_leads_to_a_page_of_the_book():
    sources = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "labs").glob("*.ipynb"))
    pages = {book.page_of(p.relative_to(ROOT).as_posix()) for p in sources} | {"index.html", "docs/formulas.html"}
    texts = {"docs/formulas.html": (ROOT / "docs" / "formulas.md").read_text()}
    for path in sources:
        texts[book.page_of(path.relative_to(ROOT).as_posix())] = "\n".join(
            c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    bad = []
    for page, text in texts.items():
        for url in re.findall(r"\]\(([^)\s]+)\)|(?:href|src)=\"([^\"]+)\"", text):
            url = url[0] or url[1]
            if url.startswith("#") or book.EXTERNAL.match(url):
                continue
            html = book.rewrite_links(f'href="{url}"', page, pages)
            target = re.search(r'href="([^"#]*)', html).group(1)
            resolved = (Path("/book") / page).parent.joinpath(target).resolve().relative_to("/book").as_posix()
            if resolved not in pages:
                bad.append(f"{page}: {url}")
    assert not bad, "links to files the book does not carry: " + ", ".join(bad)
