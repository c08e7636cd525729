#!/usr/bin/env bash
# `make images`: builds kvpilot/engine and kvpilot/operator (tag = the package version) with podman,
# without a Docker daemon and without an image registry:
#   - installs podman, runc, debootstrap (and shellcheck, for `make lint`) from Debian when missing;
#   - writes a containers.conf for this kind of machine (runc: crun can't run on hybrid cgroups here;
#     ulimits within what an unprivileged sandbox may set) and exports CONTAINERS_CONF;
#   - makes the base image locally: `debootstrap --variant=minbase bookworm` + python3, imported;
#   - builds both Dockerfiles on it with the host's pip cache mounted (the engine pulls GBs of CUDA
#     wheels: a second build downloads nothing) and the host's CA bundle visible to pip at build time
#     only (this machine's package traffic passes an intercepting proxy; nothing of it is baked in).
# Everything is cached: a second run with unchanged sources reuses every layer.
# With Docker: `docker build -f Dockerfile.engine -t kvpilot/engine:0.1.0 .` (likewise the operator).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
base=localhost/kvpilot/base-python:bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ca_bundle=${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
pip_cache=${PIP_CACHE_DIR:-$cache/pip}

need=()
for tool in podman runc debootstrap shellcheck; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} from Debian" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

mkdir -p "$cache/podman" "$pip_cache"
export CONTAINERS_CONF=$cache/podman/containers.conf
cat > "$CONTAINERS_CONF" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF

if ! podman image exists "$base"; then
  start=$(date +%s)
  rootfs=$(mktemp -d "$cache/podman/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" >"$cache/podman/debootstrap.log"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$base" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  echo "base image $base made in $(( $(date +%s) - start ))s" >&2
fi

build() {  # image dockerfile
  local start; start=$(date +%s)
  podman build --pull=never --network host --layers \
    --build-arg BASE_IMAGE="$base" --build-arg PIP_CACHE_DIR=/var/cache/host-pip \
    --build-arg BUILD_CA_BUNDLE=/run/build-ca.crt \
    -v "$pip_cache:/var/cache/host-pip" -v "$ca_bundle:/run/build-ca.crt:ro" \
    -f "$root/$2" -t "$1:$version" "$root" >"$cache/podman/build-${1//\//_}.log" 2>&1 \
    || { tail -n 40 "$cache/podman/build-${1//\//_}.log" >&2; echo "podman build of $1 failed" >&2; return 1; }
  echo "$1:$version built in $(( $(date +%s) - start ))s: $(podman image inspect --format '{{.Size}}' "$1:$version" | numfmt --to=iec)" >&2
}
build kvpilot/operator Dockerfile.operator
build kvpilot/engine Dockerfile.engine
