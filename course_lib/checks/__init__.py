"""Lab checks: each prints one pass line with the measured figure, or raises `CheckFailed` with one readable
failure line and a hint. A stub that still raises NotImplementedError fails with "not implemented yet".

Each lab has its own module (`course_lib.checks.lab00`, …); this package holds the shared machinery:

    with check("param_count") as c:      # turns NotImplementedError / crashes into a readable CheckFailed
        got = fn(cfg)
        c.expect(got == want, f"got {got:,}, expected {want:,}", hint="count the biases too")
        c.passed(f"{got:,} parameters")

In Jupyter (any IPython shell), importing this package makes a failed check show as its ✘ line and hint only,
without a traceback: the traceback would go through contextlib and the check's own code, which the learner did not
write. A check cell that names an exercise function the learner has not run yet (Run All stops at the first stub)
says which exercise cell to run instead of showing a bare NameError. A lab module names its exercises with
`exercises({"fn_name": "Exercise 1 (what it is)"})`.

A lab's demo cell (it runs the learner's code to show what it does, before the checks judge it) goes in
`with demo("what it shows") as d:` — a stub prints one line and Run All goes on to the check cells, which say what
to write; a crash or a failed `d.expect(...)` prints one ✘ line and Run All goes on as well, so the learner lands
on the check whose hint names the cause instead of on a traceback in a cell they did not write.

One module per lab, its exercises' checks (`check_*`), run by the lab's check cells: lab00, lab01, lab02, lab03,
lab04, lab05, lab06, lab07, lab08, lab09, lab10, lab11, lab12, lab13, lab14.
"""
from __future__ import annotations

import contextlib
import linecache
import re


class CheckFailed(AssertionError):
    """A lab check did not pass; the message says what was measured and what to look at."""


class _Check:
    def __init__(self, name: str):
        self.name = name
        self.done = False

    def expect(self, condition: bool, message: str, hint: str = "") -> None:
        if not condition:
            raise CheckFailed(f"✘ {self.name}: {message}" + (f"\n  hint: {hint}" if hint else ""))

    def passed(self, message: str) -> None:
        self.done = True
        print(f"✔ {self.name}: {message}", flush=True)


@contextlib.contextmanager
def check(name: str):
    c = _Check(name)
    try:
        yield c
    except CheckFailed:
        raise
    except NotImplementedError:
        raise CheckFailed(f"✘ {name}: not implemented yet — replace the `raise NotImplementedError()` under "
                          f"'# YOUR CODE HERE', run that cell, then run this check again") from None
    except Exception as e:  # the learner's code crashed: show what, keep the message short
        raise CheckFailed(f"✘ {name}: your code raised {type(e).__name__}: {e}") from e
    if not c.done:
        raise CheckFailed(f"✘ {name}: the check ended without a verdict (a bug in the check)")


@contextlib.contextmanager
def demo(name: str):
    """A demo cell of a lab: never stops Run All. Not implemented yet → one line; the learner's code crashed or a
    `d.expect` failed → one ✘ line; either way the check cells below run and name the cause."""
    d = _Check(name)
    try:
        yield d
    except NotImplementedError:
        print(f"({name}: not implemented yet — the checks below say what to write)", flush=True)
    except CheckFailed as e:
        print(f"{e}\n  (the checks below name the cause)", flush=True)
    except Exception as e:  # noqa: BLE001 — the learner's code crashed: one line, then the checks
        print(f"✘ {name}: your code raised {type(e).__name__}: {e}\n  (the checks below name the cause)", flush=True)


NOT_IMPLEMENTED = "__not_implemented__"   # what a rank returns when the learner's stub raised NotImplementedError


def run_ranks(c: _Check, worker, world_size: int, *args, timeout: float = 60, hang_hint: str = ""):
    """launch(worker, world_size, *args) for a check: a hang or a crash on any rank becomes one readable
    CheckFailed line; a rank that returned NOT_IMPLEMENTED turns into 'not implemented yet'."""
    from ..distributed.launch import LaunchError, LaunchTimeout, launch
    try:
        results = launch(worker, world_size, *args, timeout=timeout)
    except LaunchTimeout:
        raise CheckFailed(f"✘ {c.name}: your code did not finish within {timeout:g} s on {world_size} ranks"
                          + (f"\n  hint: {hang_hint}" if hang_hint else "")) from None
    except LaunchError as e:
        rank = min(e.failures)
        tail = "\n".join(e.failures[rank].strip().splitlines()[-3:])
        raise CheckFailed(f"✘ {c.name}: on {world_size} ranks {str(e).splitlines()[0]}\n{tail}") from None
    if any(isinstance(r, str) and r == NOT_IMPLEMENTED for r in results):
        raise NotImplementedError
    return results


# ------------------------------------------------------------------------------- how a failure shows in Jupyter
_EXERCISES: dict[str, str] = {}         # function a lab exercise defines -> where it is, e.g. "Exercise 2 (…)"
_CHECK_CALL = re.compile(r"^(?:lab\d\d\.)?check_(\w+)\(", re.M)     # a check cell calls check_x(…) at line start


def exercises(where: dict[str, str]) -> None:
    """Name the functions a lab's exercise cells define, so a check cell run before them can say which cell to run."""
    _EXERCISES.update(where)


def _cell_source(tb) -> str | None:
    """Source of the notebook cell in whose top-level code the exception was raised, or None if it was raised
    elsewhere (a library function, the learner's function body)."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if code.co_name != "<module>":
        return None
    return "".join(linecache.getlines(code.co_filename)) or None


def name_error_hint(error: NameError, tb) -> str | None:
    """The ✘ line for a NameError raised by a check cell itself, or None when it is an ordinary NameError."""
    source = _cell_source(tb)
    check_call = _CHECK_CALL.search(source or "")
    if check_call is None:
        return None
    name = getattr(error, "name", None) or (re.findall(r"'(\w+)'", str(error)) or ["?"])[0]
    where = f" ({_EXERCISES[name]})" if name in _EXERCISES else ""
    return (f"✘ {check_call.group(1)}: `{name}` is not defined yet — run the exercise cell that defines `{name}`"
            f"{where} first, then this check again\n"
            f"  hint: Run All stops at the first exercise that still raises NotImplementedError; the cells after "
            f"it have not run")


def _show_in_ipython(shell, etype, value, tb, tb_offset=None):
    """IPython custom exception handler: CheckFailed → its message; NameError in a check cell → which cell to run;
    any other NameError → IPython's usual traceback."""
    text = str(value) if isinstance(value, CheckFailed) else name_error_hint(value, tb)
    if text is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    else:   # an error output with ename and evalue as usual, and the message lines in place of the traceback
        shell._showtraceback(etype, text, text.splitlines())
    return None


def _install_in_ipython() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "set_custom_exc"):
        shell.set_custom_exc((CheckFailed, NameError), _show_in_ipython)


_install_in_ipython()

__all__ = ["CheckFailed", "check", "demo", "run_ranks", "exercises", "name_error_hint", "NOT_IMPLEMENTED"]
