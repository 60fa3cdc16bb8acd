"""Notebooks that launch ranks also pass under papermill with another WORLD_SIZE than their default.

One test class per notebook, so `--dist loadscope` spreads them over the workers.
"""
import ast

import pytest

from ._nb import NOTEBOOKS, ROOT, SOLUTIONS, parameters_cells, read, rel


def _default_world_size(path):
    for node in ast.parse(parameters_cells(read(path))[0].source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "WORLD_SIZE":
            return ast.literal_eval(node.value)
    return None


def _make_test(path):
    @pytest.mark.notebooks
    def test_runs_with_another_world_size(self, tmp_path):
        import papermill as pm
        default = _default_world_size(path)
        other = 3 if default != 3 else 2
        pm.execute_notebook(str(path), str(tmp_path / path.name), parameters={"WORLD_SIZE": other},
                            kernel_name="python3", progress_bar=False, execution_timeout=300, cwd=str(path.parent))
    return test_runs_with_another_world_size


for _path in NOTEBOOKS + SOLUTIONS:
    if _default_world_size(_path) is not None:
        _name = "TestPapermill_" + _path.parent.name + "_" + _path.stem
        globals()[_name] = type(_name, (), {"test_runs_with_another_world_size": _make_test(_path),
                                            "__doc__": f"{rel(_path)} with another WORLD_SIZE"})
