"""The container provider's pure parts: the run label a sweep judges by, reading labels as
the engines print them, and the refusal to publish untokened desktops beyond this host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.providers import container
from cua_rollout.envs.providers.base import run_is_gone, run_label


def test_a_run_label_names_this_process_and_tells_a_gone_run():
    label = run_label()
    host, pid, _ = label.rsplit(":", 2)
    assert host == socket.gethostname() and int(pid) == os.getpid()
    assert not run_is_gone(label)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = run_label(ended.pid)
    ended.wait()
    assert run_is_gone(gone)
    # A reused pid with another start time is another process: the run is gone.
    assert run_is_gone(f"{socket.gethostname()}:{os.getpid()}:1")
    # Another host's run is never judged from here; a broken label is not ours to keep.
    assert not run_is_gone("elsewhere:1:1")
    assert run_is_gone("garbage")


@pytest.mark.parametrize("text", [
    "map[cua.desktop:ctr-1-0-ab cua.run:host:12:1700000000 cua.owner:root]",
    '{"cua.desktop": "ctr-1-0-ab", "cua.run": "host:12:1700000000"}',
    "cua.desktop=ctr-1-0-ab,cua.run=host:12:1700000000",
])
def test_labels_as_each_engine_prints_them(text):
    assert container._label(text, "cua.run") == "host:12:1700000000"
    assert container._label(text, "cua.desktop") == "ctr-1-0-ab"
    assert container._label(text, "absent") is None


def test_desktops_published_beyond_this_host_need_a_token():
    with pytest.raises(ValueError, match=r"desktops\.container\.publish_host '0\.0\.0\.0' .*"
                                         r"token_env"):
        DesktopsConfig(provider="container", container={"publish_host": "0.0.0.0"})
    with pytest.raises(ValueError, match=r"desktops\.local\.host '10\.1\.2\.3' .*token_env"):
        DesktopsConfig(local={"host": "10.1.2.3"})
    DesktopsConfig(local={"host": "10.1.2.3"}, token_env="T")
    DesktopsConfig(provider="static", local={"host": "10.1.2.3"})  # not the provider in use
