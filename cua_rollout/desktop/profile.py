"""The desktop profile's per-user settings: what a fresh HOME holds before any task runs, so
the apps start as they do on OSWorld's VM image (no first-run dialogs in the way, the same
default applications), for the apps installed on this desktop.

``provision(home)`` writes each file only where the home (a template's copy, say) has none.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["provision"]

_APPLICATIONS = Path("/usr/share/applications")

# Plain text opens in a text editor, as on OSWorld's Ubuntu VMs (gedit), whatever else is
# installed: with LibreOffice present, xdg-open would otherwise pick Writer for a .txt file.
# Videos open in Totem (Videos), Ubuntu's default video player: OSWorld's `open` of a video
# starts it there, and a task asks the agent to make VLC the default (xdg-mime's answer).
_VIDEO_TYPES = ("video/mp4", "video/x-matroska", "video/webm", "video/mpeg", "video/quicktime",
                "video/x-msvideo", "video/ogg")
_DEFAULT_APPS = {"text/plain": "org.xfce.mousepad.desktop",
                 **dict.fromkeys(_VIDEO_TYPES, "org.gnome.Totem.desktop")}

# VLC: no privacy question on first start (OSWorld's image has answered it). Everything
# else keeps VLC's defaults, which the vlc_config metrics compare against.
_VLCRC = """\
[qt] # Qt interface
qt-privacy-ask=0
"""

# VLC opened from a file (xdg-open, the file manager) starts through desktop/apps/vlc, which
# can run it as root; the system's entry names /usr/bin/vlc. Same id: this one wins.
_VLC_ENTRY = """\
[Desktop Entry]
Version=1.0
Name=VLC media player
Exec=vlc --started-from-file %U
TryExec=/usr/bin/vlc
Icon=vlc
Terminal=false
Type=Application
Categories=AudioVideo;Player;Recorder;
MimeType=video/mp4;video/x-matroska;video/webm;video/mpeg;video/quicktime;video/x-msvideo;\
audio/mpeg;audio/x-wav;audio/ogg;audio/flac;
StartupWMClass=vlc
"""

# LibreOffice: no tip-of-the-day dialog and no "what's new" bar on first start, as on the
# image, where it has been started before. Saving in a Microsoft format still asks "Keep
# current format?", as there.
_LIBREOFFICE_XCU = """\
<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry" \
xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="ShowTipOfTheDay" \
oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="FirstRun" \
oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Setup/Product"><prop oor:name="ooSetupLastVersion" \
oor:op="fuse"><value>{version}</value></prop></item>
<item oor:path="/org.openoffice.Setup/Office"><prop oor:name="ooSetupInstCompleted" \
oor:op="fuse"><value>true</value></prop></item>
</oor:items>
"""


# Chrome: a profile that has been started, as on the image (OSWorld's chrome tasks edit
# ~/.config/google-chrome/Default/Preferences with jq before launching the browser; on a
# profile never started there is no file, the edit fails, and the untouched desktop passes
# the task's check). The browser fills in the rest of it at its first start.
_CHROME_PREFERENCES = """\
{"browser": {"has_seen_welcome_page": true}, "profile": {"exit_type": "Normal", \
"exited_cleanly": true}}
"""
# GNOME settings where OSWorld's image differs from the schemas' defaults and a task's check
# reads them: its screen never locks (an os task asks the agent to turn locking on, and
# checks `gsettings get org.gnome.desktop.screensaver lock-enabled`). Written as dconf's user
# database, made once by gsettings itself (``_dconf_user_db``) and copied into each HOME.
GSETTINGS: tuple[tuple[str, str, str], ...] = (
    ("org.gnome.desktop.screensaver", "lock-enabled", "false"),
)
_DCONF_TIMEOUT_S = 30.0
_dconf_db: dict[str, bytes | None] = {}

_BROWSERS = ("/usr/bin/google-chrome-stable", "/opt/google/chrome/google-chrome",
             "/usr/bin/chromium", "/usr/bin/chromium-browser")


def _write(path: Path, text: str) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _libreoffice_version() -> str | None:
    """Major.minor of the installed LibreOffice (``ooSetupVersion`` in its main registry),
    None without one."""
    for xcd in (Path("/usr/lib/libreoffice/share/registry/main.xcd"),
                Path("/opt/libreoffice/share/registry/main.xcd")):
        try:
            text = xcd.read_text(errors="replace")
        except OSError:
            continue
        found = re.search(r'oor:name="ooSetupVersion"[^>]*>\s*<value>([0-9.]+)</value>', text)
        if found:
            return found.group(1)
    return None


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cua-rollout" / "desktop-profile"


def _dconf_user_db() -> bytes | None:
    """dconf's user database holding ``GSETTINGS`` (None where gsettings, dconf or a
    schema is missing): made once per machine by ``gsettings set`` on a bus of its own,
    cached by the settings and the machine's schemas."""
    schemas = Path("/usr/share/glib-2.0/schemas/gschemas.compiled")
    try:
        stamp = str(schemas.stat().st_mtime_ns)
    except OSError:
        return None
    key = hashlib.sha256(repr((GSETTINGS, stamp)).encode()).hexdigest()[:16]
    if key in _dconf_db:
        return _dconf_db[key]
    cached = _cache_root() / f"dconf-{key}"
    db: bytes | None = None
    try:
        db = cached.read_bytes()
    except OSError:
        db = _make_dconf_db()
        if db is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
            tmp.write_bytes(db)
            os.replace(tmp, cached)
    _dconf_db[key] = db
    return db


def _make_dconf_db() -> bytes | None:
    if not (shutil.which("dbus-run-session") and shutil.which("gsettings")):
        return None
    with tempfile.TemporaryDirectory(prefix="cua-dconf-") as tmp:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp,
               "XDG_CONFIG_HOME": f"{tmp}/.config", "XDG_RUNTIME_DIR": tmp,
               "GSETTINGS_BACKEND": "dconf"}
        script = " && ".join(f"gsettings set {schema} {key} {value}"
                             for schema, key, value in GSETTINGS)
        try:
            done = subprocess.run(["dbus-run-session", "--", "sh", "-c", script], env=env,
                                  capture_output=True, timeout=_DCONF_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        db = Path(tmp, ".config", "dconf", "user")
        if done.returncode != 0 or not db.is_file():
            return None
        return db.read_bytes()


def provision(home: Path) -> None:
    """Write the profile's settings for the installed apps into ``home``."""
    home = Path(home)
    chosen = {m: app for m, app in _DEFAULT_APPS.items() if (_APPLICATIONS / app).exists()}
    if chosen:
        _write(home / ".config" / "mimeapps.list", "[Default Applications]\n"
               + "".join(f"{m}={app}\n" for m, app in chosen.items()))
    dconf = home / ".config" / "dconf" / "user"
    if not dconf.exists() and (db := _dconf_user_db()) is not None:
        dconf.parent.mkdir(parents=True, exist_ok=True)
        dconf.write_bytes(db)
    if shutil.which("vlc", path="/usr/bin"):
        _write(home / ".config" / "vlc" / "vlcrc", _VLCRC)
        _write(home / ".local" / "share" / "applications" / "vlc.desktop", _VLC_ENTRY)
    if any(Path(b).exists() for b in _BROWSERS):
        chrome = home / ".config" / "google-chrome"
        _write(chrome / "Default" / "Preferences", _CHROME_PREFERENCES)
        _write(chrome / "First Run", "")
    version = _libreoffice_version()
    if version:
        _write(home / ".config" / "libreoffice" / "4" / "user" / "registrymodifications.xcu",
               _LIBREOFFICE_XCU.format(version=version))
