#!/bin/sh
# Idempotent set-up: .venv with the pinned packages, course_lib (editable) and the course's Jupyter kernel.
# Re-runs the install only when pyproject.toml or this script changed (hash stamp in .venv).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
KERNEL=llm-systems-course

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: '$PYTHON' not found. Install Python 3.10 or newer, or point make at one: make PYTHON=/path/to/python3.11 lab" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
    echo "error: the course needs Python >= 3.10, but '$PYTHON' is $("$PYTHON" --version 2>&1)." >&2
    echo "       Install a newer Python and run: make PYTHON=python3.11 lab   (or: make PYTHON=python3.11 test)" >&2
    exit 1
fi

stamp="$VENV/.course-installed"
want=$(cat pyproject.toml tools/install.sh | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
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
echo "== installing pinned packages and course_lib into $VENV (first time: about a minute, ~1.4 GB)"
extra=""
if [ -n "${TORCH_INDEX:-}" ]; then extra="--extra-index-url $TORCH_INDEX"; fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $extra -e ".[lab,test]"
"$VENV/bin/python" -m ipykernel install --sys-prefix --name "$KERNEL" \
    --display-name "Python (LLM systems course)" >/dev/null
"$VENV/bin/python" -c 'import course_lib; course_lib.check_environment(verbose=False)'
echo "$want" > "$stamp"
echo "== ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
