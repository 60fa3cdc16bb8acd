#!/usr/bin/env python3
"""`make book`: the whole course as a website in build/book/, for readers without a setup.

    python tools/book.py                 execute every notebook (tools/run_all.py → build/executed/), then build
    python tools/book.py --no-run        build from the executed copies already in build/executed/ (make run-all)

Built with Sphinx, MyST-NB and sphinx-book-theme (pinned in pyproject.toml): a sidebar with every page, previous/next
links, each page's own contents, full-text search, formulas typeset by MathJax served from the book itself (the copy
the sphinx-mathjax-offline package ships: nothing loads from the network), the theme's assets once in _static/ and
each figure once in _images/. What goes in: every lecture notebook executed (figures and printed numbers as they came
out on this machine); every lab as generated in labs/ (no solutions), NOT executed — an unmodified lab stops at its
first exercise with "not implemented yet", so its outputs would show set-up lines and a failure, not the lesson;
the formula sheet docs/formulas.md; a contents page (index.html) naming the commit and the date of the run. Each
page links the notebook to download (as stored: what `make lab` runs); "formulas §N", "notebook NN" and "lab NN" in
the text link to that section, notebook or lab, and links written for the repository (../labs/x.ipynb,
formulas.md#heading) lead to the book's page. The folder opens from disk as it is or from any web server.
"""
from __future__ import annotations

import argparse
import html
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r'(?P<attr>\b(?:href|src))="(?P<url>[^"]*)"')
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)     # http:, https:, mailto:, data:, //host
# Loads a script or style sheet, or an image, from another host: the page would need the network.
REMOTE_ASSET = re.compile(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//', re.I)
MATHJAX = "mathjax/tex-chtml-full.js"       # under _static/: TeX input, HTML output, every TeX extension built in
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"      # a live control: nothing to show in a static page
# The style sheet IPython's Code display (course_lib.show_source) puts before every listing: 4.7 kB each time, and
# for `.output_html`, a class the book's pages do not have; the theme's own pygments.css colours `.highlight` once.
PYGMENTS_STYLE = re.compile(r"<style>pre \{ line-height: 125%; \}.*?</style>", re.S)


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


# ------------------------------------------------------------------------------------------- the text as links
# Markdown that must stay as written: code, math, links, HTML, headings (a link in a heading would be one in the
# sidebar too).
KEEP = re.compile(r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]+\$|!?\[[^\]]*\]\([^)]*\)|<!--.*?-->|<[^>\n]+>|^#[^\n]*",
                  re.S | re.M)
FORMULA = re.compile(r"\b(?:docs/)?formulas(?:\.md)? §(\d+)(?:\.(\d+))?")   # formulas §2.2, docs/formulas.md §9
MENTION = re.compile(r"\b([Nn]otebook|[Ll]ab) (\d\d)\b")
SECTION = re.compile(r"^(#{2,3}) (?:§(\d+)|(\d+)\.(\d+)) ", re.M)        # "## §2 …", "### 2.2 …" in formulas.md


def formula_label(section: str, sub: str | None = None) -> str:
    return f"formulas-{section}" + (f"-{sub}" if sub else "")


def formula_sections(formulas_md: str) -> set[str]:
    """The labels of the formula sheet's sections ('formulas-2') and subsections ('formulas-2-2')."""
    return {formula_label(m[2]) if m[2] else formula_label(m[3], m[4]) for m in SECTION.finditer(formulas_md)}


def label_formula_sections(formulas_md: str) -> str:
    """The formula sheet with a MyST target before each numbered (sub)section, for the links below to name."""
    return SECTION.sub(lambda m: f"({formula_label(m[2]) if m[2] else formula_label(m[3], m[4])})=\n{m[0]}",
                       formulas_md)


