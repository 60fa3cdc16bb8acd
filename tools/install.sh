#!/bin/sh
# Idempotent set-up: .venv with the pinned packages, course_lib (editable) and the course's Jupyter kernel.
# Re-runs the install only when pyproject.toml, this script or tools/uv_install.py changed (hash stamp in .venv).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
UV_VERSION=0.13.8   # the installer (tools/uv_install.py hands it pip's configuration)

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: '$PYTHON' not found. Install Python 3.11 or newer, or point make at one: make PYTHON=/path/to/python3.11 lab" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "error: the course needs Python >= 3.11, but '$PYTHON' is $("$PYTHON" --version 2>&1)." >&2
    echo "       Install a newer Python and run: make PYTHON=python3.11 lab   (or: make PYTHON=python3.11 test)" >&2
    exit 1
fi

stamp="$VENV/.course-installed"
want=$(cat pyproject.toml tools/install.sh tools/uv_install.py course_lib/lab.py | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
   && "$VENV/bin/python" -c 'import course_lib' >/dev/null 2>&1; then
    exit 0   # nothing changed since the last install
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV with $("$PYTHON" --version 2>&1)"
    if ! "$PYTHON" -m venv "$VENV"; then
        echo "error: could not create a virtual environment. On Debian/Ubuntu: sudo apt install python3-venv" >&2
        exit 1
    fi
fi
echo "== installing pinned packages and course_lib into $VENV (first time: a minute or two, ~1.4 GB)"
# uv (pinned, from PyPI) downloads and unpacks in parallel: a fresh install took ~3 min with pip alone. Same pins,
# same resolution as pip (the best match over every index, so TORCH_INDEX's +cpu build wins as with pip), and pip's
# own configuration (find-links, extra indexes, constraints, certificate) handed over, since uv does not read it.
# Without uv (an index that lacks it) or if uv fails, pip installs as before.
extra=""
if [ -n "${TORCH_INDEX:-}" ]; then extra="--extra-index-url $TORCH_INDEX"; fi
pip="$VENV/bin/python -m pip --disable-pip-version-check"
# shellcheck disable=SC2086
if $pip install --quiet "uv==$UV_VERSION" >/dev/null 2>&1 \
   && "$VENV/bin/python" tools/uv_install.py $extra -e ".[pinned,lab,test]"; then
    :
else
    echo "   (uv $UV_VERSION unavailable or failed: installing with pip instead, ~3 min)"
    # shellcheck disable=SC2086
    $pip install --quiet $extra -e ".[pinned,lab,test]"
fi
# The course kernel (one OpenMP thread) and JupyterLab's settings: course_lib/lab.py says why, and does the same for
# an install without make (`python -m course_lib.lab`).
"$VENV/bin/python" -m course_lib.lab --setup-only
"$VENV/bin/python" -c 'import course_lib; course_lib.check_environment(verbose=False)'
echo "$want" > "$stamp"
echo "== ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
