# alignflow worker image: torch-free. Prefect workers, flow runs and the `alignflow` pipeline CLI.
#
# The flows only plan stages, pass URIs and launch the stage images; nothing here imports torch, so
# the image stays ~1.2 GB (measured; MLflow brings scipy, scikit-learn, pandas, pyarrow).
# Uses (the entrypoint passes any non-alignflow command through):
#   docker run IMAGE prefect worker start --pool alignflow-k8s --type kubernetes   (a worker)
#   docker run IMAGE plan /configs/pipeline.yaml                                    (the alignflow CLI)
#   the flow-run container of a Docker/Kubernetes work pool (the pool sets the command)
# Build from the repo root:
#   docker build -f containers/worker.Dockerfile -t alignflow-worker:$(git rev-parse --short=12 HEAD) \
#     --build-arg ALIGNFLOW_CODE_VERSION=0.1.0+g$(git rev-parse --short=12 HEAD) .
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

# Work-pool integrations to add, pinned, e.g. "prefect-kubernetes==X.Y.Z prefect-docker==X.Y.Z"
# (their releases must accept prefect==3.8.8). Empty: process work pools only.
ARG PREFECT_INTEGRATIONS=""
# Build-time pip settings (a CA bundle for a TLS-intercepting proxy, a local wheel directory);
# unset unless passed; build args are not kept in the image's environment.
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

RUN python3 -m venv /opt/venv \
    && groupadd --gid 10001 alignflow \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/alignflow --shell /bin/bash alignflow \
    && install -d -o alignflow -g alignflow /workspace

# The core's dependencies (pinned: prefect==3.8.8 and mlflow==3.17.2 in pyproject.toml, the rest by
# constraints.txt) in their own layer, so a code change does not reinstall them.
COPY pyproject.toml /src/pyproject.toml
COPY containers/constraints.txt /src/containers/constraints.txt
# PREFECT_INTEGRATIONS is a space-separated list of pinned requirements: word splitting is wanted.
# hadolint ignore=SC2086
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt ${PREFECT_INTEGRATIONS} -c /src/containers/constraints.txt \
    && rm /tmp/requirements.txt

ARG ALIGNFLOW_CODE_VERSION=unknown
COPY README.md /src/README.md
COPY alignflow /src/alignflow
COPY flows /src/flows
COPY stages /src/stages
COPY kernels /src/kernels
COPY containers/entrypoint.sh /usr/local/bin/alignflow-entrypoint
# The distribution includes the stages and kernels packages; without torch they cannot run, and the
# entrypoint refuses every stage but the torch-free `data` stage.
RUN pip install --no-cache-dir --no-deps /src \
    && pip check \
    && rm -rf /src \
    && chmod 0755 /usr/local/bin/alignflow-entrypoint \
    && python -c "import alignflow.flows.pipeline, importlib.util as u; assert u.find_spec('torch') is None"

# ALIGNFLOW_WARM_STAGES=0: the pipeline flow would pre-start a stage process importing torch, which this
# image does not have; its stages run in the training/engine images (deployment.stage_infra).
ENV ALIGNFLOW_CODE_VERSION=${ALIGNFLOW_CODE_VERSION} \
    ALIGNFLOW_IMAGE_ROLE=worker \
    ALIGNFLOW_WARM_STAGES=0 \
    HOME=/home/alignflow \
    MLFLOW_DISABLE_TELEMETRY=true \
    PREFECT_SERVER_ANALYTICS_ENABLED=false

# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd (uid 10001 = alignflow).
USER 10001:10001
WORKDIR /workspace

LABEL org.opencontainers.image.title="alignflow-worker" \
      org.opencontainers.image.description="alignflow orchestration: Prefect worker and flow runs, the alignflow CLI (torch-free)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${ALIGNFLOW_CODE_VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# No HEALTHCHECK: this image also runs short flow-run jobs, where a probe is meaningless. A worker's
# liveness is `prefect worker start --with-healthcheck` (HTTP /health on :8080) probed by Kubernetes.
HEALTHCHECK NONE
ENTRYPOINT ["alignflow-entrypoint"]
CMD ["--help"]
