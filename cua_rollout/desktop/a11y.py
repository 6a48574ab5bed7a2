"""The AT-SPI accessibility tree of the desktop as XML, in the layout of OSWorld's Linux tree.

Run by the desktop server with the system interpreter (``/usr/bin/python3
cua_rollout/desktop/a11y.py
tree|terminal``), because Debian's python3-pyatspi is importable only there; so this file uses
nothing but the standard library, ``gi`` and ``pyatspi``. ``tree`` prints the XML of every
application; ``terminal`` prints JSON ``{"output": text-or-null}`` with the text of the focused
terminal widget of the active window. Exit status 3 means AT-SPI is not available (the reason
is on stderr); it never prints an empty tree in that case, and it never starts a D-Bus session
bus of its own (which would outlive it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

__all__ = [
    "BUS_CALL_TIMEOUT_MS",
    "EXIT_UNAVAILABLE",
    "MAX_CHILDREN",
    "MAX_DEPTH",
    "NS",
    "Unavailable",
    "connect",
    "find_bus",
    "main",
    "session_bus",
    "terminal_text",
    "tree_xml",
]

EXIT_UNAVAILABLE = 3

# The namespaces of OSWorld's Linux tree (its evaluators and agents look attributes up by
# these URIs).
NS = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "doc": "https://accessibility.ubuntu.example.org/ns/document",
    "docattr": "https://accessibility.ubuntu.example.org/ns/document/attributes",
    "txt": "https://accessibility.ubuntu.example.org/ns/text",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}
MAX_DEPTH = 50  # deeper nodes are cut (as OSWorld does)
MAX_CHILDREN = 1024  # children per node beyond this are cut (as OSWorld does)
# How long one D-Bus call to find or check the accessibility bus may take.
BUS_CALL_TIMEOUT_MS = 5000

_XML_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*$")
_XML_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


class Unavailable(Exception):
    """AT-SPI cannot be reached; the message says why."""


# ---------------------------------------------------------------------- finding the bus


def _bus_from_x_root() -> str | None:
    """The address at-spi-bus-launcher publishes on the root window (``AT_SPI_BUS``)."""
    if not os.environ.get("DISPLAY") or shutil.which("xprop") is None:
        return None
    try:
        out = subprocess.run(
            ["xprop", "-root", "AT_SPI_BUS"],
            capture_output=True,
            text=True,
            timeout=BUS_CALL_TIMEOUT_MS / 1000,
            check=False,
        ).stdout
    except subprocess.TimeoutExpired:
        return None
    m = re.search(r'AT_SPI_BUS\(STRING\) = "(.*)"', out)
    return m.group(1) if m else None


def session_bus() -> str | None:
    """The session bus's address: the named one, else the standard per-user socket; never
    one that D-Bus would have to autolaunch."""
    named = os.environ.get("DBUS_SESSION_BUS_ADDRESS", "")
    if named:
        return None if named.startswith("disabled:") else named
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and stat.S_ISSOCK(_mode(os.path.join(runtime, "bus"))):
        return f"unix:path={os.path.join(runtime, 'bus')}"
    return None


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


def _bus_from_session() -> str | None:
    """Ask the session bus for the a11y bus (which D-Bus activation may start)."""
    session = session_bus()
    if session is None:
        return None
    from gi.repository import Gio, GLib

    flags = (
        Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT
        | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
    )
    try:
        conn = Gio.DBusConnection.new_for_address_sync(session, flags, None, None)
        reply = conn.call_sync(
            "org.a11y.Bus",
            "/org/a11y/bus",
            "org.a11y.Bus",
            "GetAddress",
            None,
            GLib.VariantType.new("(s)"),
            Gio.DBusCallFlags.NONE,
            BUS_CALL_TIMEOUT_MS,
            None,
        )
    except GLib.Error as exc:
        raise Unavailable(
            f"the session bus has no AT-SPI bus (org.a11y.Bus): {exc.message}"
        ) from exc
    address = reply.unpack()[0]
    return address or None


def find_bus() -> str:
    """The AT-SPI bus address, looked up in libatspi's order; ``Unavailable`` if none."""
    address = os.environ.get("AT_SPI_BUS_ADDRESS") or _bus_from_x_root() or _bus_from_session()
    if not address:
        raise Unavailable(
            "no AT-SPI bus: AT_SPI_BUS_ADDRESS is unset, the X root window has no AT_SPI_BUS "
            "property and there is no session bus (DBUS_SESSION_BUS_ADDRESS, "
            "$XDG_RUNTIME_DIR/bus); run the desktop session under dbus-run-session with "
            "/usr/libexec/at-spi-bus-launcher"
        )
    from gi.repository import Gio, GLib

    try:
        conn = Gio.DBusConnection.new_for_address_sync(
            address,
            Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT
            | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION,
            None,
            None,
        )
        conn.close_sync(None)
    except GLib.Error as exc:
        raise Unavailable(f"cannot connect to the AT-SPI bus {address}: {exc.message}") from exc
    return address


