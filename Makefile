# specmesh: `make demo` runs the whole stack on the real offline pair and streams a generation; `make test` runs
# the test suite. Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
PRESET ?= qwen

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
	$(BIN)/specmesh demo --preset $(PRESET) --chat --max-new-tokens 96 "$(PROMPT)"

demo-tiny: install
	$(BIN)/specmesh demo --preset tiny --max-new-tokens 32 "Hello"

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .

validate-deploy: install
	deploy/validate.sh

bench: install
	$(BIN)/python bench/run_workload.py --preset $(PRESET) --start-stack

clean:
	rm -rf $(VENV) build *.egg-info protos/specmesh/v1/*_pb2*.py*
