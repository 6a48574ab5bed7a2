"""The chaos run (benchmarks/chaos.py --quick): every fault of the reliability review injected
into a real run (Ray, runners, storage, model client, simulated desktops and replicas), and
every count zero; and the counting itself, on a run directory that lies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos import COUNTS, QUICK, SCENARIOS, Run, count
from tests.support import REPO_ROOT


def test_the_counts_see_lost_duplicated_and_misrecorded_episodes(tmp_path: Path):
    run_dir = tmp_path / "run"

    def episode(i: int, attempt: int = 0, status: str = "success") -> dict:
        directory = run_dir / f"d/t{i}/0"
        directory.mkdir(parents=True, exist_ok=True)
        record = {"episode_id": f"d/t{i}/0", "attempt": attempt, "status": status,
                  "reward": 1.0 if status == "success" else None}
        (directory / "episode.json").write_text(json.dumps(record))
        (directory / "traj.jsonl").write_text("{}\n")
        (directory / "result.txt").write_text("1.0\n")
        return record

    lines = [episode(0), episode(0), episode(1), {**episode(2), "attempt": 1},
             episode(3, status="infra_error")]
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "d/t1/0/result.txt").write_text("0.0\n")  # disagrees with the line
    size = QUICK.__class__(tasks=5, outage_s=0, reload_s=0, hang_s=0, run_timeout_s=0)
    run = Run(tmp_path, run_dir, tmp_path / "c.yaml", size, tmp_path / "log")
    assert count(run, size) == {"expected": 5, "recorded": 4, "lost": 1, "duplicated": 1,
                                "misrecorded": 2, "outage_infra_errors": 1}


@pytest.mark.integration
def test_the_quick_chaos_run_loses_duplicates_and_misrecords_nothing(tmp_path: Path):
    out = tmp_path / "chaos.json"
    result = subprocess.run([sys.executable, "benchmarks/chaos.py", "--quick", "--json",
                             str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["scenarios"]
    assert [r["name"] for r in rows] == list(SCENARIOS)
    for row in rows:
        assert "error" not in row, (row["name"], row.get("error"), row.get("log_tail"))
        if "skipped" in row:
            continue
        assert set(COUNTS) | {"name", "recover_s"} <= set(row)
        assert row["expected"] == row["recorded"] == QUICK.tasks, row
        assert {k: row[k] for k in COUNTS[2:]} == dict.fromkeys(COUNTS[2:], 0), row
