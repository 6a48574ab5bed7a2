#!/usr/bin/env bash
# Build the VM launcher image (deploy/vm-launcher/Containerfile) with podman or docker, tagged
# with the project version and a hash of its inputs; an image of that tag is reused. Prints
# the tag on its last line. The Debian base comes from debootstrap (no registry needed; root).
#
#   bash scripts/build_vm_launcher_image.sh [--engine podman|docker] [--print-tag]
#   env: DEBIAN_MIRROR (default http://deb.debian.org/debian), PYTHON (default .venv/bin/python)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

engine=""
print_tag=0
while [ $# -gt 0 ]; do
    case "$1" in
        --engine) engine="${2:?--engine needs podman or docker}"; shift ;;
        --print-tag) print_tag=1 ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "build_vm_launcher_image.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$engine" ]; then
    if command -v podman >/dev/null 2>&1; then engine=podman
    elif command -v docker >/dev/null 2>&1; then engine=docker
    else echo "build_vm_launcher_image.sh: neither podman nor docker is installed" >&2; exit 2; fi
fi
log() { printf '[launcher-image] %s\n' "$*" >&2; }

dir=deploy/vm-launcher
pkg_list="$(grep -v -E '^[[:space:]]*(#|$)' "$dir/apt-launcher.txt" | sort -u | paste -sd, -)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
hash_of() { sha256sum | cut -c1-12; }
base_hash="$(printf '%s\n' "$pkg_list" | hash_of)"
inputs_hash="$( { printf '%s\n' "$base_hash"; cat "$0" "$dir/Containerfile";
    find cua_rollout/vm -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z \
        | xargs -0 sha256sum; } | hash_of)"
base_tag="localhost/cua-vm-launcher-base:bookworm-$base_hash"
tag="localhost/cua-vm-launcher:$version-$inputs_hash"
if [ "$print_tag" = 1 ]; then echo "$tag"; exit 0; fi

run_flags=()
[ "$engine" = podman ] && run_flags+=(--runtime runc)
exists() { "$engine" image inspect "$1" >/dev/null 2>&1; }
if exists "$tag"; then
    "$engine" tag "$tag" localhost/cua-vm-launcher:latest
    log "up to date: $tag"; echo "$tag"; exit 0
fi
started=$(date +%s)
work="$(mktemp -d "${TMPDIR:-/tmp}/cua-launcher.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if exists "$base_tag"; then
    log "base up to date: $base_tag"
else
    command -v debootstrap >/dev/null || { echo "build_vm_launcher_image.sh: debootstrap is not installed" >&2; exit 2; }
    [ "$(id -u)" = 0 ] || { echo "build_vm_launcher_image.sh: debootstrap needs root" >&2; exit 2; }
    mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    log "debootstrap bookworm with $pkg_list from $mirror"
    debootstrap --variant=minbase --include="ca-certificates,$pkg_list" \
        bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
           "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* \
           "$work"/rootfs/usr/share/locale/* "$work"/rootfs/usr/share/info/*
    log "importing the base as $base_tag"
    tar -C "$work/rootfs" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$base_tag" >/dev/null
    rm -rf "$work/rootfs"
fi

py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
mkdir -p "$work/ctx/wheels" "$work/ctx/cua_rollout"
log "wheel of qemu.qmp"
"$py" -m pip wheel -q --no-deps -w "$work/ctx/wheels" "$("$py" -c 'import importlib.metadata as m; print("qemu.qmp==" + m.version("qemu.qmp"))')" >&2
# cua_rollout/vm alone, without cua_rollout/__init__.py: a namespace package holding the
# machine layer and nothing else of the controller.
tar -C cua_rollout --exclude=__pycache__ --exclude='*.pyc' -c vm | tar -C "$work/ctx/cua_rollout" -x
log "building $tag with $engine"
"$engine" build "${run_flags[@]}" --build-arg "BASE=$base_tag" \
    --label "org.opencontainers.image.version=$version" --label "cua.inputs=$inputs_hash" \
    -t "$tag" -t localhost/cua-vm-launcher:latest -f "$dir/Containerfile" "$work/ctx" >&2
size="$("$engine" image inspect "$tag" --format '{{.Size}}')"
log "built $tag: $((size / 1024 / 1024)) MB in $(( $(date +%s) - started )) s"
echo "$tag"
