"""What each desktop (and each runner) of a run did over time, from the run directory alone:
every episode attempt as segments of time on its desktop, in phases, and the share of the
desktops' time each phase took. Pure functions over the records (no matplotlib):
scripts/plot_run.py draws them.

An attempt holds its desktop from its lease (``started_at + timing.lease_wait_s``) to its
``ended_at``; in that span:

    setup        the first ``timing.reset_s`` seconds (the task's setup on the desktop)
    model        a step waiting for the model (``model_s``; an outage wait included)
    action       the step's action on the desktop (``action_s``; older runs: all of ``env_s``)
    pause        the pause after the action (``pause_s``)
    screenshot   fetching the next screenshot (``screenshot_s``)
    overhead     the rest of the step (``step_s`` minus the above)
    evaluation   the last ``timing.evaluation_s`` seconds (scoring)
    leased       on lease, in none of the above (writes between steps, an attempt whose
                 steps have no timings)

A step starts at its traj.jsonl ``timing.started_at`` (epoch s; a ``started_at`` of the line
itself is read too); its model phase is drawn from there, then action, pause, screenshot,
and the overhead at its end. Older lines have no start: it is then ``action_timestamp -
model_s`` (the stamp is taken when the reply arrived, in the writer's local time without a
zone, so the zone is found as the multiple of 15 minutes that puts the first step at the end
of the setup), else right after the previous step. Time on no attempt is idle (or the pool
resetting the desktop: the records cannot tell them apart).

metrics.jsonl's ``utilization.desktop`` (cua_rollout/runtime/utilization.py) splits the same time
into
coarser states: acting = setup + action + screenshot + evaluation, model_wait = model,
pause, other = overhead + leased; resetting and idle are IDLE here.

Attempts: the final one of each episode (results.jsonl and its directory's traj.jsonl), the
earlier lines of the episode in results.jsonl and results.superseded.jsonl (reruns of
infra errors: no steps, their files were replaced) and ``<episode>/attempt_<n>/``
directories (episode.json, traj.jsonl) when a writer keeps them. Retries inside one start of
a run leave no record of their own (only ``desktops_tried``), so they do not show.
"""

from __future__ import annotations

import calendar
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from cua_rollout.core.files import read_json
from cua_rollout.core.layout import (
    EPISODE_FILE,
    RESULTS_FILE,
    RUN_FILE,
    SUPERSEDED_RESULTS_FILE,
    TRAJ_FILE,
)
from cua_rollout.results.runs import LAYOUT_OURS, Problem, Run, read_jsonl, read_traj

__all__ = [
    "ATTEMPT_DIR_PREFIX",
    "IDLE",
    "PHASES",
    "ActivityWindow",
    "Lanes",
    "Segment",
    "activity_series",
    "desktop_time_split",
    "episode_segments",
    "lanes",
    "run_span",
]

# The phases of a desktop's time on lease, in the order they are stacked and listed.
PHASES = ("setup", "model", "action", "pause", "screenshot", "overhead", "evaluation", "leased")
# Time on no attempt: idle, or being reset by the pool.
IDLE = "idle"
# Earlier attempts' files, when a writer keeps them: <episode dir>/attempt_<n>/.
ATTEMPT_DIR_PREFIX = "attempt_"

# OSWorld's action_timestamp: local time of the writer, no zone.
_STAMP_FORMAT = "%Y%m%d@%H%M%S%f"
# UTC offsets are whole quarter hours, within +-14 h.
_ZONE_STEP_S = 900
_MAX_ZONE_S = 14 * 3600


@dataclass(frozen=True, slots=True)
class Segment:
    """A span of one attempt on its desktop in one phase. ``start``/``end``: Unix s;
    ``step``: the traj.jsonl step_num for the step phases, else None."""

    desktop: str
    runner: str
    episode_id: str
    phase: str
    start: float
    end: float
    attempt: int = 0
    step: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Lanes:
    """The lanes of a timeline: ``names`` those shown (the busiest ``limit``, in natural
    order of their names), ``segments`` each shown lane's segments, ``hidden`` the lanes left
    out (natural order), ``busy_s`` every lane's seconds in any phase."""

    names: list[str]
    segments: dict[str, list[Segment]]
    hidden: list[str]
    busy_s: dict[str, float]


@dataclass(frozen=True)
class ActivityWindow:
    """One window of ``activity_series``: ``split`` the desktops' time per phase and IDLE
    (fractions summing to 1), ``steps`` the steps that began in the window."""

    start: float
    end: float
    split: dict[str, float]
    steps: int


# --------------------------------------------------------------------------- reading


