"""Every notebook follows the course's conventions (CONTRIBUTING.md)."""
import ast
import re
import sys

import pytest

from ._nb import (
    ALL,
    LABS,
    NOTEBOOKS,
    ROOT,
    SOLUTIONS,
    assigned_names,
    is_check_cell,
    launches_ranks,
    parameters_cells,
    read,
    rel,
)

sys.path.insert(0, str(ROOT / "tools"))
import nbfmt  # noqa: E402

lectures_and_solutions = pytest.mark.parametrize("path", NOTEBOOKS + SOLUTIONS, ids=rel)



def _targets(node) -> list:
    """What an assignment, augmented or annotated assignment, for loop or comprehension binds (else nothing)."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.comprehension)):
        return [node.target]
    return []

def test_there_is_at_least_the_orientation_notebook_and_one_lab():
    assert (ROOT / "notebooks" / "00_orientation.ipynb") in NOTEBOOKS and SOLUTIONS


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_stored_without_outputs_in_normal_form(path):
    nb = read(path)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs, f"{rel(path)} cell {i} has stored outputs: run `python tools/nbfmt.py {rel(path)}`"
            assert cell.execution_count is None, f"{rel(path)} cell {i} has an execution count"
    assert path.read_text() == nbfmt.text_of(read(path)), \
        f"{rel(path)} is not in stored form: run `python tools/nbfmt.py {rel(path)}`"


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_file_names_follow_the_numbering(path):
    pattern = r"\d\d_[a-z0-9_]+\.ipynb" if path.parent.name == "notebooks" else r"lab\d\d_[a-z0-9_]+\.ipynb"
    assert re.fullmatch(pattern, path.name), f"{rel(path)} should be named like {pattern}"


@lectures_and_solutions
def test_opens_with_title_objectives_prerequisites_and_time(path):
    first = read(path).cells[0]
    assert first.cell_type == "markdown" and first.source.lstrip().startswith("# ")
    for needed in ("Learning objectives", "Prerequisites", "Estimated time"):
        assert needed in first.source, f"{rel(path)}: the first cell needs '{needed}'"


@lectures_and_solutions
def test_exactly_one_parameters_cell_with_every_knob(path):
    nb = read(path)
    cells = parameters_cells(nb)
    assert len(cells) == 1, f"{rel(path)}: {len(cells)} cells tagged 'parameters', need exactly one"
    names = assigned_names(cells[0].source)
    need = {"SEED", "QUICK"} | ({"WORLD_SIZE"} if launches_ranks(nb) else set())
    assert need <= names, f"{rel(path)}: the parameters cell must assign {sorted(need - names)}"


@lectures_and_solutions
def test_the_parameters_cell_computes_nothing_from_other_knobs(path):
    """papermill (and tools/run_all.py -p) set knobs in a cell injected *after* the parameters cell, so a value the
    parameters cell computes from a knob (`STEPS = 60 if QUICK else 400`) keeps the default's value: QUICK=False
    would be silently ignored."""
    source = parameters_cells(read(path))[0].source
    knobs = assigned_names(source)
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            value, targets = node.value, [t.id for t in node.targets if isinstance(t, ast.Name)]
        else:
            value, targets = node, []
        reads = sorted({n.id for n in ast.walk(value) if isinstance(n, ast.Name) and n.id in knobs})
        name = targets[0] if targets else "…"
        assert not reads, (
            f"{rel(path)}: the parameters cell computes {name} from {', '.join(reads)} (line {node.lineno}). "
            f"papermill sets knobs in a cell after this one, so {name} would ignore e.g. QUICK = False. Keep a "
            f"plain default here, e.g. `{name} = None  # None: … when QUICK, … otherwise`, and derive it in the "
            f"first cell after the environment guard: `{name} = {name} or (… if QUICK else …)`.")


@lectures_and_solutions
def test_guards_the_environment_before_using_the_library(path):
    code = [c for c in read(path).cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]
    assert "import course_lib" in code[0].source and "check_environment()" in code[0].source \
        and "make lab" in code[0].source, f"{rel(path)}: the first code cell after the parameters must be the guard"


@lectures_and_solutions
def test_the_guard_is_notebook_00s_word_for_word(path):
    """One guard, copied: what a kernel without the course prints must not differ between notebooks."""
    def guard(p):
        code = [c for c in read(p).cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]
        return code[0].source.split("course_lib.check_environment()")[0]
    assert guard(path) == guard(ROOT / "notebooks" / "00_orientation.ipynb"), f"{rel(path)}: copy notebook 00's guard"


@lectures_and_solutions
def test_names_the_kernel_every_jupyter_has(path):
    """`python3`, not the course's own kernel: papermill, nbclient and hosted notebooks have no `llm-systems-course`
    (NoSuchKernel, or a kernel picker), and in `make lab` python3 is the course's .venv anyway."""
    assert read(path).metadata["kernelspec"]["name"] == "python3", f"{rel(path)}: run tools/nbfmt.py on it"


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_widgets_draw_nothing_while_the_notebook_runs(path):
    """interact/interactive draw into an Output widget at once, which can hang papermill (jupyter/nbclient#312)."""
    code = "\n".join(c.source for c in read(path).cells if c.cell_type == "code")
    found = re.findall(r"\b(interact|interactive|interactive_output|interact_manual)\b\s*\(", code)
    assert not found, f"{rel(path)}: {sorted(set(found))} draws while the notebook runs; draw the default " \
        "figure as ordinary output and use course_lib.core.plots.explorer for the controls"


