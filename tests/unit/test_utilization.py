"""The utilization clocks and the tracker that turns their totals into the interval's split
(cua_rollout/runtime/utilization.py), on hand-computed cases with a clock the test moves."""

from __future__ import annotations

import pytest

from cua_rollout.runtime.utilization import DESKTOP_STATES, StateClock, UtilizationTracker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_state_clock_integrates_counts_over_time_including_the_current_state():
    clock = Clock()
    states = StateClock(clock)
    states.move(None, "free")
    states.move(None, "free")
    clock.t += 2.0                       # 2 free for 2 s: 4
    states.move("free", "leased")
    clock.t += 3.0                       # 1 free + 1 leased for 3 s
    assert states.totals() == {"free": 7.0, "leased": 3.0}
    assert states.counts() == {"free": 1, "leased": 1}
    states.move("leased", None)          # leaves: no more time counted for it
    states.move("free", "free")          # no change
    clock.t += 1.0
    assert states.totals() == {"free": 8.0, "leased": 3.0}
    assert states.counts() == {"free": 1}


def _runner(phases: dict[str, float], steps: int = 0, actions: int = 0,
            **split: float) -> dict:
    return {"phase_s": phases, "steps": steps, "actions": actions,
            **{f"{k}_s": v for k, v in split.items()}}


def test_tracker_splits_the_desktops_time_and_the_mean_step():
    tracker = UtilizationTracker()
    assert tracker.update(0.0, {"free": 0.0}, {"r1": _runner({})}) is None  # no interval yet
    # 10 s with 4 desktops = 40 desktop-seconds: 30 leased, 4 resetting, 6 free.
    pool = {"leased": 30.0, "resetting": 4.0, "free": 5.0, "starting": 1.0}
    runners = {
        "r1": _runner({"setup": 2.0, "model": 8.0, "action": 3.0, "pause": 1.0,
                       "screenshot": 1.0, "other": 0.5}, steps=10, actions=9,
                      model=8.0, action=3.0, pause=1.0, screenshot=1.0, overhead=0.2),
        "r2": _runner({"model": 7.0, "action": 3.0, "evaluate": 1.0, "other": 0.5},
                      steps=5, actions=5, model=7.0, action=3.0, overhead=0.1),
    }
    u = tracker.update(10.0, pool, runners)
    assert u is not None and u["window_s"] == 10.0 and u["desktops"] == 4.0
    split = u["desktop"]
    assert set(split) == set(DESKTOP_STATES)
    assert split["leased"] == pytest.approx(30 / 40)
    assert split["acting"] == pytest.approx((2 + 3 + 1 + 3 + 1) / 40)   # setup+action+shot+eval
    assert split["model_wait"] == pytest.approx(15 / 40)
    assert split["pause"] == pytest.approx(1 / 40)
    assert split["other"] == pytest.approx((30 - 10 - 15 - 1) / 40)
    assert split["resetting"] == pytest.approx(4 / 40) and split["idle"] == pytest.approx(6 / 40)
    assert split["leased"] + split["resetting"] + split["idle"] == pytest.approx(1.0)
    assert u["actions_per_min"] == pytest.approx(60 * 14 / 10)
    assert u["step_s"] == {"model": 1.0, "action": 0.4, "pause": pytest.approx(1 / 15, abs=1e-4),
                           "screenshot": pytest.approx(1 / 15, abs=1e-4),
                           "overhead": 0.02, "steps": 15}

    # The next interval counts only what happened in it; a runner that went away stops
    # counting, a new one (or one whose totals went down: replaced) counts from zero.
    pool2 = {k: v * 2 for k, v in pool.items()}
    runners2 = {"r1": _runner({"model": 16.0, "action": 6.0}, steps=20, actions=18,
                              model=16.0, action=6.0),
                "r3": _runner({"model": 1.0}, steps=1, actions=0, model=1.0)}
    u2 = tracker.update(20.0, pool2, runners2)
    assert u2 is not None and u2["desktop"]["model_wait"] == pytest.approx((8 + 1) / 40)
    assert u2["actions_per_min"] == pytest.approx(60 * 9 / 10)
    assert u2["step_s"]["steps"] == 11


def test_runner_time_beyond_the_pools_lease_is_scaled_to_it():
    tracker = UtilizationTracker()
    tracker.update(0.0, {}, {})
    # The runners saw 12 s of busy leased time, the pool 10 s (a lease a call apart).
    u = tracker.update(10.0, {"leased": 10.0, "free": 10.0},
                       {"r": _runner({"model": 6.0, "action": 6.0})})
    assert u is not None
    split = u["desktop"]
    assert split["model_wait"] == pytest.approx(0.25) and split["acting"] == pytest.approx(0.25)
    assert split["other"] == 0.0 and split["idle"] == pytest.approx(0.5)


def test_no_desktops_and_no_steps_give_empty_figures_not_errors():
    tracker = UtilizationTracker()
    tracker.update(0.0, None, {})
    u = tracker.update(5.0, None, {})
    assert u == {"window_s": 5.0, "desktops": 0.0, "desktop": None, "actions_per_min": 0.0,
                 "step_s": None}
    assert tracker.update(5.0, None, {}) is None  # no time passed: no interval


def test_fleet_summary_from_the_supervisors_state_file(tmp_path):
    from cua_rollout.model.fleet.state import fleet_summary, write_state

    assert fleet_summary(tmp_path) is None  # no supervisor (yet)
    write_state(tmp_path, {"model_version": "v3", "endpoints": [
        {"state": "serving", "restarts": 1, "reloads": 2},
        {"state": "serving", "restarts": 0, "reloads": 2},
        {"state": "backoff", "restarts": 3, "reloads": 1}]})
    assert fleet_summary(tmp_path) == {"replicas": {"serving": 2, "backoff": 1},
                                       "restarts": 4, "reloads": 5, "model_version": "v3"}


def test_the_status_line_shows_the_utilization(capsys):
    from cua_rollout.runtime.progress import Progress

    stats = {"success_rate": 0.5, "steps_per_s": 4.0, "desktops": {"leased": 2, "free": 1},
             "utilization": {"desktop": {"leased": 0.7, "acting": 0.2, "model_wait": 0.4,
                                         "pause": 0.05, "other": 0.05, "resetting": 0.1,
                                         "idle": 0.2}, "actions_per_min": 238.4},
             "model_servers": {"summary": {"running": 3, "waiting": 1, "kv_cache_usage": 0.41,
                                           "generation_tokens_per_s": 850.2, "endpoints_up": 1,
                                           "endpoints": 2}}}
    Progress(enabled=False, total=10, done_before=0).update(4, 10, stats)
    line = capsys.readouterr().err
    assert ("desktops acting 20% model 40% pause 5% resetting 10% idle 20%  actions/min 238  "
            "servers 3 run / 1 wait, kv 41%, 850 tok/s, up 1/2") in line


def test_a_run_without_desktops_shows_its_mean_turn(capsys):
    from cua_rollout.runtime.progress import Progress

    stats = {"success_rate": 1.0, "steps_per_s": 15.0,
             "utilization": {"window_s": 5.0, "desktops": 0.0, "desktop": None,
                             "actions_per_min": 0.0,
                             "step_s": {"model": 0.412, "action": 0.051, "pause": 0.0,
                                        "screenshot": 0.0, "overhead": 0.003, "steps": 75}}}
    Progress(enabled=False, total=10, done_before=0).update(4, 10, stats)
    line = capsys.readouterr().err
    assert "turns/min 900, each model 0.41 s tools 0.05 s" in line
    assert "desktops" not in line
