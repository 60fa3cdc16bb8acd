"""The two commands and what stands behind them: pins, install, JupyterLab, environment errors, dry run."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from course_lib._env import EnvironmentProblem, check_environment, check_python, pinned_requirements

ROOT = Path(__file__).resolve().parents[1]


def _yml_pins():
    text = (ROOT / "environment.yml").read_text()
    return {m.group(1).lower(): m.group(2)
            for m in re.finditer(r"^\s*-\s*\"?([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;\"]+)", text, re.M)}


def test_environment_yml_carries_the_same_pins_as_pyproject():
    assert _yml_pins() == pinned_requirements(ROOT / "pyproject.toml")


def test_every_dependency_is_pinned_exactly_but_torch_which_keeps_a_hosted_notebooks_own():
    """torch is a range in the dependencies (pip into a hosted notebook keeps its torch) and pinned in the `pinned`
    extra that make lab/test install; the pin is the range's lower bound, and the torch here lies in the range."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = ["):text.index("\n[tool.")]     # [project] and its optional extras
    reqs = re.findall(r'^\s*(?:pinned = \[)?"([^"]+)"\]?,?\s*$', block, re.M)
    ranged = [r for r in reqs if "==" not in r]
    assert len(reqs) >= 20 and len(ranged) == 1 and ranged[0].startswith("torch>="), ranged
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", ranged[0]).groups()
    pins = pinned_requirements(ROOT / "pyproject.toml")
    assert len(pins) == len(reqs) - 1, "every pinned line must be read by pinned_requirements (extras included)"
    assert pins["torch"] == low
    import torch
    version = tuple(map(int, torch.__version__.split("+")[0].split(".")[:2]))
    assert tuple(map(int, low.split(".")[:2])) <= version < tuple(map(int, high.split(".")[:2]))
    if torch.__version__.split("+")[0] == pins["torch"]:
        assert torch.version.cuda is None, f"the pin installed a CUDA build of torch ({torch.version.cuda})"


def test_ci_runs_the_readme_test_command_and_nothing_else():
    lines = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[-1].strip() == "exec make test"
    assert "make test" in (ROOT / "README.md").read_text() and "make lab" in (ROOT / "README.md").read_text()


def test_old_python_is_refused_with_what_to_run():
    with pytest.raises(EnvironmentProblem, match="make PYTHON=python3.11 lab"):
        check_python((3, 10))       # numpy, matplotlib, ipykernel and nbgrader as pinned need 3.11


def test_the_oldest_python_is_the_same_everywhere_it_is_stated():
    from course_lib._env import MIN_PYTHON
    need = ".".join(map(str, MIN_PYTHON))
    assert f'requires-python = ">={need}"' in (ROOT / "pyproject.toml").read_text()
    assert f"sys.version_info >= {MIN_PYTHON}" in (ROOT / "tools/install.sh").read_text()
    assert f"python={need}" in (ROOT / "environment.yml").read_text()
    assert f"Python ≥ {need}" in (ROOT / "README.md").read_text()


def test_install_script_refuses_an_old_python(tmp_path):
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Python 3.10.14'; exit 0; fi\nexit 1\n")
    fake.chmod(0o755)
    out = subprocess.run(["sh", "tools/install.sh"], cwd=ROOT, env={**os.environ, "PYTHON": str(fake)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "needs Python >= 3.11" in out.stderr and "Python 3.10.14" in out.stderr


def test_missing_package_says_run_make_lab():
    with pytest.raises(EnvironmentProblem, match="make lab"):
        check_environment(verbose=False, required=("torch", "surely-not-installed-package"))


def test_notebook_guard_without_course_lib_prints_what_to_run():
    import nbformat
    nb = nbformat.read(ROOT / "notebooks" / "00_orientation.ipynb", as_version=4)
    guard = next(c.source for c in nb.cells if c.cell_type == "code" and "check_environment()" in c.source)
    # -S: no site-packages, so course_lib is not importable — as in a kernel of another environment
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}     # nor through PYTHONPATH
    out = subprocess.run([sys.executable, "-S", "-c", guard], capture_output=True, text=True, cwd="/", timeout=60,
                         env=env)
    assert out.returncode != 0
    assert "make lab" in out.stderr and "Traceback" not in out.stderr
    assert '%pip install "git+' in out.stderr                            # outside a clone: from the repository
    inside = subprocess.run([sys.executable, "-S", "-c", guard], capture_output=True, text=True, timeout=60,
                            cwd=ROOT / "notebooks", env=env)
    assert f'%pip install -e "{ROOT}"' in inside.stderr                  # in a clone (a JupyterHub): that folder


def test_the_course_kernel_runs_one_openmp_thread():
    """`make test` pins OMP_NUM_THREADS=1; the kernel `make lab` registers must too, or a learner's notebook spins
    one OpenMP thread per core and runs several times slower whenever anything else uses the CPU."""
    from jupyter_client.kernelspec import KernelSpecManager

    from course_lib import COURSE_KERNEL
    spec = KernelSpecManager().get_kernel_spec(COURSE_KERNEL)
    assert spec.env.get("OMP_NUM_THREADS") == "1", f"{spec.resource_dir}/kernel.json: env is {spec.env}"
    assert Path(spec.argv[0]).resolve().parent == Path(sys.executable).resolve().parent, \
        "the course kernel should run the course's .venv"


def test_install_turns_off_jupyterlabs_news_pop_up():
    path = Path(sys.prefix, "share", "jupyter", "lab", "settings", "overrides.json")
    assert path.exists(), f"{path} missing: tools/install.sh writes it"
    settings = json.loads(path.read_text())["@jupyterlab/apputils-extension:notification"]
    assert settings["fetchNews"] == "false" and settings["checkForUpdates"] is False


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_jupyterlab():
    port = _free_port()
    env = {**os.environ, "JUPYTER_TOKEN": "course-test-token"}
    env.pop("DISPLAY", None)
    proc = subprocess.Popen(["make", "lab", f"PORT={port}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # Wait for the URL Jupyter prints once it listens, and talk only to that port: probing a port before
        # anyone owns it could hit another test's gloo rank that the OS gave the same ephemeral port.
        url, deadline = None, time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
            url = m.group(1) if m else None
        assert url, "JupyterLab never printed its URL"
        status = None
        while status is None and time.monotonic() < deadline:   # the URL is logged just before the loop serves
            try:
                with urllib.request.urlopen(f"{url}/api/status?token=course-test-token", timeout=5) as r:
                    status = r.status
            except OSError:
                time.sleep(0.3)
        assert status == 200, "JupyterLab's HTTP API did not answer"
        with urllib.request.urlopen(f"{url}/api/kernelspecs?token=course-test-token", timeout=10) as r:
            assert b"llm-systems-course" in r.read(), "the course kernel is not registered"
        notification = "@jupyterlab/apputils-extension:notification"
        with urllib.request.urlopen(f"{url}/lab/api/settings/{notification}?token=course-test-token", timeout=10) as r:
            defaults = {k: v.get("default") for k, v in json.load(r)["schema"]["properties"].items()}
        assert defaults["fetchNews"] == "false", "JupyterLab would ask about Jupyter news in a pop-up on every load"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def test_run_all_executes_and_tabulates(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("X = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("assert X == 2")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "99_tiny.ipynb"
    nbformat.write(nb, path)
    out = subprocess.run([sys.executable, "tools/run_all.py", str(path), "-p", "X", "2",
                          "--out", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"99_tiny\.ipynb\s+\d+\.\d\s+ok", out.stdout) and (tmp_path / "out").exists()
