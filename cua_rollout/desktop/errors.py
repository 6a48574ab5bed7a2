"""The errors of the desktop side: what its logic modules raise, each carrying what the caller
needs. Nothing here knows HTTP: the server's routes choose the status code of each error.

    DesktopSideError
     ├── DisplayError              Xvfb or the window manager would not start, or died
     ├── RequestBodyError          a JSON endpoint's body is not a JSON object
     │    ├── NotJSON                  not declared as JSON
     │    ├── MalformedJSON            declared as JSON, but not parseable
     │    └── NotAnObject              JSON, but not an object
     ├── CommandError              a command did not run to its end
     │    ├── BadCommand               unusable as given (empty, wrong types, bad quoting or limit)
     │    ├── CommandNotStarted        its program could not be started
     │    └── CommandTimeout           ran past its time limit; its process group was killed
     ├── PathError                 a path given by the caller is not what it must be
     │    ├── NoSuchPath               nothing exists there
     │    ├── NotADirectory            not an existing directory
     │    └── NotAReadableFile         exists, but is no file the server can read
     ├── TransferError             a file could not be stored on the desktop
     │    ├── UploadFailed             writing an uploaded file failed
     │    └── DownloadFailed           every attempt to download a URL failed
     ├── OpenFileError             ``open_file`` could not show the file's window
     │    ├── NothingToOpen            neither a file nor a command on PATH
     │    ├── NoApplication            no installed application opens this kind of file
     │    ├── OpenFailed               the opener could not start, or exited with an error
     │    └── WindowTimeout            no matching window appeared in time
     ├── WindowCommandFailed       wmctrl could not run
     ├── AccessibilityError        the AT-SPI dump did not produce a tree
     │    ├── AccessibilityUnavailable AT-SPI (or the interpreter with pyatspi) is not there
     │    └── AccessibilityFailed      the dump failed or ran past its time limit
     └── RecordingError            a screen recording could not be started or finished
          ├── AlreadyRecording         a recording is in progress
          ├── NotRecording             no recording is in progress
          └── RecordingFailed          ffmpeg failed, hung, or left no usable file
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AccessibilityError",
    "AccessibilityFailed",
    "AccessibilityUnavailable",
    "AlreadyRecording",
    "BadCommand",
    "CommandError",
    "CommandNotStarted",
    "CommandTimeout",
    "DesktopSideError",
    "DisplayError",
    "DownloadFailed",
    "MalformedJSON",
    "NoApplication",
    "NoSuchPath",
    "NotADirectory",
    "NotAReadableFile",
    "NotAnObject",
    "NotJSON",
    "NotRecording",
    "NothingToOpen",
    "OpenFailed",
    "OpenFileError",
    "PathError",
    "RecordingError",
    "RecordingFailed",
    "RequestBodyError",
    "TransferError",
    "UploadFailed",
    "WindowCommandFailed",
    "WindowTimeout",
]


class DesktopSideError(Exception):
    """Base of every error raised on the desktop side."""


class DisplayError(DesktopSideError):
    """The X display could not be started (Xvfb or the window manager failed, or a display
    number was not free) or is not running; the message names what failed."""


# ---------------------------------------------------------------------- request bodies


class RequestBodyError(DesktopSideError):
    """The body of a request to a JSON endpoint is not a JSON object."""


class NotJSON(RequestBodyError):
    """The body is not declared as JSON (``Content-Type``)."""


class MalformedJSON(RequestBodyError):
    """The body is declared as JSON but does not parse."""


class NotAnObject(RequestBodyError):
    """The body is JSON, but not an object."""


# ---------------------------------------------------------------------- commands


class CommandError(DesktopSideError):
    """A command did not run to its end."""


class BadCommand(CommandError):
    """The command cannot be run as given: no command, elements that are not strings,
    unbalanced quotes, or a time limit that is not a positive number."""


class CommandNotStarted(CommandError):
    """The command's program could not be started (no such program, not executable...); the
    message is the operating system's."""


