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


def source_of(obj, *, only=None) -> str:
    """The source `show_source` renders: all of `obj`, or, for a class, the methods that teach.

    only:  the method names to show (a str or a list): the class's header (decorators, class line, docstring and
           what it declares before its first method, such as a dataclass's fields), then those methods in the order
           given; a comment names the methods left out. Parts are chosen by name, never by line number, so an edit
           elsewhere in the file cannot change what a lecture shows.
    """
    import inspect
    import textwrap
    if only is None:
        return inspect.getsource(obj)
    if not inspect.isclass(obj):
        raise TypeError(f"show_source(only=...) needs a class, got {obj!r}")
    names = [only] if isinstance(only, str) else list(only)
    file = inspect.getsourcefile(obj)
    methods = {n: v for n, v in vars(obj).items()       # written in the class (not made by @dataclass)
               if (inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)))
               and getattr(getattr(_function_of(v), "__code__", None), "co_filename", None) == file}
    missing = [n for n in names if n not in methods]
    if missing:
        raise ValueError(f"{obj.__qualname__} defines no method {', '.join(missing)}; it defines "
                         f"{', '.join(methods)}")
    lines = inspect.getsource(obj).splitlines()
    body = next(i for i, line in enumerate(lines) if line.lstrip().startswith("class ")) + 1
    first_method = min((_function_of(m).__code__.co_firstlineno for m in methods.values()), default=None)
    header_end = len(lines) if first_method is None else first_method - inspect.getsourcelines(obj)[1]
    while header_end > body and (not lines[header_end - 1].strip() or lines[header_end - 1].lstrip().startswith("@")):
        header_end -= 1                        # the first method's decorators and the blank lines before it
    shown = lines[:header_end]
    for n in names:
        shown += ["", textwrap.indent(textwrap.dedent(inspect.getsource(_function_of(methods[n]))).rstrip(), "    ")]
    rest = [n for n in methods if n not in names]
    if rest:
        shown += ["", f"    # … and {', '.join(rest)}"]
    return "\n".join(shown) + "\n"


def _function_of(member):
    """The function behind a method, property (its getter), classmethod or staticmethod, under its decorators."""
    import inspect
    return inspect.unwrap(getattr(member, "fget", None) or getattr(member, "__func__", member))


def show_source(obj, *, title: str | None = None, only=None):
    """Render the real source of `obj` (so prose cannot drift from what runs); `only` picks a class's methods that
    teach (see `source_of`)."""
    src = source_of(obj, only=only)
    try:
        from IPython.display import Code, display
        _ = get_ipython  # noqa: F821  (defined only inside IPython)
        display(Code(src, language="python"))
    except (ImportError, NameError):
        print(f"# --- {title or getattr(obj, '__qualname__', obj)} ---\n{src}")


__all__ = ["EnvironmentProblem", "KnobError", "check_environment", "check_knobs", "check_python", "show_source",
           "source_of", "COURSE_KERNEL"]