@pytest.mark.parametrize("path", SOLUTIONS, ids=rel)
def test_solutions_end_with_checks_from_course_lib(path):
    nb = read(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    number = re.match(r"lab(\d\d)_", path.name).group(1)
    checks = [c for c in code if is_check_cell(c)]
    assert checks, f"{rel(path)} has no check cell calling course_lib.checks.lab{number}.check_*"
    assert is_check_cell(code[-1]), f"{rel(path)}: the last code cell must be a check"
    imports = "\n".join(c.source for c in code)
    assert re.search(rf"course_lib\.checks(\.lab{number}\b| import \(?[\w\s,]*\blab{number}\b)", imports), \
        f"{rel(path)}: checks must come from course_lib.checks.lab{number}"
    assert (ROOT / "course_lib" / "checks" / f"lab{number}.py").exists()
    assert (ROOT / "labs" / path.name).exists(), f"labs/{path.name} missing: run `make labs`"


def test_labs_and_solutions_pair_up():
    assert {p.name for p in LABS} == {p.name for p in SOLUTIONS}


def test_readme_course_map_lists_every_notebook_and_lab():
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS + SOLUTIONS:
        assert path.name in readme, f"README.md's course map does not mention {path.name}"


def test_notebook_00s_course_map_lists_every_notebook_by_number():
    cell = next(c.source for c in read(ROOT / "notebooks" / "00_orientation.ipynb").cells
                if c.cell_type == "markdown" and "## The course map" in c.source)
    listed = set(re.findall(r"^\| (\d\d) \|", cell, flags=re.M))
    assert listed == {p.name[:2] for p in NOTEBOOKS}, \
        f"notebook 00's course map lists {sorted(listed)}; the notebooks are {sorted(p.name[:2] for p in NOTEBOOKS)}"


SETUP_COMMON = {"torch", "np", "plt", "tqdm", "check_knobs", "show_source"}   # the block every notebook opens with
SETUP_WIDE = 3            # a library name used in this many sections is imported once, in the setup cell
SETUP_MAX_LINES = 40


def _names_loaded(source: str) -> set:
    from IPython.core.inputtransformer2 import TransformerManager
    tree = ast.parse(TransformerManager().transform_cell(source))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=rel)
