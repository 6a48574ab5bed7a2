#!/usr/bin/env bash
# The VM test image's Debian (run by scripts/build_vm_image.sh, as root): debootstrap bookworm
# minbase with the packages given, an initramfs of the few modules that find the root disk, and
# no documentation, manuals or translations (as scripts/build_desktop_image.sh strips them).
#
#   bash deploy/vm-image/rootfs.sh ROOTDIR PACKAGES(comma-separated) MIRROR
set -euo pipefail
root="${1:?rootfs.sh: ROOTDIR}"; packages="${2:?rootfs.sh: PACKAGES}"; mirror="${3:?rootfs.sh: MIRROR}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror"

# The kernel's postinst made an initramfs of most modules; this one has the disk's alone.
printf 'MODULES=list\nCOMPRESS=gzip\n' > "$root/etc/initramfs-tools/conf.d/cua-vm.conf"
grep -v -E '^[[:space:]]*(#|$)' "$here/initramfs-modules" > "$root/etc/initramfs-tools/modules"
chroot "$root" update-initramfs -u -k all

rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* \
       "$root"/usr/share/locale/* "$root"/usr/share/info/*
