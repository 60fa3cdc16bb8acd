import os
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")


def _mp_helper(proc) -> bool:
    """multiprocessing's fork server and resource tracker: they serve every later launch and end with this process
    (their pipes from it close), so they are no leak of one launch."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.forkserver import main" in cmd or "multiprocessing.resource_tracker import main" in cmd


@pytest.fixture
def no_leaks():
    """Fail if the test leaves a child process or a listening socket behind."""
    me = psutil.Process()
    before_children = {p.pid for p in me.children(recursive=True)}
    yield
    leftover = [p for p in me.children(recursive=True) if p.pid not in before_children and not _mp_helper(p)]
    for p in leftover:   # don't let one leak poison later tests
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not leftover, f"child processes survived the call: {leftover}"
    listening = [c for c in me.net_connections() if c.status == psutil.CONN_LISTEN]
    assert not listening, f"listening sockets survived the call: {listening}"
