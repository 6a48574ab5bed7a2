"""A tiny QEMU guest for the VM machine layer's tests and benchmark: a Debian kernel and a
busybox initramfs whose ``/init`` serves HTTP on port 5000 and prints ``READY`` on the serial
port. Built at first use from Debian's archive (``apt-get download``, ``dpkg-deb -x``) and
cached under ``~/.cache/cua-rollout/vm-test-guest/<hash of the inputs>``.

It lives among the doubles because the benchmark (``benchmarks/bench_vm.py``) boots it too, and
benchmarks import nothing of ``tests/`` but ``tests.doubles``.

The guest's HTTP server (busybox nc running a shell handler per connection, HTTP/1.1 with
Content-Length, one request per connection, state in RAM) speaks the part of OSWorld's desktop
protocol the pool needs, and a few test endpoints:

    POST /screen_size       ``{"width": 64, "height": 36}``
    GET /screenshot         a 64x36 PNG: dark, or light once marked (see /cgi-bin/mark)
    GET /requests           the line and headers of every request received (``Authorization``
                            among them if a client sent one: the token gate's tests read it)
    /hello                  ``hello from the test guest``
    /cgi-bin/mark           writes ``dirty`` into /www/mark (guest RAM), then /mark is served
                            and the screen changes
    /cgi-bin/disk-write?X   writes ``X`` (word characters only) at the start of /dev/vda, synced
    /cgi-bin/disk-fill?N    writes N MiB of random bytes over /dev/vda (fills an overlay)
    /cgi-bin/disk-read      the first 16 bytes of /dev/vda, read with O_DIRECT (not the page
                            cache, so it shows what the disk holds)
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GUEST_HTTP_PORT", "READY_LINE", "SCREEN_HEIGHT", "SCREEN_WIDTH", "TestGuest",
           "build_test_guest", "make_base_disk"]

CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cua-rollout"
GUEST_HTTP_PORT = 5000
READY_LINE = "READY"
# What the guest's screenshots measure (its /screen_size): small, so PNGs stay tiny.
SCREEN_WIDTH = 64
SCREEN_HEIGHT = 36
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
# (10.0.2.15): the same result as udhcpc, without its round trips under TCG. The server is
# busybox nc accepting connections in a loop (-ll) and running HANDLER on each: busybox httpd
# runs scripts only under /cgi-bin/ and refuses POST to anything else, and OSWorld's protocol
# wants POST /screen_size. READY is printed once the port listens.
INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /run
for m in {' '.join(Path(m).name for m in MODULES)}; do insmod /lib/modules/$m; done
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
(while true; do nc -ll -p {GUEST_HTTP_PORT} -e /bin/http-handler; done) &
until netstat -ltn | grep -q ':{GUEST_HTTP_PORT} '; do usleep 50000; done
echo {READY_LINE} > /dev/ttyS0
while true; do sleep 3600; done
"""

