#!/usr/bin/env bash
# The GPU check of issue 14, for a machine with CUDA torch (the lent device: run it with the
# `device` tool, carrying .whl made by bench/gpu_wheels.sh). In about ten minutes:
#   1. the Hugging Face model tests (tiny checkpoints of every family against transformers:
#      Llama, Mistral, Qwen2, Qwen3, Gemma 3, GPT-OSS, and the hybrids LFM2, Qwen3-Next,
#      Nemotron-H, served through the scheduler) and the torch engine's reuse tests, on CUDA;
#   2. a random Llama-shaped checkpoint of about 1B parameters in bfloat16: the engine
#      benchmark against transformers (bench.hf_engine) and peak host memory while loading
#      it to the GPU (bench.checkpoint_load).
# Results go to $OUT (the device tool's folder) or bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
echo "== 1. correctness on CUDA"
REPLICAS_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/replicas/models tests/replicas/test_torch_engine.py 2>&1 | tee "$OUT/gpu_tests.txt"
echo "== 2. engine benchmark, ~1B parameters, bfloat16"
timeout 420 python3 -m bench.hf_engine --size 1b --dtype bfloat16 --device cuda \
  --out "$OUT/hf_engine_gpu.json" 2>&1 | tee "$OUT/gpu_bench.txt"
timeout 180 python3 -m bench.checkpoint_load --device cuda --out "$OUT/checkpoint_load_gpu.json" \
  2>&1 | tee -a "$OUT/gpu_bench.txt"
echo "== 3. a hybrid family (Qwen3-Next shape, 72M parameters), bfloat16"
timeout 240 python3 -m bench.hybrid_engine --family qwen3-next --dtype bfloat16 --device cuda \
  --out "$OUT/hybrid_engine_gpu.json" 2>&1 | tee "$OUT/gpu_hybrid.txt"
