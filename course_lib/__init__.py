"""course_lib: the shared library of the course *Systems for large-model training*.

Every technique the notebooks teach lives here once, as a short readable module; notebooks import it,
show it (`show_source`) and measure it.

    model        toy GPT (presets ~50 K – ~20 M parameters), parameter and FLOP counts
    data         shipped real-text corpus, byte tokenizer, rank-sharded deterministic batches
    train        the single-process reference training loop every technique is compared against
    memory       exact live-bytes accounting by category, timeline, simulated accelerator (OOM)
    launch       real ranks: processes joined by torch.distributed, with timeouts and tracebacks
    comm         the traffic ledger: a thin communicator recording bytes per rank, op and tag
    collectives  broadcast / reduce / all-reduce / all-gather / reduce-scatter built from send/recv
    transports   TCP / shared-memory / memcpy measurements between two processes; the RDMA/GPUDirect path model
    ddp          data parallelism: naive, bucketed and overlapped gradient all-reduce (any nn.Module)
    zero         ZeRO-1/2: a sharded optimizer wrapping any torch.optim class
    fsdp         ZeRO-3 / FSDP: parameters sharded per unit, gathered for compute
    costmodel    alpha-beta link model with sourced presets and a calibration helper ("modeled")
    plots        per-rank timelines, memory by category, traffic bars
    checks       lab checks: one pass line with the measured figure, or one failure with a hint
"""
from ._env import EnvironmentProblem, check_environment, check_python

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


__all__ = ["EnvironmentProblem", "check_environment", "check_python", "show_source", "COURSE_KERNEL"]
