"""Lab checks: each prints one pass line with the measured figure, or raises `CheckFailed` with one readable
failure line and a hint. A stub that still raises NotImplementedError fails with "not implemented yet".

Each lab has its own module (`course_lib.checks.lab00`, …); this package holds the shared machinery:

    with check("param_count") as c:      # turns NotImplementedError / crashes into a readable CheckFailed
        got = fn(cfg)
        c.expect(got == want, f"got {got:,}, expected {want:,}", hint="count the biases too")
        c.passed(f"{got:,} parameters")
"""
from __future__ import annotations

import contextlib


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


NOT_IMPLEMENTED = "__not_implemented__"   # what a rank returns when the learner's stub raised NotImplementedError


def run_ranks(c: _Check, worker, world_size: int, *args, timeout: float = 60, hang_hint: str = ""):
    """launch(worker, world_size, *args) for a check: a hang or a crash on any rank becomes one readable
    CheckFailed line; a rank that returned NOT_IMPLEMENTED turns into 'not implemented yet'."""
    from ..dist.launch import LaunchError, LaunchTimeout, launch
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


__all__ = ["CheckFailed", "check", "run_ranks", "NOT_IMPLEMENTED"]