def episode_segments(run: Run, problems: list[Problem] | None = None) -> list[Segment]:
    """Every attempt of the run's episodes as segments (ordered by desktop, then start).
    Attempts without a desktop (never leased) or without times have none; OSWorld's layout
    has none at all. Unreadable traj.jsonl lines are appended to ``problems`` when given."""
    if run.layout != LAYOUT_OURS:
        return []
    found: list[Problem] = []
    segments: list[Segment] = []
    seen: set[tuple[str, float | None]] = set()
    finals: set[str] = set()
    for episode in run.episodes:
        record = episode.record
        lines, traj_problems = read_traj(episode)
        found.extend(traj_problems)
        segments += _attempt_segments(record, lines, episode.episode_id)
        seen.add((episode.episode_id, _number(record.get("started_at"))))
        finals.add(episode.episode_id)
        if episode.dir is not None and episode.dir.is_dir():
            for attempt_dir in sorted(episode.dir.glob(f"{ATTEMPT_DIR_PREFIX}*")):
                earlier = read_json(attempt_dir / EPISODE_FILE)
                if not isinstance(earlier, dict):
                    continue
                key = (episode.episode_id, _number(earlier.get("started_at")))
                if key in seen:
                    continue
                seen.add(key)
                rows, traj_problems = read_jsonl(attempt_dir / TRAJ_FILE)
                found.extend(traj_problems)
                segments += _attempt_segments(earlier, [r for _, r in rows], episode.episode_id)
    # Lines of an episode another line superseded: earlier attempts, their steps gone. The
    # archive of superseded lines is never reported on (docs/results_format.md).
    for name in (RESULTS_FILE, SUPERSEDED_RESULTS_FILE):
        rows, _ = read_jsonl(run.path / name)
        for _, record in rows:
            episode_id = _episode_id(record)
            if episode_id not in finals:  # narrowed out of the run (--min-version ...)
                continue
            key = (episode_id, _number(record.get("started_at")))
            if key in seen:
                continue
            seen.add(key)
            segments += _attempt_segments(record, [], episode_id)
    if problems is not None:
        problems.extend(found)
    segments.sort(key=lambda s: (s.desktop, s.start, s.end))
    return segments


def run_span(run: Run, segments: Sequence[Segment] = ()) -> tuple[float, float] | None:
    """The run's time span (Unix s): from its first start (run.json, earlier starts of a
    resumed run included; else the first segment) to the last of its end and the segments'
    ends. None when there is neither a start nor a segment."""
    info = read_json(run.path / RUN_FILE) if run.layout == LAYOUT_OURS else None
    starts: list[float] = []
    ends: list[float] = []
    if isinstance(info, dict):
        earlier = info.get("previous_starts")
        for item in [*(earlier if isinstance(earlier, list) else []), info]:
            if isinstance(item, dict):
                starts += [t for t in (_number(item.get("started_at")),) if t is not None]
                ends += [t for t in (_number(item.get("ended_at")),) if t is not None]
    if segments:
        ends.append(max(s.end for s in segments))
    t0 = min(starts) if starts else (min(s.start for s in segments) if segments else None)
    if t0 is None:
        return None
    t1 = max([t0, *ends])
    return (t0, t1)


def _episode_id(record: dict[str, Any]) -> str | None:
    if all(isinstance(record.get(k), str | int) for k in ("domain", "task_id", "rollout")):
        return f"{record['domain']}/{record['task_id']}/{record['rollout']}"
    value = record.get("episode_id")
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _seconds(mapping: Any, key: str) -> float:
    """A duration field: a finite number >= 0, else 0."""
    value = _number(mapping.get(key)) if isinstance(mapping, dict) else None
    return max(0.0, value) if value is not None else 0.0


