#!/bin/sh
# Idempotent set-up: .venv with the pinned packages, course_lib (editable) and the course's Jupyter kernel.
# Re-runs the install only when pyproject.toml, this script or tools/uv_install.py changed (hash stamp in .venv).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
KERNEL=llm-systems-course
UV_VERSION=0.13.8   # the installer (tools/uv_install.py hands it pip's configuration)
KERNEL_THREADS=1   # OMP_NUM_THREADS of the course kernel (measured: see the comment at the kernel install below)

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
want=$(cat pyproject.toml tools/install.sh tools/uv_install.py | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
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
   && "$VENV/bin/python" tools/uv_install.py $extra -e ".[lab,test]"; then
    :
else
    echo "   (uv $UV_VERSION unavailable or failed: installing with pip instead, ~3 min)"
    # shellcheck disable=SC2086
    $pip install --quiet $extra -e ".[lab,test]"
fi
# One BLAS/OpenMP thread in the course kernel, as `make test` runs. Notebook 00 on a shared 2-core machine: 577 s
# with torch's default 2 threads vs 75 s with 1 under the same background load, 818 s vs 65 s with two more CPU
# hogs; alone, 1 thread needs ~15 s of CPU for the whole notebook. Spinning OpenMP threads waiting for a busy core
# cost far more than the second thread gains. (Ranks already run 1 thread each.)
"$VENV/bin/python" -m ipykernel install --sys-prefix --name "$KERNEL" \
    --display-name "Python (LLM systems course)" --env OMP_NUM_THREADS "$KERNEL_THREADS" >/dev/null
# JupyterLab defaults the course overrides (the learner can still change them in Settings):
# - it asks about "Jupyter news" in a pop-up on every load until someone answers; a class starts clean;
# - it sends widget messages to kernel subshells (ipykernel 7): notebook 09's first widget redraw after Run All came
#   out blank or half-drawn in 6 of 9 tries, sometimes in the Log Console instead; with comms on the main shell, 0 of 7.
"$VENV/bin/python" - <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.prefix, "share", "jupyter", "lab", "settings", "overrides.json")
settings = json.loads(path.read_text()) if path.exists() else {}
settings.setdefault("@jupyterlab/apputils-extension:notification", {}).update(fetchNews="false", checkForUpdates=False)
settings.setdefault("@jupyterlab/apputils-extension:kernels-settings", {}).update(commsOverSubshells="disabled")
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(settings, indent=2) + "\n")
PY
"$VENV/bin/python" -c 'import course_lib; course_lib.check_environment(verbose=False)'
echo "$want" > "$stamp"
echo "== ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
