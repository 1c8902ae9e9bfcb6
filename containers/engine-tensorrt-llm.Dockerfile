# alignflow TensorRT-LLM-engine image: the engine, ppo and evaluate stages with `engine.backend: tensorrt-llm`.
#
# TensorRT-LLM needs an NVIDIA GPU at run time (not at build time). Its wheels come from NVIDIA's
# index (the PyPI `tensorrt-llm` is a stub that downloads from there) and are built for one torch
# and CUDA: TensorRT-LLM 1.2.x = torch 2.9.1 on CUDA 13.0 wheels, CUDA toolkit 13.1 (CUDA_HOME),
# Python 3.12 (Ubuntu 24.04), Open MPI. So torch here is 2.9.1, not the training image's 2.13.0:
# checkpoints cross images as safetensors, which does not care. PPO with this backend trains with
# DeepSpeed in the same process, so DeepSpeed and the whole stage stack are installed too.
#   docker build -f containers/engine-tensorrt-llm.Dockerfile -t alignflow-engine-tensorrt-llm:$TAG \
#     --build-arg ALIGNFLOW_CODE_VERSION=0.1.0+g$(git rev-parse --short=12 HEAD) .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     alignflow-engine-tensorrt-llm:$TAG engine --spec s3://bucket/prefix/specs/engine.json
ARG BASE_IMAGE=nvidia/cuda:13.1.0-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

ARG TORCH_VERSION=2.9.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TENSORRT_LLM_VERSION=1.2.1
ARG TENSORRT_LLM_INDEX_URL=https://pypi.nvidia.com
ARG DEEPSPEED_VERSION=0.19.8
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda

# libopenmpi-dev: TensorRT-LLM imports mpi4py; python3-dev/g++: DeepSpeed JIT ops.
# apt versions are not pinned: they differ per BASE_IMAGE distribution; the Python stack is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
        libopenmpi-dev openmpi-bin \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --gid 10001 alignflow \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/alignflow --shell /bin/bash alignflow \
    && install -d -o alignflow -g alignflow /workspace /opt/torch_extensions

# torch from the CUDA 13.0 index first (TensorRT-LLM's wheel expects that exact build), then one
# resolver call for TensorRT-LLM, DeepSpeed and alignflow's dependencies with torch held where it is.
COPY pyproject.toml /src/pyproject.toml
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}" \
    && python -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["ml"]))' > /tmp/requirements.txt \
    && python -c 'import torch; print("torch==" + torch.__version__)' > /tmp/torch-pin.txt \
    && pip install --no-cache-dir --extra-index-url "${TENSORRT_LLM_INDEX_URL}" \
        "tensorrt_llm==${TENSORRT_LLM_VERSION}" "deepspeed==${DEEPSPEED_VERSION}" \
        -r /tmp/requirements.txt -c /tmp/torch-pin.txt \
    && rm /tmp/requirements.txt /tmp/torch-pin.txt

ARG ALIGNFLOW_CODE_VERSION=unknown
COPY README.md /src/README.md
COPY alignflow /src/alignflow
COPY flows /src/flows
COPY stages /src/stages
COPY kernels /src/kernels
COPY containers/entrypoint.sh /usr/local/bin/alignflow-entrypoint
RUN pip install --no-cache-dir --no-deps /src \
    && pip check \
    && rm -rf /src \
    && chmod 0755 /usr/local/bin/alignflow-entrypoint

ENV ALIGNFLOW_CODE_VERSION=${ALIGNFLOW_CODE_VERSION} \
    ALIGNFLOW_IMAGE_ROLE=engine-tensorrt-llm \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    HOME=/home/alignflow

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd (uid 10001 = alignflow).
USER 10001:10001
WORKDIR /workspace

LABEL org.opencontainers.image.title="alignflow-engine-tensorrt-llm" \
      org.opencontainers.image.description="alignflow engine/ppo/evaluate stages with the TensorRT-LLM engine" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${ALIGNFLOW_CODE_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# Batch jobs (the engine lives inside the stage process), probed through their exit code.
HEALTHCHECK NONE
ENTRYPOINT ["alignflow-entrypoint"]
CMD ["engine", "--help"]
