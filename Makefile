# Quick start: `make demo` runs the multi-rank story (a rank killed mid-save, torchrun
# restarts, training resumes bit-identically), `make test` runs the tests.
# Both create .venv and install everything on first use.
# GPU users: make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ckptd-installed
PYTEST_ARGS ?=
# The versions the tests last passed with (scripts/freeze_constraints.py writes it); empty
# resolves everything afresh: make venv CONSTRAINTS=
CONSTRAINTS ?= .ci/constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: venv demo test test-all lint bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_C) $(TORCH_SPEC)
	$(PY) -m pip install --quiet $(PIP_C) -e ".[dev,bench,integrations]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Everything, slow and multi-process tests included.
test-all: lint
	$(PY) -m pytest -m "" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/save_restore.py

clean:
	rm -rf $(VENV) demo-ckpts .pytest_cache .mypy_cache .ruff_cache
