#!/usr/bin/env bash
# Try bench/gpu_check.sh's installation here, before spending a lent GPU's minutes on it: a
# fresh virtual environment with only what the GPU machine is said to have (torch,
# transformers, safetensors, tokenizers, jinja2, numpy, pytest, httpx, and their own
# dependencies; the CPU torch here), the wheels of bench/gpu_wheels.sh (fetched for this
# Python) installed as gpu_check.sh installs them, then gpu_check.sh's tests and a quick
# engine benchmark on the CPU. A wheel missing from gpu_wheels.sh fails here as it would
# there (an import error). Leaves .whl/ holding this Python's wheels: run
# bench/gpu_wheels.sh again before carrying it to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
sim=${DRYRUN_VENV:-/tmp/gpu-check-dryrun}
pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ ! -x "$sim/bin/python" ]; then
  python3 -m venv "$sim"
  "$sim/bin/pip" install --quiet torch==2.13.0 transformers safetensors tokenizers jinja2 \
    numpy pytest httpx
fi
PYVER=$pyver bash bench/gpu_wheels.sh
rm -rf /tmp/gpu-check-site
"$sim/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/gpu-check-site .whl/*.whl
export PYTHONPATH=/tmp/gpu-check-site:$PWD
echo "== the tests of gpu_check.sh's step 1, on the CPU"
timeout 600 "$sim/bin/python" -m pytest -q -p no:cacheprovider \
  tests/replicas/models tests/replicas/test_torch_engine.py
echo "== the engine benchmark, --quick, on the CPU"
timeout 300 "$sim/bin/python" -m bench.hf_engine --quick --no-write
timeout 300 "$sim/bin/python" -m bench.checkpoint_load --quick --no-write
echo "dry run passed: reinstall the GPU machine's wheels with bash bench/gpu_wheels.sh"
