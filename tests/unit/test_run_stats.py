"""RunStats (cua_rollout/runtime/stats.py): what a sample says about the runners."""

from __future__ import annotations

from cua_rollout.runtime.stats import RunStats


async def test_a_sample_counts_the_runners_by_who_writes_their_step_files():
    stats = RunStats(1.0, None, ray_metrics=False, run_name="t")
    runners = {
        "r0": {"steps": 3, "step_files": {"mode": "runner", "steps": 3}},
        "r1": {"steps": 2, "step_files": {"mode": "runner", "steps": 2}},
        "r2": {"steps": 1, "step_files": {"mode": "storage", "steps": 0}},
        "r3": {"steps": 0, "step_files": {"mode": None, "steps": 0}},  # no episode yet
        "r4": {},  # its statistics did not come
    }
    await stats.refresh(None, runners, live_steps=6, scrape=None)
    sample = stats.snapshot(queued=0, in_flight=0, runners=5, draining=False, waiting=None,
                            outages={}, fatal=None)
    assert sample["step_files"] == {"runner": 2, "storage": 1}
    assert sample["steps"] == 6
