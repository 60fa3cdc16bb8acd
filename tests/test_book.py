"""`make book` (tools/book.py): the website builds from executed notebooks with Sphinx + MyST-NB + sphinx-book-theme;
every link and image in it resolves inside the book, no page needs the network (formulas typeset by the book's own
MathJax), and a reader can navigate: sidebar, previous/next, the page's contents, search, "formulas §N" and
"notebook NN" as links, each page's notebook to download, the commit and date on the contents page. Built here from
a small course (two executed lectures, one with a figure, formulas and mentions; one lab; a formula sheet); the real
course's links and mentions are checked too."""
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
                                  "[the sheet](../docs/formulas.md#11-the-one-formula): $M = 16\\Psi$, as "
                                  "formulas §1.1 says (formulas §1.7 has no heading: its link goes to §1). Then "
                                  "notebook 01, and lab 00 (docs/formulas.md §1.1 again); `formulas §1` in code "
                                  "stays as written."),
    nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\n"
                              "print(f'measured {6.0 * 7 + 1 / 8:.3f} bytes')\n"
                              "print('as formulas §1.1 says; notebook 01 next')  # formulas §1\n"
                              "fig, ax = plt.subplots(figsize=(2, 2)); ax.plot([0, 1], [1, 0]); plt.show()"),
]
SECOND = [nbformat.v4.new_markdown_cell("# 01 · The next lecture\n\n## A section\n\nBack to notebook 00."),
          nbformat.v4.new_code_cell("print('second')")]
LAB = [nbformat.v4.new_markdown_cell("<!-- GENERATED -->\n# Lab 00 · Tiny\n\nBack to "
                                     "[the lecture](../notebooks/00_tiny.ipynb)."),
       nbformat.v4.new_code_cell("def f():\n    # YOUR CODE HERE (≈1 line)\n    raise NotImplementedError()")]
FORMULAS = "# Formulas\n\n## §1 Memory\n\n### 1.1 The one formula\n\n$$M = 16\\Psi$$ bytes\n"
PAGES = ["docs/formulas.html", "index.html", "labs/lab00_tiny.html", "notebooks/00_tiny.html",
         "notebooks/01_next.html"]


