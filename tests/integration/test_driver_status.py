"""/healthz and /status of a real run: run.py on the demo (real Ray, local desktops, the
scripted policy) in service mode, queried while it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.core.layout import STATUS_URL_FILE
from tests.support import REPO_ROOT, get_json, run_py_command

DEMO = REPO_ROOT / "configs" / "demo.yaml"
RUN_TIMEOUT_S = 420
TOKEN = "status-test-token"


@pytest.mark.integration
@pytest.mark.slow
def test_a_running_service_answers_healthz_and_status(tmp: Path) -> None:
    incoming = tmp / "incoming"
    incoming.mkdir()
    example = REPO_ROOT / "tasks" / "demo" / "examples" / "terminal" / "terminal-hello-file.json"
    (incoming / example.name).write_bytes(example.read_bytes())
    args = run_py_command(
        DEMO, tmp / "results", f"desktops.local.state_dir={tmp / 'desktops'}",
        f"tasks.source={incoming}", "tasks.poll_interval_s=1", "tasks.rollouts_per_task=1",
        f"tasks.examples_dir={REPO_ROOT / 'tasks' / 'demo' / 'examples'}",
        "monitoring.status_token_env=CUA_STATUS_TEST_TOKEN")
    run_dir = tmp / "results" / "demo"
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CUA_STATUS_TEST_TOKEN": TOKEN})
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        body: dict[str, Any] = {}
        # Wait until the one episode is recorded and its steps counted, as /status tells it
        # (service mode: the run goes on, polling its task directory; the step counter, what
        # the stall rule watches besides finished episodes, comes with the next sample).
        while body.get("episodes", {}).get("done") != 1 or not body.get("steps"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, body
            time.sleep(0.5)
            if (run_dir / STATUS_URL_FILE).exists():
                url = (run_dir / STATUS_URL_FILE).read_text().strip()
                code, body = get_json(url + "/status", TOKEN)
                assert code == 200, body
        assert url.startswith("http://127.0.0.1:")
        assert body["run"] == "demo" and body["status"] == "running"
        assert body["episodes"]["done_this_start"] == 1
        assert body["episodes"]["total_known"] == 1
        assert body["last_progress_t"] is not None
        assert body["stall"]["stalled"] is False and body["stall"]["stall_s"] == 900.0
        assert set(body["desktops"]) >= {"free", "leased"}
        assert body["runners"]["alive"] >= 1
        assert body["healthy"] == {"ok": True, "reason": None}
        assert get_json(url + "/healthz") == (200, {"ok": True})
        code, denied = get_json(url + "/status")
        assert code == 401 and "status_token_env" in denied["error"]
        assert get_json(url + "/status", "not-the-token")[0] == 401
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 130, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The server ended with the run.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/healthz", timeout=5)