# One HTTP/1.1 request per connection (nc gives the client's socket as stdin and stdout);
# every answer has a Content-Length and closes the connection. Each request's line and
# headers go to /run/requests.log first (RAM), which GET /requests serves back.
HANDLER = r"""#!/bin/sh
cr=$(printf '\r')
read -r method target version
log=/run/requests.log
echo "$method $target" >> $log
length=0
while read -r line; do
    line=${line%"$cr"}
    [ -z "$line" ] && break
    echo "$line" >> $log
    case "$line" in
        [Cc][Oo][Nn][Tt][Ee][Nn][Tt]-[Ll][Ee][Nn][Gg][Tt][Hh]:*)
            length=$(echo "${line#*:}" | tr -cd 0-9) ;;
    esac
done
echo >> $log
if [ "${length:-0}" -gt 0 ]; then head -c "$length" > /dev/null; fi
path=${target%%\?*}
query=
case "$target" in *\?*) query=${target#*\?} ;; esac
body=/tmp/body.$$
reply() {  # status, content type, file
    printf 'HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %s\r\nConnection: close\r\n\r\n' \
        "$1" "$2" "$(wc -c < "$3")"
    cat "$3"
}
text() {  # status, the body's printf format and arguments
    status=$1
    shift
    printf "$@" > $body
    reply "$status" text/plain $body
}
screen=/www/screen.png
[ -f /www/mark ] && screen=/www/screen-marked.png
case "$method $path" in
    "GET /hello") reply "200 OK" text/plain /www/hello ;;
    "POST /screen_size"|"GET /screen_size") reply "200 OK" application/json /www/screen_size.json ;;
    "GET /screenshot") reply "200 OK" image/png $screen ;;
    "GET /requests") cp $log $body; reply "200 OK" text/plain $body ;;
    "GET /mark")
        if [ -f /www/mark ]; then reply "200 OK" text/plain /www/mark
        else text "404 Not Found" 'no mark\n'; fi ;;
    "GET /cgi-bin/mark") echo dirty > /www/mark; text "200 OK" 'marked\n' ;;
    "GET /cgi-bin/disk-write")
        word=$(echo "$query" | tr -cd 'A-Za-z0-9_')
        printf '%-16s' "$word" | dd of=/dev/vda bs=16 count=1 conv=notrunc,fsync 2>/dev/null
        text "200 OK" 'wrote %s\n' "$word" ;;
    "GET /cgi-bin/disk-fill")
        mb=$(echo "$query" | tr -cd '0-9')
        dd if=/dev/urandom of=/dev/vda bs=1M count="$mb" oflag=direct 2>/dev/null
        text "200 OK" 'filled %s MB\n' "$mb" ;;
    "GET /cgi-bin/disk-read")
        dd if=/dev/vda bs=512 count=1 iflag=direct 2>/dev/null | head -c 16 > $body
        reply "200 OK" text/plain $body ;;
    *) text "404 Not Found" 'no %s %s\n' "$method" "$path" ;;
esac
rm -f $body
"""


def _screens() -> dict[str, bytes]:
    """The two screens the guest shows, as PNG files (drawn here, on the host): a dark one,
    and after a mark a light one (every thumbnail cell differs, so a test, or the check of a
    restored screen, tells them apart)."""
    from PIL import Image, ImageDraw

    out = {}
    for name, background, box in (("screen.png", (20, 30, 60), (230, 230, 230)),
                                  ("screen-marked.png", (240, 200, 40), (20, 20, 20))):
        image = Image.new("RGB", (SCREEN_WIDTH, SCREEN_HEIGHT), background)
        ImageDraw.Draw(image).rectangle((8, 6, 40, 24), fill=box)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out[name] = buffer.getvalue()
    return out


def _www() -> dict[str, bytes]:
    """The files the server serves, by name under /www."""
    return {"hello": b"hello from the test guest\n",
            "screen_size.json": json.dumps({"width": SCREEN_WIDTH,
                                            "height": SCREEN_HEIGHT}).encode(),
            **_screens()}


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
    """The test guest, built once per set of inputs (the kernel package, busybox, /init, the
    handler and the files it serves)."""
    for tool in ("apt-get", "dpkg-deb", "cpio"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is missing (scripts/setup_env.sh --vm)")
    if not BUSYBOX.exists():
        raise RuntimeError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    package = _kernel_package()
    www = _www()
    key = hashlib.sha256("\n".join(
        [package, INIT, HANDLER, *MODULES, hashlib.sha256(BUSYBOX.read_bytes()).hexdigest(),
         *(f"{name}:{hashlib.sha256(data).hexdigest()}" for name, data in sorted(www.items()))]
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
            _build(package, Path(work_dir), out, www)
    return guest


def _build(package: str, work: Path, out: Path, www: dict[str, bytes]) -> None:
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
    for name, data in www.items():
        (root / "www" / name).write_bytes(data)
    for script, text in ((root / "init", INIT), (root / "bin" / "http-handler", HANDLER)):
        script.write_text(text, encoding="utf-8")
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

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
