"""Environment checks that turn a broken set-up into a message saying what to run.

Used in three places: at import of `course_lib` (Python version), in the first cell of every notebook
(`course_lib.check_environment()`), and by `tools/install.sh` after installing.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

MIN_PYTHON = (3, 10)
FIX = "From the course folder run `make lab` (it installs everything into .venv and registers the course kernel), " \
      "then pick the kernel 'Python (LLM systems course)' in JupyterLab."


class EnvironmentProblem(RuntimeError):
    """The Python environment cannot run the course; the message says what to run."""


def check_python(version: tuple[int, int] = sys.version_info[:2]) -> None:
    if tuple(version) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        raise EnvironmentProblem(
            f"The course needs Python >= {need}; this kernel runs Python {version[0]}.{version[1]}. "
            f"Install a newer Python and run `make PYTHON=python3.11 lab`.")


def pinned_requirements(pyproject: Path | None = None) -> dict[str, str]:
    """Map package name -> pinned version, read from pyproject.toml (every `name==version` line)."""
    pyproject = pyproject or Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.exists():  # installed non-editable: fall back to the package metadata
        reqs = md.requires("course-lib") or []
        text = "\n".join(f'"{r.split(";")[0].strip()}"' for r in reqs)
    else:
        text = pyproject.read_text()
    # "name==1.0" or "name[extra]==1.0"; the extra does not change which distribution is pinned
    return {m.group(1).lower(): m.group(2)
            for m in re.finditer(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^"\s;]+)"', text)}


def check_environment(verbose: bool = True, required=("torch", "numpy", "matplotlib", "tqdm", "ipywidgets", "psutil")) -> None:
    """Check Python and the pinned packages; raise `EnvironmentProblem` with a fix, or print one summary line.

    Missing packages are an error; a version that differs from the pin is a warning (numbers may differ).
    """
    environment_info(verbose, required)


def environment_info(verbose: bool = False, required=("torch", "numpy", "matplotlib", "tqdm", "ipywidgets", "psutil")) -> dict:
    """What `check_environment` checks, as a dict (Python, torch, threads, CUDA, package versions)."""
    check_python()
    pins = pinned_requirements()
    missing, differing, found = [], [], {}
    for name in required:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        want = pins.get(name.lower())
        if want and found[name].split("+")[0] != want.split("+")[0]:
            differing.append(f"{name} {found[name]} (course pins {want})")
    if missing:
        raise EnvironmentProblem(f"Missing package(s): {', '.join(missing)}. {FIX}")
    if differing and verbose:
        print("warning: versions differ from the course's pins, figures may differ: " + "; ".join(differing))
    import torch
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), **{k: v for k, v in found.items() if k != "torch"}}
    if verbose:
        dev = "CUDA available" if info["cuda"] else "CPU only (ranks use gloo)"
        print(f"environment OK: Python {info['python']}, torch {info['torch']}, {info['threads']} threads, {dev}")
    return info
