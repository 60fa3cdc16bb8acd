#!/usr/bin/env python3
"""Start JupyterLab on the course (what `make lab` runs after installing). Extra arguments go to `jupyter lab`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
START = PurePosixPath("notebooks/00_orientation.ipynb")   # where a learner begins


def command(ip: str = "127.0.0.1", port: str = "8888", rest: list[str] = ()) -> list[str]:
    """The `jupyter lab` command line `make lab` runs."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}", f"--ip={ip}", f"--port={port}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")          # Jupyter refuses to run as root without it (containers, CI)
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")          # headless: just print the URL
    if (ROOT / START).exists():
        # The URL the server prints (and opens in a browser) is its default_url. A notebook given as an argument
        # only changes what a local browser opens, so the printed link still led to the Launcher.
        cmd.append(f"--LabApp.default_url=/lab/tree/{quote(START.as_posix())}")
    return cmd + list(rest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ip", default="127.0.0.1")
    ap.add_argument("--port", default="8888")
    args, rest = ap.parse_known_args(argv)
    cmd = command(args.ip, args.port, rest)
    print("Starting JupyterLab on the course. Open the URL printed below (with its token) in a browser: it opens "
          f"{START}. Press Ctrl-C twice to stop.", flush=True)
    os.chdir(ROOT)
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    sys.exit(main())