class CommandTimeout(CommandError):
    """A command ran past its time limit; its process group was killed."""

    def __init__(self, argv: Sequence[str] | str, timeout_s: float) -> None:
        super().__init__(f"Command {argv!r} timed out after {timeout_s:g} seconds")
        self.argv = argv
        self.timeout_s = timeout_s


# ---------------------------------------------------------------------- paths and files


class PathError(DesktopSideError):
    """A path given by the caller is not what it must be; ``path`` is it, as resolved."""

    def __init__(self, path: object, message: str) -> None:
        super().__init__(message)
        self.path = path


class NoSuchPath(PathError):
    """Nothing exists at ``path``."""

    def __init__(self, path: object) -> None:
        super().__init__(path, f"{path} does not exist")


class NotADirectory(PathError):
    """``path`` is not an existing directory."""

    def __init__(self, path: object) -> None:
        super().__init__(path, f"{path!r} is not a directory")


class NotAReadableFile(PathError):
    """``path`` exists but is not a regular file the server may read."""

    def __init__(self, path: object) -> None:
        super().__init__(path, f"{path} is not a readable file")


class TransferError(DesktopSideError):
    """A file could not be stored on the desktop."""


class UploadFailed(TransferError):
    """Writing an uploaded file failed; the message is the operating system's."""


class DownloadFailed(TransferError):
    """Every attempt to download ``url`` failed; ``error`` is the last attempt's error."""

    def __init__(self, url: str, error: BaseException | None) -> None:
        super().__init__(f"Failed to download {url}. No retries left. Error: {error}")
        self.url = url
        self.error = error


# ---------------------------------------------------------------------- apps and windows


class OpenFileError(DesktopSideError):
    """``open_file`` could not show the window of what it was asked to open."""


class NothingToOpen(OpenFileError):
    """``target`` is neither an existing file nor a command on PATH."""

    def __init__(self, target: str) -> None:
        super().__init__(f"Application/file not found: {target}")
        self.target = target


class NoApplication(OpenFileError):
    """No installed application opens this kind of file."""


class OpenFailed(OpenFileError):
    """The opener of ``target`` could not be started or exited with an error (``reason``)."""

    def __init__(self, target: str, reason: object) -> None:
        super().__init__(f"Failed to open {target}. Error: {reason}")
        self.target = target
        self.reason = reason


class WindowTimeout(OpenFileError):
    """No window whose title contains ``name`` appeared within ``timeout_s``."""

    def __init__(self, name: str, timeout_s: float) -> None:
        super().__init__(f"Failed to find window for {name} within {timeout_s:g} seconds.")
        self.name = name
        self.timeout_s = timeout_s


class WindowCommandFailed(DesktopSideError):
    """wmctrl could not be run (not installed, or it hung)."""

    def __init__(self, reason: object) -> None:
        super().__init__(f"wmctrl failed: {reason}")
        self.reason = reason


# ---------------------------------------------------------------------- accessibility


class AccessibilityError(DesktopSideError):
    """The accessibility dump did not produce its result; the message says why."""


class AccessibilityUnavailable(AccessibilityError):
    """AT-SPI cannot be reached, or the interpreter that has pyatspi is not installed."""


class AccessibilityFailed(AccessibilityError):
    """The dump exited with an error or ran past its time limit."""


# ---------------------------------------------------------------------- recording


class RecordingError(DesktopSideError):
    """A recording could not be started or finished; ``message`` says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AlreadyRecording(RecordingError):
    """A recording is in progress: one at a time."""

    def __init__(self) -> None:
        super().__init__("Recording is already in progress.")


class NotRecording(RecordingError):
    """There is no recording in progress to stop."""

    def __init__(self) -> None:
        super().__init__("No recording in progress to stop.")


class RecordingFailed(RecordingError):
    """ffmpeg could not start, stopped writing, hung, or left no usable file."""