def test_the_setup_cell_imports_only_what_it_or_several_sections_use(path):
    """The cell after the environment guard is a short import block and the knob check, not every import of the
    notebook: a name one or two sections use is imported in the first cell that uses it, where a learner reading
    that section sees where it comes from. Imports nothing uses are defects wherever they are."""
    nb = read(path)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    first = next(k for k, i in enumerate(code) if "parameters" in nb.cells[i].metadata.get("tags", []))
    if len(code) <= first + 2:
        return
    setup = code[first + 2]
    source = nb.cells[setup].source
    assert len(source.splitlines()) <= SETUP_MAX_LINES, (
        f"{rel(path)}: the setup cell (cell {setup}) has {len(source.splitlines())} lines; keep it to the common "
        f"imports, the knob check and what the knobs derive (≤ {SETUP_MAX_LINES})")
    tree = ast.parse(source)
    lines = source.splitlines()
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = "\n".join(ln for k, ln in enumerate(lines, 1)
                     if not any(n.lineno <= k <= n.end_lineno for n in imports))
    here = _names_loaded(rest)
    section, sections_using = 0, {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and re.search(r"^## ", cell.source, flags=re.M):
            section = i
        elif cell.cell_type == "code" and i > setup:
            for name in _names_loaded(cell.source):
                sections_using.setdefault(name, set()).add(section)
    for node in imports:
        if "noqa" in lines[node.lineno - 1]:      # imported for its side effect (e.g. so forked ranks inherit it)
            continue
        for alias in node.names:
            name = (alias.asname or alias.name).split(".")[0]
            used = len(sections_using.get(name, ()))
            assert name in here or name in SETUP_COMMON or used, \
                f"{rel(path)}: the setup cell imports {name}, which no cell uses: remove it"
            assert name in here or name in SETUP_COMMON or used >= SETUP_WIDE, (
                f"{rel(path)}: the setup cell imports {name}, which only {used} section(s) use: import it in the "
                f"first cell that uses it")


def _constant_names(nb) -> set:
    """Names every assignment of which (outside the parameters cell) is arithmetic on literals and other such names:
    `hours = 54 * 24`, `mtbf = hours / 419`. Knobs are inputs, not constants."""
    from IPython.core.inputtransformer2 import TransformerManager
    params = {id(c) for c in parameters_cells(nb)}
    assigned = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or id(cell) in params:
            continue
        try:
            tree = ast.parse(TransformerManager().transform_cell(cell.source))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            for t in _targets(node):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        assigned.setdefault(n.id, []).append(node.value if isinstance(node, ast.Assign) else None)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                for a in getattr(node, "names", []):
                    assigned.setdefault((a.asname or a.name).split(".")[0], []).append(None)
                if hasattr(node, "name") and isinstance(node.name, str):
                    assigned.setdefault(node.name, []).append(None)
    constant, changed = set(), True
    while changed:
        changed = False
        for name, values in assigned.items():
            if name not in constant and all(v is not None and _is_constant(v, constant) for v in values):
                constant.add(name)
                changed = True
    return constant


def _is_constant(expr, constant: set) -> bool:
    """Literals, arithmetic and comparisons on them, and names in `constant`; no calls but abs/round/min/max."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Name) and n.id not in constant and n.id not in {"abs", "round", "min", "max"}:
            return False
        if isinstance(n, (ast.Attribute, ast.Subscript, ast.Lambda, ast.ListComp, ast.GeneratorExp)):
            return False
    return True


def _cell_trees(nb):
    from IPython.core.inputtransformer2 import TransformerManager
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        try:
            yield i, ast.parse(TransformerManager().transform_cell(cell.source))
        except SyntaxError:
            continue


def _assert_tests(nb):
    for i, tree in _cell_trees(nb):
        assigned = {t.id: ast.dump(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                yield i, node, assigned


def _single_assignments(nb) -> dict:
    """Names assigned exactly once in the whole notebook (outside loops' targets), with the value's AST."""
    values, params = {}, {id(c) for c in parameters_cells(nb)}
    for i, tree in _cell_trees(nb):
        if id(nb.cells[i]) in params:
            continue
        for node in ast.walk(tree):
            for t in _targets(node):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        one = isinstance(node, ast.Assign) and len(node.targets) == 1 and t is node.targets[0] \
                            and isinstance(t, ast.Name)
                        values.setdefault(n.id, []).append(node.value if one else None)
    return {k: v[0] for k, v in values.items() if len(v) == 1 and v[0] is not None}


_PASS_THROUGH = {"int", "float", "round", "abs", "min", "max"}


def _scaled_copy(value, other, names_ok: set) -> bool:
    """`value` is `other` times knobs and literals (`BUDGET = int(BUDGET_FRACTION * MODEL_STATES)` for
    other = MODEL_STATES): a comparison of the two only restates the knob's range."""
    target = ast.dump(other)
    if not any(ast.dump(n) == target for n in ast.walk(value)) or ast.dump(value) == target:
        return False
    inner = {id(n) for sub in ast.walk(value) if ast.dump(sub) == target for n in ast.walk(sub)}
    for n in ast.walk(value):
        if id(n) in inner:
            continue
        if isinstance(n, ast.Name) and n.id not in names_ok and n.id not in _PASS_THROUGH:
            return False
        if isinstance(n, (ast.Attribute, ast.Subscript, ast.Lambda, ast.ListComp, ast.GeneratorExp)) \
                and ast.dump(n) != target:
            return False
    return True


def _imported_names(nb) -> set:
    return {(a.asname or a.name).split(".")[0] for _, tree in _cell_trees(nb) for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}


_CONTAINERS = {"sorted", "list", "set", "tuple", "len", "dict"}


def _reads_only(expr, names: set) -> bool:
    """`expr` reads nothing but `names` (and what its own comprehensions bind), through no call but containers':
    a value fixed when the library was written, such as an imported table's first column."""
    bound = {n.id for c in ast.walk(expr) if isinstance(c, ast.comprehension) for n in ast.walk(c.target)
             if isinstance(n, ast.Name)}
    for n in ast.walk(expr):
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Name) and n.func.id in _CONTAINERS):
            return False
        if isinstance(n, ast.Name) and n.id not in names | bound | _CONTAINERS:
            return False
    return True


