# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# molecule and ansible-lint call ansible-* by name: the venv's must come first.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test test-slow lint unit integration molecule bench soak clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuops demo

lint: $(STAMP)
	$(BIN)/ruff check engine tests scripts deploy
	$(BIN)/ruff format --check engine tests scripts deploy
	$(BIN)/mypy
	$(BIN)/gpuops validate rules
	$(BIN)/yamllint -c .yamllint.yml playbooks rules tests/rules molecule
	$(BIN)/ansible-lint --profile production playbooks/

# `make test` leaves out the tests marked slow (minutes each on 2 cores); .ci/run runs
# them too, with `make test-slow`.
test: lint
	$(BIN)/pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/pytest -q tests/integration tests/e2e

# One scenario per playbook against simulated local hosts: converge, idempotence, verify.
molecule: $(STAMP)
	$(BIN)/molecule test --all

bench: $(STAMP)
	$(BIN)/gpuops bench rules --rules 50 --gpus 10000 --seconds 20

# 10 minutes of a 1,000-node fleet with NATS outages and engine kill -9s (issue 10).
soak: $(STAMP)
	$(BIN)/gpuops bench soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
