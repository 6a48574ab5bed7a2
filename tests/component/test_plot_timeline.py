"""The run timeline (cua_rollout.results.timeline) and plot_run.py's timeline and utilization
plots, on a run directory written by hand (with the storage's file helpers) whose segments
and time split are worked out below, and on an older run without the new timing fields."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from cua_rollout.cli import plot_run, view_trajectory
from cua_rollout.core.files import append_text, write_atomic
from cua_rollout.core.layout import (
    EPISODE_FILE,
    METRICS_FILE,
    RESULTS_FILE,
    RUN_FILE,
    SUPERSEDED_RESULTS_FILE,
    TRAJ_FILE,
)
from cua_rollout.results import load_run
from cua_rollout.results.timeline import (
    ATTEMPT_DIR_PREFIX,
    IDLE,
    PHASES,
    Segment,
    activity_series,
    desktop_time_split,
    episode_segments,
    lanes,
    run_span,
)
from tests.results_fixtures import RUN_A, make_run, traj_line

T0 = 1_700_000_000.0
RUN_END = 70.0  # run.json ended_at - T0
# The writer of action_timestamp lived at UTC-5: its stamps are local times of that zone.
WRITER_ZONE = timezone(timedelta(hours=-5))


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(T0 + t, tz=WRITER_ZONE).strftime("%Y%m%d@%H%M%S%f")


def _record(episode_id: str, *, desktop: str | None, runner: str, start: float, end: float,
            timing: dict[str, float] | None, steps: int = 0, attempt: int = 0,
            status: str = "success") -> dict[str, Any]:  # fmt: skip
    domain, task_id, rollout = episode_id.split("/")
    record = {
        "episode_id": episode_id, "task_id": task_id, "domain": domain, "rollout": int(rollout),
        "attempt": attempt, "status": status,
        "reward": {"success": 1.0, "failure": 0.0}.get(status), "steps": steps,
        "started_at": T0 + start, "ended_at": T0 + end, "duration_s": end - start,
        "desktop": desktop, "desktops_tried": [desktop] if desktop else [], "error": None,
        "instruction": f"do {task_id}", "runner": runner, "node": "node-0",
    }  # fmt: skip
    if timing is not None:
        record["timing"] = {"model_s": 0.0, "env_s": 0.0, "overhead_s": 0.0, "reset_s": 0.0,
                            "evaluation_s": 0.0, "lease_wait_s": 0.0, **timing}  # fmt: skip
    return record


def _step(n: int, *, model_s: float, step_s: float, env_s: float = 0.0, overhead_s: float = 0.0,
          started_at: float | None = None, stamp: str | None = None,
          **env_parts: float) -> dict[str, Any]:  # fmt: skip
    """A traj.jsonl line; ``started_at`` (run seconds) and ``env_parts`` (action_s, pause_s,
    screenshot_s) are the new fields, ``stamp`` the action_timestamp of an older writer."""
    line = traj_line(n, 0.0, False, model_s=model_s, env_s=env_s)
    line["timing"] = {"model_s": model_s, "env_s": env_s, "overhead_s": overhead_s,
                      "step_s": step_s, **env_parts}  # fmt: skip
    if started_at is not None:  # where trajectory_runner writes it
        line["timing"]["started_at"] = T0 + started_at
    line["action_timestamp"] = stamp if stamp is not None else "n/a"
    return line


def _new_step(n: int, start: float, model_s: float, action_s: float, pause_s: float,
              screenshot_s: float, step_s: float) -> dict[str, Any]:  # fmt: skip
    env_s = action_s + pause_s + screenshot_s
    return _step(n, model_s=model_s, env_s=env_s, overhead_s=step_s - model_s - env_s,
                 step_s=step_s, started_at=start, action_s=action_s, pause_s=pause_s,
                 screenshot_s=screenshot_s)  # fmt: skip


def _write_episode(run_dir: Path, record: dict[str, Any], lines: list[dict[str, Any]],
                   sub: str = "") -> None:  # fmt: skip
    directory = run_dir / record["episode_id"] / sub
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / EPISODE_FILE, json.dumps(record).encode())
    for line in lines:
        append_text(directory / TRAJ_FILE, json.dumps(line) + "\n")


# Each attempt's segments, worked out by hand: (desktop, phase, start, end) in run seconds.
EXPECTED: dict[tuple[str, int], list[tuple[str, str, float, float]]] = {
    # New step fields. Lease at 10 + 2; setup 3 s; a 0.5 s gap between the steps and 1.5 s
    # before the evaluation (the last 2 s) are on lease in no phase.
    ("chrome/a/0", 0): [
        ("d2", "setup", 12, 15),
        ("d2", "model", 15, 19), ("d2", "action", 19, 20), ("d2", "pause", 20, 20.5),
        ("d2", "screenshot", 20.5, 21), ("d2", "overhead", 21, 22),
        ("d2", "leased", 22, 22.5),
        ("d2", "model", 22.5, 24.5), ("d2", "action", 24.5, 25.5),
        ("d2", "screenshot", 25.5, 26), ("d2", "overhead", 26, 26.5),
        ("d2", "leased", 26.5, 28), ("d2", "evaluation", 28, 30),
    ],
    # Older steps: the start is the stamp (UTC-5 local time) minus model_s; env_s is one
    # action block.
    ("chrome/a/1", 0): [
        ("d1", "setup", 0, 5),
        ("d1", "model", 5, 8), ("d1", "action", 8, 10), ("d1", "overhead", 10, 11),
        ("d1", "model", 11, 13), ("d1", "action", 13, 14), ("d1", "overhead", 14, 14.5),
        ("d1", "evaluation", 14.5, 16),
    ],
    # Older steps without a usable stamp: one after the other from the end of the setup.
    ("os/b/0", 0): [
        ("d1", "setup", 21, 23),
        ("d1", "model", 23, 24), ("d1", "action", 24, 25),
        ("d1", "model", 25, 26), ("d1", "action", 26, 26.5),
        ("d1", "leased", 26.5, 29.5), ("d1", "evaluation", 29.5, 30),
    ],
    # A retry: the final attempt (1) ...
    ("os/c/0", 1): [
        ("d2", "setup", 40, 42),
        ("d2", "model", 42, 43), ("d2", "action", 43, 43.5), ("d2", "pause", 43.5, 44),
        ("d2", "evaluation", 44, 45),
    ],
    # ... and its first attempt, an infra_error after the setup, in results.superseded.jsonl.
    ("os/c/0", 0): [("d0", "setup", 30.5, 34.5), ("d0", "leased", 34.5, 35)],
    # An infra_error without steps (5 s waiting for the lease).
    ("os/d/0", 0): [("d0", "setup", 55, 56.5), ("d0", "leased", 56.5, 57)],
    # A record without timing: one block on lease.
    ("os/f/0", 0): [("d0", "leased", 60, 64)],
    # Another retry: the final attempt's setup failed; the first one's files are kept in
    # attempt_0/ (episode.json, traj.jsonl).
    ("os/g/0", 1): [("d2", "setup", 50, 52)],
    ("os/g/0", 0): [
        ("d0", "setup", 45, 46), ("d0", "model", 46, 47), ("d0", "action", 47, 48),
        ("d0", "leased", 48, 49),
    ],
}  # fmt: skip
# Seconds per phase over all attempts: 64.5 s of 3 desktops x 70 s.
PHASE_SECONDS = {"setup": 20.5, "model": 15, "action": 8, "pause": 1, "screenshot": 1,
                 "overhead": 3, "evaluation": 5, "leased": 11}  # fmt: skip
RUNNERS = {"chrome/a/0": "r0", "chrome/a/1": "r0", "os/b/0": "r1", "os/c/0": "r1",
           "os/d/0": "r1", "os/f/0": "r0", "os/g/0": "r0"}  # fmt: skip


def make_hand_run(root: Path, *, metrics: str = "new") -> Path:
    """The run of EXPECTED. ``metrics``: "new" (samples with utilization and model_servers),
    "old" (samples without them) or "none" (no metrics.jsonl)."""
    run = root / "hand"
    run.mkdir(parents=True)
    final = [
        (_record("chrome/a/0", desktop="d2", runner="r0", start=10, end=30, steps=2,
                 timing={"lease_wait_s": 2, "reset_s": 3, "evaluation_s": 2, "model_s": 6}),
         [_new_step(1, 15, 4, 1, 0.5, 0.5, 7), _new_step(2, 22.5, 2, 1, 0, 0.5, 4)]),
        (_record("chrome/a/1", desktop="d1", runner="r0", start=0, end=16, steps=2,
                 status="failure", timing={"reset_s": 5, "evaluation_s": 1.5}),
         [_step(1, model_s=3, env_s=2, overhead_s=1, step_s=6, stamp=_stamp(8)),
          _step(2, model_s=2, env_s=1, overhead_s=0.5, step_s=3.5, stamp=_stamp(13))]),
        (_record("os/b/0", desktop="d1", runner="r1", start=20, end=30, steps=2,
                 timing={"lease_wait_s": 1, "reset_s": 2, "evaluation_s": 0.5}),
         [_step(1, model_s=1, env_s=1, step_s=2), _step(2, model_s=1, env_s=0.5, step_s=1.5)]),
        (_record("os/c/0", desktop="d2", runner="r1", start=40, end=45, steps=1, attempt=1,
                 timing={"reset_s": 2, "evaluation_s": 1}),
         [_new_step(1, 42, 1, 0.5, 0.5, 0, 2)]),
        (_record("os/d/0", desktop="d0", runner="r1", start=50, end=57, status="infra_error",
                 timing={"lease_wait_s": 5, "reset_s": 1.5}), []),
        (_record("os/e/0", desktop=None, runner="r1", start=58, end=68, status="infra_error",
                 timing={"lease_wait_s": 10}), []),
        (_record("os/f/0", desktop="d0", runner="r0", start=60, end=64, status="failure",
                 timing=None), []),
        (_record("os/g/0", desktop="d2", runner="r0", start=50, end=52, attempt=1,
                 status="infra_error", timing={"reset_s": 2}), []),
    ]  # fmt: skip
    for record, lines in final:
        _write_episode(run, record, lines)
        append_text(run / RESULTS_FILE, json.dumps(record) + "\n")
    retried = _record("os/c/0", desktop="d0", runner="r0", start=30, end=35, attempt=0,
                      status="infra_error", timing={"lease_wait_s": 0.5, "reset_s": 4})
    append_text(run / SUPERSEDED_RESULTS_FILE, json.dumps(retried) + "\n")
    first = _record("os/g/0", desktop="d0", runner="r0", start=45, end=49, attempt=0, steps=1,
                    status="infra_error", timing={"reset_s": 1})
    step = _new_step(1, 46, 1, 1, 0, 0, 2)
    step["started_at"] = step["timing"].pop("started_at")  # the line's own field is read too
    _write_episode(run, first, [step], f"{ATTEMPT_DIR_PREFIX}0")
    write_atomic(run / RUN_FILE, json.dumps({
        "run": "hand", "started_at": T0, "ended_at": T0 + RUN_END, "status": "finished",
    }).encode())  # fmt: skip
    if metrics != "none":
        for k in range(8):
            sample: dict[str, Any] = {
                "t": T0 + 10 * k, "elapsed_s": 10.0 * k, "episodes_done": k, "steps": 2 * k,
                "steps_per_s": 0.2, "desktops": {"free": 1, "leased": 2, "resetting": 0,
                                                 "quarantined": 0, "starting": 0},
            }  # fmt: skip
            if metrics == "new":
                sample["utilization"] = {
                    "window_s": 10, "desktops": 3, "actions_per_min": 12.0 + k,
                    "desktop": {"leased": 0.6, "acting": 0.2, "model_wait": 0.3, "pause": 0.05,
                                "other": 0.05, "resetting": 0.1, "idle": 0.3},
                    "step_s": {"model": 2.0, "action": 1.0, "pause": 0.5, "screenshot": 0.3,
                               "overhead": 0.2, "steps": 4},
                }  # fmt: skip
                sample["model_servers"] = {
                    "endpoints": [{"url": "http://e0/v1", "up": True, "running": 2,
                                   "waiting": k % 3, "kv_cache_usage": 0.1 * k}],
                    "summary": {"running": 2, "waiting": k % 3, "kv_cache_usage": 0.1 * k,
                                "endpoints_up": 1, "endpoints": 1},
                }  # fmt: skip
            append_text(run / METRICS_FILE, json.dumps(sample) + "\n")
    return run


@pytest.fixture
def hand_run(tmp_path: Path) -> Path:
    return make_hand_run(tmp_path)


def _by_attempt(segments: list[Segment]) -> dict[tuple[str, int], list[tuple]]:
    got: dict[tuple[str, int], list[tuple]] = {}
    for s in sorted(segments, key=lambda s: s.start):
        got.setdefault((s.episode_id, s.attempt), []).append(
            (s.desktop, s.phase, round(s.start - T0, 6), round(s.end - T0, 6)))
    return got


# --------------------------------------------------------------------------- segments


def test_segments_of_every_attempt_as_worked_out(hand_run):
    problems: list = []
    segments = episode_segments(load_run(hand_run), problems)
    assert problems == []
    assert _by_attempt(segments) == {k: [(d, p, float(a), float(b)) for d, p, a, b in v]
                                     for k, v in EXPECTED.items()}  # fmt: skip
    # Never leased (os/e/0): no segment. Every segment names its runner; step phases their
    # step.
    assert {s.episode_id: s.runner for s in segments} == RUNNERS
    assert {s.step for s in segments if s.phase == "model"} == {1, 2}
    assert all(s.step is None for s in segments if s.phase in ("setup", "evaluation"))
    assert run_span(load_run(hand_run), segments) == (T0, T0 + RUN_END)


def test_an_older_run_reads_too(tmp_path):
    # tests/results_fixtures: stamps of another day than the records (no zone fits) and no
    # new fields: the steps follow the setup (0.2 s) one after the other.
    run = load_run(make_run(tmp_path, "old", RUN_A))
    segments = episode_segments(run)
    first = [s for s in segments if s.episode_id == "chrome/t1/0"]
    start = run.episodes[0].started_at
    assert [(s.phase, round(s.start - start, 6)) for s in first[:4]] == [
        ("setup", 0.0), ("model", 0.2), ("action", 0.7), ("overhead", 0.95)]
    # Every attempt spans its record; the never-timed rest of an episode is "leased".
    assert {s.episode_id for s in segments} == {e.episode_id for e in run.episodes}
    assert sum(s.duration for s in segments) == pytest.approx(sum(e.duration_s for e in RUN_A))


def test_an_osworld_run_has_no_segments(tmp_path):
    from tests.results_fixtures import make_osworld_run

    run = load_run(make_osworld_run(tmp_path))
    assert episode_segments(run) == [] and run_span(run) is None


# --------------------------------------------------------------------------- split, lanes


def test_desktop_time_split_by_hand(hand_run):
    segments = episode_segments(load_run(hand_run))
    split = desktop_time_split(segments, T0, T0 + RUN_END)
    assert list(split) == [*PHASES, IDLE]
    capacity = 3 * RUN_END
    for phase, seconds in PHASE_SECONDS.items():
        assert split[phase] == pytest.approx(seconds / capacity), phase
    assert split[IDLE] == pytest.approx(1 - 64.5 / capacity)
    assert sum(split.values()) == pytest.approx(1.0)
    # 10 s to 20 s: d1 overhead 1 + 0.5, model 2, action 1, evaluation 1.5; d2 setup 3,
    # model 4, action 1; d0 nothing: 14 s of 30.
    window = desktop_time_split(segments, T0 + 10, T0 + 20)
    assert {k: round(v * 30, 6) for k, v in window.items() if v} == {
        "overhead": 1.5, "model": 6, "action": 2, "evaluation": 1.5, "setup": 3, IDLE: 16}
    # Four desktops, one of which never ran anything.
    assert desktop_time_split(segments, T0, T0 + RUN_END, desktops=4)[IDLE] == pytest.approx(
        1 - 64.5 / (4 * RUN_END))
    assert desktop_time_split([], T0, T0 + 1)[IDLE] == 1.0


def test_activity_series_windows_and_steps(hand_run):
    segments = episode_segments(load_run(hand_run))
    windows = activity_series(segments, T0, T0 + RUN_END, 10)
    assert [(w.start - T0, w.end - T0) for w in windows] == [(10.0 * k, 10.0 * k + 10)
                                                             for k in range(7)]  # fmt: skip
    # Steps begin at 5, 11, 15, 22.5, 23, 25, 42, 46.
    assert [w.steps for w in windows] == [1, 2, 3, 0, 2, 0, 0]
    assert windows[1].split == pytest.approx(desktop_time_split(segments, T0 + 10, T0 + 20))
    # The windows add up to the whole run's split; a last window shorter than the others.
    total = {p: sum(w.split[p] for w in windows) / 7 for p in PHASES}
    assert total == pytest.approx({p: s / 210 for p, s in PHASE_SECONDS.items()})
    short = activity_series(segments, T0, T0 + 25, 10)
    assert [w.end - T0 for w in short] == [10, 20, 25]
    with pytest.raises(ValueError):
        activity_series(segments, T0, T0 + 1, 0)


def test_lanes_order_and_cap(hand_run):
    segments = episode_segments(load_run(hand_run))
    every = lanes(segments)
    assert every.names == ["d0", "d1", "d2"] and every.hidden == []
    assert every.busy_s == pytest.approx({"d0": 14.5, "d1": 25, "d2": 25})
    assert [s.start - T0 for s in every.segments["d1"]][:2] == [0, 5]
    # The busiest two, in the order of their names.
    capped = lanes(segments, limit=2)
    assert capped.names == ["d1", "d2"] and capped.hidden == ["d0"]
    assert set(capped.segments) == {"d1", "d2"}
    # Runners run attempts at once: r0's second lane takes chrome/a/0 (12 s to 30 s) while
    # chrome/a/1 (0 s to 16 s) holds the first.
    runners = lanes(segments, "runner")
    assert runners.names == ["r0/0", "r0/1", "r1/0"]
    assert {s.episode_id for s in runners.segments["r0/1"]} == {"chrome/a/0"}
    assert {s.episode_id for s in runners.segments["r0/0"]} == {
        "chrome/a/1", "os/c/0", "os/g/0", "os/f/0"}
    # Names with numbers sort as numbers; ties in busy time go by name.
    fake = [Segment(f"desktop-{n}", "r", f"d/t/{n}", "model", 0, 1) for n in (10, 9, 1, 100)]
    assert lanes(fake).names == ["desktop-1", "desktop-9", "desktop-10", "desktop-100"]
    assert lanes(fake, limit=3).hidden == ["desktop-100"]
    with pytest.raises(ValueError):
        lanes(fake, "node")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- plot_run.py


def _png(path: Path) -> tuple[int, int]:
    assert path.stat().st_size > 0
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_plot_run_timeline_and_utilization(hand_run, tmp_path, capsys):
    out = tmp_path / "plots"
    assert plot_run.main([str(hand_run), "--plots", "timeline", "utilization",
                          "--out", str(out)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    made = sorted(p.name for p in out.iterdir())
    assert made == ["timeline.png", "timeline_runners.png", "utilization.png"]
    for name in made:
        width, height = _png(out / name)
        assert width >= 1000 and height >= 250
    assert "timeline_runners: " in captured.out and "progress" not in captured.out
    # The samples carry the utilization and the model servers: nothing skipped.
    assert "no utilization samples" not in captured.err
    assert "model servers" not in captured.err


def test_plot_run_draws_one_bar_call_per_lane_and_phase(hand_run, tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    calls: list[int] = []
    original = Axes.broken_barh

    def counted(self, xranges, *args, **kwargs):
        calls.append(len(xranges))
        return original(self, xranges, *args, **kwargs)

    monkeypatch.setattr(Axes, "broken_barh", counted)
    assert plot_run.main([str(hand_run), "--plots", "timeline", "--lanes", "2",
                          "--out", str(tmp_path / "p")]) == 0  # fmt: skip
    # timeline.png: d1 (idle, 6 phases) and d2 (idle, 8 phases) of the two busiest lanes;
    # timeline_runners.png: r0/0 and r0/1 (r1/0 is the least busy).
    desktops = 1 + 6 + 1 + 8
    r0_0 = 1 + len({p for (e, a), v in EXPECTED.items() if RUNNERS[e] == "r0"
                    and e != "chrome/a/0" for _, p, _, _ in v})  # fmt: skip
    r0_1 = 1 + len({p for _, p, _, _ in EXPECTED[("chrome/a/0", 0)]})
    assert len(calls) == desktops + r0_0 + r0_1


def test_plot_run_on_a_run_without_the_new_fields(tmp_path, capsys):
    # The samples of an older run: the desktop split comes from the timeline.
    run = make_hand_run(tmp_path, metrics="old")
    assert plot_run.main([str(run), "--plots", "all", "--out", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    assert "no utilization samples, the desktop split comes from the timeline" in err
    assert "no model_servers samples, skipping the model servers panel" in err
    for name in ("timeline", "timeline_runners", "utilization", "progress"):
        _png(tmp_path / "p" / f"{name}.png")
    # results_fixtures' run (a stamp format of another day, no new fields), no metrics.
    old = make_run(tmp_path, "old", RUN_A, metrics=False)
    assert plot_run.main([str(old), "--plots", "timeline", "utilization"]) == 0
    assert sorted(p.name for p in (old / "plots").iterdir()) == [
        "timeline.png", "timeline_runners.png", "utilization.png"]


def test_plot_run_skips_the_timeline_without_desktop_times(tmp_path, capsys):
    from tests.results_fixtures import make_osworld_run

    run = make_osworld_run(tmp_path)
    assert plot_run.main([str(run), "--plots", "timeline", "utilization",
                          "--out", str(tmp_path / "p")]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "skipping the timeline" in captured.err
    assert "skipping the utilization plot" in captured.err
    assert "timeline: skipped" in captured.out and "timeline_runners: skipped" in captured.out
    assert list((tmp_path / "p").iterdir()) == []


def test_plot_run_options(hand_run, capsys):
    for argv in (["--lanes", "0"], ["--plots", "nope"]):
        with pytest.raises(SystemExit) as exc:
            plot_run.main([str(hand_run), *argv])
        assert exc.value.code == 2
    capsys.readouterr()
    # Default: every plot (the timeline's runner lanes in a second file).
    assert plot_run.main([str(hand_run)]) == 0
    assert sorted(p.stem for p in (hand_run / "plots").iterdir()) == sorted(
        (*plot_run.PLOTS, "timeline_runners"))


# --------------------------------------------------------------------------- the viewer


def test_the_viewer_shows_the_timeline(hand_run, tmp_path):
    out = tmp_path / "view"
    assert view_trajectory.main([str(hand_run), "--out", str(out)]) == 0
    index = (out / "index.html").read_text()
    assert "plot_run.py RUN_DIR --plots timeline utilization" in index  # how to draw it
    assert plot_run.main([str(hand_run), "--plots", "timeline", "utilization"]) == 0
    assert view_trajectory.main([str(hand_run), "--out", str(out)]) == 0
    index = (out / "index.html").read_text()
    assert '<img src="plots/timeline.png"' in index
    assert 'href="plots/timeline_runners.png"' in index and 'href="plots/utilization.png"' in index
    placed = out / "plots" / "timeline.png"
    assert placed.stat().st_ino == (hand_run / "plots" / "timeline.png").stat().st_ino
    # Plots drawn elsewhere: --plots-dir.
    elsewhere = tmp_path / "elsewhere"
    assert plot_run.main([str(hand_run), "--plots", "timeline", "--out", str(elsewhere)]) == 0
    other = tmp_path / "view2"
    assert view_trajectory.main([str(hand_run), "--out", str(other),
                                 "--plots-dir", str(elsewhere)]) == 0  # fmt: skip
    assert (other / "plots" / "timeline.png").is_file()
    assert not (other / "plots" / "utilization.png").exists()
