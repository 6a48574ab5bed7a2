"""``scripts/desktops.py`` on a live run (run.py on real Ray and local desktops): status lists
every desktop with its state and lease, quarantine takes a free one out (and a new one
replaces it), release gives back a leased one, and the run still completes every episode."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.support import REPO_ROOT, slow_scripted_policy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOOL = REPO_ROOT / "scripts" / "desktops.py"
DEMO = REPO_ROOT / "configs" / "demo.yaml"


def _tool(*args: str, sets: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(TOOL), *args, "--config", str(DEMO)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def _on_a_leased_desktop(command: str, expected: int, sets: list[str]
                         ) -> subprocess.CompletedProcess[str]:
    """``command`` on a desktop the status shows leased, until it exits ``expected`` (a lease
    may end between the status and the command: then again with the one leased now)."""
    for _ in range(5):
        rows = json.loads(_tool("status", "--json", sets=sets).stdout)["desktops"]
        leased = [r for r in rows if r["state"] == "leased"]
        if not leased:
            time.sleep(0.5)
            continue
        done = _tool(command, leased[0]["id"], sets=sets)
        if done.returncode == expected:
            return done
    raise AssertionError(f"{command} on a leased desktop never exited {expected}")


def test_status_quarantine_and_release_on_a_live_run(tmp):
    tasks = ["terminal-hello-file", "calc-add", "editor-append-line"]
    sets = [f"run.output_dir={tmp / 'results'}", f"run.name=tool-{tmp.name[-6:]}",
            f"desktops.local.state_dir={tmp / 'd'}", "desktops.count=3",
            "coordinator.max_concurrent_episodes=2", "ray.include_dashboard=false",
            f"tasks.task_ids={json.dumps(tasks)}"]
    with slow_scripted_policy(DEMO, sets, latency_s=2.0) as slow:
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(DEMO)]
        for s in [*sets, *slow]:
            args += ["--set", s]
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            rows: list[dict] = []
            while True:  # until the run's pool has a free desktop and a leased one
                assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
                assert time.monotonic() < deadline, rows
                done = _tool("status", "--json", sets=sets)
                if done.returncode == 0 and json.loads(done.stdout)["live"]:
                    rows = json.loads(done.stdout)["desktops"]
                    states = {r["state"] for r in rows}
                    if {"free", "leased"} <= states:
                        break
                time.sleep(0.5)
            assert len(rows) == 3
            leased = next(r for r in rows if r["state"] == "leased")
            assert leased["owner"] and leased["lease_age_s"] >= 0 and leased["url"]
            free = next(r for r in rows if r["state"] == "free")

            quarantined = _tool("quarantine", free["id"], sets=sets)
            assert quarantined.returncode == 0 and "replaces it" in quarantined.stdout, quarantined
            # A leased desktop is not quarantined under its episode ...
            refused = _on_a_leased_desktop("quarantine", 1, sets)
            assert "release it first" in refused.stderr, refused
            # ... but its lease can be taken back: its episode is retried on another one.
            released = _on_a_leased_desktop("release", 0, sets)
            assert "took back" in released.stdout, released
            assert _tool("release", "no-such-desktop", sets=sets).returncode == 1

            table = _tool("status", sets=sets)
            assert table.returncode == 0 and "live" in table.stdout and "state" in table.stdout
            after = json.loads(_tool("status", "--json", sets=sets).stdout)["desktops"]
            assert free["id"] not in {r["id"] for r in after}  # replaced by a new desktop
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    run_dir = tmp / "results" / f"tool-{tmp.name[-6:]}"
    results = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["rollout"]) for r in results) == sorted(
        (t, k) for t in tasks for k in range(2))
    assert {r["status"] for r in results} == {"success"}, [
        (r["task_id"], r["rollout"], r["attempt"], r["status"], r.get("error"))
        for r in results if r["status"] != "success"]
    assert any(r["attempt"] > 0 for r in results)  # the episode whose desktop was taken
    # With no run alive, status says so.
    offline = _tool("status", sets=sets)
    assert offline.returncode == 0 and "no live run" in offline.stdout