def link_mentions(markdown: str, labels: set[str], docs: dict[tuple[str, str], str]) -> str:
    """Turn "formulas §N[.M]" (or "docs/formulas.md §N[.M]") into a link to that section (to §N where N.M has no
    heading of its own) and "notebook NN" / "lab NN" into a link to that page; docs maps ('notebook' | 'lab', 'NN')
    to a document name."""
    def formulas(m):
        for label in (formula_label(m[1], m[2]), formula_label(m[1])):
            if label in labels:
                return f"{{ref}}`{m[0]} <{label}>`"
        return m[0]

    def mention(m):
        doc = docs.get((m[1].lower(), m[2]))
        return f"{{doc}}`{m[0]} </{doc}>`" if doc else m[0]

    out, last = [], 0
    for keep in KEEP.finditer(markdown):
        out.append(MENTION.sub(mention, FORMULA.sub(formulas, markdown[last:keep.start()])))
        out.append(keep[0])
        last = keep.end()
    out.append(MENTION.sub(mention, FORMULA.sub(formulas, markdown[last:])))
    return "".join(out)


def link_listing_mentions(page_html: str, here: str, labels: set[str], docs: dict[tuple[str, str], str]) -> str:
    """The same links in what Sphinx made of code: comments, docstrings and printed lines in the page's <main> of the
    page `here` (a document name) name formulas, notebooks and labs too. Text already in a link, inside a tag or
    split over highlighting spans (inline code) is left as it is."""
    up = "../" * here.count("/")

    def anchor(href, text):
        return f'<a class="reference internal" href="{up}{href}">{text}</a>'

    def formulas(m):
        for label in (formula_label(m[1], m[2]), formula_label(m[1])):
            if label in labels:
                return anchor(f"docs/formulas.html#{label}", m[0])
        return m[0]

    def mention(m):
        doc = docs.get((m[1].lower(), m[2]))
        return anchor(f"{doc}.html", m[0]) if doc else m[0]

    def text(part):
        return MENTION.sub(mention, FORMULA.sub(formulas, part))
    start, end = page_html.find("<main"), page_html.rfind("</main>")
    if start < 0 or end < 0:
        return page_html
    main = re.split(r"(<a\b.*?</a>|<[^>]+>)", page_html[start:end], flags=re.S)
    return page_html[:start] + "".join(p if i % 2 else text(p) for i, p in enumerate(main)) + page_html[end:]


def repository_links(markdown: str) -> str:
    """Links written for the repository that the book carries under another name: a solution → its lab; the
    README → the contents page."""
    def fix(m):
        target = m[2]
        path, _, fragment = target.partition("#")
        if EXTERNAL.match(path) or not path:
            return m[0]
        name = PurePosixPath(path)
        if name.parent.name == "solutions" and name.suffix == ".ipynb":
            target = (name.parent.parent / "labs" / name.name).as_posix() + (f"#{fragment}" if fragment else "")
        elif name.name == "README.md":
            target = (name.parent / "index.md").as_posix()
        return f"{m[1]}({target})"
    return re.sub(r"(\[[^\]]*\])\(([^)\s]+)\)", fix, markdown)