def connect() -> Any:
    """Import pyatspi against the found bus and return the desktop object."""
    address = find_bus()
    os.environ["AT_SPI_BUS_ADDRESS"] = address
    # libatspi falls back to the session bus, and with no address it would autolaunch one.
    os.environ["DBUS_SESSION_BUS_ADDRESS"] = session_bus() or "disabled:"
    try:
        import pyatspi
    except ImportError as exc:
        raise Unavailable(f"pyatspi is not importable by {sys.executable}: {exc}") from exc
    try:
        desktop = pyatspi.Registry.getDesktop(0)
        desktop.childCount  # noqa: B018  (a call on the registry: fails when it is absent)
    except Exception as exc:
        raise Unavailable(f"the AT-SPI registry does not answer: {exc}") from exc
    return desktop


# ---------------------------------------------------------------------- the tree


def _children(node: Any) -> Iterator[Any]:
    try:
        count = min(node.childCount, MAX_CHILDREN)
    except Exception:
        return
    for i in range(count):
        try:
            child = node.getChildAtIndex(i)
        except Exception:  # the child went away while we walked
            continue
        if child is not None:
            yield child


def _clean(text: str) -> str:
    # U+FFFC stands for embedded objects and U+FFFD for undecodable text: neither is content.
    return _XML_BAD_CHARS.sub("", text.replace("\ufffc", "").replace("\ufffd", ""))


def _q(prefix: str, name: str) -> str | None:
    name = name.replace(" ", "-")
    return f"{{{NS[prefix]}}}{name}" if _XML_NAME.match(name) else None


def _states(node: Any, pyatspi: Any) -> list[str]:
    names = []
    for state in node.getState().get_states():
        name = pyatspi.StateType._enum_lookup.get(int(state), "")
        name = name.split("_", 1)[1].lower() if "_" in name else ""
        if name:
            names.append(name)
    return names


