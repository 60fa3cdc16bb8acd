"""Lectures and lab solutions run with ranks that are not forked — the path macOS (forkserver), Windows (spawn) and
NCCL take (course_lib.distributed.start) — on every `make test`: a representative set here, every notebook and solution
in `make test-spawn` (COURSE_START_METHOD for the whole run).

Each runs under papermill at its defaults in a fresh kernel whose COURSE_START_METHOD makes every `launch` in it use
that method, so the workers defined in its cells travel by value; its own asserts check every number, as under fork.
The set: notebook 01 (transports: sockets, shared memory and pipes made inside the ranks) spawned, the strictest
way; from the fork server (macOS's and NCCL's way) notebook 00 (the first launch), 02 (collectives from send/recv)
and lab 03's solution (a DDP the learner writes in cells, launched by the lab's checks). Spawned ranks import torch
at every launch, so spawn runs one notebook here (~50 s on a loaded 2-core machine) and all in `make test-spawn`.
"""
import pytest

from ._nb import ROOT
from .test_papermill import _execute

CASES = [("notebooks/00_orientation.ipynb", "forkserver"), ("notebooks/01_transports.ipynb", "spawn"),
         ("notebooks/02_collectives.ipynb", "forkserver"), ("solutions/lab03_ddp.ipynb", "forkserver")]


def _make_class(path, method):
    @pytest.mark.notebooks
    def test_runs_with_ranks_that_are_not_forked(self, tmp_path, monkeypatch):
        monkeypatch.setenv("COURSE_START_METHOD", method)
        _execute(ROOT / path, tmp_path, {})

    name = f"TestStartMethod_{method}_{path.split('/')[-1].split('.')[0]}"
    return type(name, (), {"test_runs_with_ranks_that_are_not_forked": test_runs_with_ranks_that_are_not_forked,
                           "__doc__": f"{path} with COURSE_START_METHOD={method}"})


# one class per case, so `--dist loadscope` spreads them over the workers
for _path, _method in CASES:
    assert (ROOT / _path).exists(), _path
    _cls = _make_class(_path, _method)
    globals()[_cls.__name__] = _cls
