"""course_lib: the shared library of the course *Systems for large-model training*.

Every technique the notebooks teach lives here once, as a short readable module; notebooks import it,
show it (`show_source`) and measure it.

    model        toy GPT (presets ~44 K – ~20 M parameters), parameter, FLOP and activation counts
    data         shipped real-text corpus, byte tokenizer, rank-sharded deterministic batches
    train        THE training loop (`run`, with probes: ledger, memory, gradients) and the single-process reference
    memory       exact live bytes by category × placement (device/host/disk), timeline, simulated accelerator
    costmodel    alpha-beta link model with sourced presets and a calibration helper ("modeled")
    plots        per-rank timelines, memory by category, traffic bars
    dist/        launch (real ranks), comm (the traffic ledger), mesh (pp × dp × tp), collectives, flat buffers
    parallel/    dp (DDP), zero (ZeRO-1/2), fsdp (ZeRO-3), compose (apply_<technique>, in the order they compose)
    memopt/      memory-saving techniques (offload, recomputation, precision)
    transports/  TCP / RDMA / GPUDirect: measured paths between processes, the modeled exchange
    checks/      lab checks: one pass line with the measured figure, or one failure with a hint

The formulas every module is checked against are in docs/formulas.md ("formulas §N").
"""
from ._env import EnvironmentProblem, KnobError, check_environment, check_knobs, check_python

check_python()

__version__ = "0.1.0"
COURSE_KERNEL = "llm-systems-course"


def show_source(obj, *, title: str | None = None):
    """Render the real source of `obj` (so prose cannot drift from what runs)."""
    import inspect
    src = inspect.getsource(obj)
    try:
        from IPython.display import Code, display
        get_ipython  # noqa: F821  (defined only inside IPython)
        display(Code(src, language="python"))
    except (ImportError, NameError):
        print(f"# --- {title or getattr(obj, '__qualname__', obj)} ---\n{src}")


__all__ = ["EnvironmentProblem", "KnobError", "check_environment", "check_knobs", "check_python", "show_source",
           "COURSE_KERNEL"]
