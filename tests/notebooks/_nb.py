"""Helpers shared by the notebook tests."""
import ast
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
ALL = NOTEBOOKS + SOLUTIONS + LABS


def read(path):
    return nbformat.read(path, as_version=4)


def rel(path) -> str:
    return Path(path).relative_to(ROOT).as_posix()


def parameters_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]


def assigned_names(source: str) -> set:
    return set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=", source, flags=re.M))


def is_check_cell(cell) -> bool:
    """A code cell that calls a lab check: `check_x(...)` or `labNN.check_x(...)` at the start of a line."""
    return cell.cell_type == "code" and re.search(r"^(lab\d\d\.)?check_\w+\(", cell.source, re.M) is not None


def launches_ranks(nb) -> bool:
    return any(c.cell_type == "code" and re.search(r"\blaunch\(", c.source) for c in nb.cells)


def reads(source: str, name: str) -> bool:
    """Whether the cell's code (magics translated, comments and strings ignored) reads `name`."""
    from IPython.core.inputtransformer2 import TransformerManager
    try:
        tree = ast.parse(TransformerManager().transform_cell(source))
    except SyntaxError:
        return re.search(rf"\b{name}\b", source) is not None
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(tree))


def knob_is_read(nb, name: str) -> bool:
    """Whether a code cell other than the parameters cell reads the knob `name`."""
    params = parameters_cells(nb)[0]
    return any(reads(c.source, name) for c in nb.cells if c.cell_type == "code" and c is not params)
