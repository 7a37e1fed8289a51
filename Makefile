# Everything runs from a project-local virtual environment (.venv).
# torch is pinned to the CPU build first so that pip never pulls a multi-GB CUDA build;
# on a GPU machine install the CUDA torch wheel into .venv before `make setup`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: bench-all setup run demo test bench clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "$(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); this project needs 3.11 or newer: make PYTHON=python3.11 ..." >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# make run: three sim replicas (no download). make run MODEL=DIR [REPLICAS=1]: torch
# replicas serving a local Hugging Face checkpoint directory.
REPLICAS ?= 3
run: setup
	$(PY) -m loadtest cluster --replicas $(REPLICAS) --port 8000 $(if $(MODEL),--model $(MODEL))

demo: setup
	$(PY) -m kvcache.demo

# The browser test (tests/dashboard) drives Debian's chromium; installed only when missing.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

$(CHROMIUM):
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium

test: setup $(CHROMIUM)
	$(PY) -m pytest -q

bench: setup
	$(PY) -m bench.kvcache_probe
	$(PY) -m bench.kvcache_scaling
	$(PY) -m bench.kvcache_cycles
	$(PY) -m bench.kvcache_hybrid

bench-all: bench
	$(PY) -m bench.hf_engine
	$(PY) -m bench.hybrid_engine
	$(PY) -m bench.hybrid_clusters
	$(PY) -m bench.checkpoint_load
	$(PY) -m bench.torch_ttft
	$(PY) -m bench.replica_sim
	$(PY) -m bench.router_overhead --clients http1,aiohttp,httpx
	$(PY) -m bench.router_policies
	$(PY) -m bench.probe_misses
	$(PY) -m bench.faults
	$(PY) -m bench.soak
	$(PY) -m bench.aiperf
	$(PY) -m loadtest compare --external sglang --out-dir artifacts/compare

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
