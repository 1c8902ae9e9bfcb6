#!/bin/sh
# alignflow container entrypoint (installed as /usr/local/bin/alignflow-entrypoint in every image).
#
#   <stage> --spec URI [--force]   run one stage: python -m alignflow.stages <stage> (training/engine images)
#   run|validate|plan CONFIG ...   the `alignflow` pipeline CLI
#   prefect flow-run execute [ID]  what Docker/Kubernetes work pools send: python -m alignflow.flows.execute,
#                                  which runs it and exits 1 when the flow run ended Failed or Crashed
#   anything else                  exec'd as given: `prefect worker start ...`, `bash`, `python`
#
# The pass-through is what lets one image serve both as a stage container and as a Prefect job
# container: work pools replace CMD, never ENTRYPOINT.
set -eu

STAGES="data base sft reward engine ppo dpo evaluate"

usage() {
    cat <<EOF
usage: <image> <stage> --spec <path-or-uri> [--force]
       <image> run|validate|plan <config.yaml> [--set key=value ...]
       <image> <any other command>          (exec'd as is, e.g. prefect worker start --pool P)

stages: ${STAGES}
image: ${ALIGNFLOW_IMAGE_ROLE:-unknown} (code version ${ALIGNFLOW_CODE_VERSION:-unset})
EOF
}

if [ "$#" -eq 0 ]; then
    usage
    exit 2
fi

case "$1" in
    -h|--help|help)
        usage
        exit 0
        ;;
    run|validate|plan)
        exec alignflow "$@"
        ;;
esac

for stage in ${STAGES}; do
    if [ "$1" = "${stage}" ]; then
        shift
        if [ "${ALIGNFLOW_IMAGE_ROLE:-}" = "worker" ] && [ "${stage}" != "data" ]; then
            echo "error: stage '${stage}' needs torch; this is the torch-free worker image." \
                 "Run it in the training image (or an engine image for engine/ppo/evaluate)." >&2
            exit 2
        fi
        exec python -m alignflow.stages "${stage}" "$@"
    fi
done

# Work pools start a flow run with `prefect flow-run execute [ID]`, which exits 0 even when the flow run
# Failed; alignflow.flows.execute runs that command and then exits 1 for a Failed or Crashed run, so
# Kubernetes' backoffLimit and Docker restart policies see the failure.
if [ "$#" -ge 3 ] && [ "$1" = prefect ] && [ "$2" = flow-run ] && [ "$3" = execute ]; then
    shift 3
    exec python -m alignflow.flows.execute "$@"
fi

exec "$@"