def _attempt_segments(record: dict[str, Any], lines: list[dict[str, Any]],
                      episode_id: str) -> list[Segment]:  # fmt: skip
    """One attempt's segments: setup, its steps, evaluation, the gaps as ``leased``."""
    desktop = record.get("desktop")
    started, ended = _number(record.get("started_at")), _number(record.get("ended_at"))
    if ended is None and started is not None:
        duration = _number(record.get("duration_s"))
        ended = started + duration if duration is not None else None
    if not isinstance(desktop, str) or not desktop or started is None or ended is None:
        return []
    runner = record.get("runner")
    runner = runner if isinstance(runner, str) and runner else "?"
    attempt = record.get("attempt")
    attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0
    timing = record.get("timing")
    lease = min(started + _seconds(timing, "lease_wait_s"), ended)
    if ended <= lease:
        return []
    pieces: list[tuple[str, float, float, int | None]] = []
    if isinstance(timing, dict):
        setup_end = min(lease + _seconds(timing, "reset_s"), ended)
        eval_start = max(setup_end, ended - _seconds(timing, "evaluation_s"))
        if setup_end > lease:
            pieces.append(("setup", lease, setup_end, None))
        pieces += _step_pieces(lines, setup_end, eval_start)
        if ended > eval_start:
            pieces.append(("evaluation", eval_start, ended, None))
    # Whatever is not accounted for on the lease: the gaps, or all of it.
    filled: list[tuple[str, float, float, int | None]] = []
    cursor = lease
    for piece in sorted(pieces, key=lambda p: p[1]):
        if piece[1] > cursor:
            filled.append(("leased", cursor, piece[1], None))
        filled.append(piece)
        cursor = max(cursor, piece[2])
    if ended > cursor:
        filled.append(("leased", cursor, ended, None))
    return [Segment(desktop, runner, episode_id, phase, start, end, attempt, step)
            for phase, start, end, step in filled]  # fmt: skip


def _step_pieces(lines: list[dict[str, Any]], lo: float, hi: float
                 ) -> list[tuple[str, float, float, int | None]]:  # fmt: skip
    """The steps' phases, placed in [lo, hi] one after the other (a step never starts before
    the previous one ended) and cut at ``hi``."""
    pieces: list[tuple[str, float, float, int | None]] = []
    cursor = lo
    zone: float | None = None  # the writer's UTC offset, worked out at the first stamp
    zone_known = False
    for i, line in enumerate(lines):
        timing = line.get("timing")
        if not isinstance(timing, dict):
            continue
        model_s, env_s = _seconds(timing, "model_s"), _seconds(timing, "env_s")
        step = line.get("step_num")
        step = step if isinstance(step, int) and not isinstance(step, bool) else i + 1
        start = _number(timing.get("started_at"))
        if start is None:
            start = _number(line.get("started_at"))
        if start is None:
            # The stamp is taken when the reply arrived: the step began model_s before.
            stamp = line.get("action_timestamp")
            if (epoch := _number(stamp)) is not None:
                start = epoch - model_s
            elif (local := _stamp_as_utc(stamp)) is not None:
                if not zone_known:
                    zone, zone_known = _writer_zone(lines, lo), True
                if zone is not None:
                    start = local - zone - model_s
        if start is None or not lo - _ZONE_STEP_S / 2 <= start <= hi:
            start = cursor  # nothing usable, or not in this attempt: right after the last
        start = max(start, cursor)
        if any(k in timing for k in ("action_s", "pause_s", "screenshot_s")):
            env = [("action", _seconds(timing, "action_s")), ("pause", _seconds(timing, "pause_s")),
                   ("screenshot", _seconds(timing, "screenshot_s"))]  # fmt: skip
        else:
            env = [("action", env_s)]
        parts = [("model", model_s), *env]
        step_s = _number(timing.get("step_s"))
        busy = sum(d for _, d in parts)
        total = max(busy, step_s) if step_s is not None else busy + _seconds(timing, "overhead_s")
        parts.append(("overhead", total - busy))
        t = start
        for phase, seconds in parts:
            end = min(t + seconds, hi)
            if end > t:
                pieces.append((phase, t, end, step))
            t += seconds
        cursor = min(max(cursor, start + total), hi)
    return pieces


def _stamp_as_utc(stamp: Any) -> float | None:
    """An action_timestamp read as if it were UTC (its zone is unknown)."""
    if not isinstance(stamp, str):
        return None
    try:
        parsed = datetime.strptime(stamp, _STAMP_FORMAT)
    except ValueError:
        return None
    return calendar.timegm(parsed.timetuple()) + parsed.microsecond / 1e6


def _writer_zone(lines: list[dict[str, Any]], setup_end: float) -> float | None:
    """The writer's UTC offset (s) of the action_timestamps: the quarter hour that puts the
    first stamped step's start (stamp - model_s) nearest the end of the setup, where the
    first step begins. None when no step is stamped or no zone fits (a stamp of another
    day)."""
    for line in lines:
        local = _stamp_as_utc(line.get("action_timestamp"))
        if local is None:
            continue
        start = local - _seconds(line.get("timing"), "model_s")
        zone = round((start - setup_end) / _ZONE_STEP_S) * _ZONE_STEP_S
        return float(zone) if abs(zone) <= _MAX_ZONE_S else None
    return None


# --------------------------------------------------------------------------- lanes


def _natural(name: str) -> list[Any]:
    # "desktop-9" before "desktop-10": digits compare as numbers (split keeps str/int apart).
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))]


