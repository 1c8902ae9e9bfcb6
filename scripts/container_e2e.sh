#!/usr/bin/env bash
# `make container-e2e`: the whole pipeline with every stage in its own container, through a real
# Prefect Docker work pool served by podman's Docker API (no Docker engine, no image registry).
#
# This script builds the images; scripts/container_e2e.py then starts the services on 127.0.0.1
# (Prefect server, MLflow server with proxied artifacts, moto S3, `podman system service`, a Prefect
# docker worker), deploys, triggers and checks the runs, and prints the stage-to-container table.
#
# Steps here: (0) podman + runc + debootstrap from apt if missing, prefect-docker into the host venv
# if missing, the containers.conf that makes podman work as root on these machines (runc, cgroupfs,
# lower ulimits); (1) the debootstrap'ed Debian bookworm base image (cached while it exists);
# (2) the worker image (the pipeline flow's container), the training image (data/base/sft/reward)
# and the native-engine image (engine/ppo/evaluate), with podman's layer cache; each build's wall
# time goes to build/container-e2e/build-times.json.
#
# Environment: TAG (image tag, default e2e), CONTAINER_E2E_DIR (default build/container-e2e), PYTHON
# (host venv interpreter), DEBIAN_MIRROR, NO_CACHE=1 (rebuild every layer), BUILD_ONLY=1 (stop after
# the builds), SKIP_BUILD=1 (run with the images already tagged TAG), and E2E_ARGS passed to the driver.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${CONTAINER_E2E_DIR:-${ROOT}/build/container-e2e}"
PYTHON="${PYTHON:-${ROOT}/.venv/bin/python}"
TAG="${TAG:-e2e}"
BASE_IMAGE="${BASE_IMAGE:-localhost/alignflow-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HOST_CA="${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
PREFECT_DOCKER="${PREFECT_DOCKER:-prefect-docker==0.7.4}"  # accepts prefect 3.8.8; talks docker-py 7.2

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
log() { printf '[container-e2e] %s\n' "$*" >&2; }
die() { printf '[container-e2e] error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "podman runs as root on these machines (rootless needs subuid maps); run as root"
[ -x "${PYTHON}" ] || die "no host Python at ${PYTHON}: run 'make demo' (creates .venv) or set PYTHON=..."
mkdir -p "${BUILD_DIR}"
started=$(now)

# --- (0) tools --------------------------------------------------------------------------------------
# shellcheck source-path=SCRIPTDIR source=podman_setup.sh
source "${ROOT}/scripts/podman_setup.sh"
podman_setup "${BUILD_DIR}"
"${PYTHON}" -c 'import prefect_docker' 2>/dev/null || "${PYTHON}" -m pip install --quiet "${PREFECT_DOCKER}"

# --- (1) base image ---------------------------------------------------------------------------------
declare -A TIMES=()
t0=$(now)
base_image "${BASE_IMAGE}" "${BUILD_DIR}" "${DEBIAN_MIRROR}" || true
TIMES[base]="$(elapsed "${t0}")"

# --- (2) images -------------------------------------------------------------------------------------
# One code version for the host and every image, fixed now (the output digests include it).
VERSION="$(cd "${ROOT}" && "${PYTHON}" -c 'from alignflow.manifest import code_version; print(code_version())')"
context="${BUILD_DIR}/context"
rm -rf "${context}" && mkdir -p "${context}"
tar -C "${ROOT}" -cf - --exclude=__pycache__ --exclude='*.pyc' \
    pyproject.toml README.md alignflow flows stages kernels containers | tar -C "${context}" -xf -
common=(--format docker --network=host --build-arg "ALIGNFLOW_CODE_VERSION=${VERSION}")
# pip inside a build: the host's CA bundle and its local wheel dir / file:// indexes, at build time only.
[ -f "${HOST_CA}" ] && common+=(-v "${HOST_CA}:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt)
find_links="${PIP_FIND_LINKS:-$("${PYTHON}" -m pip config get global.find-links 2>/dev/null || true)}"
if [ -n "${find_links}" ] && [ -d "${find_links}" ]; then
    common+=(-v "${find_links}:/host-wheels:ro" --build-arg PIP_FIND_LINKS=/host-wheels)
fi
extra_index="${PIP_EXTRA_INDEX_URL:-$("${PYTHON}" -m pip config get global.extra-index-url 2>/dev/null || true)}"
if [ -n "${extra_index}" ]; then
    common+=(--build-arg "PIP_EXTRA_INDEX_URL=${extra_index}")
    for url in ${extra_index}; do
        case "${url}" in file://*)
            dir="$(dirname "${url#file://}")"
            [ -d "${dir}" ] && common+=(-v "${dir}:${dir}:ro") ;;
        esac
    done
fi
[ "${NO_CACHE:-0}" = 1 ] && common+=(--no-cache)

build() {  # name dockerfile extra-args...
    local name="$1" file="$2"; shift 2
    local t0; t0=$(now)
    log "podman build localhost/alignflow-${name}:${TAG}"
    podman build "${common[@]}" "$@" -f "${context}/containers/${file}" -t "localhost/alignflow-${name}:${TAG}" \
        "${context}" >"${BUILD_DIR}/build-${name}.log" 2>&1 || { tail -30 "${BUILD_DIR}/build-${name}.log" >&2; \
        die "podman build of ${name} failed; see ${BUILD_DIR}/build-${name}.log"; }
    TIMES[${name}]="$(elapsed "${t0}")"
    log "${name}: ${TIMES[${name}]} s"
}
if [ "${SKIP_BUILD:-0}" = 1 ]; then  # run with the images already tagged ${TAG} (their own code version)
    for k in worker training engine-native; do
        podman image exists "localhost/alignflow-${k}:${TAG}" || die "SKIP_BUILD=1 but localhost/alignflow-${k}:${TAG} is missing"
    done
    # shellcheck disable=SC2086  # E2E_ARGS is a list of flags
    exec "${PYTHON}" "${ROOT}/scripts/container_e2e.py" --build-dir "${BUILD_DIR}" --tag "${TAG}" ${E2E_ARGS:-}
fi
build worker worker.Dockerfile --build-arg "BASE_IMAGE=${BASE_IMAGE}"
# The image's default ALIGNFLOW_CPU_KERNELS=1 compiles the AVX-512 kernels without loading them, so
# an AVX2-only build host builds the same image (kernels/_cpu_extension.py build_ahead).
build training training.Dockerfile --build-arg "BASE_IMAGE=${BASE_IMAGE}" --build-arg DEEPSPEED_CPU_OPS=1
build engine-native engine-native.Dockerfile --build-arg "BASE_IMAGE=localhost/alignflow-training:${TAG}"

{
    printf '{"code_version": "%s", "tag": "%s", "no_cache": %s, "seconds": {' "${VERSION}" "${TAG}" "${NO_CACHE:-0}"
    sep=""
    for k in base worker training engine-native; do printf '%s"%s": %s' "${sep}" "${k}" "${TIMES[$k]}"; sep=", "; done
    printf '}, "sizes": {'
    sep=""
    for k in worker training engine-native; do
        printf '%s"%s": %s' "${sep}" "${k}" "$(podman image inspect --format '{{.Size}}' "localhost/alignflow-${k}:${TAG}")"
        sep=", "
    done
    printf '}, "total_s": %s}\n' "$(elapsed "${started}")"
} > "${BUILD_DIR}/build-times.json"
cat "${BUILD_DIR}/build-times.json" >&2
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0

export ALIGNFLOW_CODE_VERSION="${VERSION}"
# E2E_ARGS is a list of driver flags (e.g. "--local-reference --skip-failure"): word splitting is wanted.
# shellcheck disable=SC2086
exec "${PYTHON}" "${ROOT}/scripts/container_e2e.py" --build-dir "${BUILD_DIR}" --tag "${TAG}" ${E2E_ARGS:-}
