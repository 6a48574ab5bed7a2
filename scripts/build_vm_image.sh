#!/usr/bin/env bash
# Build the VM test image: the desktop image's recipe (deploy/desktop-image/apt-base.txt and
# cua_rollout/desktop/) on a bootable qcow2 disk (GPT, an EFI system partition with systemd-boot,
# Debian's cloud kernel and an initramfs, ext4 root) that boots under OVMF as OSWorld's
# Ubuntu.qcow2 does, with the desktop server as a systemd unit on port 5000 (no token: the host
# checks it). Named by a hash of its inputs in the image cache and reused, so a second build of
# unchanged inputs takes a second. Prints the image's path on its last line. Needs root.
#
#   bash scripts/build_vm_image.sh                  # build (or find) the image; print its path
#   bash scripts/build_vm_image.sh --check PATH     # boot PATH on a throwaway overlay under QEMU
#                                                   # until /screenshot serves a PNG; print the time
#   options: --print-path   the path the inputs give, without building
#            --print-tag    the image's name (version and inputs hash), without building
#            --serial-log FILE  (--check) keep the guest's serial console there
#            --accel tcg|kvm    (--check) default tcg (KVM does not run guests on every host)
#            --timeout S        (--check) how long the boot may take (default 900)
#   env:     DEBIAN_MIRROR (default http://deb.debian.org/debian), PYTHON (default .venv/bin/python)
#            CUA_IMAGE_CACHE: where images are kept, named by their inputs hash (default
#            ~/.cache/cua-rollout/images); only the newest image (and Debian base) is kept.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

print_path=0
print_tag=0
check=""
serial_log=""
accel=tcg
check_timeout_s=900
while [ $# -gt 0 ]; do
    case "$1" in
        --print-path) print_path=1 ;;
        --print-tag) print_tag=1 ;;
        --check) check="${2:?--check needs the path of an image}"; shift ;;
        --serial-log) serial_log="${2:?--serial-log needs a file}"; shift ;;
        --accel) accel="${2:?--accel needs tcg or kvm}"; shift ;;
        --timeout) check_timeout_s="${2:?--timeout needs seconds}"; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "build_vm_image.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$accel" in tcg|kvm) ;; *) echo "build_vm_image.sh: --accel must be tcg or kvm" >&2; exit 2 ;; esac
