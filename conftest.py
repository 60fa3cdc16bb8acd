"""Session-wide pytest plumbing for `make test`: a per-notebook wall-time table at the end of the run.

nbval reports each notebook cell as its own test; this sums them per notebook (setup includes the kernel start)
and adds each papermill run (tests/notebooks/test_papermill.py: one test per whole run), so the '< 60 s on 2 cores'
budget of every notebook is visible in CI's log. It is a report, not an assertion: timings on a shared 2-core box
are too noisy to fail on.
"""
from collections import defaultdict

NOTEBOOK_BUDGET_S = 60.0
_seconds = defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _seconds[path] += report.duration
    elif "::TestPapermill_" in report.nodeid and report.when == "call":       # one whole run per test
        cls, params = report.nodeid.split("::TestPapermill_")[1].split("::test_runs_with")
        folder, _, stem = cls.partition("_")
        _seconds[f"{folder}/{stem}.ipynb papermill{params}"] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    tr = terminalreporter
    tr.section("notebook wall time (nbval: all cells incl. kernel start; papermill: each whole run)")
    for path, secs in sorted(_seconds.items()):
        flag = f"   <-- over the {NOTEBOOK_BUDGET_S:.0f} s budget" if secs > NOTEBOOK_BUDGET_S else ""
        tr.write_line(f"{secs:7.1f} s  {path}{flag}")
    tr.write_line(f"{sum(_seconds.values()):7.1f} s  total")
