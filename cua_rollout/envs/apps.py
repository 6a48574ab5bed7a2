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

OSWorld's task files write ``related_apps`` freely: 23 spellings in its 369 tasks, among them
``vscode`` (28 tasks) beside ``vs_code`` (6), ``libreoffice calc`` (18), ``calc``, ``writer``,
``Chrome``, ``OS``, ``browser``, ``terminal``, ``pdf`` and ``image``. ``app_name`` reads each
spelling as the app it means (case and spaces aside, ``APP_ALIASES``), so a task is never
called unrunnable for how its file spells an app the desktop has. ``pdf``, ``image`` and
``ubuntu_media_player`` are the viewers of OSWorld's Ubuntu (Document Viewer, Image Viewer,
Videos) or any app that shows such files (``APP_COMMANDS``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from cua_rollout.config import DesktopsConfig

__all__ = ["APP_ALIASES", "APP_COMMANDS", "PACKAGE_APPS", "DesktopApps", "app_name",
           "apps_of_packages", "desktop_apps", "main"]

# Other spellings of an app in OSWorld's task files -> the app (after ``app_name`` folds case
# and turns spaces into underscores).
APP_ALIASES: dict[str, str] = {
    "vscode": "vs_code", "code": "vs_code", "calc": "libreoffice_calc",
    "writer": "libreoffice_writer", "impress": "libreoffice_impress", "browser": "chrome",
    "google_chrome": "chrome", "gnome-terminal": "terminal", "gnome_terminal": "terminal",
}

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
    "libreoffice": ("soffice", "libreoffice"),
    "terminal": ("gnome-terminal",),
    # Viewers: what OSWorld's Ubuntu opens such files with, or another app that shows them.
    "pdf": ("evince", "atril", "okular", "google-chrome", "chromium"),
    "image": ("eog", "ristretto", "gimp"),
    "ubuntu_media_player": ("totem", "vlc"),
}
# The desktop itself: always there.
_ALWAYS = frozenset({"os"})

# A Debian package of a desktop image -> the apps it provides.
PACKAGE_APPS: dict[str, tuple[str, ...]] = {
    "chromium": ("chrome", "pdf"), "google-chrome-stable": ("chrome", "pdf"),
    "gimp": ("gimp", "image"),
    "libreoffice-calc": ("libreoffice_calc", "libreoffice"),
    "libreoffice-writer": ("libreoffice_writer", "libreoffice"),
    "libreoffice-impress": ("libreoffice_impress", "libreoffice"),
    "thunderbird": ("thunderbird",), "vlc": ("vlc", "ubuntu_media_player"),
    "code": ("vs_code",), "xterm": ("xterm",), "mousepad": ("mousepad",),
    "galculator": ("galculator",), "gnome-terminal": ("terminal",), "evince": ("pdf",),
    "eog": ("image",), "totem": ("ubuntu_media_player",), "picard": ("picard",),
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
        """The apps of ``wanted`` (as a task spells them) these desktops do not have, in
        order, each once, by their own names (``app_name``)."""
        names = list(dict.fromkeys(app_name(app) for app in wanted))
        if self.here:
            return [app for app in names if app not in _ALWAYS and not _installed_here(app)]
        if self.apps is None:
            return []
        have = {app_name(app) for app in self.apps} | _ALWAYS
        return [app for app in names if app not in have]


def app_name(spelling: str) -> str:
    """The app a task's ``related_apps`` entry means: case folded, spaces as underscores,
    then ``APP_ALIASES`` (``"libreoffice calc"`` and ``"calc"`` are ``libreoffice_calc``)."""
    name = "_".join(spelling.strip().lower().split())
    return APP_ALIASES.get(name, name)


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
    return sorted({app for p in packages for app in PACKAGE_APPS.get(p, ())})


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