log() { printf '[vm-image] %s\n' "$*" >&2; }
die() { echo "build_vm_image.sh: $*" >&2; exit 2; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 is not installed (apt-get install $2)"; }

# --- --check: boot an image on a throwaway overlay until its server serves a screenshot --------
# The image is only ever a backing file: the guest writes to the overlay, thrown away after.
if [ -n "$check" ]; then
    [ -f "$check" ] || die "no image at $check"
    need qemu-system-x86_64 qemu-system-x86; need qemu-img qemu-utils; need curl curl
    ovmf_code=/usr/share/OVMF/OVMF_CODE_4M.fd
    ovmf_vars=/usr/share/OVMF/OVMF_VARS_4M.fd
    [ -f "$ovmf_code" ] && [ -f "$ovmf_vars" ] || die "OVMF is not installed (apt-get install ovmf)"
    dir="$(mktemp -d "${TMPDIR:-/tmp}/cua-vm-check.XXXXXX")"
    qemu_pid=""
    stop_qemu() {
        [ -n "$qemu_pid" ] || return 0
        kill "$qemu_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$qemu_pid" 2>/dev/null || true
        wait "$qemu_pid" 2>/dev/null || true
        qemu_pid=""
    }
    finish() {
        stop_qemu
        [ -z "$serial_log" ] || cp "$dir/serial.log" "$serial_log" 2>/dev/null || true
        rm -rf "$dir"
    }
    trap finish EXIT
    cp "$ovmf_vars" "$dir/vars.fd"  # the VM's own UEFI variables (systemd-boot writes some)
    qemu-img create -q -f qcow2 -F qcow2 -b "$(realpath "$check")" "$dir/overlay.qcow2"
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    accel_flags=(-accel "$accel")
    [ "$accel" = kvm ] && accel_flags+=(-cpu host)
    started_ns=$(date +%s%N)
    qemu-system-x86_64 "${accel_flags[@]}" -m 2048 -smp 1 \
        -drive "if=pflash,format=raw,readonly=on,file=$ovmf_code" \
        -drive "if=pflash,format=raw,file=$dir/vars.fd" \
        -drive "file=$dir/overlay.qcow2,format=qcow2,if=virtio" \
        -netdev "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:$port-:5000" \
        -device virtio-net-pci,netdev=n0 \
        -serial "file:$dir/serial.log" -display none -monitor none </dev/null 2>"$dir/qemu.err" &
    qemu_pid=$!
    log "booting $check under $accel (QEMU pid $qemu_pid, port $port)"
    deadline=$(( $(date +%s) + check_timeout_s ))
    url="http://127.0.0.1:$port/screenshot"
    # Milestones seen on the serial console, in seconds after QEMU started: where a boot's time goes.
    since() { local ms=$(( ($(date +%s%N) - started_ns) / 1000000 )); echo "$((ms / 1000)).$((ms % 1000 / 100))"; }
    kernel_s=""; unit_s=""
    while :; do
        [ -n "$kernel_s" ] || ! grep -a -q 'Linux version' "$dir/serial.log" 2>/dev/null || kernel_s="$(since)"
        [ -n "$unit_s" ] || ! grep -a -q 'Started .*cua-desktop' "$dir/serial.log" 2>/dev/null || unit_s="$(since)"
        if ! kill -0 "$qemu_pid" 2>/dev/null; then
            tail -30 "$dir/serial.log" "$dir/qemu.err" >&2 || true; die "QEMU ended before the server answered"
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            tail -30 "$dir/serial.log" >&2 || true; die "no screenshot from $url in $check_timeout_s s"
        fi
        # A short wait on a cheap path first: until the guest has its address, QEMU's user
        # network holds a forwarded connection open rather than refusing it.
        code="$(curl -s -m 2 -o /dev/null -w '%{http_code}' "${url%/screenshot}/platform" || true)"
        [ "$code" = 200 ] && code="$(curl -s -m 60 -o "$dir/shot.png" -w '%{http_code}' "$url" || true)"
        if [ "$code" = 200 ] && [ "$(head -c 8 "$dir/shot.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; then
            break
        fi
        sleep 1
    done
    boot_s="$(since)"
    size="$(python3 -c 'import struct, sys; d = open(sys.argv[1], "rb").read(24); print("%dx%d" % struct.unpack(">II", d[16:24]))' "$dir/shot.png")"
    log "the server answered: a $size PNG screenshot, $boot_s s after QEMU started (the kernel by ${kernel_s:-?} s, the server's unit by ${unit_s:-?} s)"
    echo "boot_s=$boot_s"
    exit 0
fi

# --- the inputs and the image's name ----------------------------------------------------------
image_dir=deploy/desktop-image
vm_dir=deploy/vm-image
# apt-vm.txt carries a reason on each package's line after '#'.
pkg_list="$(cat "$image_dir/apt-base.txt" "$vm_dir/apt-vm.txt" | sed 's/#.*//' | tr -s ' \t' '\n' \
    | grep -v '^$' | LC_ALL=C sort -u | paste -sd, -)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
hash_of() { sha256sum | cut -c1-12; }
# The Debian base: its packages and the script that makes it.
base_hash="$( { printf '%s\n' "$pkg_list"; cat "$vm_dir/rootfs.sh" "$vm_dir/initramfs-modules"; } | hash_of)"
# The image: the base, this script, deploy/vm-image/, the Python requirements and how they are
# installed, cua_rollout/desktop/.
inputs_hash="$( { printf '%s\n' "$base_hash"; cat "$0" "$image_dir/requirements.txt" "$image_dir/install-server.sh";
    find "$vm_dir" cua_rollout/desktop -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum; } | hash_of)"
name=cua-desktop-vm
tag="$name-$version-$inputs_hash"
cache="${CUA_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cua-rollout/images}"
image="$cache/$tag.qcow2"
base_archive="$cache/cua-vm-base-bookworm-$base_hash.tar.zst"
if [ "$print_tag" = 1 ]; then echo "$tag"; exit 0; fi
if [ "$print_path" = 1 ]; then echo "$image"; exit 0; fi
# The newest image is also $cache/cua-desktop-vm.qcow2 (a symlink): what configs/demo_vm.yaml
# names. The ready states of VMs key on the image's real path, size and mtime, not the link.
finish() { ln -sfn "$(basename "$image")" "$cache/$name.qcow2"; echo "$image"; exit 0; }
if [ -f "$image" ]; then
    log "up to date: $image"
    finish
fi

[ "$(id -u)" = 0 ] || die "building the image needs root (debootstrap, chroot, files owned by the guest's users)"
need debootstrap debootstrap; need mkfs.ext4 e2fsprogs; need mkfs.vfat dosfstools
need mcopy mtools; need sfdisk fdisk; need qemu-img qemu-utils; need zstd zstd
[[ "$(mke2fs -V 2>&1)" =~ mke2fs\ 1\.(4[3-9]|[5-9]) ]] || die "mke2fs >= 1.43 is needed (mkfs.ext4 -d)"
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
started=$(date +%s)
mkdir -p "$cache"
# One build at a time per cache (set-up and a test may both ask); the second finds the first's.
exec 9>"$cache/.cua-desktop-vm.lock"
flock 9
if [ -f "$image" ]; then
    log "built meanwhile: $image"
    finish
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/cua-vm-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

