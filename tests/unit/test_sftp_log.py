"""tests.support.netfs reads the SFTP server's log right: which files a client wrote, where
they ended up and with how many bytes, whatever order FUSE's releases arrive in."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.support.netfs import SftpExport

LOG = """\
session opened for local user root from [10.0.0.2]
mkdir name "/r/.attempts/e.0.n" mode 0755
open "/r/.attempts/e.0.n/.task.tmp" flags WRITE,CREATE,EXCL mode 0100644
posix-rename old "/r/.attempts/e.0.n/.task.tmp" new "/r/.attempts/e.0.n/task_config.json"
close "/r/.attempts/e.0.n/.task.tmp" bytes read 0 written 145
open "/r/.attempts/e.0.n/.s.tmp" flags WRITE,CREATE,EXCL mode 0100644
close "/r/.attempts/e.0.n/.s.tmp" bytes read 0 written 2000
posix-rename old "/r/.attempts/e.0.n/.s.tmp" new "/r/.attempts/e.0.n/step_0.png"
open "/r/.attempts/e.0.n/traj.jsonl" flags WRITE,APPEND,CREATE mode 0100644
close "/r/.attempts/e.0.n/traj.jsonl" bytes read 0 written 300
open "/r/.attempts/e.0.n/traj.jsonl" flags WRITE,APPEND,CREATE mode 0100644
close "/r/.attempts/e.0.n/traj.jsonl" bytes read 0 written 310
open "/r/.attempts/e.0.n/.gone.tmp" flags WRITE,CREATE,EXCL mode 0100644
close "/r/.attempts/e.0.n/.gone.tmp" bytes read 0 written 7
remove name "/r/.attempts/e.0.n/.gone.tmp"
open "/r/.attempts/e.0.n/task_config.json" flags READ mode 00
close "/r/.attempts/e.0.n/task_config.json" bytes read 145 written 0
"""


def test_writes_follow_renames_appends_removals_and_late_closes(tmp_path: Path):
    hosts = SimpleNamespace(ip={"a": "10.0.0.1", "b": "10.0.0.2"})
    export = SftpExport(hosts, None, "a", tmp_path / "served", tmp_path)  # type: ignore[arg-type]
    export.logs.mkdir()
    (export.logs / "10.0.0.2.log").write_text(LOG)
    assert export.writes("b") == {"/r/.attempts/e.0.n/task_config.json": 145,
                                  "/r/.attempts/e.0.n/step_0.png": 2000,
                                  "/r/.attempts/e.0.n/traj.jsonl": 610}
    assert export.made_dirs("b") == {"/r/.attempts/e.0.n"}
    assert export.writes("a") == {}  # no session of that client
