# alignflow native-engine image: the engine, ppo and evaluate stages with `engine.backend: native`.
#
# The native engine is ours and pure torch (+ the Triton kernels torch's CUDA wheel brings), and PPO
# trains with DeepSpeed in the same process as the engine it refits, so this image is the training
# image with the engine stage as its default command: the engine is built, refit and evaluated with
# the exact torch/transformers/DeepSpeed that trained the policy. The CUDA base is chosen when the
# training image is built (its BASE_IMAGE); here BASE_IMAGE is that training image, tagged.
#   docker build -f containers/engine-native.Dockerfile -t alignflow-engine-native:$TAG \
#     --build-arg BASE_IMAGE=alignflow-training:$TAG .
#   docker run --gpus all alignflow-engine-native:$TAG engine --spec s3://bucket/prefix/specs/engine.json
ARG BASE_IMAGE=alignflow-training:0.1.0
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

# The training image's user; restated so this file shows what it runs as (hadolint DL3002 spirit).
USER 10001:10001
WORKDIR /workspace
ENV ALIGNFLOW_IMAGE_ROLE=engine-native \
    PYTHONUNBUFFERED=1

# Fail the build if the backend's modules do not import (catches a training image built without them).
RUN python -c "import alignflow.stages.engine, alignflow.stages.ppo.stage, alignflow.stages.common.generation"

LABEL org.opencontainers.image.title="alignflow-engine-native" \
      org.opencontainers.image.description="alignflow engine/ppo/evaluate stages with the native (pure torch) engine" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

# Batch jobs, probed through their exit code and StageResult line, not a healthcheck.
HEALTHCHECK NONE
ENTRYPOINT ["alignflow-entrypoint"]
CMD ["engine", "--help"]