# ----------------------------------------------------------------------------------------------- the source tree
def title_of(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", re.sub(r"<!--.*?-->", "", cell.source, flags=re.S), re.M)
            if m:
                return m.group(1).strip()
    return fallback


def _number(name: str) -> str:
    return re.match(r"(?:lab)?(\d\d)", name).group(1)


def _prepare(nb, doc: str, labels: set[str], docs: dict, download: str, what: str) -> None:
    """In place: the notebook as the book shows it (links, the download line under the title, no live widgets, no
    style sheet repeated in each listing)."""
    nb.metadata.pop("widgets", None)
    titled = False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = link_mentions(repository_links(cell.source), labels, docs)
            if not titled:
                cell.source = re.sub(r"^(#\s+.+)$", lambda m: f"{m[0]}\n\n{download_line(download, what)}",
                                     cell.source, count=1, flags=re.M)
                titled = "{download}" in cell.source
        elif cell.cell_type == "code":
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                data.pop(WIDGET_VIEW, None)
                if "text/html" in data:
                    data["text/html"] = PYGMENTS_STYLE.sub("", "".join(data["text/html"]))
    if not titled:
        raise BookError(f"{doc}: no markdown title ('# …') to put the download link under")


def download_line(download: str, what: str) -> str:
    return (f"{{download}}`Download this notebook </{download}>` ({what}; to run it, clone the course and "
            f"`make lab`) · {{doc}}`Contents </index>` · {{ref}}`Formula sheet <formulas-sheet>`")


def git_state(root: Path) -> str:
    """'commit `abc1234567` of 2026-12-04' (and '+ uncommitted changes' when the tree differs), or why none."""
    def git(*args):
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    commit = git("rev-parse", "--short=10", "HEAD")
    if not commit:
        return "not a git checkout (no commit to name)"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"commit `{commit}` of {git('log', '-1', '--format=%cd', '--date=short')}{dirty}"


def contents(lectures: dict[str, str], labs: dict[str, str], ran: str, state: str) -> str:
    """The contents page (MyST): each lecture beside the lab with its number, the formula sheet, the sidebar's
    toctrees (lecture NN, then lab NN), and when and from what the lectures ran."""
    lab_by_number = {_number(PurePosixPath(d).name): (d, t) for d, t in labs.items()}
    rows = []
    for doc, title in lectures.items():
        lab = lab_by_number.pop(_number(PurePosixPath(doc).name), None)
        rows.append(f"| {_number(PurePosixPath(doc).name)} | {{doc}}`{title} <{doc}>` | "
                    + (f"{{doc}}`{lab[1]} <{lab[0]}>`" if lab else "") + " |")
    rows += [f"| {n} | | {{doc}}`{t} <{d}>` |" for n, (d, t) in sorted(lab_by_number.items())]

    def toctree(caption, docs):
        return ["```{toctree}", f":caption: {caption}", ":hidden:", "", *docs, "```", ""]
    return "\n".join([
        "# Systems for large-model training — the book",
        "",
        "The course's lecture notebooks as they ran (every figure and printed number is from a real run, and each "
        "number is asserted in the notebook against its formula), the labs as a learner gets them, and the formula "
        "sheet. Each page links its notebook for download; to run the notebooks and do the labs, clone the course "
        "and run `make lab`. Search is in the sidebar.",
        "",
        f"The lectures ran on {ran}, from {state}.",
        "",
        "| # | lecture (executed) | lab (exercises, not executed: the checks need your code) |",
        "|---|---|---|",
        *rows,
        "",
        "**{ref}`The formula sheet <formulas-sheet>`** — every formula an assert checks, with its paper and section.",
        "",
        # in the order a learner goes: each lecture, then its lab (previous/next follow it)
        *toctree("Lectures and labs", sorted([*lectures, *labs],
                                             key=lambda d: (_number(PurePosixPath(d).name), d.startswith("labs/")))),
        *toctree("Reference", ["docs/formulas"]),
    ])


CONF = """\
# GENERATED by tools/book.py for one build; edit that file.
project = "Systems for large-model training"
author = "the course's authors"
extensions = ["myst_nb"]
exclude_patterns = ["_downloads_src/**"]
nb_execution_mode = "off"                 # the lectures ran in tools/run_all.py; labs are shown, not run
nb_ipywidgets_js = {}                     # no widget manager from a CDN: the controls need a kernel anyway
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3                  # GitHub's heading anchors, so links written for the repository resolve
html_theme = "sphinx_book_theme"
html_title = project
html_static_path = ["_static"]
mathjax_path = "%(mathjax)s"
html_copy_source = False                  # the download link gives the notebook; no second copy of each page
html_show_sourcelink = False
html_theme_options = {"home_page_in_toc": True, "show_toc_level": 2, "use_download_button": False,
                      "use_fullscreen_button": False, "navigation_with_keys": True}
"""


def mathjax_dir() -> Path:
    """The MathJax 3 that the sphinx-mathjax-offline package ships (pinned); a BookError saying what to install."""
    import importlib.util
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise BookError("MathJax for offline formulas comes from the sphinx-mathjax-offline package: "
                        "run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"


def stage(src: Path, executed: Path, root: Path = ROOT) -> dict[str, str]:
    """Write the Sphinx source tree into `src`: conf.py, index.md, notebooks/, labs/, docs/formulas.md, the
    stored notebooks to download, and MathJax's script and fonts. Returns {document: title}."""
    lectures_src = sorted((root / "notebooks").glob("*.ipynb"))
    missing = [p.name for p in lectures_src if not (executed / "notebooks" / p.name).exists()]
    if missing:
        raise BookError(f"no executed copy of {', '.join(missing)} in {executed / 'notebooks'}: run "
                        f"`python tools/book.py` (it executes them) or `make run-all` first")
    if src.exists():
        shutil.rmtree(src)
    formulas = (root / "docs" / "formulas.md").read_text()
    labels = formula_sections(formulas)
    stored = {f"notebooks/{p.stem}": p for p in lectures_src}
    stored.update({f"labs/{p.stem}": p for p in sorted((root / "labs").glob("*.ipynb"))})
    docs = {("notebook" if d.startswith("notebooks/") else "lab", _number(PurePosixPath(d).name)): d for d in stored}
    titles: dict[str, str] = {}
    for doc, path in stored.items():
        lecture = doc.startswith("notebooks/")
        nb = nbformat.read(executed / "notebooks" / path.name if lecture else path, as_version=4)
        if lecture:
            failed = [i for i, c in enumerate(nb.cells)
                      if c.cell_type == "code" and any(o.output_type == "error" for o in c.outputs)]
            if failed:
                raise BookError(f"{executed / 'notebooks' / path.name}: cell {failed[0]} failed when the notebook "
                                f"ran; the book shows lectures that run")
        titles[doc] = title_of(nb, path.stem)
        download = f"_downloads_src/{doc}.ipynb"
        _prepare(nb, doc, labels, docs, download, "as stored, without outputs" if lecture else "the lab to solve")
        _write(src / f"{doc}.ipynb", nbformat.writes(nb))
        (src / download).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, src / download)
    _write(src / "docs" / "formulas.md", "(formulas-sheet)=\n" + link_mentions(
        repository_links(label_formula_sections(formulas)), labels, docs))
    ran = min(datetime.fromtimestamp((executed / "notebooks" / p.name).stat().st_mtime, UTC)
              for p in lectures_src) if lectures_src else datetime.now(UTC)
    lectures = {d: t for d, t in titles.items() if d.startswith("notebooks/")}
    labs = {d: t for d, t in titles.items() if d.startswith("labs/")}
    _write(src / "index.md", contents(lectures, labs, f"{ran:%Y-%m-%d %H:%M} UTC", git_state(root)))
    _write(src / "conf.py", CONF % {"mathjax": MATHJAX})
    mathjax = mathjax_dir()
    shutil.copyfile(mathjax / PurePosixPath(MATHJAX).name, _mkdirs(src / "_static" / MATHJAX))
    shutil.copytree(mathjax / "output" / "chtml" / "fonts", src / "_static" / "mathjax" / "output" / "chtml" / "fonts")
    return {"index": "contents", **titles, "docs/formulas": "Formula sheet"}


def build(out: Path, executed: Path, root: Path = ROOT, src: Path | None = None) -> list[str]:
    """Write the book into `out` from the executed lectures in `executed/notebooks/`; the pages written (the
    documents, as .html paths). Sphinx's warnings go to `out`'s sibling file sphinx-warnings.txt."""
    src = src or out.parent / f"{out.name}-src"
    docs = stage(src, executed, root)
    if out.exists():
        shutil.rmtree(out)
    warnings = out.parent / f"{out.name}-sphinx-warnings.txt"
    run = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-d", str(src / "_doctrees"),
                          "-w", str(warnings), str(src), str(out)], capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise BookError(f"sphinx-build failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    # What a reader never loads: the themes' source maps (for debugging their minified scripts, 3.3 MB) and the
    # book theme's translation catalogues (the book is in English).
    for extra in [*(out / "_static").rglob("*.map"), out / "_static" / "locales", out / "_sources"]:
        shutil.rmtree(extra) if extra.is_dir() else extra.unlink(missing_ok=True)
    labels = formula_sections((src / "docs" / "formulas.md").read_text())
    names = {("notebook" if d.startswith("notebooks/") else "lab", _number(PurePosixPath(d).name)): d
             for d in docs if d.startswith(("notebooks/", "labs/"))}
    for doc in docs:
        page = out / f"{doc}.html"
        page.write_text(link_listing_mentions(page.read_text(), doc, labels, names))
    return sorted(f"{d}.html" for d in docs)


def _mkdirs(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, text: str) -> None:
    _mkdirs(path).write_text(text)


# ------------------------------------------------------------------------------------------------- the check
def check_book(out: Path) -> list[str]:
    """Every href and src in every page that is not external resolves (a file in the book, and for a #fragment an
    id in that page); no page loads a script, style sheet or image from the network; a page with formulas loads
    MathJax from the book. Returns the problems (empty when the book is whole)."""
    problems, ids, texts = [], {}, {}
    pages = sorted(p for p in out.rglob("*.html") if p.relative_to(out).parts[0] != "_static")    # not templates
    for page in pages:
        texts[page] = page.read_text()
        ids[page.resolve()] = set(re.findall(r'\bid="([^"]+)"', texts[page]))
    for page in pages:
        name = page.relative_to(out)
        for m in LINK.finditer(texts[page]):
            url = html.unescape(m["url"])
            if EXTERNAL.match(url):
                continue
            path, _, fragment = url.partition("#")
            path = path.partition("?")[0]
            target = (page.parent / path).resolve() if path else page.resolve()
            where = f"{name}: {m['attr']}={url!r}"
            if not target.is_file() or not target.is_relative_to(out.resolve()):
                problems.append(f"{where} names no file in the book")
            elif fragment and target.suffix == ".html" and fragment not in ids.get(target, set()):
                problems.append(f"{where}: no id {fragment!r} in {target.relative_to(out.resolve())}")
        for m in REMOTE_ASSET.finditer(texts[page]):
            problems.append(f"{name}: {m[0]}… loads from the network")
        if re.search(r'class="math[" ]', texts[page]) and not re.search(
                rf'<script[^>]+src="[^"]*_static/{re.escape(MATHJAX)}[^"]*"', texts[page]):
            problems.append(f"{name}: has formulas but does not load the book's own MathJax ({MATHJAX})")
    if not (out / "_static" / MATHJAX).is_file():
        problems.append(f"_static/{MATHJAX} is missing: formulas would show as TeX")
    return problems


def book_size(out: Path) -> str:
    files = [p for p in out.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    parts = {}
    for p in files:
        top = p.relative_to(out).parts[0] if len(p.relative_to(out).parts) > 1 else "pages at the top"
        parts[top] = parts.get(top, 0) + p.stat().st_size
    biggest = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:5])
    return f"{total / 1e6:.1f} MB in {len(files)} files (MB: {biggest})"


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
    t0 = time.perf_counter()
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
    warnings = args.out.parent / f"{args.out.name}-sphinx-warnings.txt"
    count = len([w for w in warnings.read_text().splitlines() if "WARNING" in w]) if warnings.exists() else 0
    print(f"wrote {len(pages)} pages to {args.out} in {time.perf_counter() - t0:.0f} s: {book_size(args.out)}; "
          f"open {args.out / 'index.html'}" + (f" ({count} Sphinx warnings in {warnings})" if count else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
