#!/usr/bin/env bash
# Build the desktop image (deploy/desktop-image/Containerfile) with podman or docker, tagged with the
# project version, the profile and a hash of its inputs; an image of that tag is reused, so a
# second build of unchanged inputs takes a second. Prints the tag on its last line.
#
#   bash scripts/build_desktop_image.sh                    # the demo's desktop
#   bash scripts/build_desktop_image.sh --profile osworld  # + OSWorld's apps (Chromium, LibreOffice ...)
#   options: --engine podman|docker (default: podman if installed, else docker)
#            --base debootstrap|registry  (default debootstrap: Debian from deb.debian.org, no
#                                          registry needed; registry: FROM debian:bookworm-slim)
#            --print-tag                  # the tag the inputs give, without building
#   env:     DEBIAN_MIRROR (default http://deb.debian.org/debian), PYTHON (default .venv/bin/python)
#            CUA_IMAGE_CACHE: a directory where built images are saved as archives named by their
#            tags (inputs hash), and loaded from when the engine lacks them, as on a fresh CI
#            machine with a restored cache (default ~/.cache/cua-rollout/images; empty: none).
#            Only the newest archive of each profile and base is kept.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

profile=demo
engine=""
base_from=debootstrap
print_tag=0
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) profile="${2:?--profile needs demo or osworld}"; shift ;;
        --engine) engine="${2:?--engine needs podman or docker}"; shift ;;
        --base) base_from="${2:?--base needs debootstrap or registry}"; shift ;;
        --print-tag) print_tag=1 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "build_desktop_image.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$profile" in demo|osworld) ;; *) echo "build_desktop_image.sh: --profile must be demo or osworld, not '$profile'" >&2; exit 2 ;; esac
case "$base_from" in debootstrap|registry) ;; *) echo "build_desktop_image.sh: --base must be debootstrap or registry" >&2; exit 2 ;; esac
if [ -z "$engine" ]; then
    if command -v podman >/dev/null 2>&1; then engine=podman
    elif command -v docker >/dev/null 2>&1; then engine=docker
    else echo "build_desktop_image.sh: neither podman nor docker is installed (bash scripts/setup_env.sh --containers)" >&2; exit 2; fi
fi
log() { printf '[image] %s\n' "$*" >&2; }

image_dir=deploy/desktop-image
packages=("$image_dir/apt-base.txt")
[ "$profile" = osworld ] && packages+=("$image_dir/apt-osworld.txt")
pkg_list="$(cat "${packages[@]}" | grep -v -E '^[[:space:]]*(#|$)' | sort -u | paste -sd, -)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"

# The inputs: the Debian packages, the Python requirements, the Containerfile and what it runs,
# cua_rollout/desktop/ itself and this script.
hash_of() { sha256sum | cut -c1-12; }
# The image's Python: Debian's (the venv sees its python3-pyatspi; pyautogui needs tkinter).
image_python="python3,python3-venv,python3-tk,ca-certificates"
base_hash="$(printf '%s\n' "$image_python" "$pkg_list" "$base_from" | hash_of)"
inputs_hash="$( { printf '%s\n' "$base_hash" "$profile"; cat "$0" "$image_dir/requirements.txt" "$image_dir/Containerfile" "$image_dir/install-server.sh" cua_rollout/envs/apps.py;
    find cua_rollout/desktop -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z \
        | xargs -0 sha256sum; } | hash_of)"
base_tag="localhost/cua-desktop-base:bookworm-$base_hash"
tag="localhost/cua-desktop:$version-$profile-$inputs_hash"
if [ "$print_tag" = 1 ]; then echo "$tag"; exit 0; fi

# Podman on cgroups v1 needs runc and explicit ulimits (docs/containers.md).
run_flags=()
if [ "$engine" = podman ]; then
    run_flags+=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
fi
build_flags=("${run_flags[@]}")
# The docker image format keeps HEALTHCHECK (podman's default, OCI, drops it).
[ "$engine" = podman ] && build_flags+=(--format docker)
exists() { "$engine" image inspect "$1" >/dev/null 2>&1; }

cache="${CUA_IMAGE_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/cua-rollout/images}"
archive() { printf '%s/%s.tar' "$cache" "$(tr '/:' '+=' <<<"$1")"; }
# Load an image from the cache when the engine lacks it; true when it is there after.
from_cache() {
    exists "$1" && return 0
    [ -n "$cache" ] && [ -f "$(archive "$1")" ] || return 1
    log "loading $1 from $(archive "$1")"
    "$engine" load -q -i "$(archive "$1")" >/dev/null 2>&1 && exists "$1"
}
# Save an image to the cache, in place of older archives of the same name before the hash.
to_cache() {
    [ -n "$cache" ] || return 0
    local file stem
    file="$(archive "$1")"; stem="${file%-*}"
    mkdir -p "$cache" && rm -f "$stem"-*.tar "$stem"-*.tar.part
    if "$engine" save -q -o "$file.part" "$1" >/dev/null 2>&1; then
        mv "$file.part" "$file"
        log "saved $1 to $file ($(( $(stat -c %s "$file") / 1024 / 1024 )) MB)"
    else
        rm -f "$file.part"; log "could not save $1 to the cache $cache (continuing)"
    fi
}

