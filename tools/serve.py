#!/usr/bin/env python3
"""Start JupyterLab on the course (what `make lab` runs after installing). Extra arguments go to `jupyter lab`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ip", default="127.0.0.1")
    ap.add_argument("--port", default="8888")
    args, rest = ap.parse_known_args(argv)
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}", f"--ip={args.ip}", f"--port={args.port}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")          # Jupyter refuses to run as root without it (containers, CI)
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        cmd.append("--no-browser")          # headless: just print the URL
    start = ROOT / "notebooks" / "00_orientation.ipynb"
    if start.exists():
        cmd.append(str(start.relative_to(ROOT)))
    print("Starting JupyterLab on the course. Open the URL printed below (with its token) in a browser;"
          " press Ctrl-C twice to stop.", flush=True)
    os.chdir(ROOT)
    os.execv(sys.executable, cmd + rest)


if __name__ == "__main__":
    sys.exit(main())
