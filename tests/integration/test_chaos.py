"""The chaos run (benchmarks/chaos.py --quick): every fault of issues 12 and 34 injected into a
real run (run.py, Ray, runners, storage, coordinator, model client, simulated desktops and
replicas; a slow replica, the desktops' network cut, a Ray worker node lost, the index's
PostgreSQL restarted, the disk filled while retention sweeps), and every count zero; the
behaviour each fault calls for (a stop is exit 1 with one line, a second driver is refused at
once, a killed driver's Ray goes with it, the slow replica serves fewer requests, the lost
node's runners are replaced, the index catches up, images go only with their marker); and the
harness itself: the counting on a run directory that lies, and the fault proxy it injects
through (refusing, freezing, slowing)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chaos import COUNTS, QUICK, SCENARIOS, count, recover_s, tasks_for
from benchmarks.chaos_proxy import FaultProxy
from benchmarks.sim_world import DesktopSim, SimWorld
from tests.support import background
from tests.support.background import CHAOS_LANES

# ------------------------------------------------------------------ the counting


def _episode(run_dir: Path, i: int, attempt: int = 0, status: str = "failure",
             steps: int = 2, ended_at: float = 100.0) -> dict[str, Any]:
    """A well-recorded episode directory and its line."""
    scored = status != "infra_error"
    record = {"episode_id": f"d/t{i}/0", "attempt": attempt, "status": status,
              "reward": 0.0 if scored else None, "steps": steps, "ended_at": ended_at}
    directory = run_dir / f"d/t{i}/0"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "episode.json").write_text(json.dumps(record))
    if scored:
        (directory / "result.txt").write_text("0.0\n")
        traj = [{"step_num": n, "reward": 0, "screenshot_file": f"step_{n}.png"}
                for n in range(1, steps)]
        traj.append({"step_num": steps, "reward": 0.0, "screenshot_file": None})
        (directory / "traj.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traj))
        for n in range(steps):
            (directory / f"step_{n}.png").write_bytes(b"png")
    return record


def _write(path: Path, records: list[dict[str, Any]], extra: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + extra)


def test_a_clean_run_directory_counts_zero(tmp_path: Path):
    run_dir = _mk(tmp_path / "run")
    _write(run_dir / "results.jsonl", [_episode(run_dir, i) for i in range(3)])
    ids = {f"d/t{i}/0" for i in range(3)}
    got = count(run_dir, 3, ids)
    assert {k: got[k] for k in COUNTS} == {"expected": 3, "recorded": 3, "lost": 0,
                                           "duplicated": 0, "misrecorded": 0,
                                           "outage_infra_errors": 0}


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_the_counts_see_lost_duplicated_misrecorded_and_infra_errors(tmp_path: Path):
    run_dir = _mk(tmp_path / "run")
    lines = [_episode(run_dir, 0), _episode(run_dir, 0),           # a duplicate in the index
             _episode(run_dir, 1), {**_episode(run_dir, 2), "attempt": 1},  # another attempt
             _episode(run_dir, 3, status="infra_error"),
             _episode(run_dir, 4), _episode(run_dir, 5), _episode(run_dir, 6, steps=3)]
    _write(run_dir / "results.jsonl", lines, '{"cut": ')
    # A start moved these out: a success recorded before (a duplicate), an infra_error.
    _write(run_dir / "results.superseded.jsonl",
           [_episode(run_dir, 7), {**_episode(run_dir, 8), "status": "infra_error"}])
    (run_dir / "d/t1/0/result.txt").write_text("1.0\n")           # disagrees with the line
    (run_dir / "d/t4/0/step_1.png").unlink()                      # a screenshot traj names
    with (run_dir / "d/t5/0/traj.jsonl").open("a") as f:          # a step too many
        f.write("{}\n")
    (run_dir / "d/t6/0/episode.json").unlink()
    ids = {f"d/t{i}/0" for i in range(10)}
    got = count(run_dir, 10, ids)
    assert {k: got[k] for k in COUNTS} == {
        "expected": 10, "recorded": 7, "lost": 3, "duplicated": 2, "misrecorded": 5,
        "outage_infra_errors": 2}
    assert set(got["why"]["misrecorded"]) == {"d/t1/0", "d/t2/0", "d/t4/0", "d/t5/0",
                                              "d/t6/0"}
    assert got["why"]["broken_lines"] == 1


def test_recovery_is_timed_to_the_first_episode_that_ended_after_the_fault(tmp_path: Path):
    run_dir = _mk(tmp_path / "run")
    _write(run_dir / "results.jsonl", [_episode(run_dir, 0, ended_at=100.0),
                                       _episode(run_dir, 1, ended_at=107.5),
                                       _episode(run_dir, 2, ended_at=104.0)])
    assert recover_s(run_dir, 103.0) == 1.0
    assert recover_s(run_dir, 108.0) is None
    assert recover_s(run_dir, None) is None


# ------------------------------------------------------------------ the fault proxy


def _get(url: str, timeout_s: float = 10.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        r.read()
        return r.status


def _execute(url: str, command: str, timeout_s: float = 10.0) -> int:
    req = urllib.request.Request(url + "/execute", data=json.dumps({"command": command}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()
        return r.status


def test_the_fault_proxy_refuses_freezes_slows_and_comes_back(tmp_path: Path):
    desktop = DesktopSim(rich_screenshots=False, screenshots=1)
    first = SimWorld(desktops=2, desktop=desktop).start()
    second = None
    port = int(first.desktop_urls[0].rsplit(":", 1)[1].split("/")[0])
    gate = FaultProxy(port).start()
    try:
        d0, d1 = gate.url("/d/0"), gate.url("/d/1")
        assert _get(d0 + "/screenshot") == 200
        assert _execute(d0, "sim-reset") == 200                  # a reset is not frozen
        gate.freeze_on_execute()
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            _execute(d0, "pyautogui.click(1, 1)", timeout_s=1.0)  # frozen mid-/execute
        assert gate.frozen_prefix == b"/d/0/"
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            _get(d0 + "/screenshot", timeout_s=1.0)               # the whole desktop hangs
        assert _get(d1 + "/screenshot") == 200                    # not its neighbour
        gate.thaw()
        assert _get(d0 + "/screenshot") == 200

        gate.slow(3)                                              # answers held, not lost
        assert _get(d0 + "/screenshot") == 200 and gate.slowed == 1
        gate.slow(1)
        assert _get(d1 + "/screenshot") == 200 and gate.slowed == 1
        with pytest.raises(ValueError, match="slow factor"):
            gate.slow(0.5)

        gate.down()
        with pytest.raises(urllib.error.URLError, match="refused"):
            _get(d0 + "/screenshot")
        first.stop()
        second = SimWorld(desktops=2, desktop=desktop).start()
        gate.up(int(second.desktop_urls[0].rsplit(":", 1)[1].split("/")[0]))
        assert gate.url("/d/0") == d0 and _get(d0 + "/screenshot") == 200
    finally:
        gate.stop()
        first.stop()
        if second is not None:
            second.stop()


# ------------------------------------------------------------------ the chaos run


@pytest.fixture(scope="module")
def chaos() -> list[dict[str, Any]]:
    """The quick run, in two lanes (``tests/support/background.py``: two chaos.py processes
    with disjoint scenarios, started when the session started)."""
    assert sorted(n for lane in CHAOS_LANES for n in lane) == sorted(SCENARIOS)
    rows = {}
    for key in ("chaos-0", "chaos-1"):
        done = background.result(key, timeout_s=2400)
        print(done.stdout)
        assert done.returncode == 0, (key, done.stdout[-2000:], done.stderr[-4000:])
        rows.update({row["name"]: row for row in json.loads(done.json.read_text())["scenarios"]})
    return [rows[name] for name in SCENARIOS]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.harness("chaos-0", "chaos-1")
@pytest.mark.timeout(2400)
def test_the_quick_chaos_run_loses_duplicates_and_misrecords_nothing(
        chaos: list[dict[str, Any]]):
    assert [r["name"] for r in chaos] == list(SCENARIOS)
    for row in chaos:
        assert "error" not in row, (row["name"], row.get("error"), row.get("traceback"))
        assert set(COUNTS) | {"name", "recover_s"} <= set(row), row["name"]
        assert all(isinstance(row[k], int) for k in COUNTS), row
        assert row["recover_s"] is None or isinstance(row["recover_s"], float | int)
        n = tasks_for(row["name"], QUICK)
        counts = {k: row[k] for k in COUNTS}
        assert counts == {"expected": n, "recorded": n, "lost": 0, "duplicated": 0,
                          "misrecorded": 0, "outage_infra_errors": 0}, (
            row["name"], counts, row.get("facts"), row.get("log_tail", "")[-3000:])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.harness("chaos-0", "chaos-1")
@pytest.mark.timeout(2400)
def test_each_fault_is_met_as_the_service_promises(chaos: list[dict[str, Any]]):
    """Beyond the counts: the fault really happened (requests cut, a desktop frozen, a
    reload drained under load), a fault that stops the run stops it with exit 1 and one line
    and the rerun finishes, a second driver is refused at once, nothing outlives its run."""
    rows = {r["name"]: r for r in chaos}
    assert not any(r.get("error") for r in chaos)
    facts = {name: r["facts"] for name, r in rows.items()}
    assert facts["model_down"]["requests_cut"] > 0 and facts["model_down"]["model_outages"]
    assert facts["replica_killed"]["requests_cut"] > 0
    reload = facts["single_replica_reload"]
    assert reload["in_flight_at_drain"] > 0 and reload["drained"]
    assert set(reload["model_versions"]) == {"v1", "v2"}
    assert facts["desktop_hangs"]["requests_held"] > 0
    assert facts["runner_killed"]["runners_replaced"] >= 1
    assert facts["driver_killed"]["orphans"] == []
    second = facts["second_driver"]["second"]
    assert second["exit"] == 1 and "another run.py" in second["message"]
    slow = facts["slow_endpoint"]  # the routing sent most requests to the fast replica
    assert slow["slowed"] > 0
    assert slow["answered_while_slow"]["fast"] > slow["answered_while_slow"]["slow"], slow
    assert facts["network_cut"]["cut_s"] >= QUICK.cut_s
    lost = facts["node_lost"]
    assert lost["runners_on_b_at_kill"] >= 1 and lost["runners_replaced"] >= 1, lost
    assert lost["left_on_b"] == 0 and set(lost["after_kill_by_node"]) == {"a"}, lost
    pg = facts["postgres_restart"]
    assert rows["postgres_restart"]["index_behind"] == 0, pg
    # Episodes were recorded while the index was down, and its writes failed meanwhile.
    assert pg["recorded_while_down"] > 0 and pg["index_failure_logged"], pg
    for name in ("storage_killed", "disk_full", "retention_disk_full"):
        assert rows[name]["exit_codes"] == [1, 0], (name, rows[name]["exit_codes"])
    swept = facts["retention_disk_full"]  # the disk filled while images were being removed
    assert swept["removed_at_fault"] > 0 and swept["removed_at_end"] >= swept["removed_at_fault"]
    notes = {name: r["notes"] for name, r in rows.items() if r.get("notes")}
    assert not notes, json.dumps(notes, indent=1)[:4000]
