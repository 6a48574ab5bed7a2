"""The warm interpreter behind plain ``/execute`` actions (``cua_rollout.desktop.actions``): one
long-lived
process per desktop server that imports pyautogui once and then runs each action's code as a
fresh ``python -c`` would, without paying for a new interpreter and pyautogui's import.

The server starts it as

    python -c "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')" \\
        <this file> <max output bytes>

so that its import path is the one of ``python -c`` (the working directory first, nothing
added). It speaks one JSON object per line: on its original stdout it first answers
``{"ready": true, "pid": n}`` once pyautogui is imported (or ``{"ready": false, "error":
traceback}``, then exits), then reads requests ``{"code": str}`` from its original stdin and
answers each with one of

    {"returncode": int, "stdout": str, "stderr": str}   the code ran (0, or 1 and the
                                                        traceback in stderr, as python -c)
    {"fallback": reason}                                not run: the X display changed under
                                                        this interpreter (keyboard mapping,
                                                        screen size) or went away; it exits,
                                                        and the server runs the action in a
                                                        fresh process

What makes a run match a fresh ``python -c``:

- the code runs with ``exec`` in a new namespace holding only ``__name__ == "__main__"`` and
  the builtins; its own ``import pyautogui`` / ``import time`` bind the modules (cached);
- pyautogui's settings (``PAUSE``, ``FAILSAFE``, ``MINIMUM_DURATION``, ``FAILSAFE_POINTS``,
  the screenshot log ...) are put back to their import-time values before every action, its
  cached mouse-button setting is dropped, and the warnings registries are reset;
- file descriptors 1 and 2 are memory files emptied before every action, so everything the
  code (or a process it starts) writes is captured; what importing pyautogui printed comes
  first in every action's output, as a fresh interpreter would print it each time; output
  beyond the server's limit is cut as the server cuts a fresh process's;
- an exception ends the run with status 1 and the traceback the interpreter's own hook
  prints, without this module's frames; ``SystemExit`` ends it with its status;
- pyautogui reads the keyboard mapping and the screen size once, at import: an action after
  either changed is not run here (``fallback``), so it never types with stale keycodes.

It exits at the end of its stdin (the server closed it, or died).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import json
import os
import sys
import warnings
from typing import Any, BinaryIO

__all__ = ["main"]

_TRUNCATED = b"\n[output truncated]\n"


def _capture_file(name: str) -> int:
    """A file descriptor of an anonymous memory file (a temporary file where there is none)."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        try:
            return memfd_create(f"action-{name}", 0)
        except OSError:
            pass
    import tempfile

    return os.dup(tempfile.TemporaryFile().fileno())  # the dup outlives the file object


def _empty(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)


