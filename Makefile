# The course's two commands are `make lab` and `make test`; everything else is a helper.
# Both start with the same idempotent install (tools/install.sh), which is quick when nothing changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Extra package index for torch on machines without a local CPU wheel, e.g.
#   make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# Where JupyterLab listens.
PORT ?= 8888
IP   ?= 127.0.0.1
# pytest workers; loadscope keeps each notebook (and each test module or class) on one worker.
JOBS ?= 2
# How `make test-spawn` starts ranks: spawn (Windows' only way, the slowest) or forkserver (macOS's and NCCL's).
START_METHOD ?= spawn

# Python stores each module's bytecode at its first import (in .venv and course_lib/), for every later kernel and
# rank to reuse; a machine that sets PYTHONDONTWRITEBYTECODE would make each of the ~100 kernels and processes of a
# test run compile torch and course_lib from source again (~4 s each).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install lab test lint unit test-spawn labs run-all book clean help

help:
	@echo "make lab      set up (first time) and open the course in JupyterLab"
	@echo "make test     set up (first time) and run every test, notebook and lab check"
	@echo "make lint     ruff on the whole tree (pyflakes, pycodestyle, import order): make test runs it first"
	@echo "make unit     lint, then the unit tests only (a minute): the quick loop while editing course_lib"
	@echo "make test-spawn  every lecture and lab solution with spawned ranks (START_METHOD=forkserver: fork server)"
	@echo "make labs     regenerate labs/ from solutions/"
	@echo "make run-all  execute every notebook into build/executed/ and time each (instructor dry run)"
	@echo "make book     the course as a website in build/book/ (executes every notebook first)"
	@echo "make clean    remove build outputs (keeps .venv)"

install:
	@PYTHON="$(PYTHON)" TORCH_INDEX="$(TORCH_INDEX)" sh tools/install.sh
	@$(PY) tools/nbfmt.py --install-git-filter

lab: install
	@$(PY) tools/serve.py --ip "$(IP)" --port "$(PORT)"

# One BLAS/OpenMP thread per process: the workers already fill the cores, and spinning OpenMP threads on an
# oversubscribed machine made notebook 00 run 3-4x slower than alone.
# nbval runs the lectures at their defaults; solutions/ runs under papermill (tests/notebooks/test_papermill.py,
# with other knobs where they have any), so it is not collected here: that would run each solution twice.
test: install lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) --dist loadscope -p no:cacheprovider -rs --durations=10 \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=300 --timeout=1200 \
		tests notebooks

lint: install
	$(PY) -m ruff check --no-cache .

unit: install lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) -p no:cacheprovider -q tests/unit tests/test_layering.py tests/test_docs.py

# Every lecture (nbval, at its defaults) and every lab solution (papermill, with other knobs) with ranks that are not
# forked, as on macOS, Windows and with NCCL (course_lib/distributed/start.py); `make test` runs a representative set of
# them (tests/notebooks/test_start_methods.py). Spawned ranks import torch at every launch: this takes a while.
test-spawn: install
	COURSE_START_METHOD=$(START_METHOD) OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) --dist loadscope -p no:cacheprovider \
		-rs --durations=10 --nbval-lax --nbval-current-env --nbval-cell-timeout=600 --timeout=2400 \
		tests/notebooks/test_papermill.py notebooks

labs: install
	$(PY) tools/make_labs.py

run-all: install
	$(PY) tools/run_all.py

# Executes every notebook (as run-all does), then builds the website build/book/ with Sphinx (tools/book.py);
# open build/book/index.html from disk.
book: install
	OMP_NUM_THREADS=1 $(PY) tools/book.py

clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -prune -not -path './.venv/*' -exec rm -rf {} +
