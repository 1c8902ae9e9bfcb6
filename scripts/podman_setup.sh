# shellcheck shell=bash
# Podman on these machines, shared by scripts/container_test.sh and scripts/container_e2e.sh (sourced; needs the
# caller's log and die functions): the tools from apt, the containers.conf that makes podman work as root here,
# and the debootstrap'ed Debian bookworm base image (no image registry is reachable).

# podman_setup BUILD_DIR: apt-installs podman, runc and debootstrap where missing; writes and exports
# CONTAINERS_CONF. The default crun + systemd cgroups + host ulimits fail here; runc + cgroupfs + these limits work.
podman_setup() {
    local build_dir="$1" missing=() tool
    for tool in podman runc debootstrap; do command -v "${tool}" >/dev/null || missing+=("${tool}"); done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing ${missing[*]} with apt"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 podman runc debootstrap >/dev/null
    fi
    cat > "${build_dir}/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    export CONTAINERS_CONF="${build_dir}/containers.conf"
    podman info >/dev/null || die "podman does not start with ${CONTAINERS_CONF}"
}

# base_image IMAGE BUILD_DIR MIRROR [REBUILD]: debootstraps bookworm (minbase + python3) and imports it as IMAGE,
# unless IMAGE exists and REBUILD is not 1 (~90 s). Returns 0 when it built, 1 when the image was cached.
base_image() {
    local image="$1" build_dir="$2" mirror="$3" rebuild="${4:-0}"
    if [ "${rebuild}" != 1 ] && podman image exists "${image}"; then
        return 1
    fi
    local rootfs="${build_dir}/rootfs"
    rm -rf "${rootfs}"
    log "debootstrap bookworm (minbase + python3) into ${rootfs}"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "${rootfs}" "${mirror}" >"${build_dir}/debootstrap.log" 2>&1 \
        || die "debootstrap failed; see ${build_dir}/debootstrap.log"
    rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/*
    tar -C "${rootfs}" -c . | podman import --change 'CMD ["/bin/bash"]' - "${image}" >/dev/null
    rm -rf "${rootfs}"
}
