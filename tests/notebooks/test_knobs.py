"""The knobs of the parameters cell work when papermill sets them: QUICK = False changes the run, and a bad
WORLD_SIZE is refused right after the parameters, with its allowed range, before anything slow runs.

Cheap by design (no training): for each notebook, a fresh IPython shell runs the parameters cell, the line papermill
would inject after it, and the cells up to the one that derives values from the knobs. One subprocess runs every
notebook (torch is imported once); each notebook is its own test.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from ._nb import NOTEBOOKS, ROOT, SOLUTIONS, assigned_names, knob_is_read, parameters_cells, read, reads, rel

NO_EFFECT = "no effect"     # what the QUICK (or SEED) line of a notebook whose QUICK (SEED) changes nothing must say


def _code_cells(nb):
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def _plan(path):
    """(cells, note): the code cells from the parameters cell on, up to and including the first cell after the
    environment guard that reads QUICK; note says why there is nothing to run."""
    nb = read(path)
    cells = _code_cells(nb)
    first = next(k for k, (i, _) in enumerate(cells) if nb.cells[i] is parameters_cells(nb)[0])
    after_guard = cells[first + 2:]
    readers = [k for k, (_, src) in enumerate(after_guard) if reads(src, "QUICK")]
    if not readers:
        return None, "no cell after the environment guard reads QUICK"
    return cells[first:first + 2] + after_guard[:readers[0] + 1], ""


def _knob_cell(path):
    """The code cells from the parameters cell up to the first cell after the environment guard."""
    nb = read(path)
    cells = _code_cells(nb)
    first = next(k for k, (i, _) in enumerate(cells) if nb.cells[i] is parameters_cells(nb)[0])
    return cells[first:first + 3]


def _knob_line(path, name: str = "QUICK"):
    """The line of the parameters cell that sets `name` (with its comment)."""
    return next((ln for ln in parameters_cells(read(path))[0].source.splitlines() if re.match(rf"{name}\s*=", ln)), "")


_RUNNER = textwrap.dedent(r"""
    import json, os, re, sys
    os.environ["MPLBACKEND"] = "Agg"
    from IPython.core.interactiveshell import InteractiveShell
    jobs, results = json.load(open(sys.argv[1])), {}
    shell = InteractiveShell.instance()
    for job in jobs:
        # a fresh namespace per job; not shell.reset(), whose gc.collect() cost 0.25 s a job (half of this run)
        shell.user_ns.clear()
        shell.user_ns_hidden.clear()
        shell.init_user_ns()
        os.chdir(job["cwd"])
        res = {"ok": True}
        for index, source in job["cells"]:
            r = shell.run_cell(source, store_history=False, silent=True)
            if not r.success:
                e = r.error_in_exec or r.error_before_exec
                res = {"ok": False, "cell": index, "ename": type(e).__name__, "evalue": str(e)}
                break
        if res["ok"]:
            res["values"] = {k: repr(v) for k, v in shell.user_ns.items()
                             if re.fullmatch(r"[A-Z][A-Z0-9_]*", k) and " at 0x" not in repr(v)}
        results[job["id"]] = res
    json.dump(results, open(sys.argv[2], "w"))
