"""Every lecture and solution passes under papermill with knobs a learner would change (README: SEED, WORLD_SIZE).

Each notebook runs once with another SEED and, if it has one, another WORLD_SIZE in the same run (a knob that no
cell after the parameters reads is not varied: that run would repeat the default one); a notebook adds combinations
in its metadata, e.g. `"course": {"matrix": [{"SEED": 7, "WORLD_SIZE": 3}]}`, and sets other knobs of that first
run with `"course": {"variant": {"STEPS": 1}}`: other values a learner could pick, at the cheap end of their stated
range (fewer steps, repeats or micro-batches), so the run tests those knobs too and costs less. Notebook 00 is also
run with WORLD_SIZE = 0, which must fail at once with the allowed range.

Lectures also run at their defaults under nbval (`make test` collects notebooks/); solutions run here only — every
solution's own checks assert its results, so a second run at the defaults would repeat this one — and a solution
with no knob to vary runs once, at its defaults.

One test class per notebook, so `--dist loadscope` spreads the notebooks over the workers.
"""
import ast

import pytest

from ._nb import NOTEBOOKS, ROOT, SOLUTIONS, knob_is_read, parameters_cells, read, rel


def _defaults(path) -> dict:
    """The literal knobs of the parameters cell."""
    knobs = {}
    for node in ast.parse(parameters_cells(read(path))[0].source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                knobs[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return knobs


def matrix(path) -> list:
    """The knob combinations papermill runs `path` with."""
    defaults, nb = _defaults(path), read(path)
    used = {k for k in ("SEED", "WORLD_SIZE") if k in defaults and knob_is_read(nb, k)}
    first = {}
    if "SEED" in used:
        first["SEED"] = 3 if defaults["SEED"] != 3 else 4
    if "WORLD_SIZE" in used:
        first["WORLD_SIZE"] = 3 if defaults["WORLD_SIZE"] != 3 else 2
    if first:
        first.update(nb.metadata.get("course", {}).get("variant", {}))
    return ([first] if first else []) + list(nb.metadata.get("course", {}).get("matrix", []))


def _execute(path, tmp_path, parameters):
    import papermill as pm
    return pm.execute_notebook(str(path), str(tmp_path / path.name), parameters=parameters, kernel_name="python3",
                               progress_bar=False, execution_timeout=300, cwd=str(path.parent),
                               shutdown_kernel="immediate")   # as nbval does: a graceful stop idles ~1 s per run


def _ids(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items()) or "defaults"


def _make_class(path):
    combos = matrix(path) or ([{}] if path in SOLUTIONS else [])
    if not combos:
        return None

    @pytest.mark.notebooks
    @pytest.mark.parametrize("parameters", combos, ids=[_ids(c) for c in combos])
    def test_runs_with(self, parameters, tmp_path):
        unknown = set(parameters) - set(_defaults(path))
        assert not unknown, f"{rel(path)}: course.matrix sets {sorted(unknown)}, which its parameters cell lacks"
        _execute(path, tmp_path, parameters)

    return type("TestPapermill_" + path.parent.name + "_" + path.stem, (),
                {"test_runs_with": test_runs_with, "__doc__": f"{rel(path)} under papermill with other knobs"})


for _path in NOTEBOOKS + SOLUTIONS:
    _cls = _make_class(_path)
    if _cls is not None:
        globals()[_cls.__name__] = _cls


@pytest.mark.notebooks
def test_notebook_00_refuses_world_size_0_before_training_with_the_allowed_range(tmp_path):
    from papermill.exceptions import PapermillExecutionError
    path = ROOT / "notebooks" / "00_orientation.ipynb"
    with pytest.raises(PapermillExecutionError) as err:
        _execute(path, tmp_path, {"WORLD_SIZE": 0})
    assert "WORLD_SIZE = 0" in err.value.evalue and "pick 2 to 8" in err.value.evalue, err.value.evalue
    executed = read(tmp_path / path.name).cells            # with papermill's injected cell
    assert not any("train_reference(" in c.source or "launch(" in c.source
                   for c in executed[:err.value.cell_index + 1]), "WORLD_SIZE = 0 must be refused before training"
