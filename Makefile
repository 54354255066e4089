# The README's two commands: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,dask]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) jobs/demo.py

# ruff first: unused imports and names, undefined names, import order (pyproject.toml).
# One process by default; TEST_WORKERS=2 runs the suite on two pytest-xdist workers, a test file to
# a worker, in the order tests/conftest.py gives them.
TEST_WORKERS ?= 0
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

bench: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) mlruns demo_output .pytest_cache
