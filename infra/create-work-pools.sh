#!/usr/bin/env bash
# Creates (or updates, with --overwrite) the three alignflow work pools on the Prefect server
# that PREFECT_API_URL points at:
#   alignflow-process     process     flow runs as subprocesses of a worker (compose `worker`)
#   alignflow-docker-gpu  docker      stage flow runs as GPU containers on a Docker host (work-pools/docker.json)
#   alignflow-k8s-gpu     kubernetes  flow runs as GPU Jobs on a Kubernetes cluster (work-pools/kubernetes.json)
# Creating a pool needs no worker and no prefect-docker / prefect-kubernetes here; the workers
# that serve the docker and kubernetes pools need those packages in their image.
#
#   PREFECT_API_URL=http://127.0.0.1:4200/api infra/create-work-pools.sh [POOL...]
#
# Against the stack's server, which requires a login, also export PREFECT_API_AUTH_STRING (the
# `user:password` of PREFECT_AUTH_STRING in infra/.env): prefect reads it itself.
#
# With no argument every pool is created; name pools to create only those.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefect_bin="${PREFECT:-prefect}"

if [[ -z "${PREFECT_API_URL:-}" ]]; then
  echo "error: PREFECT_API_URL is not set; without it prefect would create the pools in a temporary" \
       "local server. Set it to your server, e.g. PREFECT_API_URL=http://127.0.0.1:4200/api" >&2
  exit 2
fi
if ! command -v "$prefect_bin" >/dev/null 2>&1; then
  echo "error: '$prefect_bin' not found; activate the alignflow environment (.venv/bin) or set PREFECT=/path/to/prefect" >&2
  exit 2
fi

# name | type | base job template ("" = Prefect's default for the type) | concurrency limit ("" = none)
pools=(
  "alignflow-process|process||"
  # One flow run per GPU host at a time: each run takes all of the host's GPUs (gpu_count -1).
  # Stage flows only: the pipeline flow holds a slot while it waits on its stages, so on this pool
  # it would deadlock them. Deploy it on alignflow-process (`alignflow deploy` refuses this pool for
  # it when its stages run here: flows/deploy.py check_pipeline_pool).
  "alignflow-docker-gpu|docker|$here/work-pools/docker.json|1"
  "alignflow-k8s-gpu|kubernetes|$here/work-pools/kubernetes.json|"
)

known=()
for entry in "${pools[@]}"; do
  known+=("${entry%%|*}")
done
wanted=("$@")
for name in "${wanted[@]}"; do
  if [[ ! " ${known[*]} " == *" $name "* ]]; then
    echo "error: unknown pool '$name'; choose from: ${known[*]}" >&2
    exit 2
  fi
done

for entry in "${pools[@]}"; do
  IFS='|' read -r name type template limit <<<"$entry"
  if (( ${#wanted[@]} )) && [[ ! " ${wanted[*]} " == *" $name "* ]]; then
    continue
  fi
  args=(work-pool create "$name" --type "$type" --overwrite)
  if [[ -n "$template" ]]; then
    args+=(--base-job-template "$template")
  fi
  echo "+ $prefect_bin ${args[*]}"
  "$prefect_bin" "${args[@]}"
  if [[ -n "$limit" ]]; then
    "$prefect_bin" work-pool set-concurrency-limit "$name" "$limit"
  fi
done
