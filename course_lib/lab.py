"""`python -m course_lib.lab`: what `make lab` does, without make, in whatever Python environment runs it.

    pip install -e ".[lab]"               # from the course folder, into any venv or conda env
    python -m course_lib.lab              # set Jupyter up for the course, then JupyterLab on notebook 00
    python -m course_lib.lab --setup-only # the set-up alone (tools/install.sh runs this after installing)
    python -m course_lib.lab --user       # register the kernel for this user: what a JupyterHub sees

The set-up: the course kernel "Python (LLM systems course)" (`COURSE_KERNEL`), registered in this environment (or
for the user), with one OpenMP thread; and JupyterLab's settings the course overrides. Notebooks name the standard
`python3` kernel, so they run in any kernel that has the course; JupyterLab started here gives every kernel one
OpenMP thread too, as `make test` runs them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from . import COURSE_KERNEL

ROOT = Path(__file__).resolve().parent.parent
START = PurePosixPath("notebooks/00_orientation.ipynb")   # where a learner begins
KERNEL_DISPLAY = "Python (LLM systems course)"
# One BLAS/OpenMP thread per kernel. Notebook 00 on a shared 2-core machine: 577 s with torch's default 2 threads vs
# 75 s with 1 under the same background load, 818 s vs 65 s with two more CPU hogs; alone, 1 thread needs ~15 s of CPU
# for the whole notebook. Spinning OpenMP threads waiting for a busy core cost far more than the second thread gains
# (ranks already run 1 thread each).
KERNEL_THREADS = "1"


def register_kernel(user: bool = False) -> None:
    """The course kernel, running this Python: in this environment (`--sys-prefix`), or for the user (`--user`, what a
    JupyterHub lists: a kernel inside a venv is invisible to the hub's own Jupyter)."""
    where = "--user" if user else "--sys-prefix"
    subprocess.run([sys.executable, "-m", "ipykernel", "install", where, "--name", COURSE_KERNEL,
                    "--display-name", KERNEL_DISPLAY, "--env", "OMP_NUM_THREADS", KERNEL_THREADS],
                   check=True, stdout=subprocess.DEVNULL)


def lab_settings() -> Path:
    """JupyterLab defaults the course overrides (the learner can still change them in Settings):
    - it asks about "Jupyter news" in a pop-up on every load until someone answers; a class starts clean;
    - it sends widget messages to kernel subshells (ipykernel 7): notebook 09's first widget redraw after Run All came
      out blank or half-drawn in 6 of 9 tries, sometimes in the Log Console instead; with comms on the main shell,
      0 of 7."""
    path = Path(sys.prefix, "share", "jupyter", "lab", "settings", "overrides.json")
    settings = json.loads(path.read_text()) if path.exists() else {}
    settings.setdefault("@jupyterlab/apputils-extension:notification", {}).update(fetchNews="false",
                                                                                   checkForUpdates=False)
    settings.setdefault("@jupyterlab/apputils-extension:kernels-settings", {}).update(commsOverSubshells="disabled")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")
    return path


def command(ip: str = "127.0.0.1", port: str = "8888", rest: list[str] = ()) -> list[str]:
    """The `jupyter lab` command line `make lab` runs."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}", f"--ip={ip}", f"--port={port}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")          # Jupyter refuses to run as root without it (containers, CI)
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")          # headless: just print the URL
    if (ROOT / START).exists():
        # The URL the server prints (and opens in a browser) is its default_url. A notebook given as an argument
        # only changes what a local browser opens, so the printed link still led to the Launcher.
        cmd.append(f"--LabApp.default_url=/lab/tree/{quote(START.as_posix())}")
    return cmd + list(rest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ip", default="127.0.0.1")
    ap.add_argument("--port", default="8888")
    ap.add_argument("--setup-only", action="store_true", help="register the kernel and settings, start nothing")
    ap.add_argument("--user", action="store_true", help="register the kernel for this user (JupyterHub)")
    args, rest = ap.parse_known_args(argv)
    if not args.setup_only and not (ROOT / "notebooks").is_dir():
        raise SystemExit(f"error: no notebooks/ beside {Path(__file__).parent}: course_lib.lab opens the course "
                         f"folder, so install from a clone (git clone <the course repository URL>; cd into it; "
                         f"pip install -e \".[lab]\")")
    try:
        import ipykernel  # noqa: F401
        import jupyterlab  # noqa: F401
    except ModuleNotFoundError as e:
        raise SystemExit(f"error: {e.name} is missing: pip install -e \"{ROOT}[lab]\" installs what the lab needs")
    register_kernel(user=args.user)
    lab_settings()
    if args.setup_only:
        return 0
    print("Starting JupyterLab on the course. Open the URL printed below (with its token) in a browser: it opens "
          f"{START}. Press Ctrl-C twice to stop.", flush=True)
    os.chdir(ROOT)
    os.environ.setdefault("OMP_NUM_THREADS", KERNEL_THREADS)     # inherited by every kernel the server starts
    os.execv(sys.executable, command(args.ip, args.port, rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
