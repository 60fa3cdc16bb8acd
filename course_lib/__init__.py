"""course_lib: the shared library of the course *Systems for large-model training*.

Every technique the notebooks teach lives here once, as a short readable module; notebooks import it,
show it (`show_source`) and measure it. One package per layer, bottom to top — a module imports only its own layer
and those below (tests/test_layering.py reads every import, function-local ones too):

    foundation
      core/          the toy GPT (model, moe), its data, the atomic write (files), the alpha-beta link model
                     (costmodel), the plots every notebook draws
      memory/        exact live bytes by category × placement (device/host/disk), timeline, simulated accelerator
      lab            `python -m course_lib.lab`: the course's set-up (kernel, JupyterLab settings) and JupyterLab
    distributed
      distributed/   launch (real ranks), comm (the traffic ledger), mesh (pp × dp × cp × tp, ep inside dp),
                     collectives, all-to-all, flat buffers
      run            the torchrun entry: `torchrun … -m course_lib.run module:worker`
    train
      train          THE training loop (`run`, with probes: ledger, memory, gradients) and the single-process reference
    techniques       each `apply_<technique>(model, mesh, …)` in its own module
      parallel/      dp (DDP), zero (ZeRO-1/2), fsdp (ZeRO-3), pipeline, tensor, context (ring attention), expert (EP)
      memopt/        memory-saving techniques (offload, recomputation, precision, quantization) and memory_fit, which
                     technique fits a model on a device at what modeled cost
      optim/         the one optimizer module: AdamW, fp32 master weights, 8-bit states
      transports/    TCP / RDMA / GPUDirect: measured paths between processes, the modeled exchange
    systems
      resilience/    checkpoints and recovery
      io/            data from object storage through caches
    composer
      composer/      ONE plan of every technique (plan), checked before launch, the composer that applies it on a rank
                     in the one order techniques compose in (parallelize), the bytes each axis carries (expected)
      capstone/      notebook 13's worker: every axis at once through parallelize, equal to one process; the survey's
                     table measured (survey), the per-rank timeline (plots); runs under torchrun
      calculator/    the capstone's analytic calculator: memory, step time, planner, cost; checked against published
                     tables (data/published/)
      checks/        lab checks: one pass line with the measured figure, or one failure with a hint

The formulas every module is checked against are in docs/formulas.md ("formulas §N").

The package itself holds `show_source` and the environment checks (`_env`: a broken set-up becomes a message saying
what to run).
"""
from ._env import EnvironmentProblem, KnobError, check_environment, check_knobs, check_python

check_python()

__version__ = "0.1.0"
COURSE_KERNEL = "llm-systems-course"


def source_of(obj, *, lines=None, only=None) -> str:
    """The source `show_source` renders: all of `obj`, or the part that teaches.

    only:  for a class, the method names to show (a str or a list): the class line and docstring, then those
           methods; a comment names the ones left out.
    lines: (first, last), 1-based lines of the object's source to keep, or a list of such ranges in order; a
           comment marks what was cut.
    """
    import inspect
    import textwrap
    if only is not None:
        if not inspect.isclass(obj):
            raise TypeError(f"show_source(only=...) needs a class, got {obj!r}")
        names = [only] if isinstance(only, str) else list(only)
        missing = [n for n in names if n not in vars(obj)]
        if missing:
            raise ValueError(f"{obj.__qualname__} defines no {', '.join(missing)}; it defines "
                             f"{', '.join(n for n, v in vars(obj).items() if inspect.isfunction(v))}")
        head = inspect.getsource(obj).splitlines()
        doc = inspect.getdoc(obj)
        shown = [head[0]] + ([textwrap.indent(f'"""{doc}"""', "    ")] if doc else [])
        for n in names:
            member = vars(obj)[n]
            member = getattr(member, "fget", None) or getattr(member, "__func__", member)
            shown += ["", textwrap.indent(textwrap.dedent(inspect.getsource(member)).rstrip(), "    ")]
        rest = [n for n, v in vars(obj).items() if inspect.isfunction(v) and n not in names]
        if rest:
            shown += ["", f"    # … and {', '.join(rest)}"]
        return "\n".join(shown) + "\n"
    src = inspect.getsource(obj)
    if lines is None:
        return src
    ranges = [tuple(lines)] if isinstance(lines[0], int) else [tuple(r) for r in lines]
    all_lines = src.splitlines()
    shown, end = [], 0                      # `end`: the last line shown so far
    for first, last in ranges:
        if not end < first <= last <= len(all_lines):
            raise ValueError(f"lines={lines!r}: the source of {getattr(obj, '__qualname__', obj)} has lines 1 to "
                             f"{len(all_lines)}; give ranges (first, last) in order, not overlapping")
        if first > end + 1:
            shown.append(f"# … {first - end - 1} line(s) {'above' if end == 0 else 'left out'}")
        shown += all_lines[first - 1:last]
        end = last
    if end < len(all_lines):
        shown.append(f"# … {len(all_lines) - end} line(s) below")
    return "\n".join(shown) + "\n"


def show_source(obj, *, title: str | None = None, lines=None, only=None):
    """Render the real source of `obj` (so prose cannot drift from what runs); `only`/`lines` pick the part that
    teaches (see `source_of`)."""
    src = source_of(obj, lines=lines, only=only)
    try:
        from IPython.display import Code, display
        get_ipython  # noqa: F821  (defined only inside IPython)
        display(Code(src, language="python"))
    except (ImportError, NameError):
        print(f"# --- {title or getattr(obj, '__qualname__', obj)} ---\n{src}")


__all__ = ["EnvironmentProblem", "KnobError", "check_environment", "check_knobs", "check_python", "show_source",
           "source_of", "COURSE_KERNEL"]
