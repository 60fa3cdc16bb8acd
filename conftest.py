"""Session-wide pytest plumbing for `make test`: the longest work first, and a per-notebook wall-time table at the
end of the run.

nbval reports each notebook cell as its own test; this sums them per notebook (setup includes the kernel start)
and adds each papermill run (tests/notebooks/test_papermill.py: one test per whole run), so the '< 60 s on 2 cores'
budget of every notebook is visible in CI's log. It is a report, not an assertion: timings on a shared 2-core box
are too noisy to fail on.

Order: the two workers take scopes (a notebook, a test module or class: `--dist loadscope`) in collection order, so
a long scope collected last runs alone while the other worker idles. Collection puts the long scopes first —
notebooks, then papermill runs, then the integration tests (real ranks) — and the many short unit tests last,
where they fill in around whatever is still running (longest-first scheduling). Within a scope the order is
untouched: nbval runs a notebook's cells in order.
"""
from collections import defaultdict

NOTEBOOK_BUDGET_S = 60.0
_seconds = defaultdict(float)


def _rank(item) -> int:
    path = item.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        return 0
    if "::TestPapermill_" in item.nodeid:
        return 1
    if path.startswith("tests/integration/") or path in ("tests/test_nbgrader.py", "tests/notebooks/test_labs.py"):
        return 2
    return 3


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_rank)          # stable: each scope keeps its items, and their order


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