# --- the Debian base (cached apart: a change to cua_rollout/desktop/ does not debootstrap again) ----
if [ -f "$base_archive" ]; then
    log "base up to date: $base_archive"
    mkdir "$rootfs" && tar -C "$rootfs" --numeric-owner -I zstd -xpf "$base_archive"
else
    mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    log "debootstrap bookworm with $(tr ',' '\n' <<<"$pkg_list" | wc -l) packages from $mirror"
    bash "$vm_dir/rootfs.sh" "$rootfs" "$pkg_list" "$mirror" > "$work/rootfs.log" 2>&1 \
        || { tail -20 "$work/rootfs.log" >&2; exit 1; }
    rm -f "$cache"/cua-vm-base-bookworm-*.tar.zst "$cache"/cua-vm-base-bookworm-*.part
    tar -C "$rootfs" --numeric-owner -c . | zstd -q -T0 -3 -o "$base_archive.part" && mv "$base_archive.part" "$base_archive"
    log "saved the base to $base_archive ($(( $(stat -c %s "$base_archive") / 1024 / 1024 )) MB)"
fi

# --- the desktop server, installed as in the container image --------------------------------------
# Commands in the guest's tree see none of this host's settings (pip's, PYTHONDONTWRITEBYTECODE).
in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$rootfs" "$@"; }
want="$(in_root python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$want" = "$have" ] || die "the image's Python is $want and $py is $have: set PYTHON to a Python $want (the wheels are built for it)"
log "wheels of $image_dir/requirements.txt"
mkdir -p "$rootfs/tmp/wheels"
"$py" -m pip wheel -q -w "$rootfs/tmp/wheels" -r "$image_dir/requirements.txt" 2>&1 \
    | { grep -v -e 'is ignored: it is' || true; } >&2
cp "$image_dir/requirements.txt" "$image_dir/install-server.sh" "$rootfs/tmp/"
in_root sh /tmp/install-server.sh /tmp/wheels /tmp/requirements.txt 1000 >&2
rm -rf "$rootfs/tmp/wheels" "$rootfs/tmp/requirements.txt" "$rootfs/tmp/install-server.sh"
# cua_rollout/desktop alone: cua_rollout is a namespace package here, as in the container image.
mkdir -p "$rootfs/opt/cua/cua_rollout/desktop"
tar -C cua_rollout/desktop --exclude=__pycache__ --exclude='*.pyc' -c . | tar -C "$rootfs/opt/cua/cua_rollout/desktop" -x
# Compiled now: the server's user cannot write /opt/cua, and compiling at every boot under TCG
# would cost seconds.
in_root /opt/venv/bin/python -m compileall -q /opt/cua >&2

# --- the system: the server's unit, DHCP, a quick boot with nothing on the console to wait for --
install -m 0644 "$vm_dir/cua-desktop.service" "$rootfs/etc/systemd/system/cua-desktop.service"
install -m 0755 "$vm_dir/cua-screen-size" "$rootfs/usr/local/sbin/cua-screen-size"
install -m 0755 "$vm_dir/cua-clock" "$rootfs/usr/local/sbin/cua-clock"
install -m 0644 "$vm_dir/cua-clock.service" "$rootfs/etc/systemd/system/cua-clock.service"
install -m 0644 -D "$vm_dir/20-dhcp.network" "$rootfs/etc/systemd/network/20-dhcp.network"
mkdir -p "$rootfs/etc/systemd/journald.conf.d"
# The journal in memory: an overlay is thrown away anyway, and TCG makes every write slow.
printf '[Journal]\nStorage=volatile\n' > "$rootfs/etc/systemd/journald.conf.d/cua-vm.conf"
in_root systemctl -q enable cua-desktop.service cua-clock.service systemd-networkd.service
# No getty and no logind (nobody logs in; the serial console only shows the boot; logind costs
# seconds of the one TCG vCPU at boot), no first-boot prompts (an empty /etc/machine-id makes
# each VM its own, and would start systemd-firstboot's questions), nothing waiting for the
# network, no periodic maintenance in a VM that lives minutes.
masked=(getty.target systemd-logind.service systemd-firstboot.service systemd-networkd-wait-online.service
        apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service
        fstrim.timer dpkg-db-backup.timer)
