#!/usr/bin/env python3
"""Start JupyterLab on the course (what `make lab` runs after installing): `python -m course_lib.lab`, which also
works without make. Extra arguments go to `jupyter lab`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from course_lib.lab import START, command, main  # noqa: E402,F401  (command and START: tests/notebooks/test_jupyterlab.py)

if __name__ == "__main__":
    sys.exit(main())
