"""The desktop profile's per-user settings: what a fresh HOME holds before any task runs, so
the apps start as they do on OSWorld's VM image (no first-run dialogs in the way, the same
default applications), for the apps installed on this desktop.

``provision(home)`` writes each file only where the home (a template's copy, say) has none.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = ["provision"]

_APPLICATIONS = Path("/usr/share/applications")

# Plain text opens in a text editor, as on OSWorld's Ubuntu VMs (gedit), whatever else is
# installed: with LibreOffice present, xdg-open would otherwise pick Writer for a .txt file.
_DEFAULT_APPS = {"text/plain": "org.xfce.mousepad.desktop"}

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


def provision(home: Path) -> None:
    """Write the profile's settings for the installed apps into ``home``."""
    home = Path(home)
    chosen = {m: app for m, app in _DEFAULT_APPS.items() if (_APPLICATIONS / app).exists()}
    if chosen:
        _write(home / ".config" / "mimeapps.list", "[Default Applications]\n"
               + "".join(f"{m}={app}\n" for m, app in chosen.items()))
    if shutil.which("vlc", path="/usr/bin"):
        _write(home / ".config" / "vlc" / "vlcrc", _VLCRC)
        _write(home / ".local" / "share" / "applications" / "vlc.desktop", _VLC_ENTRY)
    version = _libreoffice_version()
    if version:
        _write(home / ".config" / "libreoffice" / "4" / "user" / "registrymodifications.xcu",
               _LIBREOFFICE_XCU.format(version=version))
