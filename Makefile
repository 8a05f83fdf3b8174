# specmesh: `make demo` runs the whole stack on the real offline pair and streams a generation; `make test` runs
# ruff, mypy (configured in pyproject.toml) and the test suite. Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
PRESET ?= qwen
# Numerics of both model services: auto (default: int4 where its kernel builds, else int8, else float32), int4, int8,
# float32. Empty = each service's SPECMESH_*_DTYPE, else auto.
DTYPE ?=
DTYPE_FLAG = $(if $(DTYPE),--dtype $(DTYPE))

.PHONY: install demo demo-tiny test lint bench validate-deploy clean

$(BIN)/specmesh: pyproject.toml setup.py $(wildcard protos/specmesh/v1/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch first (an unpinned torch would pull GBs of CUDA wheels).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(BIN)/specmesh

install: $(BIN)/specmesh

demo: install
	$(BIN)/specmesh demo --preset $(PRESET) $(DTYPE_FLAG) --chat --max-new-tokens 96 "$(PROMPT)"

demo-tiny: install
	$(BIN)/specmesh demo --preset tiny $(DTYPE_FLAG) --max-new-tokens 32 "Hello"

test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

validate-deploy: install
	deploy/validate.sh

bench: install
	$(BIN)/python bench/run_workload.py --preset $(PRESET) --start-stack

clean:
	rm -rf $(VENV) build *.egg-info protos/specmesh/v1/*_pb2*.py*

# Load generators for README's "Benchmark your deployment", each in its own venv (their dependencies conflict with
# specmesh's and with each other's); tests/test_load_tools.py runs them against the HTTP API.
GUIDELLM_VERSION ?= 0.8.1
AIPERF_VERSION ?= 0.13.0
.PHONY: load-tools

load-tools: .venv-guidellm/bin/guidellm .venv-aiperf/bin/aiperf

.venv-guidellm/bin/guidellm:
	$(PYTHON) -m venv .venv-guidellm
	.venv-guidellm/bin/python -m pip install -q --upgrade pip
	.venv-guidellm/bin/python -m pip install -q guidellm==$(GUIDELLM_VERSION)

.venv-aiperf/bin/aiperf:
	$(PYTHON) -m venv .venv-aiperf
	.venv-aiperf/bin/python -m pip install -q --upgrade pip
	.venv-aiperf/bin/python -m pip install -q aiperf==$(AIPERF_VERSION)