def _node(node: Any, pyatspi: Any, depth: int) -> ET.Element:
    attrib: dict[str, str] = {"name": _clean(node.name or "")}
    states = _states(node, pyatspi)
    for name in states:
        if key := _q("st", name):
            attrib[key] = "true"
    try:
        attributes = node.get_attributes() or {}
    except Exception:
        attributes = {}
    for name, value in attributes.items():
        if name and (key := _q("attr", name)):
            attrib[key] = _clean(str(value))
    if "visible" in states and "showing" in states:
        try:
            x, y, w, h = node.queryComponent().getExtents(pyatspi.XY_SCREEN)
        except NotImplementedError:
            pass
        else:
            attrib[f"{{{NS['cp']}}}screencoord"] = f"({x}, {y})"
            attrib[f"{{{NS['cp']}}}size"] = f"({w}, {h})"
    text = ""
    try:
        iface = node.queryText()
        text = _clean(iface.getText(0, iface.characterCount))
    except NotImplementedError:
        pass
    for query, flag in (("queryImage", "image"), ("querySelection", "selection")):
        try:
            getattr(node, query)()
            attrib[flag] = "true"
        except NotImplementedError:
            pass
    try:
        value = node.queryValue()
    except NotImplementedError:
        pass
    else:
        for name, getter in (
            ("value", lambda: value.currentValue),
            ("min", lambda: value.minimumValue),
            ("max", lambda: value.maximumValue),
            ("step", lambda: value.minimumIncrement),
        ):
            try:
                attrib[f"{{{NS['val']}}}{name}"] = str(getter())
            except Exception:
                continue
    try:
        action = node.queryAction()
    except NotImplementedError:
        pass
    else:
        for i in range(action.nActions):
            base = action.getName(i).replace(" ", "-")
            if (desc := _q("act", f"{base}_desc")) and (kb := _q("act", f"{base}_kb")):
                attrib[desc] = _clean(action.getDescription(i) or "")
                attrib[kb] = _clean(action.getKeyBinding(i) or "")
    role = (node.getRoleName() or "").strip().replace(" ", "-") or "unknown"
    element = ET.Element(role if _XML_NAME.match(role) else "unknown", attrib)
    if text:
        element.text = text
    if depth < MAX_DEPTH:
        for child in _children(node):
            try:
                element.append(_node(child, pyatspi, depth + 1))
            except Exception:  # an app that dies mid-walk loses its subtree, not the tree
                continue
    return element


# Where a real Chrome would be; without one, Chromium stands in for it (cua_rollout/desktop/apps/
# google-chrome) and is named as Chrome in the tree: OSWorld's chrome getters find the
# address bar under `application[name=Google Chrome]` (on x86 hosts).
_CHROME_BINARIES = ("/usr/bin/google-chrome-stable", "/opt/google/chrome/google-chrome")


def tree_xml(desktop: Any) -> str:
    """The whole desktop as OSWorld's ``desktop-frame`` XML."""
    import pyatspi

    for prefix, uri in NS.items():
        ET.register_namespace(prefix, uri)
    root = ET.Element("desktop-frame")
    stand_in = not any(os.path.exists(path) for path in _CHROME_BINARIES)
    for app in _children(desktop):
        try:
            element = _node(app, pyatspi, 1)
        except Exception:
            continue
        if stand_in and element.get("name") == "Chromium":
            element.set("name", "Google Chrome")
        root.append(element)
    return ET.tostring(root, encoding="unicode")


def terminal_text(desktop: Any) -> str | None:
    """Text of the focused terminal widget in the active window (any VTE-based terminal:
    gnome-terminal, xfce4-terminal ...); None unless exactly one is found."""
    import pyatspi

    found: list[str] = []

    def walk(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        for child in _children(node):
            try:
                if child.getRole() == pyatspi.ROLE_TERMINAL and child.getState().contains(
                    pyatspi.STATE_FOCUSED
                ):
                    iface = child.queryText()
                    found.append(_clean(iface.getText(0, iface.characterCount)).rstrip())
                    continue
            except Exception:
                continue
            walk(child, depth + 1)

    for app in _children(desktop):
        for frame in _children(app):
            try:
                active = frame.getState().contains(pyatspi.STATE_ACTIVE)
            except Exception:
                continue
            if active:
                walk(frame, 2)
    return found[0] if len(found) == 1 else None


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else "tree"
    if mode not in ("tree", "terminal"):
        print(f"usage: {argv[0]} [tree|terminal]", file=sys.stderr)
        return 2
    try:
        desktop = connect()
    except Unavailable as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNAVAILABLE
    if mode == "tree":
        sys.stdout.write(tree_xml(desktop))
    else:
        sys.stdout.write(json.dumps({"output": terminal_text(desktop)}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
