# Quick start:  make demo   (sets up, runs every algorithm on the built-in default scenario)
#               make test   (sets up with all extras, runs ruff and the test suite)
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test bench runtime-demo readme-table clean

# pip byte-compiles what it installs: keep it (--no-compile halves the install, but where
# PYTHONDONTWRITEBYTECODE=1, as on these machines, every process then compiles torch again)
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# torch first, pinned: this machine family has the CPU wheel on disk; a bare "torch" would pull CUDA.
$(VENV)/.full: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,hf,ray,runtime,serve,eval,docs]'
	touch $(VENV)/.core $@

demo: $(VENV)/.core
	$(BIN)/slimcaching demo

# about 21 minutes on an idle 2-core machine on a fresh clone (the suite 18, installs 3; measured
# on a clean clone of main): the suite runs on every core
test: $(VENV)/.full
	@echo "make test: ruff, then the test suite in parallel (about 18 minutes on 2 cores; installs add ~3 on a fresh clone)"
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n auto --maxschedchunk 1 --doctest-modules src/slimcaching tests

# the README's table is what `make demo` prints: this rewrites it from a fresh run (the test checks it)
readme-table: $(VENV)/.full
	SLIMCACHING_WRITE_README=1 $(BIN)/python -m pytest -q tests/test_docs.py -k readme_demo_table

runtime-demo: $(VENV)/.full
	$(BIN)/python -m slimcaching.runtime.model.tiny examples/runtime/tiny-moe
	$(BIN)/slimcaching solve examples/runtime/scenario.yaml -a slimcaching -o examples/runtime/placement.json
	$(BIN)/slimcaching cluster run examples/runtime/scenario.yaml examples/runtime/placement.json \
	    --model examples/runtime/tiny-moe --prompts examples/runtime/prompts.txt --max-new-tokens 16 --pace \
	    --json examples/runtime/run.json

bench: $(VENV)/.full
	$(BIN)/python benchmarks/bench_evaluate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis src/*.egg-info examples/runtime/tiny-moe examples/runtime/placement.json \
	    examples/runtime/run.json examples/runtime/hybrid.json