if from_cache "$tag"; then
    "$engine" tag "$tag" "localhost/cua-desktop:$profile"  # the last one built or asked for
    [ -z "$cache" ] || [ -f "$(archive "$tag")" ] || to_cache "$tag"
    log "up to date: $tag"
    echo "$tag"
    exit 0
fi
started=$(date +%s)
work="$(mktemp -d "${TMPDIR:-/tmp}/cua-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# --- the Debian base ------------------------------------------------------------------------
if from_cache "$base_tag"; then
    log "base up to date: $base_tag"
elif [ "$base_from" = debootstrap ]; then
    command -v debootstrap >/dev/null || { echo "build_desktop_image.sh: debootstrap is not installed (bash scripts/setup_env.sh --containers)" >&2; exit 2; }
    [ "$(id -u)" = 0 ] || { echo "build_desktop_image.sh: debootstrap needs root" >&2; exit 2; }
    mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    log "debootstrap bookworm with $(tr ',' '\n' <<<"$pkg_list" | wc -l) packages from $mirror"
    debootstrap --variant=minbase --include="$image_python,$pkg_list" \
        bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    # What an image does not need: downloaded packages, documentation, translations.
    rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
           "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* \
           "$work"/rootfs/usr/share/locale/* "$work"/rootfs/usr/share/info/*
    log "importing the base as $base_tag"
    tar -C "$work/rootfs" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$base_tag" >/dev/null
    rm -rf "$work/rootfs"
    to_cache "$base_tag"
else
    log "base from debian:bookworm-slim with apt-get"
    printf 'FROM docker.io/library/debian:bookworm-slim\nRUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends %s && rm -rf /var/lib/apt/lists/*\n' \
        "$(tr ',' ' ' <<<"$image_python,$pkg_list")" > "$work/Containerfile.base"
    "$engine" build "${build_flags[@]}" -t "$base_tag" -f "$work/Containerfile.base" "$work" >&2
fi

# --- the image: cua_rollout/desktop/, its wheels (built here, so the build needs no network) ------------
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
want="$("$engine" run --rm "${run_flags[@]}" "$base_tag" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$want" = "$have" ] || { echo "build_desktop_image.sh: the image's Python is $want and $py is $have: set PYTHON to a Python $want (the wheels are built for it)" >&2; exit 2; }
mkdir -p "$work/ctx/wheels"
log "wheels of $image_dir/requirements.txt"
"$py" -m pip wheel -q -w "$work/ctx/wheels" -r "$image_dir/requirements.txt" 2>&1 \
    | { grep -v -e 'is ignored: it is neither' || true; } >&2
cp "$image_dir/requirements.txt" "$image_dir/install-server.sh" "$work/ctx/"
# cua_rollout/desktop alone, without cua_rollout/__init__.py: in the image cua_rollout is a
# namespace package holding the desktop server and nothing of the controller.
mkdir -p "$work/ctx/cua_rollout/desktop"
tar -C cua_rollout/desktop --exclude=__pycache__ --exclude='*.pyc' -c . | tar -C "$work/ctx/cua_rollout/desktop" -x
# The apps the image's packages provide (the pre-flight check reads this label: a task whose
# related_apps the desktops lack is not runnable on them).
apps="$("$py" -m cua_rollout.envs.apps "${packages[@]}")" \
    || { echo "build_desktop_image.sh: $py cannot list the image's apps (cua_rollout.envs.apps)" >&2; exit 2; }
log "building $tag with $engine (apps: $apps)"
"$engine" build "${build_flags[@]}" --build-arg "BASE=$base_tag" \
    --label "org.opencontainers.image.version=$version" --label "cua.profile=$profile" \
    --label "cua.inputs=$inputs_hash" --label "cua.apps=$apps" \
    -t "$tag" -t "localhost/cua-desktop:$version-$profile" -t "localhost/cua-desktop:$profile" -f "$image_dir/Containerfile" "$work/ctx" >&2
size="$("$engine" image inspect "$tag" --format '{{.Size}}')"
log "built $tag: $((size / 1024 / 1024)) MB in $(( $(date +%s) - started )) s"
to_cache "$tag"
echo "$tag"