def _read(fd: int, limit: int) -> bytes:
    """What was written to ``fd`` since it was emptied; at most ``limit`` bytes, plus one."""
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < min(size, limit + 1):
        chunk = os.pread(fd, min(size, limit + 1) - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _cut(data: bytes, limit: int) -> str:
    if len(data) > limit:
        data = data[:limit] + _TRUNCATED
    return data.decode("utf-8", "replace")


def _exit_status(exc: SystemExit) -> int:
    """The exit status the interpreter gives a ``SystemExit`` (printing a non-int code)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class _Defaults:
    """pyautogui's settings as importing it left them, to put back before every action."""

    def __init__(self, pyautogui: Any) -> None:
        self.module = pyautogui
        self.values = {
            name: copy.deepcopy(value)
            for name, value in vars(pyautogui).items()
            if name.isupper() and isinstance(value, bool | int | float | str | list | tuple)
        }
        self.warning_filters = list(warnings.filters)

    def restore(self) -> None:
        module = vars(self.module)
        for name, value in self.values.items():
            if module.get(name) != value or type(module.get(name)) is not type(value):
                module[name] = copy.deepcopy(value)
        platform = getattr(self.module, "platformModule", None)
        if platform is not None and hasattr(platform, "_mouse_is_swapped_setting"):
            platform._mouse_is_swapped_setting = None  # a fresh process asks dconf again
        warnings.filters[:] = self.warning_filters
        warnings.onceregistry.clear()
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()  # every module's __warningregistry__ starts over, as in a new process


class _Display:
    """The X connection pyautogui opened at import, watched for what would make it stale."""

    def __init__(self, pyautogui: Any) -> None:
        platform = getattr(pyautogui, "platformModule", None)
        self.display = getattr(platform, "_display", None)
        self.size = tuple(pyautogui.size())
        self.keymap = self._keymap() if self.display is not None else None

    def _keymap(self) -> list[Any]:
        info = self.display.display.info
        first, last = info.min_keycode, info.max_keycode
        return [list(syms) for syms in self.display.get_keyboard_mapping(first, last - first + 1)]

    def stale(self) -> str | None:
        """Why the next action must not run here, or None. The X server announces a changed
        keyboard mapping (MappingNotify), but also sends one when the device keys come from
        changes (the first XTest key), so the mapping itself is compared then."""
        if self.display is None:
            return None
        try:
            from Xlib import X

            remapped = False
            for _ in range(self.display.pending_events()):
                event = self.display.next_event()
                if event.type == X.MappingNotify and event.request == X.MappingKeyboard:
                    remapped = True
            if remapped and self._keymap() != self.keymap:
                return "the keyboard mapping changed"
            geometry = self.display.screen().root.get_geometry()
        except Exception as exc:  # the connection is gone (Xlib's errors are Exceptions)
            return f"the X connection failed: {type(exc).__name__}: {exc}"
        if (geometry.width, geometry.height) != self.size:
            return "the screen size changed"
        return None


class _Worker:
    def __init__(self, limit: int, replies: BinaryIO) -> None:
        self.limit = limit
        self.replies = replies
        self.stdout = _capture_file("stdout")
        self.stderr = _capture_file("stderr")
        os.dup2(self.stdout, 1)
        os.dup2(self.stderr, 2)
        self.preamble = (b"", b"")

    def reply(self, message: dict[str, Any]) -> None:
        self.replies.write(json.dumps(message).encode() + b"\n")
        self.replies.flush()

    def flush(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()

    def begin(self) -> None:
        self.flush()
        _empty(self.stdout)
        _empty(self.stderr)

    def collected(self) -> tuple[bytes, bytes]:
        self.flush()
        return _read(self.stdout, self.limit), _read(self.stderr, self.limit)

    def run(self, code: str) -> dict[str, Any]:
        self.begin()
        returncode = _execute(code)
        out, err = self.collected()
        return {
            "returncode": returncode,
            "stdout": _cut(self.preamble[0] + out, self.limit),
            "stderr": _cut(self.preamble[1] + err, self.limit),
        }


def _without_trailing_pause(code: str) -> ast.Module:
    """``code`` with ``_pause=False`` on its last statement when that is a pyautogui call:
    pyautogui sleeps ``PAUSE`` (0.1 s) after every call, which between two calls of an action
    lets the app take the first one in, but after the last one only delays the reply (the
    caller pauses before it looks at the screen: ``runner.action_pause_s``). The events sent
    are the same; line numbers are unchanged."""
    tree = ast.parse(code, "<string>", "exec")
    last = tree.body[-1] if tree.body else None
    if (isinstance(last, ast.Expr) and isinstance(call := last.value, ast.Call)
            and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "pyautogui"
            and not any(k.arg == "_pause" for k in call.keywords)):
        call.keywords.append(ast.copy_location(
            ast.keyword(arg="_pause", value=ast.Constant(False)), call))
        ast.fix_missing_locations(tree)
    return tree


def _execute(code: str) -> int:
    """Run ``code`` as ``python -c`` runs it; its exit status."""
    namespace: dict[str, Any] = {
        "__name__": "__main__",
        "__doc__": None,
        "__package__": None,
        "__spec__": None,
        "__loader__": None,
        "__builtins__": builtins,
    }
    try:
        exec(compile(_without_trailing_pause(code), "<string>", "exec", dont_inherit=True),
             namespace)
    except SystemExit as exc:
        return _exit_status(exc)
    except BaseException as exc:  # printed as the interpreter prints it, status 1
        tb = exc.__traceback__
        # Drop this function's frame: the traceback starts at <string>, as with python -c.
        exc.__traceback__ = tb.tb_next if tb is not None else None
        with contextlib.suppress(BaseException):  # a broken hook must not end the worker
            sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    return 0


def main() -> None:
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 16 * 1024 * 1024
    sys.argv[:] = ["-c"]  # what the action's code sees, as under python -c
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a fresh /execute process has stdin on /dev/null
    os.close(devnull)
    worker = _Worker(limit, replies)
    worker.begin()
    try:
        import pyautogui
    except BaseException:  # reported to the server, which falls back to fresh processes
        import traceback

        worker.reply({"ready": False, "error": traceback.format_exc()})
        return
    worker.preamble = worker.collected()
    defaults = _Defaults(pyautogui)
    display = _Display(pyautogui)
    worker.reply({"ready": True, "pid": os.getpid()})
    for line in requests:
        request = json.loads(line)
        reason = display.stale()
        if reason is not None:
            worker.reply({"fallback": reason})
            return
        defaults.restore()
        worker.reply(worker.run(str(request["code"])))


if __name__ == "__main__":
    main()