""")

PATHS = [p for p in NOTEBOOKS + SOLUTIONS if "QUICK" in assigned_names(parameters_cells(read(p))[0].source)]
WORLD_SIZE_PATHS = [p for p in NOTEBOOKS + SOLUTIONS
                    if "WORLD_SIZE" in assigned_names(parameters_cells(read(p))[0].source)]


def _jobs():
    jobs = []
    for path in PATHS:
        cells, _ = _plan(path)
        if cells:
            for quick in (True, False):   # what papermill injects after the parameters cell
                jobs.append({"id": f"{rel(path)}|QUICK={quick}", "cwd": str(path.parent),
                             "cells": [cells[0], ("injected", f"QUICK = {quick}")] + cells[1:]})
    for path in WORLD_SIZE_PATHS:
        cells = _knob_cell(path)
        jobs.append({"id": f"{rel(path)}|WORLD_SIZE=0", "cwd": str(path.parent),
                     "cells": [cells[0], ("injected", "WORLD_SIZE = 0")] + cells[1:]})
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("knobs")
    (tmp / "jobs.json").write_text(json.dumps(_jobs()))
    (tmp / "runner.py").write_text(_RUNNER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(tmp / "runner.py"), str(tmp / "jobs.json"), str(tmp / "out.json")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.notebooks
@pytest.mark.parametrize("path", PATHS, ids=rel)
def test_quick_false_changes_what_the_notebook_runs(path, runs):
    cells, why = _plan(path)
    if cells is None:
        others = [i for i, src in _code_cells(read(path)) if reads(src, "QUICK")]
        assert NO_EFFECT in _knob_line(path) and not others, (
            f"{rel(path)}: QUICK = False changes nothing ({why}). Derive what QUICK selects in the first cell after "
            f"the environment guard (`STEPS = STEPS or (60 if QUICK else 400)`), or, if nothing here is worth "
            f"shortening, say so on its line in the parameters cell: `QUICK = True  # {NO_EFFECT} here: …`")
        return
    quick, slow = runs[f"{rel(path)}|QUICK=True"], runs[f"{rel(path)}|QUICK=False"]
    for r in (quick, slow):
        assert r["ok"], f"{rel(path)}: cell {r['cell']} raised {r['ename']}: {r['evalue']}"
    changed = sorted(k for k in quick["values"] if k != "QUICK" and quick["values"][k] != slow["values"].get(k))
    assert changed, (f"{rel(path)}: with QUICK = False papermill's run derives the same values as with QUICK = True "
                     f"(cell {cells[-1][0]} reads QUICK but nothing in UPPERCASE changed): derive the QUICK-dependent "
                     f"sizes there, from the knobs")
    assert NO_EFFECT not in _knob_line(path), (f"{rel(path)}: the QUICK line says '{NO_EFFECT}', "
                                               f"but it changes {changed}")


@pytest.mark.notebooks
@pytest.mark.parametrize("path", WORLD_SIZE_PATHS, ids=rel)
def test_world_size_0_is_refused_before_anything_runs_with_the_allowed_range(path, runs):
    r = runs[f"{rel(path)}|WORLD_SIZE=0"]
    knob_cell = _knob_cell(path)[-1][0]
    assert not r["ok"], f"{rel(path)}: WORLD_SIZE = 0 passed the cell after the environment guard (cell {knob_cell})"
    assert r["cell"] == knob_cell and "WORLD_SIZE" in r["evalue"] and re.search(r"\d", r["evalue"]), (
        f"{rel(path)}: WORLD_SIZE = 0 should be refused in cell {knob_cell}, the first after the environment guard, "
        f"with a message naming WORLD_SIZE and its allowed range; got cell {r['cell']}, {r['ename']}: {r['evalue']}")


@pytest.mark.parametrize("path", PATHS, ids=rel)
def test_a_seed_that_nothing_reads_says_so_on_its_line(path):
    """The papermill matrix skips a SEED no cell reads (that run would repeat the default), so the knob must not
    promise what it does not do."""
    line, used = _knob_line(path, "SEED"), knob_is_read(read(path), "SEED")
    assert used or NO_EFFECT in line, (f"{rel(path)}: no cell reads SEED; say so on its line in the parameters cell: "
                                       f"`SEED = 0  # {NO_EFFECT} here: …`")
    assert not (used and NO_EFFECT in line), f"{rel(path)}: the SEED line says '{NO_EFFECT}', but a cell reads SEED"


@pytest.mark.parametrize("knobs, message", [
    ({"WORLD_SIZE": (0, 2, 8)}, "WORLD_SIZE = 0: pick 2 to 8"),
    ({"WORLD_SIZE": (2.5, 2, 8)}, "WORLD_SIZE = 2.5: pick 2 to 8"),
    ({"SEED": -1}, "SEED = -1: pick an integer ≥ 0"),
    ({"QUICK": "no"}, "QUICK = 'no': pick True or False"),
    ({"STEPS": (10, 30, None)}, "STEPS = 10: pick an integer ≥ 30"),
    ({"CACHE_FRACTION": (1.5, 0.0, 1.0)}, "CACHE_FRACTION = 1.5: pick 0 to 1"),
    ({"PRESET": ("huge", ["nano", "micro"])}, "PRESET = 'huge': pick one of 'nano', 'micro'"),
    ({"MATRIX": (36, 24, None, 24)}, "MATRIX = 36: pick a multiple of 24 ≥ 24"),
    ({"MAX_BYTES": (6, 4, 64, 4)}, "MAX_BYTES = 6: pick a multiple of 4 from 4 to 64"),
    ({"STEPS": (10, 20, None, "the loss check compares 5 steps with 5")},
     "STEPS = 10: pick an integer ≥ 20 (the loss check compares 5 steps with 5)"),
])
def test_check_knobs_refuses_a_bad_value_in_one_line_with_the_range(knobs, message):
    import course_lib
    with pytest.raises(course_lib.KnobError) as err:
        course_lib.check_knobs(**knobs)
    assert str(err.value) == message and "\n" not in str(err.value)


def test_check_knobs_returns_the_values_it_accepts():
    import course_lib
    assert course_lib.check_knobs(SEED=3, QUICK=False, WORLD_SIZE=(4, 2, 8), PRESET=("nano", ["nano"]),
                                  VALUE=0.1) == {"SEED": 3, "QUICK": False, "WORLD_SIZE": 4, "PRESET": "nano",
                                                 "VALUE": 0.1}


def test_check_knobs_rules_are_checked_after_the_knobs_they_read():
    import course_lib
    with pytest.raises(course_lib.KnobError, match=r"^WORLD_SIZE = 0: pick 2 to 4$"):   # not a ZeroDivisionError
        course_lib.check_knobs((lambda: 24 % 0 == 0, "NUM_SHARDS: a multiple of WORLD_SIZE"), WORLD_SIZE=(0, 2, 4))
    with pytest.raises(course_lib.KnobError, match=r"^NUM_SHARDS = 25: pick a multiple of 4$"):
        course_lib.check_knobs((25 % 4 == 0, "NUM_SHARDS = 25: pick a multiple of 4"), WORLD_SIZE=(4, 2, 4))
