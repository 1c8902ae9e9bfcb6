# alignflow training image: torch + transformers + DeepSpeed + the alignflow stages.
#
# Runs every ML stage (data, base, sft, reward, dpo; engine/ppo/evaluate with the native or hf engine):
#   docker run --gpus all IMAGE sft --spec s3://bucket/prefix/specs/sft.json
# Build from the repo root (containers/README.md has the CPU and podman variants):
#   docker build -f containers/training.Dockerfile -t alignflow-training:$(git rev-parse --short=12 HEAD) \
#     --build-arg ALIGNFLOW_CODE_VERSION=0.1.0+g$(git rev-parse --short=12 HEAD) .
#
# BASE_IMAGE is a CUDA *devel* image: DeepSpeed JIT-compiles its CUDA ops (FusedAdam) with nvcc at
# the first deepspeed.initialize, and nvcc's CUDA major version must match torch's (PyPI's torch
# 2.13.0 is built against CUDA 13.0). Any Debian/Ubuntu image with python3 >= 3.11 works: the podman
# test build (scripts/container_test.sh) uses a debootstrap'ed Debian bookworm and CPU wheels.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

# torch first and pinned: a bare `torch` lets pip pick the newest CUDA build (GBs, maybe another CUDA).
# TORCH_INDEX_URL picks the build: https://pypi.org/simple = the CUDA 13.0 wheel;
# https://download.pytorch.org/whl/cpu = a CPU image (+cpu wheel, ~190 MB instead of ~3 GB with CUDA libs).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple

# Build-time pip settings for builds behind a TLS-intercepting proxy or with a local wheel
# directory (podman build -v /host/wheels:/wheels:ro --build-arg PIP_FIND_LINKS=/wheels). Unset
# unless passed; build args are not kept in the image's environment.
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# python3-dev and g++: DeepSpeed (torch.utils.cpp_extension) compiles its ops at run time.
# apt versions are not pinned: they differ per BASE_IMAGE distribution; the Python stack is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --gid 10001 alignflow \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/alignflow --shell /bin/bash alignflow \
    && install -d -o alignflow -g alignflow /workspace /opt/torch_extensions

RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}"

# Third-party dependencies in their own layer (slow: DeepSpeed builds from its sdist), read from
# pyproject.toml and pinned by constraints.txt, so a code change does not reinstall them.
COPY pyproject.toml /src/pyproject.toml
COPY containers/constraints.txt /src/containers/constraints.txt
RUN python -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["ml"]))' > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt -c /src/containers/constraints.txt \
    && rm /tmp/requirements.txt

# 1: JIT-compile DeepSpeed's CPU shared-memory comm op at build time (CPU images), so a stage does not
# spend 1.5-3 min of CPU compiling it at its first deepspeed.initialize. GPU runs use NCCL instead.
# Before the code is copied: it depends on torch and DeepSpeed only, not on alignflow.
ARG DEEPSPEED_CPU_OPS=0
ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions
RUN if [ "${DEEPSPEED_CPU_OPS}" = "1" ]; then \
        DS_ACCELERATOR=cpu python -c "from deepspeed.accelerator import get_accelerator; \
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" \
        && chown -R 10001:10001 /opt/torch_extensions; \
    fi

# Declared here, not at the top: a new commit must not invalidate the layers above.
# The version the image is built from; manifests record it (alignflow/manifest.py code_version()).
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

# 2: compile alignflow's C++ CPU kernels (kernels/csrc: fp32 decode linears, attention, the sampler and its AVX2 build) into
# TORCH_EXTENSIONS_DIR too. A stage container starts from the image every run, so otherwise every
# engine and PPO stage on CPU spends 54-66 s (2 cores) compiling them. 0 skips it (GPU-only images).
ARG ALIGNFLOW_CPU_KERNELS=1
RUN if [ "${ALIGNFLOW_CPU_KERNELS}" = "1" ]; then \
        python -c "from alignflow.kernels import _cpu_extension; print(_cpu_extension.build_ahead())" \
        && chown -R 10001:10001 /opt/torch_extensions; \
    fi

ENV ALIGNFLOW_CODE_VERSION=${ALIGNFLOW_CODE_VERSION} \
    ALIGNFLOW_IMAGE_ROLE=training \
    HOME=/home/alignflow

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd (uid 10001 = alignflow).
USER 10001:10001
WORKDIR /workspace

LABEL org.opencontainers.image.title="alignflow-training" \
      org.opencontainers.image.description="alignflow ML stages: SFT, reward models, engine build, PPO/GRPO, evaluation (torch, transformers, DeepSpeed)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${ALIGNFLOW_CODE_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# Stages are batch jobs: the orchestrator (Prefect, a Kubernetes Job) watches the exit code and the
# StageResult line; there is no long-running service to probe.
HEALTHCHECK NONE
ENTRYPOINT ["alignflow-entrypoint"]
CMD ["--help"]