@pytest.fixture(scope="module")
def small_course(tmp_path_factory):
    from nbclient import NotebookClient
    root = tmp_path_factory.mktemp("course")
    for folder in ("notebooks", "labs", "docs", "executed/notebooks"):
        (root / folder).mkdir(parents=True)
    for name, cells in (("00_tiny", LECTURE), ("01_next", SECOND)):
        lecture = nbformat.v4.new_notebook(cells=cells)
        nbformat.write(lecture, root / "notebooks" / f"{name}.ipynb")
        NotebookClient(lecture, timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(root)}}).execute()
        nbformat.write(lecture, root / "executed" / "notebooks" / f"{name}.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=LAB), root / "labs" / "lab00_tiny.ipynb")
    (root / "docs" / "formulas.md").write_text(FORMULAS)
    out = root / "book"
    pages = book.build(out, root / "executed", root=root)
    return root, out, pages


def _page(out, name):
    return (out / name).read_text()


def test_the_book_has_every_page_and_every_link_and_image_resolves_without_the_network(small_course):
    _, out, pages = small_course
    assert pages == PAGES and all((out / p).is_file() for p in pages)
    assert book.check_book(out) == []
    lecture = _page(out, "notebooks/00_tiny.html")
    assert 'href="../labs/lab00_tiny.html"' in lecture, "a link to a lab should lead to the lab's page"
    assert "solutions/" not in lecture, "the book has no solutions: a link to one leads to the lab"
    # written for GitHub (formulas.md#11-the-one-formula), it leads to the heading in the book's page
    assert re.search(r'href="../docs/formulas.html#[^"]+"><span[^>]*>the sheet', lecture)
    assert re.search(r'<script[^>]+src="../_static/mathjax/tex-chtml-full.js', lecture), "MathJax from the book"
    assert not re.search(r'src="(https?:)?//', "".join(_page(out, p) for p in pages)), "a page loads from the network"


def test_formulas_and_notebook_mentions_are_links(small_course):
    _, out, _ = small_course
    lecture = _page(out, "notebooks/00_tiny.html")
    formulas = _page(out, "docs/formulas.html")
    assert 'id="formulas-1-1"' in formulas and 'id="formulas-1"' in formulas
    assert re.search(r'href="../docs/formulas.html#formulas-1-1"[^>]*>.*?formulas §1\.1', lecture, re.S)
    assert re.search(r'href="../docs/formulas.html#formulas-1"[^>]*>.*?formulas §1\.7', lecture, re.S)
    assert re.search(r'href="../docs/formulas.html#formulas-1-1"[^>]*>.*?docs/formulas.md §1\.1', lecture, re.S)
    assert re.search(r'href="01_next.html"[^>]*>.*?notebook 01', lecture, re.S)
    assert re.search(r'href="../labs/lab00_tiny.html"[^>]*>.*?lab 00', lecture, re.S)
    assert "<code class=\"docutils literal notranslate\"><span class=\"pre\">formulas</span>" in lecture, \
        "a mention in inline code should stay code"
    output = re.search(r'42.125 bytes\s+as <a class="reference internal" href="../docs/formulas.html#formulas-1-1">'
                       r'formulas §1.1</a> says; <a class="reference internal" href="../notebooks/01_next.html">'
                       r'notebook 01</a>', lecture)
    comment = re.search(r'<span class="c1"># <a class="reference internal" href="../docs/formulas.html#formulas-1">'
                        r'formulas §1</a></span>', lecture)
    assert output and comment, "mentions in what a cell printed and in its comments should be links too"


def test_a_reader_can_navigate_search_and_download(small_course):
    root, out, pages = small_course
    lecture = _page(out, "notebooks/00_tiny.html")
    for page in ("../index.html", "01_next.html", "../labs/lab00_tiny.html", "../docs/formulas.html"):
        assert f'href="{page}"' in lecture, f"the sidebar of notebook 00 should link {page}"
    assert re.search(r'class="[^"]*left-prev[^"]*"[^>]*href="../index.html"|href="../index.html"[^>]*class="[^"]*'
                     r'left-prev', lecture), "previous: the contents"
    assert re.search(r'href="../labs/lab00_tiny.html"[^>]*class="[^"]*right-next|class="[^"]*right-next[^"]*"[^>]*'
                     r'href="../labs/lab00_tiny.html"', lecture), "next: the lecture's lab"
    second = _page(out, "notebooks/01_next.html")
    assert re.search(r'class="[^"]*page-toc[^"]*"', second) and 'href="#a-section"' in second, "in-page contents"
    assert (out / "search.html").is_file() and re.search(r"\"tini\":\[[^]]*3", (out / "searchindex.js").read_text())
    download = re.search(r'href="(../_downloads/[^"]+/00_tiny.ipynb)"', lecture)
    assert download, "the page should link its notebook to download"
    assert (out / "notebooks" / download[1]).resolve().read_text() == (root / "notebooks" / "00_tiny.ipynb").read_text()
    index = _page(out, "index.html")
    assert re.search(r"The lectures ran on \d{4}-\d\d-\d\d \d\d:\d\d UTC, from not a git checkout", index)
    for page in ("notebooks/00_tiny.html", "labs/lab00_tiny.html", "docs/formulas.html"):
        assert f'href="{page}"' in index, f"the contents page does not link {page}"


def test_lectures_show_what_they_printed_and_drew_assets_once_and_labs_are_not_run(small_course):
    _, out, pages = small_course
    lecture = _page(out, "notebooks/00_tiny.html")
    assert "measured 42.125 bytes" in lecture
    figure = re.search(r'<img[^>]+src="(../_images/[^"]+\.png)"', lecture)
    assert figure and (out / "notebooks" / figure[1]).resolve().is_file(), "the figure should be a file in _images/"
    assert max((out / p).stat().st_size for p in pages) < 200_000, "a page carries assets it should share"
    lab = _page(out, "labs/lab00_tiny.html")
    assert 'class="cell_output' in lecture and "NotImplementedError" in lab and 'class="cell_output' not in lab, \
        "a lab page shows the stub, not a run"


def test_a_broken_link_a_missing_anchor_or_a_remote_script_is_reported(small_course):
    _, out, _ = small_course
    stray = out / "notebooks" / "stray.html"
    stray.write_text('<a href="../labs/missing.html">x</a> <a href="00_tiny.html#no-such-heading">y</a>'
                     '<img src="figure.png"><script src="https://cdn.example.org/mathjax.js"></script>'
                     '<span class="math notranslate">\\(x\\)</span>')
    try:
        problems = book.check_book(out)
    finally:
        stray.unlink()
    assert len(problems) == 5 and all(p.startswith("notebooks/stray.html") for p in problems), problems


def test_a_lecture_that_did_not_run_is_refused(tmp_path):
    with pytest.raises(book.BookError, match="no executed copy of 00_orientation.ipynb"):
        book.build(tmp_path / "book", tmp_path / "nothing-executed")


def _course_markdown():
    sources = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "labs").glob("*.ipynb"))
    texts = {"docs/formulas.md": (ROOT / "docs" / "formulas.md").read_text()}
    for path in sources:
        texts[path.relative_to(ROOT).as_posix()] = "\n".join(
            c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    return sources, texts


def test_every_relative_link_in_the_course_leads_to_a_page_of_the_book():
    sources, texts = _course_markdown()
    docs = {p.relative_to(ROOT).as_posix() for p in sources} | {"docs/formulas.md", "README.md"}
    bad = []
    for page, text in texts.items():
        for url in re.findall(r"\]\(([^)\s]+)\)", book.repository_links(text)):
            path = url.partition("#")[0]
            if not path or book.EXTERNAL.match(path):
                continue
            resolved = (Path("/r") / page).parent.joinpath(path).resolve().relative_to("/r").as_posix()
            if resolved not in docs and resolved != "index.md":
                bad.append(f"{page}: {url}")
    assert not bad, "links to files the book does not carry: " + ", ".join(bad)


def test_every_formulas_and_notebook_mention_in_the_course_becomes_a_link():
    sources, texts = _course_markdown()
    labels = book.formula_sections(texts["docs/formulas.md"])
    docs = {("notebook" if p.parent.name == "notebooks" else "lab", book._number(p.name)): p.stem for p in sources}
    plain = []
    for page, text in texts.items():
        linked = book.link_mentions(text, labels, docs)
        left = book.KEEP.sub("", linked)     # outside code, math, links and headings (a link made is a role: code)
        plain += [f"{page}: {m[0]}" for m in [*book.FORMULA.finditer(left), *book.MENTION.finditer(left)]]
    assert not plain, "mentions left as plain text (no such section or notebook?): " + ", ".join(plain[:20])
