# The README's two commands: `make demo` and `make test`.  Both set up .venv first.
# torch==2.13.0 is installed before the package so pip takes the CPU wheel instead of a
# multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/rolloutpipe run configs/demo.yaml --out runs/demo

lint: setup
	$(BIN)/ruff check rolloutpipe tests
	$(BIN)/ruff format --check rolloutpipe tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: setup
	$(BIN)/rolloutpipe bench --out runs/bench

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