for unit in "${masked[@]}"; do ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"; done
echo cua-desktop > "$rootfs/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 cua-desktop\n' > "$rootfs/etc/hosts"
: > "$rootfs/etc/machine-id"
printf '# The root file system comes from the kernel command line (root=PARTUUID=..., rw);\n# the EFI system partition is not mounted.\n' > "$rootfs/etc/fstab"

# --- the disk: GPT, an EFI system partition (FAT32) and an ext4 root, made as files ------------
# Fixed identifiers from the inputs hash: the same inputs give the same disk.
uuid_of() { printf '%s' "$1-$inputs_hash" | sha256sum | sed -E 's/^(.{8})(.{4}).(.{3}).(.{3})(.{12}).*/\1-\2-4\3-8\4-\5/'; }
disk_uuid="$(uuid_of disk)"; esp_uuid="$(uuid_of esp)"; root_uuid="$(uuid_of root)"; fs_uuid="$(uuid_of rootfs)"
kernel="$(cd "$rootfs/boot" && ls vmlinuz-* | sort -V | tail -1)"
kver="${kernel#vmlinuz-}"
[ -f "$rootfs/boot/initrd.img-$kver" ] || die "no initramfs for $kver in the base"
esp_mib=64  # FAT32 needs >= 33 MiB of 512-byte clusters; the kernel and initramfs take ~15
esp="$work/esp.img"
truncate -s "${esp_mib}M" "$esp"
mkfs.vfat --invariant -F 32 -n CUA-ESP -i "${inputs_hash:0:8}" "$esp" >/dev/null
mmd -i "$esp" ::/EFI ::/EFI/BOOT ::/loader ::/loader/entries
# systemd-boot at the removable-media path, which OVMF boots with empty variables; no menu.
mcopy -i "$esp" "$rootfs/usr/lib/systemd/boot/efi/systemd-bootx64.efi" ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$esp" "$rootfs/boot/$kernel" ::/vmlinuz
mcopy -i "$esp" "$rootfs/boot/initrd.img-$kver" ::/initrd.img
printf 'default cua.conf\ntimeout 0\neditor no\n' > "$work/loader.conf"
printf 'title CUA desktop (Debian bookworm, %s)\nlinux /vmlinuz\ninitrd /initrd.img\noptions root=PARTUUID=%s rw console=ttyS0,115200\n' \
    "$kver" "$root_uuid" > "$work/cua.conf"
mcopy -i "$esp" "$work/loader.conf" ::/loader/loader.conf
mcopy -i "$esp" "$work/cua.conf" ::/loader/entries/cua.conf
# The kernel and initramfs live on the ESP; the root needs no second copy.
rm -f "$rootfs"/boot/vmlinuz-* "$rootfs"/boot/initrd.img-* "$rootfs"/vmlinuz* "$rootfs"/initrd.img*

used_mib="$(du -s --block-size=1M "$rootfs" | cut -f1)"
free_mib=2048  # room for what episodes write; unused blocks cost nothing in the qcow2
root_mib=$(( used_mib * 11 / 10 + free_mib ))
root="$work/root.img"
# Inode tables zeroed now (zeros are not stored in the qcow2), not by the guest's kernel at boot.
mkfs.ext4 -q -F -L cua-root -U "$fs_uuid" -E lazy_itable_init=0,lazy_journal_init=0 \
    -d "$rootfs" "$root" "${root_mib}M" >/dev/null
rm -rf "$rootfs"
disk="$work/disk.raw"
total_mib=$(( 1 + esp_mib + root_mib + 1 ))  # 1 MiB before (GPT, alignment) and after (backup GPT)
truncate -s "${total_mib}M" "$disk"
sfdisk -q "$disk" <<EOF
label: gpt
label-id: $disk_uuid
start=2048, size=$(( esp_mib * 2048 )), type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, uuid=$esp_uuid, name="EFI system partition"
start=$(( (1 + esp_mib) * 2048 )), size=$(( root_mib * 2048 )), type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709, uuid=$root_uuid, name="root"
EOF
dd if="$esp" of="$disk" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$root" of="$disk" bs=1M seek=$(( 1 + esp_mib )) conv=notrunc,sparse status=none
rm -f "$esp" "$root"
log "converting to qcow2 (compressed)"
rm -f "$cache/$name"-*.qcow2 "$cache/$name"-*.qcow2.part
qemu-img convert -c -o compression_type=zstd -O qcow2 "$disk" "$image.part"
chmod 0444 "$image.part"  # the base of every VM's overlay: nothing may write it
mv "$image.part" "$image"
log "built $image: $(( $(stat -c %s "$image") / 1024 / 1024 )) MB (virtual $total_mib MiB) in $(( $(date +%s) - started )) s"
finish
