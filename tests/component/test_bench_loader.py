"""benchmarks/bench_loader.py at a small size: its figures are there and the loader's view of
the restart matches the file it wrote. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_loader


def test_the_loader_benchmark_reports_each_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_loader.main(["--sizes", "1500", "--tasks", "20", "--rollouts", "4",
                              "--iterations", "3", "--index", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["size"] == 1500
    it = row["iteration"]
    assert {"iteration_ms", "poll_ms", "total_known_ms", "rss_mb", "loader_mb"} <= set(it)
    compacted = row["storage"]["compacted"]
    assert row["storage"]["cut_bytes"] > 0 and compacted["broken"] == 0
    assert compacted["dropped"] > 0 and compacted["superseded"] > 0
    assert row["loader"]["finished_before"] == compacted["kept"]
    loader = row["loader"]  # nothing runs yet: every episode known is finished or handed out
    assert loader["total_known"] == loader["finished_before"] + loader["to_hand_out"]
    assert row["index"]["inserted"] == row["index_restart"]["unchanged"] == compacted["kept"]
