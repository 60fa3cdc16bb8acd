"""Environment checks that turn a broken set-up into a message saying what to run.

Used in three places: at import of `course_lib` (Python version), in the first cell of every notebook
(`course_lib.check_environment()`), and by `tools/install.sh` after installing.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

MIN_PYTHON = (3, 11)   # numpy, matplotlib, ipykernel and nbgrader as pinned need 3.11
FIX = "From the course folder run `make lab` (it installs everything into .venv and opens JupyterLab with it), or " \
      "`pip install -e <course folder>` into this kernel's environment and restart the kernel."


class EnvironmentProblem(RuntimeError):
    """The Python environment cannot run the course; the message says what to run."""


def check_python(version: tuple[int, int] = sys.version_info[:2]) -> None:
    if tuple(version) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        raise EnvironmentProblem(
            f"The course needs Python >= {need}; this kernel runs Python {version[0]}.{version[1]}. "
            f"Install a newer Python and run `make PYTHON=python3.11 lab`.")


def pinned_requirements(pyproject: Path | None = None) -> dict[str, str]:
    """Map package name -> pinned version, read from pyproject.toml (every `name==version` line, with or without an
    environment marker)."""
    pyproject = pyproject or Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.exists():  # installed non-editable: fall back to the package metadata
        reqs = md.requires("course-lib") or []
        text = "\n".join(f'"{r.split(";")[0].strip()}"' for r in reqs)
    else:
        text = pyproject.read_text()
    # "name==1.0" or "name[extra]==1.0"; the extra does not change which distribution is pinned
    return {m.group(1).lower(): m.group(2)
            for m in re.finditer(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^"\s;]+)\s*(?:;[^"]*)?"', text)}


def check_environment(verbose: bool = True,
                      required=("torch", "numpy", "matplotlib", "tqdm", "ipywidgets", "psutil")) -> None:
    """Check Python and the pinned packages; raise `EnvironmentProblem` with a fix, or print one summary line.

    Missing packages are an error; a version that differs from the pin is a warning (numbers may differ).
    """
    environment_info(verbose, required)


def environment_info(verbose: bool = False,
                     required=("torch", "numpy", "matplotlib", "tqdm", "ipywidgets", "psutil")) -> dict:
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


class KnobError(ValueError):
    """A notebook knob is out of its range; the message is one line that says what to pick."""


def _bound(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def check_knobs(*rules, **knobs) -> dict:
    """Validate a notebook's knobs in one call, right after its parameters cell; return them as a dict.

        check_knobs(SEED=SEED, QUICK=QUICK, WORLD_SIZE=(WORLD_SIZE, 2, 8), STEPS=(STEPS, 30, None),
                    PRESET=(PRESET, ["nano", "micro"]), MATRIX=(MATRIX, 24, None, 24, "8 and 9 ranks split it"))

    SEED must be an integer ≥ 0 and QUICK a bool; `(value, lo, hi)` is an integer (a number, if a bound is a float)
    in [lo, hi], None for no bound, and `(value, lo, hi, k)` an integer multiple of k there; `(value, choices)` is
    one of the choices; a spec may end with a string that says why; anything else is taken as it is. A rule is
    `(ok, message)` for what involves several knobs, checked after the knobs (`ok` may be a function, so that it
    is evaluated only once the knobs it reads are valid). A bad value raises KnobError with one line, e.g.
    "WORLD_SIZE = 0: pick 2 to 8".
    """
    values = {}
    for name, spec in knobs.items():
        if name == "SEED" and not isinstance(spec, tuple):
            spec = (spec, 0, None)
        if name == "QUICK" and not isinstance(spec, tuple):
            if not isinstance(spec, bool):
                raise KnobError(f"QUICK = {spec!r}: pick True or False")
            values[name] = spec
            continue
        if not isinstance(spec, tuple):
            values[name] = spec
            continue
        why = f" ({spec[-1]})" if len(spec) > 2 and isinstance(spec[-1], str) else ""
        spec = spec[:-1] if why else spec
        value = spec[0]
        if len(spec) == 2:
            if value not in spec[1]:
                raise KnobError(f"{name} = {value!r}: pick one of {', '.join(map(repr, spec[1]))}{why}")
        elif len(spec) in (3, 4):
            lo, hi = spec[1], spec[2]
            step = spec[3] if len(spec) == 4 else None
            real = (isinstance(lo, float) or isinstance(hi, float)) and step is None
            kinds = (int, float) if real else (int,)
            what = "a number" if real else f"a multiple of {step}" if step else "an integer"
            rng = (f"{_bound(lo)} to {_bound(hi)}" if lo is not None and hi is not None else
                   f"{what} ≥ {_bound(lo)}" if lo is not None else f"{what} ≤ {_bound(hi)}")
            if step and lo is not None and hi is not None:
                rng = f"{what} from {_bound(lo)} to {_bound(hi)}"
            if isinstance(value, bool) or not isinstance(value, kinds) or \
                    (lo is not None and value < lo) or (hi is not None and value > hi) or (step and value % step):
                raise KnobError(f"{name} = {value!r}: pick {rng}{why}")
        else:
            raise TypeError(f"check_knobs: {name} needs value, (value, lo, hi[, multiple]) or (value, choices), "
                            f"got {spec!r}")
        values[name] = value
    for rule in rules:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], str)):
            raise TypeError(f"check_knobs: a rule is (ok, message), got {rule!r}")
        ok, message = rule
        if not (ok() if callable(ok) else ok):
            raise KnobError(message)
    return values