def _tautology(test, constant: set, assigned: dict, knobs: set, single: dict | None = None,
               imported: set = frozenset()) -> str | None:
    """Why the assert's test cannot fail, or None (a knob's range check is input validation, not a tautology)."""
    if _is_constant(test, constant):
        return "it is arithmetic on constants"
    single = single or {}
    for part in (test.values if isinstance(test, ast.BoolOp) else [test]):
        if not isinstance(part, ast.Compare):
            continue
        ends = [part.left] + part.comparators
        if len(ends) == 3 and all(isinstance(e, ast.Constant) for e in (ends[0], ends[2])) \
                and (ends[0].value, ends[2].value) in ((0, 1), (0.0, 1.0)) \
                and not (isinstance(ends[1], ast.Name) and ends[1].id in knobs):
            return "a fraction between 0 and 1 is no check of its value"
        for op, left, right in zip(part.ops, ends, ends[1:]):
            if isinstance(op, (ast.Eq, ast.LtE, ast.GtE, ast.Is)) and ast.dump(left) == ast.dump(right):
                return "it compares an expression with itself"
            if isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, ast.Name) and a.id in single and \
                            _scaled_copy(single[a.id], b, knobs | constant):
                        return f"{a.id} is {ast.unparse(b)} scaled by a knob: the comparison restates the knob's range"
            if not isinstance(op, ast.Eq):
                continue
            for a, b in ((left, right), (right, left)):
                if isinstance(a, ast.Call) and getattr(a.func, "id", None) == "round" and isinstance(b, ast.Constant):
                    return "it compares a rounded value with a number copied from the output"
                if isinstance(a, ast.Name) and assigned.get(a.id) == ast.dump(b):
                    return f"it compares {a.id} with the expression it was just assigned"
                if isinstance(a, (ast.List, ast.Tuple, ast.Set)) and len(a.elts) >= 2 \
                        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in a.elts) \
                        and _reads_only(b, imported | constant):
                    return "it compares the library's own list with a copy written out in the notebook"
    return None