def lanes(segments: Iterable[Segment], by: Literal["desktop", "runner"] = "desktop",
          limit: int | None = None) -> Lanes:  # fmt: skip
    """The timeline's lanes. ``by="desktop"``: one lane per desktop. ``by="runner"``: a
    runner runs several episodes at once, so each runner has as many lanes as it had
    attempts at once (``<runner>/<k>``, an attempt in the first lane free at its lease).
    ``limit``: keep the busiest lanes only (ties: by name)."""
    rows: dict[str, list[Segment]] = {}
    if by == "desktop":
        for s in segments:
            rows.setdefault(s.desktop, []).append(s)
    elif by == "runner":
        spans: dict[tuple[str, str, int], list[Segment]] = {}
        for s in segments:
            spans.setdefault((s.runner, s.episode_id, s.attempt), []).append(s)
        ordered = sorted(spans.items(), key=lambda kv: (min(s.start for s in kv[1]), kv[0]))
        free_at: dict[str, list[float]] = {}  # per runner: when each of its lanes frees
        for (runner, _, _), group in ordered:
            start, end = min(s.start for s in group), max(s.end for s in group)
            ends = free_at.setdefault(runner, [])
            k = next((k for k, e in enumerate(ends) if e <= start), len(ends))
            if k == len(ends):
                ends.append(end)
            else:
                ends[k] = end
            rows.setdefault(f"{runner}/{k}", []).extend(group)
    else:
        raise ValueError(f"by: 'desktop' or 'runner', not {by!r}")
    busy = {name: sum(s.duration for s in group) for name, group in rows.items()}
    chosen = sorted(rows, key=lambda n: (-busy[n], _natural(n)))
    if limit is not None:
        chosen = chosen[: max(0, limit)]
    shown = sorted(chosen, key=_natural)
    hidden = sorted(set(rows) - set(chosen), key=_natural)
    for group in rows.values():
        group.sort(key=lambda s: s.start)
    return Lanes(shown, {n: rows[n] for n in shown}, hidden, busy)


# --------------------------------------------------------------------------- time split


def desktop_time_split(segments: Iterable[Segment], t0: float, t1: float, *,
                       desktops: int | None = None) -> dict[str, float]:  # fmt: skip
    """The share of the desktops' time in [t0, t1] spent in each phase of PHASES, and IDLE
    (the rest): fractions that sum to 1. The desktops are those of the segments unless
    ``desktops`` says how many there were (a desktop that never ran an attempt counts only
    then)."""
    windows = activity_series(segments, t0, t1, max(t1 - t0, 1e-9), desktops=desktops)
    return windows[0].split if windows else {**dict.fromkeys(PHASES, 0.0), IDLE: 1.0}


def activity_series(segments: Iterable[Segment], t0: float, t1: float, window_s: float, *,
                    desktops: int | None = None) -> list[ActivityWindow]:  # fmt: skip
    """``desktop_time_split`` of each window of ``window_s`` seconds from t0 (the last one
    ends at t1) and the steps that began in it; one pass over the segments."""
    if not window_s > 0:
        raise ValueError(f"window_s: must be > 0, got {window_s}")
    if t1 <= t0:
        return []
    n = max(1, math.ceil((t1 - t0) / window_s - 1e-9))
    bounds = [(t0 + k * window_s, min(t0 + (k + 1) * window_s, t1)) for k in range(n)]
    busy = [dict.fromkeys(PHASES, 0.0) for _ in range(n)]
    names: set[str] = set()
    step_starts: dict[tuple[str, int, int], float] = {}
    for s in segments:
        names.add(s.desktop)
        if s.step is not None:
            key = (s.episode_id, s.attempt, s.step)
            step_starts[key] = min(s.start, step_starts.get(key, s.start))
        a, b = max(s.start, t0), min(s.end, t1)
        if b <= a or s.phase not in busy[0]:
            continue
        for k in range(min(n - 1, int((a - t0) // window_s)), n):
            lo, hi = bounds[k]
            if lo >= b:
                break
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                busy[k][s.phase] += overlap
    steps = [0] * n
    for start in step_starts.values():
        if t0 <= start < t1:
            steps[min(n - 1, int((start - t0) // window_s))] += 1
    count = desktops if desktops is not None else len(names)
    out = []
    for (lo, hi), phases, began in zip(bounds, busy, steps, strict=True):
        capacity = count * (hi - lo)
        split = {p: (v / capacity if capacity > 0 else 0.0) for p, v in phases.items()}
        split[IDLE] = max(0.0, 1.0 - sum(split.values())) if capacity > 0 else 1.0
        out.append(ActivityWindow(lo, hi, split, began))
    return out
