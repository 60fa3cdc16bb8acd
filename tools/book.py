#!/usr/bin/env python3
"""`make book`: the whole course as a static HTML site in build/book/, for readers without a setup.

    python tools/book.py                 execute every notebook (tools/run_all.py → build/executed/), then build
    python tools/book.py --no-run        build from the executed copies already in build/executed/ (make run-all)

What goes in: every lecture notebook executed (figures and printed numbers as they came out on this machine); every
lab as generated in labs/ (no solutions), NOT executed — an unmodified lab stops at its first exercise with "not
implemented yet", so its outputs would show set-up lines and a failure, not the lesson; the exercise is the
spec and the stub; the formula sheet docs/formulas.md; a contents page, index.html. The site keeps the repository's
layout (notebooks/NN_x.html, labs/labNN_x.html, docs/formulas.html), every link between pages is relative and
rewritten from .ipynb/.md to the page, images are embedded in the page, so the folder opens from disk as it is or
can be served by any web server. Formulas are typeset by MathJax, which the pages load from its CDN (offline they
show as TeX source).
"""
from __future__ import annotations

import argparse
import html
import posixpath
import re
import shutil
import sys
from pathlib import Path, PurePosixPath

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r'(?P<attr>\b(?:href|src))="(?P<url>[^"]*)"')
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)     # http:, https:, mailto:, data:, //host


class BookError(RuntimeError):
    pass


def page_of(source: str) -> str | None:
    """Where a repository file appears in the book: notebooks/x.ipynb → notebooks/x.html; a solution → its lab (the
    book has no solutions); None for a file the book does not carry."""
    path = PurePosixPath(source)
    if path.suffix == ".ipynb" and path.parent.name == "solutions":
        path = PurePosixPath("labs") / path.name
    if path.suffix == ".ipynb" or path.as_posix() == "docs/formulas.md":
        return path.with_suffix(".html").as_posix()
    if path.as_posix() == "README.md":
        return "index.html"
    return None


def rewrite_links(text: str, page: str, pages: set[str]) -> str:
    """Point each relative link of the page at `page` (a book path) to the book page it names; links outside the
    book are left as written (check_book reports them)."""
    here = posixpath.dirname(page)

    def fix(m):
        url = m["url"]
        if not url or url.startswith("#") or EXTERNAL.match(url):
            return m[0]
        path, _, fragment = url.partition("#")
        target = posixpath.normpath(posixpath.join(here, path))
        mapped = page_of(target) if target not in pages else target
        if mapped not in pages:
            return m[0]
        new = posixpath.relpath(mapped, here or ".") + (f"#{fragment}" if fragment else "")
        return f'{m["attr"]}="{html.escape(new, quote=True)}"'
    return LINK.sub(fix, text)


def to_html(nb) -> str:
    from nbconvert import HTMLExporter
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return body