@lectures_and_solutions
def test_no_assert_that_cannot_fail(path):
    """An assert must be able to fail: not arithmetic on constants (`assert 54 * 24 == 1296`), not a value against its
    own definition (`x = f(a); assert x == f(a)`) or against itself, not a rounded figure against a number copied from
    the output, not `0 <= fraction < 1`, not a list of names written out from the code it checks
    (`assert names[:3] == ["context parallel", "tensor parallel", …]`), not a value against what it was scaled from by
    a knob (`BUDGET = int(FRACTION * STATES)`; `assert BUDGET < STATES` restates FRACTION's range). Compare a
    measurement with a closed form, or print the figure without asserting it."""
    nb = read(path)
    constant, knobs = _constant_names(nb), assigned_names(parameters_cells(nb)[0].source)
    single, imported = _single_assignments(nb), _imported_names(nb)
    bad = [f"cell {i}: `{ast.unparse(node.test)[:90]}` — {why}" for i, node, assigned in _assert_tests(nb)
           if (why := _tautology(node.test, constant, assigned, knobs, single, imported))]
    assert not bad, f"{rel(path)} has asserts that cannot fail:\n  " + "\n  ".join(bad)


def test_the_tautology_rules_catch_what_notebooks_12_to_14_once_asserted():
    """Each rule fires on the pattern it names (as notebooks 13 and 14 once had them) and not on a check of a
    computed value against a list written out (notebook 07: the problems a probe reports)."""
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("FRACTION = 0.6\nSEED = 0", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("from course_lib.composer.parallelize import ORDER\nSTATES = measure()\n"
                                  "BUDGET = int(FRACTION * STATES)\npeak = run(BUDGET)\nproblems = probe()"),
        nbformat.v4.new_code_cell("assert peak <= BUDGET < STATES\n"
                                  "assert [n for n, _ in ORDER][:2] == ['context parallel', 'tensor parallel']\n"
                                  "assert peak == peak\n"
                                  "assert set(problems) == {'too small', 'fills up'}\n"
                                  "assert peak < STATES")])
    constant, knobs = _constant_names(nb), assigned_names(parameters_cells(nb)[0].source)
    single, imported = _single_assignments(nb), _imported_names(nb)
    found = [_tautology(node.test, constant, assigned, knobs, single, imported) for _, node, assigned in
             _assert_tests(nb)]
    assert [bool(w) for w in found] == [True, True, True, False, False], found
    assert "scaled by a knob" in found[0] and "copy written out" in found[1] and "itself" in found[2]


def _show_source_calls(nb):
    """(cell index, ast.Call) of every show_source(...) in the notebook's code cells."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "show_source"
                                               or getattr(node.func, "attr", None) == "show_source"):
                yield i, node


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(expr) -> list:
    """The names of a dotted expression (`O.OffloadAdam.step` → ['O', 'OffloadAdam', 'step'])."""
    if isinstance(expr, ast.Attribute):
        return _dotted(expr.value) + [expr.attr]
    return [expr.id] if isinstance(expr, ast.Name) else []


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_shown_code_is_chosen_by_name_never_by_line_number(path):
    for i, call in _show_source_calls(read(path)):
        assert "lines" not in {k.arg for k in call.keywords}, \
            f"{rel(path)} cell {i}: show_source(..., lines=...) cuts by line number, and an edit above the cut " \
            f"silently changes the lecture; show a named function or method (only=[...]), or give the part a name"


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_lectures_show_public_names_only(path):
    for i, call in _show_source_calls(read(path)):
        names = _dotted(call.args[0]) if call.args else []
        for k in call.keywords:
            if k.arg == "only":
                items = k.value.elts if isinstance(k.value, (ast.List, ast.Tuple)) else [k.value]
                names += [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        private = [n for n in names if _private(n)]
        assert not private, f"{rel(path)} cell {i} shows the private name(s) {private}: make it public in the " \
                            f"library (every caller with it) or show something else"
