"""A tiny QEMU guest for the VM machine layer's tests and benchmark: a Debian kernel and a
busybox initramfs whose ``/init`` serves HTTP on port 5000 and prints ``READY`` on the serial
port. Built at first use from Debian's archive (``apt-get download``, ``dpkg-deb -x``) and
cached under ``~/.cache/cua-rollout/vm-test-guest/<hash of the inputs>``.

It lives among the doubles because the benchmark (``benchmarks/bench_vm.py``) boots it too, and
benchmarks import nothing of ``tests/`` but ``tests.doubles``.

The guest's HTTP server (busybox httpd, document root in RAM) answers:

    /hello                  ``hello from the test guest``
    /cgi-bin/mark           writes ``dirty`` into /www/mark (guest RAM), then /mark is served
    /cgi-bin/disk-write?X   writes ``X`` (word characters only) at the start of /dev/vda, synced
    /cgi-bin/disk-fill?N    writes N MiB of random bytes over /dev/vda (fills an overlay)
    /cgi-bin/disk-read      the first 16 bytes of /dev/vda, read with O_DIRECT (not the page
                            cache, so it shows what the disk holds)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GUEST_HTTP_PORT", "READY_LINE", "TestGuest", "build_test_guest", "make_base_disk"]

CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cua-rollout"
GUEST_HTTP_PORT = 5000
READY_LINE = "READY"
BUSYBOX = Path("/bin/busybox")
# Load order of the drivers QEMU's virtio NIC and disk need (Debian builds them as modules;
# the package carries no modules.dep, so the order is spelled out: dependencies first).
MODULES = [
    "drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_pci_modern_dev.ko", "drivers/virtio/virtio_pci_legacy_dev.ko",
    "drivers/virtio/virtio_pci.ko", "net/core/failover.ko", "drivers/net/net_failover.ko",
    "drivers/net/virtio_net.ko", "drivers/block/virtio_blk.ko",
]
APT_TIMEOUT_S = 600

# The network is configured statically with the address QEMU's user-mode DHCP would give
# (10.0.2.15): the same result as udhcpc, without its round trips under TCG.
INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in {' '.join(Path(m).name for m in MODULES)}; do insmod /lib/modules/$m; done
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
mkdir -p /www/cgi-bin
echo 'hello from the test guest' > /www/hello
cat > /www/cgi-bin/mark <<'EOF'
#!/bin/sh
echo dirty > /www/mark
printf 'Content-Type: text/plain\\r\\n\\r\\nmarked\\n'
EOF
cat > /www/cgi-bin/disk-write <<'EOF'
#!/bin/sh
word=$(echo "$QUERY_STRING" | tr -cd 'A-Za-z0-9_')
printf '%-16s' "$word" | dd of=/dev/vda bs=16 count=1 conv=notrunc,fsync 2>/dev/null
printf 'Content-Type: text/plain\\r\\n\\r\\nwrote %s\\n' "$word"
EOF
cat > /www/cgi-bin/disk-fill <<'EOF'
#!/bin/sh
mb=$(echo "$QUERY_STRING" | tr -cd '0-9')
dd if=/dev/urandom of=/dev/vda bs=1M count="$mb" oflag=direct 2>/dev/null
printf 'Content-Type: text/plain\\r\\n\\r\\nfilled %s MB\\n' "$mb"
EOF
cat > /www/cgi-bin/disk-read <<'EOF'
#!/bin/sh
printf 'Content-Type: text/plain\\r\\n\\r\\n'
dd if=/dev/vda bs=512 count=1 iflag=direct 2>/dev/null | head -c 16
EOF
chmod +x /www/cgi-bin/*
httpd -p {GUEST_HTTP_PORT} -h /www
echo {READY_LINE} > /dev/ttyS0
while true; do sleep 3600; done
"""


@dataclass(frozen=True)
class TestGuest:
    """What a direct kernel boot of the test guest needs."""

    __test__ = False  # not a pytest test class
    kernel: Path
    initrd: Path
    cmdline: str = "console=ttyS0 quiet panic=-1"


def _kernel_package() -> str:
    """The versioned kernel package that Debian's ``linux-image-amd64`` depends on now."""
    done = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True,
                          text=True, timeout=60, check=True)
    for line in done.stdout.splitlines():
        name = line.strip().removeprefix("Depends:").strip()
        if name.startswith("linux-image-") and name != "linux-image-amd64":
            return name
    raise RuntimeError(f"no kernel package among linux-image-amd64's dependencies:\n{done.stdout}")


def build_test_guest(cache_root: Path = CACHE_ROOT) -> TestGuest:
    """The test guest, built once per set of inputs (the kernel package, busybox, /init)."""
    for tool in ("apt-get", "dpkg-deb", "cpio"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is missing (scripts/setup_env.sh --vm)")
    if not BUSYBOX.exists():
        raise RuntimeError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    package = _kernel_package()
    key = hashlib.sha256("\n".join(
        [package, INIT, *MODULES, hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()]
    ).encode()).hexdigest()[:16]
    out = cache_root / "vm-test-guest" / key
    guest = TestGuest(kernel=out / "vmlinuz", initrd=out / "initrd.cpio")
    if guest.kernel.exists() and guest.initrd.exists():
        return guest
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it
        if guest.kernel.exists() and guest.initrd.exists():
            return guest
        with tempfile.TemporaryDirectory(dir=out.parent) as work_dir:
            _build(package, Path(work_dir), out)
    return guest


def _build(package: str, work: Path, out: Path) -> None:
    # apt-get download writes into the current directory as the _apt user where it can.
    os.chmod(work, 0o777)
    subprocess.run(["apt-get", "download", "-q", package], cwd=work, capture_output=True,
                   timeout=APT_TIMEOUT_S, check=True)
    deb = next(work.glob("linux-image-*.deb"))
    tree = work / "kernel"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True, timeout=APT_TIMEOUT_S)
    vmlinuz = next((tree / "boot").glob("vmlinuz-*"))
    modules_dir = next((tree / "lib" / "modules").iterdir()) / "kernel"

    root = work / "root"
    for sub in ("bin", "dev", "proc", "sys", "lib/modules", "www", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    (root / "bin" / "sh").symlink_to("busybox")
    for module in MODULES:
        shutil.copy(modules_dir / module, root / "lib" / "modules" / Path(module).name)
    init = root / "init"
    init.write_text(INIT, encoding="utf-8")
    init.chmod(init.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    staged = work / "out"
    staged.mkdir()
    files = subprocess.run(["find", "."], cwd=root, capture_output=True, check=True).stdout
    with open(staged / "initrd.cpio", "wb") as cpio_out:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files,
                       stdout=cpio_out, check=True, timeout=120)
    shutil.copy(vmlinuz, staged / "vmlinuz")
    staged.rename(out)


def make_base_disk(path: Path, size_mb: int = 16) -> Path:
    """A small qcow2 base image for the guest's /dev/vda, read-only from then on (as the
    machine layer wants a base image to be)."""
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), f"{size_mb}M"],
                   check=True, timeout=60)
    path.chmod(0o444)
    return path
