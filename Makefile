# modelyard — `make run` serves the demo model; `make test` runs every test tier.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: run install llama-server demo-model test test-unit test-integration test-e2e check bench-proxy bench-sched clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

llama-server:
	@bash scripts/provide-llama-server.sh >/dev/null

demo-model: install
	@PYTHON=$(BIN)/python bash scripts/provide-demo-model.sh >/dev/null

run: install llama-server demo-model
	$(BIN)/modelyard serve

# The e2e tier needs the real llama-server and demo model: here they are provided, so the
# tests must not skip for want of them.
test: install llama-server demo-model
	MODELYARD_REQUIRE_E2E=1 $(BIN)/python -m pytest

test-unit: install
	$(BIN)/python -m pytest -m unit

test-integration: install
	$(BIN)/python -m pytest -m integration

test-e2e: install llama-server demo-model
	MODELYARD_REQUIRE_E2E=1 $(BIN)/python -m pytest -m e2e

check: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

bench-proxy: install llama-server demo-model
	$(BIN)/python bench/proxy.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

bench-sched: install
	$(BIN)/python bench/sched.py
