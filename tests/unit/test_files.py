"""cua_rollout.core.files: the directory lock (one owner per run or fleet directory, released when
its
holder dies), atomic writes and the JSONL reader every reader shares."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cua_rollout.core.files import (
    DirectoryLock,
    LineMark,
    LockHeld,
    append_text,
    iter_jsonl,
    iter_lines_from,
    last_line_mark,
    repair_jsonl_tail,
    write_atomic,
)


def test_a_held_lock_names_its_holder_and_frees_on_release(tmp_path: Path):
    first = DirectoryLock(tmp_path).acquire()
    # flock is per open file: a second open in this process is refused like another process.
    with pytest.raises(LockHeld, match=f"pid {os.getpid()} on host"):
        DirectoryLock(tmp_path).acquire()
    first.release()
    with DirectoryLock(tmp_path) as again:
        assert again.path == tmp_path / ".lock"


def test_a_lock_whose_holder_died_is_free(tmp_path: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from cua_rollout.core.files import DirectoryLock
            DirectoryLock({str(tmp_path)!r}).acquire()
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=f"pid {holder.pid} "):
            DirectoryLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    DirectoryLock(tmp_path).acquire().release()  # the kernel dropped the dead holder's lock


def test_atomic_write_mode_and_a_monotonic_mtime(tmp_path: Path):
    path = tmp_path / "state.json"
    first = write_atomic(path, b"{}", mode=0o600)
    assert path.read_bytes() == b"{}" and (path.stat().st_mode & 0o777) == 0o600
    assert write_atomic(path, b"[]", min_mtime_ns=first + 10**9) > first + 10**9
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left


def test_jsonl_lines_and_a_cut_tail(tmp_path: Path):
    lines = list(iter_jsonl('{"a": 1}\n\n[2]\n{"cut'))
    assert [(x.number, x.value) for x in lines[:2]] == [(1, {"a": 1}), (3, [2])]
    assert lines[2].number == 4 and lines[2].error is not None
    path = tmp_path / "results.jsonl"
    path.write_text('{"a": 1}\n{"cut')
    assert repair_jsonl_tail(path) == len('{"cut') and path.read_text() == '{"a": 1}\n'
    assert repair_jsonl_tail(tmp_path / "missing.jsonl") == 0


def test_credentials_in_urls_are_redacted_wherever_they_appear():
    from cua_rollout.core.http import redact_url, redact_urls

    assert redact_url("http://u:p@host:8000/v1") == "http://***@host:8000/v1"
    assert redact_url("see https://token@h/x and http://h/y") == "see https://***@h/x and http://h/y"
    assert redact_url("mail user@example.com, http://plain:80") == \
        "mail user@example.com, http://plain:80"
    dump = {"model": {"endpoints": ["http://a:b@m:1"]}, "argv": ["--set", "x=http://k@d:5"],
            "n": 3}
    assert redact_urls(dump) == {"model": {"endpoints": ["http://***@m:1"]},
                                 "argv": ["--set", "x=http://***@d:5"], "n": 3}


@pytest.mark.parametrize("chunk", [1, 2, 5, 64 * 1024])
@pytest.mark.parametrize(("content", "line"), [
    (b"", None), (b"no newline yet", None), (b"a\n", b"a\n"), (b"a\nbb\n", b"bb\n"),
    (b"a\nbb\ncut sho", b"bb\n"), (b"x" * 100 + b"\n" + "é".encode() * 150 + b"\n",
                                   "é".encode() * 150 + b"\n"),
])
def test_the_last_complete_line_is_marked_and_found_again(tmp_path: Path, chunk: int,
                                                          content: bytes, line: bytes | None):
    path = tmp_path / "results.jsonl"
    path.write_bytes(content)
    mark = last_line_mark(path, chunk=chunk)
    if line is None:
        assert mark is None
        return
    assert mark is not None and content[mark.start:mark.end] == line
    assert mark.found_in(path) and LineMark.from_json(mark.to_json()) == mark
    path.write_bytes(b"!" + content)  # the file changed under the mark
    assert not mark.found_in(path)
    assert not LineMark(mark.start, mark.end + 10**9, mark.digest).found_in(path)
    assert LineMark.from_json([1, "2", "x"]) is None and LineMark.from_json(None) is None


def test_an_append_says_where_it_starts_and_lines_are_read_from_an_offset(tmp_path: Path):
    path = tmp_path / "r.jsonl"
    assert append_text(path, "one\n") == 0
    assert append_text(path, b"two\nthree\n") == 4
    assert list(iter_lines_from(path, 4)) == [(4, b"two\n"), (8, b"three\n")]
