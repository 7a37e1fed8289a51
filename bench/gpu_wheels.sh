#!/usr/bin/env bash
# Fetch, here, the wheels bench/gpu_check.sh installs on the lent GPU machine (which reaches
# no registry but has CUDA torch, transformers, safetensors, tokenizers, jinja2, numpy,
# pytest, httpx ...): the project's other runtime dependencies, for CPython 3.12 x86-64
# (PYVER=3.11 fetches them for 3.11, to try the install here). FastAPI 0.165 imports the
# OpenTelemetry API and annotated-doc itself: both are in the list.
# Writes .whl/ (ignored by git: add "/.whl/" to .git/info/exclude and carry ".whl").
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 \
  "pydantic-core==$(.venv/bin/python -c 'import pydantic_core; print(pydantic_core.__version__)')" \
  pydantic-settings==2.16.3 python-dotenv==1.2.4 typing-inspection==0.4.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 orjson==3.13.0 \
  pybase64==1.5.1 httptools==0.9.0 prometheus-client==0.26.0
ls .whl
