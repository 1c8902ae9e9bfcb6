#!/usr/bin/env bash
# `make container-test`: build the training image with podman (no Docker engine, no image registry)
# and run the SFT stage in it against the host's object store; prints each step's wall time and the
# image size.
#
# Steps: (0) podman + runc + debootstrap from apt if missing, and a containers.conf that makes podman
# work as root on these machines (runc, cgroupfs, lower ulimits); (1) a Debian bookworm base image
# from debootstrap (cached: skipped when the image exists); (2) the training image
# (containers/training.Dockerfile on that base, in docker format so SHELL and HEALTHCHECK are kept;
# CPU torch from the host's wheel directory, the host's CA bundle for pip); (3) the data and base
# stages on the host (`alignflow run`, a small config) into a fresh work dir whose file:// object
# store and MLflow DB are bind-mounted into the container at the same path; (4) the SFT spec, built
# the way the flow builds it; (5) the SFT stage in the container, as its non-root user, without
# network; (6) checks: StageResult ok, manifest verified on the host,
# MLflow run finished; a second run is a 'skipped' (the published output is found and reused).
#
# Environment: IMAGE, BASE_IMAGE (tags), CONTAINER_TEST_DIR (build dir, default build/container-test),
# PYTHON (host interpreter with alignflow installed, default .venv/bin/python), DEBIAN_MIRROR,
# REBUILD_BASE=1 (re-debootstrap), NO_CACHE=1 (build the image from scratch).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${CONTAINER_TEST_DIR:-${ROOT}/build/container-test}"
PYTHON="${PYTHON:-${ROOT}/.venv/bin/python}"
IMAGE="${IMAGE:-localhost/alignflow-training:test}"
BASE_IMAGE="${BASE_IMAGE:-localhost/alignflow-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HOST_CA="${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
UID_IN_IMAGE=10001  # the image's non-root user (containers/training.Dockerfile)

declare -a TIMINGS=()
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
log() { printf '[container-test] %s\n' "$*" >&2; }
die() { printf '[container-test] error: %s\n' "$*" >&2; exit 1; }
record() { TIMINGS+=("$(printf '%-34s %8s s' "$1" "$2")"); log "$1: $2 s"; }

[ "$(id -u)" = 0 ] || die "podman runs as root on these machines (rootless needs subuid maps); run as root"
[ -x "${PYTHON}" ] || die "no host Python at ${PYTHON}: run 'make demo' (creates .venv) or set PYTHON=..."
mkdir -p "${BUILD_DIR}"

# --- (0) tools and podman configuration ------------------------------------------------------
t0=$(now)
# shellcheck source-path=SCRIPTDIR source=podman_setup.sh
source "${ROOT}/scripts/podman_setup.sh"
podman_setup "${BUILD_DIR}"
record "tools + podman config" "$(elapsed "${t0}")"

# --- (1) base image from debootstrap (no registry) ---------------------------------------------
t0=$(now)
if base_image "${BASE_IMAGE}" "${BUILD_DIR}" "${DEBIAN_MIRROR}" "${REBUILD_BASE:-0}"; then
    record "base image (debootstrap + import)" "$(elapsed "${t0}")"
else
    record "base image (cached)" "$(elapsed "${t0}")"
fi

# --- (2) training image -------------------------------------------------------------------------
t0=$(now)
# One code version for the host stages, the spec and the image, fixed now: files edited while this
# runs must not move the host's output digests (they include the code version).
VERSION="$(cd "${ROOT}" && "${PYTHON}" -c 'from alignflow.manifest import code_version; print(code_version())')"
export ALIGNFLOW_CODE_VERSION="${VERSION}"
# A clean build context: only what the Dockerfile copies (no .venv, artifacts or caches).
context="${BUILD_DIR}/context"
rm -rf "${context}" && mkdir -p "${context}"
tar -C "${ROOT}" -cf - --exclude=__pycache__ --exclude='*.pyc' \
    pyproject.toml README.md alignflow flows stages kernels containers | tar -C "${context}" -xf -
build_args=(--build-arg "BASE_IMAGE=${BASE_IMAGE}" --build-arg "ALIGNFLOW_CODE_VERSION=${VERSION}"
            --build-arg DEEPSPEED_CPU_OPS=1)
# pip inside the build: the host's CA bundle (TLS-intercepting proxy) and the host's local wheel
# directory and file:// indexes (the CPU torch wheel lives there), mounted read-only at build time only.
[ -f "${HOST_CA}" ] && build_args+=(-v "${HOST_CA}:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt)
find_links="${PIP_FIND_LINKS:-$("${PYTHON}" -m pip config get global.find-links 2>/dev/null || true)}"
if [ -n "${find_links}" ] && [ -d "${find_links}" ]; then
    build_args+=(-v "${find_links}:/host-wheels:ro" --build-arg PIP_FIND_LINKS=/host-wheels)
fi
extra_index="${PIP_EXTRA_INDEX_URL:-$("${PYTHON}" -m pip config get global.extra-index-url 2>/dev/null || true)}"
if [ -n "${extra_index}" ]; then
    build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=${extra_index}")
    for url in ${extra_index}; do
        case "${url}" in file://*)
            dir="$(dirname "${url#file://}")"  # .../simple's parent also holds the files it links to
            [ -d "${dir}" ] && build_args+=(-v "${dir}:${dir}:ro") ;;
        esac
    done
fi
[ "${NO_CACHE:-0}" = 1 ] && build_args+=(--no-cache)
log "podman build ${IMAGE} (minutes on first build: torch, DeepSpeed sdist, DeepSpeed CPU op)"
podman build --format docker --network=host -f "${context}/containers/training.Dockerfile" -t "${IMAGE}" "${build_args[@]}" \
    "${context}" 2>&1 | tee "${BUILD_DIR}/build.log" | grep -E '^(STEP|COMMIT|Successfully)' >&2 \
    || die "podman build failed; see ${BUILD_DIR}/build.log"
size_bytes="$(podman image inspect --format '{{.Size}}' "${IMAGE}")"
record "training image build" "$(elapsed "${t0}")"

# --- (3) upstream stages on the host ------------------------------------------------------------
t0=$(now)
WORK="${BUILD_DIR}/work"
rm -rf "${WORK}" && mkdir -p "${WORK}"
overrides=(--set "workdir=${WORK}" --set "storage.root=file://${WORK}/store" --set "name=container-test"
           --set data.demo.n_sft=256 --set data.demo.n_preferences=64 --set data.demo.n_prompts=32
           --set data.demo.n_eval_prompts=16 --set sft.epochs=1)
(cd "${WORK}" && "${PYTHON}" -m alignflow.cli run "${ROOT}/configs/tiny.yaml" "${overrides[@]}" \
    --set 'stages=[data,base]') >"${BUILD_DIR}/host-stages.log" 2>&1 \
    || { tail -20 "${BUILD_DIR}/host-stages.log" >&2; die "host data/base stages failed; see ${BUILD_DIR}/host-stages.log"; }
record "data + base stages on the host" "$(elapsed "${t0}")"

# --- (4) the SFT spec -----------------------------------------------------------------------------
t0=$(now)
(cd "${WORK}" && "${PYTHON}" - "${ROOT}/configs/tiny.yaml" "${WORK}" "${overrides[@]}" --set 'stages=[data,base,sft]' <<'EOF'
"""Build the SFT StageSpec as the flow does (flows/pipeline.py build_spec), from the published data/base outputs."""
import sys
from pathlib import Path

from alignflow import tracking
from alignflow.config import load_config
from alignflow.contract import StageResult, TrackingSpec
from alignflow.flows.pipeline import _raw_data_digests, build_spec
from alignflow.flows.plan import plan
from alignflow.manifest import code_version, find_published
from alignflow.storage import normalize_root

config_path, workdir = sys.argv[1], Path(sys.argv[2])
overrides = [a for a in sys.argv[3:] if a != "--set"]
config = load_config(config_path, overrides)
root = normalize_root(config.storage.root, workdir)
version = code_version()
uri = tracking.resolve_tracking_uri(config.tracking, workdir)
parent = tracking.start_parent_run(uri, config.tracking.experiment, "container-test", {}, tags={"alignflow.code_version": version})
tracking_spec = TrackingSpec(uri=uri, experiment=config.tracking.experiment, parent_run_id=parent,
                             tags={"alignflow.pipeline_run": parent, "alignflow.runner": "podman"})
extra = _raw_data_digests(config, workdir)
results = {}
for call in plan(config):
    spec = build_spec(call, config, results, root, version, tracking_spec, workdir, extra)
    if call.stage == "sft":
        spec.dump(workdir / "sft-spec.json")
        (workdir / "parent-run-id").write_text(parent)
        print(spec.output_uri)
        break
    manifest = find_published(spec.output_uri, spec.storage)
    if manifest is None:
        sys.exit(f"error: {call.stage} output {spec.output_uri} is not published; did the host stages run?")
    results[call.key] = StageResult(stage=call.stage, status="skipped", output_uri=manifest.uri,
                                    manifest_digest=manifest.digest)
EOF
) > "${BUILD_DIR}/sft-output-uri" || die "could not build the SFT spec"
SFT_URI="$(tail -1 "${BUILD_DIR}/sft-output-uri")"
# The container runs as uid ${UID_IN_IMAGE}; it writes the store, the MLflow DB and its caches here.
chown -R "${UID_IN_IMAGE}:${UID_IN_IMAGE}" "${WORK}"
record "SFT spec" "$(elapsed "${t0}")"

# --- (5) SFT in the container ---------------------------------------------------------------------
# --no-healthcheck: podman 4.3 tries to set up systemd timers even for HEALTHCHECK NONE and logs an
# error without systemd; the image has no healthcheck anyway.
run_sft() {
    podman run --rm --no-healthcheck --network=none -v "${WORK}:${WORK}" -w "${WORK}" "${IMAGE}" sft --spec "${WORK}/sft-spec.json"
}
t0=$(now)
log "podman run ${IMAGE} sft --spec ${WORK}/sft-spec.json"
run_sft > "${BUILD_DIR}/sft-run.log" 2>&1 || { tail -30 "${BUILD_DIR}/sft-run.log" >&2; die "SFT stage failed in the container"; }
sft_time="$(elapsed "${t0}")"
record "SFT stage in the container" "${sft_time}"
t0=$(now)
run_sft > "${BUILD_DIR}/sft-rerun.log" 2>&1 || die "SFT re-run failed; see ${BUILD_DIR}/sft-rerun.log"
record "SFT re-run (expects skipped)" "$(elapsed "${t0}")"

# --- (6) checks on the host -------------------------------------------------------------------------
(cd "${WORK}" && "${PYTHON}" - "${BUILD_DIR}" "${SFT_URI}" "${WORK}" <<'EOF'
import sys
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from alignflow import tracking
from alignflow.contract import StageResult
from alignflow.manifest import materialize

build, sft_uri, work = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
first = StageResult.from_output((build / "sft-run.log").read_text())
again = StageResult.from_output((build / "sft-rerun.log").read_text())
assert first.status == "ok", f"SFT in the container: status {first.status}: {first.message}"
assert first.output_uri == sft_uri, f"SFT published to {first.output_uri}, expected {sft_uri}"
assert again.status == "skipped", f"SFT re-run: status {again.status} (expected skipped: output reused)"
_, manifest = materialize(sft_uri, work / ".alignflow" / "cache")  # checks every file's size and sha256
assert manifest is not None and manifest.digest == first.manifest_digest, "SFT manifest missing or different"
uri = f"sqlite:///{work / 'mlflow.db'}"
mlflow.set_tracking_uri(uri)
run = MlflowClient(uri).get_run(first.mlflow_run_id)
parent = (work / "parent-run-id").read_text()
assert run.info.status == "FINISHED", f"MLflow run {run.info.run_id}: {run.info.status}"
assert run.data.tags.get("mlflow.parentRunId") == parent, "SFT run is not nested under the test's parent run"
tracking.end_run(uri, parent)
print(f"sft ok: {first.output_uri} ({len(manifest.files)} files), metrics {first.metrics}, "
      f"stage duration {first.duration_s:.1f} s, mlflow run {first.mlflow_run_id}")
EOF
) || die "checks failed; logs in ${BUILD_DIR}"

size_mb="$(awk -v b="${size_bytes}" 'BEGIN { printf "%.0f", b / 1e6 }')"
echo
echo "container-test passed: ${IMAGE} (${size_mb} MB, code version ${VERSION})"
printf '  %s\n' "${TIMINGS[@]}"
printf '{"image": "%s", "image_size_bytes": %s, "sft_in_container_s": %s, "code_version": "%s"}\n' \
    "${IMAGE}" "${size_bytes}" "${sft_time}" "${VERSION}" > "${BUILD_DIR}/report.json"
echo "  logs and report.json in ${BUILD_DIR}"
