"""cua_rollout.core.errors.one_line: what a stop line or status line shows of any error."""

from __future__ import annotations

from cua_rollout.core.errors import StorageError, one_line


class _Wrapper(Exception):
    """Like Ray's RayTaskError: the error behind it in ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__("Traceback (most recent call last):\n  File ...\nwrapped")
        self.cause = cause


def test_a_multi_line_message_keeps_its_first_line():
    exc = RuntimeError("\nThe actor died unexpectedly.\n\tclass_name: StorageActor\n\tpid: 7")
    assert one_line(exc) == "RuntimeError: The actor died unexpectedly."


def test_the_error_behind_a_wrapper_is_named():
    assert one_line(_Wrapper(StorageError("disk full"))) == "StorageError: disk full"


def test_long_and_empty_messages():
    assert one_line(ValueError("x" * 500), limit=20) == "ValueError: " + "x" * 17 + "..."
    assert one_line(KeyError()) == "KeyError"
