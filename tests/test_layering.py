"""The layers of course_lib (stated in the package docstring) hold: no module imports a module of a layer above its
own — not even inside a function — and no modules import each other in a circle. Read from the source with `ast`,
so an import hidden in a function body counts as much as one at the top."""
import ast
from pathlib import Path

import course_lib

ROOT = Path(course_lib.__file__).parent

# Bottom to top: a module may import its own layer and the layers below. The first package component decides
# (`course_lib.parallel.zero` is in "techniques"); the package itself (`course_lib/__init__.py`) is a foundation.
LAYERS = (
    ("foundation", {"", "_env", "lab", "core", "memory"}),
    ("distributed", {"distributed", "run"}),
    ("train", {"train"}),
    ("techniques", {"parallel", "memopt", "optim", "transports"}),
    ("systems", {"resilience", "io"}),
    ("composer", {"composer", "checks", "calculator", "capstone"}),
)
LEVEL = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}


def _modules() -> dict:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(["course_lib", *parts])] = (path, is_pkg)
    return out


def _imports(name: str, path: Path, is_pkg: bool, known) -> set:
    """The course_lib modules `name` imports anywhere in its source."""
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:          # `from .x import y`: y may be a name in x, not a module
                t = t.rpartition(".")[0]
            if t.startswith("course_lib") and t != name:
                found.add(t)
    return found


def _graph() -> dict:
    mods = _modules()
    return {n: _imports(n, p, pkg, mods) for n, (p, pkg) in mods.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_in_a_layer():
    graph = _graph()
    missing = sorted({_top(m) for m in graph} - set(LEVEL))
    assert not missing, f"course_lib modules in no layer: {missing}; add each to LAYERS here and to the package " \
                        f"docstring"


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            if LEVEL.get(_top(dep), -1) > LEVEL.get(_top(mod), 99) and not mod.startswith(dep + "."):
                bad.append(f"{mod} ({LAYERS[LEVEL[_top(mod)]][0]}) imports {dep} ({LAYERS[LEVEL[_top(dep)]][0]})")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ re-exporting its own submodules is not a circle: drop edges from a package to its
    # children and from a child to its own package's __init__
    edges = {m: {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")}
             for m, deps in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):                                   # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The reader counts a function-local import (the kind that hid compose's circle), resolved to its module."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from ..parallel.zero import apply_zero\n")
    known = {"course_lib.parallel.zero", "course_lib.parallel", "course_lib.distributed.m"}
    assert _imports("course_lib.distributed.m", src, False, known) == {"course_lib.parallel.zero"}


def _package(module: str) -> str:
    """The top-level package a module belongs to ('course_lib.parallel' for course_lib.parallel.zero)."""
    return ".".join(module.split(".")[:2])


def test_no_two_packages_import_each_other():
    """Between two top-level packages imports go one way only (a module importing its own package's __init__ or
    the course_lib package itself does not count): the tree then reads bottom to top, and a package can be
    understood, tested and moved with only what is below it."""
    edges = {}
    for mod, deps in _graph().items():
        for dep in deps:
            a, b = _package(mod), _package(dep)
            if a != b and "course_lib" not in (a, b):
                edges.setdefault((a, b), []).append(f"{mod} -> {dep}")
    both = sorted(f"{a} <-> {b}: {edges[(a, b)][0]} and {edges[(b, a)][0]}" for a, b in edges
                  if (b, a) in edges and a < b)
    assert not both, "packages that import each other:\n" + "\n".join(both)


def test_every_package_docstring_names_its_modules():
    """Each package's docstring is its table of contents: it names every module and subpackage in it."""
    missing = []
    for init in sorted(ROOT.rglob("__init__.py")):
        pkg = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        words = set(doc.replace("/", " ").replace(".", " ").replace("`", " ").replace(",", " ").split())
        kids = [p.stem for p in pkg.glob("*.py") if p.stem != "__init__"]
        kids += [d.name for d in pkg.iterdir() if (d / "__init__.py").exists()]
        missing += [f"{pkg.relative_to(ROOT.parent)}: {k}" for k in sorted(kids) if k not in words]
    assert not missing, "modules the package docstring does not name (add a line for each):\n" + "\n".join(missing)
