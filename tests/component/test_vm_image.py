"""The VM test image (``scripts/build_vm_image.sh``, issue 32): built once (or found in the image
cache by its inputs hash), found again in about a second, a read-only qcow2 base. That it boots
under OVMF and serves is the VM desktops' test (tests/integration/test_vm_image_desktops.py: the
pool's first start boots it for its ready state); ``build_vm_image.sh --check`` boots it alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, unavailable

BUILD = REPO_ROOT / "scripts" / "build_vm_image.sh"
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
BUILD_TIMEOUT_S = 3600  # a cold build: debootstrap from deb.debian.org, wheels, the disk
BOOT_TIMEOUT_S = 900  # TCG: the guest's X, Python and server start many times slower than native

# The first test also pays for the module's build (a cold one when the cache is empty).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + BOOT_TIMEOUT_S)]
CACHED_BUILD_MAX_S = 10.0


def _build(*args: str, timeout_s: float = BUILD_TIMEOUT_S, tmpdir: Path | None = None
           ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)  # the wheels are built for the guest's Python 3.11
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run(["bash", str(BUILD), *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s, env=env, check=False)


@pytest.fixture(scope="module")
def image() -> Path:
    for tool, package in (("qemu-system-x86_64", "qemu-system-x86"), ("qemu-img", "qemu-utils"),
                          ("curl", "curl")):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed ({package})")
    if not OVMF_CODE.is_file():
        unavailable("OVMF is not installed (ovmf)")
    path = Path(_build("--print-path").stdout.strip())
    if not path.is_file() and os.geteuid() != 0:
        unavailable("the VM image is not built and building it needs root "
                    "(sudo bash scripts/build_vm_image.sh)")
    done = _build()
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip().splitlines()[-1]) == path
    return path


def test_the_image_is_a_read_only_qcow2_found_again_by_its_inputs(image):
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(image)],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["format"] == "qcow2"
    assert "backing-filename" not in info  # a base, not an overlay
    assert image.stat().st_mode & 0o222 == 0  # the base of every VM: nothing writes it
    t0 = time.monotonic()
    again = _build(timeout_s=60)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] == str(image)
    assert time.monotonic() - t0 < CACHED_BUILD_MAX_S

