# syntax=docker/dockerfile:1
#
# Two images from one file, chosen with --target:
#
#   replica  python -m replicas, with torch (the CPU build by default)
#   router   python -m router, without torch (the router never imports it)
#
#   docker build --target replica -t prefix-router-replica:latest .
#   docker build --target replica --build-arg TORCH_VARIANT=cu128 -t prefix-router-replica:cuda .
#   docker build --target router  -t prefix-router-router:latest .
#
# TORCH_VARIANT picks the PyTorch wheel index (https://download.pytorch.org/whl/<variant>):
# `cpu` (default), or one of the CUDA builds PyTorch publishes for TORCH_VERSION (cu126,
# cu128, ...). CUDA wheels carry their CUDA runtime: the host needs only the NVIDIA driver
# and the NVIDIA container toolkit (Kubernetes: the NVIDIA device plugin).
# docker-compose.yml builds both images; deploy/README.md explains every file.

ARG PYTHON_VERSION=3.11

# --------------------------------------------------------------------------- base
FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# The user both images run as (numeric below, so Kubernetes' runAsNonRoot can check it).
RUN groupadd --gid 10001 app && useradd --create-home --uid 10001 --gid 10001 app
WORKDIR /app
# The project's runtime dependencies except torch (pyproject.toml's list less torch; the
# replica stage adds torch), then its otel extra. tests/deploy/test_dockerfile.py keeps the
# lists in step.
RUN pip install \
        "fastapi>=0.110" \
        "uvicorn[standard]>=0.27" \
        "httptools>=0.6" \
        "httpx>=0.27" \
        "aiohttp>=3.9" \
        "pydantic>=2.6" \
        "pydantic-settings>=2.2" \
        "prometheus-client>=0.20" \
        "pyyaml>=6" \
        "numpy>=1.24" \
        "pybase64>=1.3" \
        "orjson>=3.9" \
        "safetensors>=0.4" \
        "tokenizers>=0.19" \
        "jinja2>=3.1.6"
# The otel extra, so that both images can trace when OTEL_* or --otel-endpoint says so
# (tracing stays off, and these unimported, otherwise).
RUN pip install \
        "opentelemetry-api>=1.30" \
        "opentelemetry-sdk>=1.30" \
        "opentelemetry-exporter-otlp-proto-http>=1.30"

# --------------------------------------------------------------------------- wheel
# The project itself, built once for both images (no dependencies: those are above).
FROM base AS wheel
COPY pyproject.toml README.md ./
COPY kvcache/ kvcache/
COPY wire/ wire/
COPY text/ text/
COPY replicas/ replicas/
COPY router/ router/
COPY loadtest/ loadtest/
RUN pip wheel --no-deps --wheel-dir /wheels .

# --------------------------------------------------------------------------- router
FROM base AS router
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/*.whl \
 && python -c "import router.app, router.__main__" \
 && if python -c "import torch" 2>/dev/null; then echo "torch found in the router image" >&2; exit 1; fi
COPY config/ /app/config/
USER 10001:10001
EXPOSE 8000
# Flags or ROUTER_* variables: --replicas (or --discover-dns), --policy, ... (python -m router --help)
CMD ["python", "-m", "router", "--host", "0.0.0.0", "--port", "8000"]

# --------------------------------------------------------------------------- replica
FROM base AS replica
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/*.whl \
 && python -c "import replicas.app, torch; print('torch', torch.__version__)"
COPY config/ /app/config/
USER 10001:10001
EXPOSE 9001
# Flags or REPLICA_* variables: --engine torch|sim, --kv-pages, ... (python -m replicas --help)
CMD ["python", "-m", "replicas", "--host", "0.0.0.0", "--port", "9001", "--engine", "torch"]
