"""Which apps a run's desktops have, for the apps a task names (its ``related_apps``): a task
that needs an app the desktops lack cannot be done there, whatever the agent does, so the
pre-flight check (``cua_rollout.evaluation.preflight``) counts it unrunnable and the loader
skips it with that reason.

Where the list comes from, per provider (``desktop_apps``):

- ``desktops.apps`` when set (any provider: the desktops at those URLs, that VM image);
- ``local``: the apps whose command is installed on this machine (the desktops run here);
- ``container``: the image's ``cua.apps`` label (``scripts/build_desktop_image.sh`` writes it
  from the image's Debian packages, ``python -m cua_rollout.envs.apps PACKAGE_LIST...``);
- otherwise unknown: every app is taken as there (OSWorld's own VM has all of its apps).

App names are OSWorld's (``chrome``, ``libreoffice_calc``, ``vs_code`` ...) and the demo
tasks' own (``mousepad``, ``galculator``, ``xterm``); ``os`` is the desktop itself. Chromium
stands in for OSWorld's Chrome (docs/osworld.md lists what a task can tell apart).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from cua_rollout.config import DesktopsConfig

__all__ = ["APP_COMMANDS", "PACKAGE_APPS", "DesktopApps", "apps_of_packages", "desktop_apps",
           "main"]

# An app -> the commands any of which provides it on a desktop. A name not listed is looked
# up as a command of its own name.
APP_COMMANDS: dict[str, tuple[str, ...]] = {
    "chrome": ("google-chrome", "chromium", "chromium-browser"),
    "gimp": ("gimp",),
    "libreoffice_calc": ("localc",),
    "libreoffice_writer": ("lowriter",),
    "libreoffice_impress": ("loimpress",),
    "thunderbird": ("thunderbird",),
    "vlc": ("vlc",),
    "vs_code": ("code",),
}
# The desktop itself: always there.
_ALWAYS = frozenset({"os"})

# A Debian package of a desktop image -> the app it provides.
PACKAGE_APPS: dict[str, str] = {
    "chromium": "chrome", "google-chrome-stable": "chrome", "gimp": "gimp",
    "libreoffice-calc": "libreoffice_calc", "libreoffice-writer": "libreoffice_writer",
    "libreoffice-impress": "libreoffice_impress", "thunderbird": "thunderbird", "vlc": "vlc",
    "code": "vs_code", "xterm": "xterm", "mousepad": "mousepad", "galculator": "galculator",
    "gnome-terminal": "gnome-terminal",
}

# The container engine's answer about an image's label, at most this long.
_INSPECT_TIMEOUT_S = 20.0


class DesktopApps(NamedTuple):
    """The apps of a run's desktops (None: unknown, every app is taken as there; ``here``:
    the commands installed on this machine, looked up per app) and where that was learnt,
    for the reason a task is skipped."""

    apps: frozenset[str] | None
    source: str
    here: bool = False

    def lacks(self, wanted: Iterable[str]) -> list[str]:
        """The apps of ``wanted`` these desktops do not have, in order."""
        if self.here:
            return [app for app in wanted if app not in _ALWAYS and not _installed_here(app)]
        if self.apps is None:
            return []
        have = self.apps | _ALWAYS
        return [app for app in wanted if app not in have]


def _installed_here(app: str) -> bool:
    return any(shutil.which(c) for c in APP_COMMANDS.get(app, (app,)))


def _image_label(engine: str, image: str) -> str | None:
    """The image's ``cua.apps`` label (None: no label, no engine, no such image)."""
    if engine == "auto":
        engine = "podman" if shutil.which("podman") else "docker"
    if shutil.which(engine) is None:
        return None
    try:
        out = subprocess.run(
            [engine, "image", "inspect", "--format", '{{index .Config.Labels "cua.apps"}}',
             image], capture_output=True, text=True, timeout=_INSPECT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    label = out.stdout.strip()
    return label if out.returncode == 0 and label and label != "<no value>" else None


def desktop_apps(cfg: DesktopsConfig) -> DesktopApps:
    """The apps of the desktops ``cfg`` describes (see the module's docstring)."""
    if cfg.apps is not None:
        return DesktopApps(frozenset(cfg.apps), "desktops.apps")
    if cfg.provider == "local":
        return DesktopApps(None, "the commands installed on this machine (local desktops)",
                           here=True)
    if cfg.provider == "container":
        label = _image_label(cfg.container.engine, cfg.container.image)
        if label is not None:
            return DesktopApps(frozenset(filter(None, label.split(","))),
                               f"the label cua.apps of {cfg.container.image}")
        return DesktopApps(None, f"{cfg.container.image} declares no apps (label cua.apps)")
    return DesktopApps(None, f"{cfg.provider} desktops declare no apps (desktops.apps)")


def apps_of_packages(lines: Iterable[str]) -> list[str]:
    """The apps the Debian packages of a package list provide (comments and blank lines
    skipped), sorted."""
    packages = {line.split("#", 1)[0].strip() for line in lines}
    return sorted({PACKAGE_APPS[p] for p in packages if p in PACKAGE_APPS})


def main(argv: list[str] | None = None) -> int:
    """``python -m cua_rollout.envs.apps LIST...``: the apps of package lists, comma-separated
    (the desktop image's ``cua.apps`` label)."""
    files = list(sys.argv[1:] if argv is None else argv)
    if not files:
        print("usage: python -m cua_rollout.envs.apps PACKAGE_LIST...", file=sys.stderr)
        return 2
    lines = [line for f in files for line in Path(f).read_text(encoding="utf-8").splitlines()]
    print(",".join(apps_of_packages(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
