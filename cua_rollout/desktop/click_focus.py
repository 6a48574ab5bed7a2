"""Click-to-focus without a grab: a press on a window that is not the active one activates it.

Openbox implements click-to-focus with a binding in the ``Client`` context, for which it grabs
every button on every client window *synchronously*: each press is frozen until openbox has
run the binding's actions and replays it (``XAllowEvents(ReplayPointer, event_time())``).
Under load that hand-off lost presses: replaying the demo's reference solutions at 16
concurrent desktops, about 1 ``left_double`` in 17 reached mousepad as a single click, and a
probe of 250 double-clicks on 2 busy cores lost 2 with the binding and none without it.

So the desktops' openbox configuration (``openbox-rc.xml``) binds nothing in the client area,
and this watcher gives back click-to-focus from outside the event path. It observes the
pointer's button presses with the X RECORD extension, which copies device events to a second
connection without grabbing or delaying anything, and when a press lands on a managed window
that is not ``_NET_ACTIVE_WINDOW`` it asks the window manager to activate (focus and raise) it,
as a pager does (EWMH ``_NET_ACTIVE_WINDOW`` client message, source 2). The press itself has
already gone to the application, unchanged, exactly as it was sent.

It runs as a daemon thread of the desktop server, for the server's lifetime; without RECORD
or without an EWMH window manager it logs why and does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from Xlib import X, display
from Xlib.error import XError
from Xlib.ext import record
from Xlib.protocol import event, rq

__all__ = ["ClickFocus"]

log = logging.getLogger(__name__)

# How long an activation may take to show in _NET_ACTIVE_WINDOW before the watcher moves on.
_ACTIVATE_WAIT_S = 0.5
_POLL_S = 0.005


class ClickFocus:
    """Watches the display's button presses from a daemon thread (``start()``/``stop()``).

    ``stats()`` counts presses seen and activations asked; ``error`` says why it is not
    running, if it is not."""

    def __init__(self, display_name: str) -> None:
        self.display_name = display_name
        self.error: str | None = None
        self.presses = 0
        self.activations = 0
        self._thread: threading.Thread | None = None
        self._record: Any = None
        self._control: Any = None
        self._context: int | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> bool:
        """Open the two connections and start watching; False (with ``error``) when this
        display cannot be watched."""
        try:
            self._control = display.Display(self.display_name)
            if not self._control.has_extension("RECORD"):
                raise RuntimeError("the X server has no RECORD extension")
            root = self._control.screen().root
            supported = root.get_full_property(self._atom("_NET_SUPPORTED"), X.AnyPropertyType)
            if supported is None or self._atom("_NET_ACTIVE_WINDOW") not in supported.value:
                raise RuntimeError("the window manager does not support _NET_ACTIVE_WINDOW")
            self._record = display.Display(self.display_name)
            self._context = self._control.record_create_context(
                0,
                [record.AllClients],
                [{
                    "core_requests": (0, 0),
                    "core_replies": (0, 0),
                    "ext_requests": (0, 0, 0, 0),
                    "ext_replies": (0, 0, 0, 0),
                    "delivered_events": (0, 0),
                    "device_events": (X.ButtonPress, X.ButtonPress),
                    "errors": (0, 0),
                    "client_started": False,
                    "client_died": False,
                }],
            )
            self._control.sync()
        except Exception as exc:  # no RECORD, no EWMH WM, display gone
            self.error = f"click-to-focus is off on {self.display_name}: {exc}"
            log.warning("%s", self.error)
            self._close()
            return False
        self._thread = threading.Thread(target=self._watch, name="click-focus", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop watching and close both connections (idempotent)."""
        self._stopping.set()
        if self._context is not None and self._control is not None:
            # Ends record_enable_context in the thread (unless the display went first).
            with contextlib.suppress(Exception):
                self._control.record_disable_context(self._context)
                self._control.sync()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._close()

    def stats(self) -> dict[str, Any]:
        """The ``click_focus*`` fields of ``GET /actions`` (``protocol.ActionsReply``)."""
        return {
            "click_focus": self._thread is not None and self._thread.is_alive(),
            "click_focus_presses": self.presses,
            "click_focus_activations": self.activations,
            "click_focus_error": self.error,
        }

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        try:
            self._record.record_enable_context(self._context, self._on_data)
        except Exception as exc:
            if not self._stopping.is_set():
                self.error = f"click-to-focus stopped on {self.display_name}: {exc}"
                log.warning("%s", self.error)

    def _on_data(self, reply: Any) -> None:
        if reply.category != record.FromServer or reply.client_swapped:
            return
        data = reply.data
        while len(data):
            ev, data = rq.EventField(None).parse_binary_value(
                data, self._record.display, None, None)
            if ev.type == X.ButtonPress and ev.detail in (1, 2, 3):
                self.presses += 1
                try:
                    self._focus_at(ev.root_x, ev.root_y, ev.time)
                except XError as exc:  # a window vanished under the press
                    log.debug("click-to-focus: %s", exc)

    def _focus_at(self, x: int, y: int, when: int) -> None:
        target = self._client_at(x, y)
        if target is None or target == self._active():
            return
        root = self._control.screen().root
        message = event.ClientMessage(
            window=self._control.create_resource_object("window", target),
            client_type=self._atom("_NET_ACTIVE_WINDOW"),
            data=(32, [2, when, 0, 0, 0]),  # source 2: a pager, which openbox always obeys
        )
        root.send_event(message, event_mask=X.SubstructureRedirectMask
                        | X.SubstructureNotifyMask)
        self._control.flush()
        self.activations += 1
        deadline = time.monotonic() + _ACTIVATE_WAIT_S
        while self._active() != target and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def _client_at(self, x: int, y: int) -> int | None:
        """The managed window (in _NET_CLIENT_LIST) whose frame is the topmost viewable child
        of the root under (x, y), or None (the root, or an unmanaged popup such as a menu)."""
        root = self._control.screen().root
        clients = root.get_full_property(self._atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
        if clients is None:
            return None
        frames: dict[int, int] = {}
        for wid in clients.value:
            window = self._control.create_resource_object("window", wid)
            top = window
            while True:
                tree = top.query_tree()
                if tree.parent.id == root.id:
                    break
                top = tree.parent
            frames[top.id] = wid
        for child in reversed(root.query_tree().children):  # topmost first
            attrs = child.get_attributes()
            if attrs.map_state != X.IsViewable:
                continue
            geo = child.get_geometry()
            border = geo.border_width
            if geo.x <= x < geo.x + geo.width + 2 * border and \
                    geo.y <= y < geo.y + geo.height + 2 * border:
                return frames.get(child.id)  # None: an unmanaged window is on top there
        return None

    def _active(self) -> int | None:
        prop = self._control.screen().root.get_full_property(
            self._atom("_NET_ACTIVE_WINDOW"), X.AnyPropertyType)
        return prop.value[0] if prop is not None and len(prop.value) else None

    def _atom(self, name: str) -> int:
        return self._control.intern_atom(name)

    def _close(self) -> None:
        for conn in (self._record, self._control):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._record = self._control = None
