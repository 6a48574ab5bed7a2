"""deploy/vm-image/, checked without building: the VM test image starts the desktop server as
the container image does (the same command, user, environment; only the token differs: none
in the guest, the host checks it), and every package it adds to the desktop's list says why."""

from __future__ import annotations

import re
import shlex

from tests.support import REPO_ROOT

CONTAINERFILE = REPO_ROOT / "deploy" / "desktop-image" / "Containerfile"
UNIT = REPO_ROOT / "deploy" / "vm-image" / "cua-desktop.service"
APT_VM = REPO_ROOT / "deploy" / "vm-image" / "apt-vm.txt"
APT_BASE = REPO_ROOT / "deploy" / "desktop-image" / "apt-base.txt"


def _containerfile() -> dict[str, object]:
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    found: dict[str, object] = {"env": env}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
        elif word == "USER":
            found["user"] = rest.strip()
        elif word == "ENTRYPOINT":
            found["argv"] = [a.strip().strip('"') for a in rest.strip()[1:-1].split(",")]
        elif word == "EXPOSE":
            found["port"] = rest.strip()
    return found


def _unit() -> dict[str, object]:
    env: dict[str, str] = {}
    found: dict[str, object] = {"env": env}
    for line in UNIT.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            env.update(item.split("=", 1) for item in shlex.split(value))
        elif key == "User":
            found["user"] = value
        elif key == "ExecStart":
            found["argv"] = value.split()
    return found


def test_the_unit_starts_the_server_as_the_container_image_does():
    image, unit = _containerfile(), _unit()
    assert "SCREEN_WIDTH" in image["env"] and "argv" in image  # the Containerfile was read
    assert unit["argv"] == image["argv"]
    assert unit["user"] == image["user"]
    assert unit["env"]["CUA_DESKTOP_PORT"] == image["port"]
    # Every setting of the image's, with the image's value; the guest adds only the no-token one.
    assert {k: unit["env"].get(k) for k in image["env"]} == image["env"]
    assert set(unit["env"]) - set(image["env"]) <= {"HOME", "CUA_DESKTOP_INSECURE_NO_TOKEN"}
    assert unit["env"]["CUA_DESKTOP_INSECURE_NO_TOKEN"] == "1"


def test_each_added_package_has_a_reason_and_is_not_already_the_desktops():
    base = {line.strip() for line in APT_BASE.read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    for line in APT_VM.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-z0-9.+-]+)\s+#\s*(\S.{10,})", line.strip())
        assert match, f"apt-vm.txt: {line!r} needs a package and a reason after '#'"
        assert match.group(1) not in base, f"{match.group(1)} is already in apt-base.txt"