def markdown_page(markdown: str, title: str) -> str:
    """A markdown document rendered like a notebook's markdown cells (the same styles and MathJax)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(markdown)])
    nb.metadata["title"] = title
    return to_html(nb)


def title_of(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", re.sub(r"<!--.*?-->", "", cell.source, flags=re.S), re.M)
            if m:
                return m.group(1).strip()
    return fallback


def contents(lectures: dict[str, str], labs: dict[str, str]) -> str:
    """The contents page (markdown): each lecture beside the lab with its number, then the formula sheet."""
    def number(page):
        return re.match(r"(?:lab)?(\d\d)", PurePosixPath(page).name).group(1)
    lab_by_number = {number(p): (p, t) for p, t in labs.items()}
    rows = []
    for page, title in lectures.items():
        lab = lab_by_number.pop(number(page), None)
        rows.append(f"| {number(page)} | [{title}]({page}) | " + (f"[{lab[1]}]({lab[0]})" if lab else "") + " |")
    rows += [f"| {n} | | [{t}]({p}) |" for n, (p, t) in sorted(lab_by_number.items())]
    return "\n".join([
        "# Systems for large-model training — the book",
        "",
        "The course's lecture notebooks as they ran (every figure and printed number is from a real run, and each "
        "number is asserted in the notebook against its formula), the labs as a learner gets them, and the formula "
        "sheet. To run the notebooks and do the labs yourself: clone the repository and run `make lab`.",
        "",
        "| # | lecture (executed) | lab (exercises, not executed: the checks need your code) |",
        "|---|---|---|",
        *rows,
        "",
        "**[The formula sheet](docs/formulas.html)** — every formula an assert checks, with its paper and section.",
    ])


def build(out: Path, executed: Path, root: Path = ROOT) -> list[str]:
    """Write the book into `out` from the executed lectures in `executed/notebooks/`; the pages written."""
    lectures_src = sorted((root / "notebooks").glob("*.ipynb"))
    missing = [p.name for p in lectures_src if not (executed / "notebooks" / p.name).exists()]
    if missing:
        raise BookError(f"no executed copy of {', '.join(missing)} in {executed / 'notebooks'}: run "
                        f"`python tools/book.py` (it executes them) or `make run-all` first")
    sources = {f"notebooks/{p.name}": executed / "notebooks" / p.name for p in lectures_src}
    sources.update({f"labs/{p.name}": p for p in sorted((root / "labs").glob("*.ipynb"))})
    pages = {page_of(s) for s in sources} | {"index.html", "docs/formulas.html"}
    if out.exists():
        shutil.rmtree(out)
    titles: dict[str, str] = {}
    for source, path in sources.items():
        nb = nbformat.read(path, as_version=4)
        page = page_of(source)
        titles[page] = title_of(nb, PurePosixPath(source).stem)
        nb.metadata["title"] = titles[page]
        if source.startswith("notebooks/"):
            errors = [c for c in nb.cells if c.cell_type == "code" and any(o.output_type == "error" for o in c.outputs)]
            if errors:
                raise BookError(f"{path}: a cell failed when the notebook ran; the book shows lectures that run")
        _write(out / page, rewrite_links(to_html(nb), page, pages))
    formulas = (root / "docs" / "formulas.md").read_text()
    _write(out / "docs" / "formulas.html",
           rewrite_links(markdown_page(formulas, "Formula sheet"), "docs/formulas.html", pages))
    lectures = {p: t for p, t in titles.items() if p.startswith("notebooks/")}
    labs = {p: t for p, t in titles.items() if p.startswith("labs/")}
    _write(out / "index.html", rewrite_links(markdown_page(contents(lectures, labs), "Systems for large-model "
                                                           "training"), "index.html", pages))
    fix_fragments(out)
    return sorted(pages)


def github_slug(anchor: str) -> str:
    """The anchor GitHub gives a heading, from the id nbconvert gave it ('1.-The-one-formula' → '1-the-one-formula'),
    so a link written for the repository (`formulas.md#1-the-one-formula`) also works in the book."""
    return re.sub(r"[^\w\- ]", "", anchor.replace("-", " ").lower()).replace(" ", "-")


def fix_fragments(out: Path) -> None:
    """Point each #fragment that names no id of its page at the id GitHub's rule would give the same heading."""
    ids = {page: set(re.findall(r'\bid="([^"]+)"', page.read_text())) for page in out.rglob("*.html")}
    slugs = {page: {github_slug(i): i for i in found} for page, found in ids.items()}
    for page in ids:
        def fix(m):
            path, _, fragment = html.unescape(m["url"]).partition("#")
            if not fragment or EXTERNAL.match(path):
                return m[0]
            target = (page.parent / path).resolve() if path else page
            if fragment in ids.get(target, ()) or fragment not in slugs.get(target, {}):
                return m[0]
            return f'{m["attr"]}="{html.escape(path + "#" + slugs[target][fragment], quote=True)}"'
        page.write_text(LINK.sub(fix, page.read_text()))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def check_book(out: Path) -> list[str]:
    """Every href and src in every page that is not external resolves: a file in the book, and for a #fragment
    an id in that page. Returns the problems (empty when the book is whole)."""
    problems, ids = [], {}
    pages = sorted(out.rglob("*.html"))
    for page in pages:
        ids[page] = set(re.findall(r'\bid="([^"]+)"', page.read_text()))
    for page in pages:
        for m in LINK.finditer(page.read_text()):
            url = html.unescape(m["url"])
            if EXTERNAL.match(url):
                continue
            path, _, fragment = url.partition("#")
            target = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(out)}: {m['attr']}={url!r}"
            if not target.is_file() or not target.is_relative_to(out.resolve()):
                problems.append(f"{where} names no file in the book")
            elif fragment and target.suffix == ".html" and fragment not in ids.get(target, set()):
                problems.append(f"{where}: no id {fragment!r} in {target.relative_to(out.resolve())}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "book")
    ap.add_argument("--executed", type=Path, default=ROOT / "build" / "executed",
                    help="where the executed notebooks are (tools/run_all.py --out)")
    ap.add_argument("--no-run", action="store_true", help="do not execute the notebooks; use those in --executed")
    args = ap.parse_args(argv)
    if not args.no_run:
        sys.path.insert(0, str(ROOT / "tools"))
        import run_all
        if run_all.main(["--out", str(args.executed)]) != 0:
            print("error: a notebook failed to execute (table above); the book is built from lectures that run",
                  file=sys.stderr)
            return 1
    try:
        pages = build(args.out, args.executed)
    except BookError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    problems = check_book(args.out)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"wrote {len(pages)} pages to {args.out}: open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
