"""A static, offline HTML report of a run's trajectories: index.html, a sortable table of
tasks x rollouts (under the run's timeline, when plot_run.py drew it), and a page per episode
with each step's screenshot, the action drawn over it, thought, response and timings. A text
episode's page (math, py, rag, web: docs/text_modes.md) has no images: the question, each
turn's reply and tool calls (arguments, output, return code, error), and the final answer
against the task's reference answer, its metric and score. Exit codes: 0, 2 on bad usage or
RUN_DIR missing.

One file on purpose: a self-contained report generator (its HTML, CSS and the pages of both
episode kinds), with no state shared with the rest of the package."""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cua_rollout.core.layout import MESSAGES_FILE, TASK_CONFIG_FILE, screenshot_name
from cua_rollout.core.retention import read_marker
from cua_rollout.results import (
    Episode,
    Problem,
    Run,
    add_out_dir,
    compute_rates,
    fail,
    fmt_float,
    fmt_rate,
    k_label,
    make_out_dir,
    open_run,
    read_traj,
    report_problems,
    results_parser,
    summarize_tasks,
)
from cua_rollout.results.text import text_summary

__all__ = ["main"]

EPISODES_DIR = "episodes"
# plot_run.py's run-level figures the index shows (the first) or links, when they exist.
PLOTS_DIR = "plots"
RUN_PLOTS = ("timeline.png", "timeline_runners.png", "utilization.png")
# Overlay sizes are in screen pixels of a 1280-wide screen and scale with the screenshot.
_REFERENCE_WIDTH_PX = 1280
_MARKER_RADIUS_PX = 18
_FONT_PX = 22
_SCROLL_ARROW_PX = 120
_LABEL_MAX_CHARS = 80
_SCROLL_VECTORS = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
# A text episode's tool call: what a return code other than 0 (ran) says; the codes of
# cua_rollout/agents/tool.py's TOOL_FAILED, TOOL_MALFORMED, TOOL_UNKNOWN, TOOL_OVER_LIMIT (the
# results scripts read run directories only, they import nothing of the runner's).
_TOOL_RETURNCODES = {
    1: "tool error",
    2: "arguments not a JSON object",
    3: "unknown tool",
    4: "over the per-turn limit, not run",
}

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; }
th[data-col] { cursor: pointer; background: #f0f0f0; user-select: none; }
th[data-dir=asc]::after { content: " \\25B2"; }
th[data-dir=desc]::after { content: " \\25BC"; }
td.num { text-align: right; }
.st-success { background: #d7f5d7; } .st-failure { background: #f8d7d7; }
.st-max_steps, .st-timeout { background: #fbe9c8; }
.st-infra_error, .st-cancelled { background: #e0e0e0; color: #555; }
.step, .final { border-top: 2px solid #888; margin-top: 1.5em; padding-top: .5em; }
.cols { display: flex; gap: 1.5em; align-items: flex-start; }
.shot { flex: 0 0 62%; margin: 0; }
/* The overlay covers exactly the image (not the caption under it), so its viewBox in
   screen pixels lands where the action happened. */
.shot .frame { position: relative; }
.shot img { display: block; width: 100%; height: auto; background: #333; }
.shot svg { position: absolute; left: 0; top: 0; width: 100%; height: 100%; pointer-events: none; }
.text { flex: 1; min-width: 0; }
pre { white-space: pre-wrap; word-break: break-word; background: #f6f6f6; padding: .5em; }
.missing { padding: 3em 1em; background: #eee; color: #a00; }
.timeline img { max-width: 100%; height: auto; }
.warn { color: #a00; }
"""

# Text episodes' pages only: desktop pages keep _CSS alone.
_TEXT_CSS = """
.turn, .answer { border-top: 2px solid #888; margin-top: 1.5em; padding-top: .5em; }
.tool-call { border-left: 4px solid #9bc; margin: .8em 0; padding: 0 0 0 .8em; }
.tool-call.failed { border-left-color: #d33; background: #fdf0f0; }
.tool-call.failed .rc, .tool-error { color: #a00; font-weight: bold; }
.tool-call h4 { margin: .3em 0; font-weight: normal; }
.empty { color: #777; font-style: italic; }
table.answer th { text-align: left; }
table.answer pre { margin: 0; }
"""

_SORT_JS = """
"use strict";
function sortBy(th) {
  const row = th.parentNode, idx = Array.prototype.indexOf.call(row.children, th);
  const dir = th.dataset.dir === "asc" ? "desc" : "asc";
  for (const h of row.children) { delete h.dataset.dir; }
  th.dataset.dir = dir;
  const numeric = th.dataset.type === "num", sign = dir === "asc" ? 1 : -1;
  const tbody = th.closest("table").tBodies[0];
  const key = (tr) => {
    const cell = tr.cells[idx];
    const raw = cell ? (cell.dataset.sort ?? cell.textContent.trim()) : "";
    return numeric ? (raw === "" ? NaN : Number(raw)) : raw;
  };
  const rows = Array.from(tbody.rows);
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    if (numeric) {
      // Cells without a figure go last in both directions.
      if (Number.isNaN(x) || Number.isNaN(y)) { return Number.isNaN(x) - Number.isNaN(y); }
      return sign * (x - y);
    }
    return sign * x.localeCompare(y, undefined, { numeric: true });
  });
  for (const tr of rows) { tbody.appendChild(tr); }
}
for (const th of document.querySelectorAll("th[data-col]")) {
  th.addEventListener("click", () => sortBy(th));
}
function sortFromHash() {
  const m = /^#sort=([\\w-]+)(?::(asc|desc))?$/.exec(location.hash);
  if (!m) { return; }
  const th = document.querySelector('th[data-col="' + m[1] + '"]');
  if (!th) { return; }
  th.click();
  if (th.dataset.dir !== (m[2] || "asc")) { th.click(); }
}
sortFromHash();
window.addEventListener("hashchange", sortFromHash);
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _page(title: str, body: str, *, script: str = "", css: str = "") -> str:
    tail = f"<script>{script}</script>\n" if script else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>{_e(title)}</title>\n<style>{_CSS}{css}</style></head>\n"
        f"<body>\n{body}\n{tail}</body></html>\n"
    )


# --------------------------------------------------------------------------- images


def _place_image(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (a copy across file systems); reruns replace it."""
    if dst.exists():
        if dst.samefile(src):
            return
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _image_size(path: Path) -> tuple[int, int] | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, UnidentifiedImageError):
        return None


def _observation_name(lines: list[dict[str, Any]], i: int) -> str | None:
    """The screenshot the model saw before step ``i`` (0-based): ``observation_file``, else
    the previous step's ``screenshot_file``, else step_0.png for the first step."""
    name = lines[i].get("observation_file")
    if not isinstance(name, str) or not name:
        name = lines[i - 1].get("screenshot_file") if i > 0 else screenshot_name(0)
    # Only a file name: screenshots live in the episode directory, never elsewhere.
    return Path(name).name if isinstance(name, str) and name else None


# --------------------------------------------------------------------------- overlay


def _point(value: Any) -> tuple[float, float] | None:
    if isinstance(value, list | tuple) and len(value) == 2:
        x, y = value
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (x, y)):
            return (float(x), float(y))
    return None


def _common(action: Any) -> Any:
    """A parsed action of any agent's format in the fields the overlay reads (``kind``,
    ``point``, ``content``, ``keys``): UI-TARS's as they are; OSWorld's computer_13 actions
    (``action_type``, ``x``, ``y``) and code blocks; Qwen's tool calls (``action``,
    ``screen_point``)."""
    if not isinstance(action, dict) or "kind" in action:
        return action
    if "code" in action or "special" in action:
        return {"kind": action.get("special") or "code", "content": action.get("code")}
    if "action_type" in action:
        xy = (action["x"], action["y"]) if "x" in action and "y" in action else None
        keys = action.get("keys") or ([action["key"]] if "key" in action else [])
        return {"kind": str(action["action_type"]).lower(), "point": xy,
                "content": action.get("text"), "keys": keys}
    return {"kind": action.get("action"), "point": action.get("screen_point"),
            "content": action.get("text"), "keys": action.get("keys") or []}


def _action_label(action: dict[str, Any]) -> str:
    kind = str(action.get("kind") or "?")
    keys = action.get("keys")
    content = action.get("content")
    if kind == "scroll":
        label = f"scroll {action.get('direction') or ''}".strip()
    elif isinstance(keys, list) and keys:
        label = f"{kind} {'+'.join(str(k) for k in keys)}"
    elif isinstance(content, str) and content:
        label = f"{kind} \u201c{content}\u201d"
    else:
        label = kind
    if len(label) > _LABEL_MAX_CHARS:
        label = label[: _LABEL_MAX_CHARS - 1] + "\u2026"
    return label


def overlay_svg(actions: list[Any], width: int, height: int, uid: str) -> str:
    """An SVG drawn over a width x height screenshot: a ring at each click point, an arrow
    for a drag or a scroll, a label with the action (typed text, keys)."""
    scale = width / _REFERENCE_WIDTH_PX
    r, font, arrow = _MARKER_RADIUS_PX * scale, _FONT_PX * scale, _SCROLL_ARROW_PX * scale
    stroke = 4 * scale
    marker = f"ah-{uid}"
    shapes: list[str] = []
    banner_y = font * 1.5

    def label(text: str, x: float, y: float) -> None:
        # Keep the label on screen; a dark outline keeps it readable on any background.
        x = max(min(x, width - len(text) * font * 0.55), 4 * scale)
        y = max(min(y, height - font * 0.4), font)
        shapes.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{font:.1f}" font-family="sans-serif" '
            f'fill="#ffeb3b" stroke="#000" stroke-width="{stroke:.1f}" '
            f'paint-order="stroke" class="action-label">{_e(text)}</text>'
        )

    def ring(x: float, y: float, cls: str) -> None:
        shapes.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="none" stroke="#ff1744" '
            f'stroke-width="{stroke:.1f}" class="{cls}"/>'
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{stroke:.1f}" fill="#ff1744"/>'
        )

    def line(x1: float, y1: float, x2: float, y2: float, cls: str) -> None:
        shapes.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="#ff1744" '
            f'stroke-width="{stroke:.1f}" marker-end="url(#{marker})" class="{cls}"/>'
        )

    for action in actions:
        if not isinstance(action, dict):
            continue
        kind = action.get("kind")
        text = _action_label(action)
        point, end = _point(action.get("point")), _point(action.get("end_point"))
        if kind == "scroll":
            x, y = point or (width / 2, height / 2)
            dx, dy = _SCROLL_VECTORS.get(str(action.get("direction")), (0, 1))
            ring(x, y, "scroll-point")
            line(x, y, x + dx * arrow, y + dy * arrow, "scroll-arrow")
            label(text, x + r * 1.5, y - r * 1.5)
        elif point is not None:
            ring(*point, "drag-start" if end is not None else "click-point")
            if end is not None:
                line(*point, *end, "drag-arrow")
            label(text, point[0] + r * 1.5, point[1] - r * 1.5)
        else:
            label(text, 8 * scale, banner_y)
            banner_y += font * 1.4
    defs = (
        f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="5" '
        f'markerHeight="5" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        f'fill="#ff1744"/></marker></defs>'
    )
    return (
        # Inline SVG in HTML needs no xmlns: the pages name no URL at all.
        f'<svg class="overlay" viewBox="0 0 {width} {height}" preserveAspectRatio="none">'
        f"{defs}{''.join(shapes)}</svg>"
    )


# --------------------------------------------------------------------------- pages


def _figure(
    episode: Episode, name: str | None, image_dir: Path, slug: str, caption: str,
    actions: list[Any], uid: str,
) -> str:  # fmt: skip
    src = episode.dir / name if (episode.dir is not None and name) else None
    if src is not None and name and not src.is_file():
        # storage.retention may have removed it, or re-encoded it under another name.
        marker = read_marker(src.parent)
        replaced = marker.replacement(name) if marker is not None else name
        if marker is not None and replaced is None:
            gone = (f"{name}: images removed by retention policy {marker.policy} at "
                    f"{_when(marker.at)}")
            return f'<figure class="shot"><div class="missing">{_e(gone)}</div></figure>'
        if replaced is not None and replaced != name:
            name, src = replaced, src.parent / replaced
    if src is None or not src.is_file():
        missing = f'<div class="missing">screenshot not found: {_e(name)}</div>'
        return f'<figure class="shot">{missing}</figure>'
    image_dir.mkdir(parents=True, exist_ok=True)
    _place_image(src, image_dir / name)
    size = _image_size(src)
    overlay = overlay_svg(actions, *size, uid) if size and actions else ""
    dims = f' width="{size[0]}" height="{size[1]}"' if size else ""
    url = f"{slug}/{quote(name, safe='@')}"  # a file name may hold '#', '?' or spaces
    return (
        f'<figure class="shot"><div class="frame"><img src="{_e(url)}" loading="lazy" '
        f'alt="{_e(name)}"{dims}>{overlay}</div><figcaption>{_e(caption)}</figcaption></figure>'
    )


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _tree_section(episode: Episode, line: dict[str, Any]) -> str:
    """The accessibility tree (or the marks' table) the step's request showed, folded."""
    name = line.get("a11y_tree_file")
    path = episode.dir / name if episode.dir is not None and isinstance(name, str) else None
    if path is None or not path.is_file():
        return ""
    table = path.read_text(encoding="utf-8", errors="replace")
    rows = max(0, table.count("\n"))
    return (f'<details><summary>Accessibility tree shown ({rows} elements)</summary>'
            f'<pre class="response">{_e(table)}</pre></details>')


def _timing_rows(line: dict[str, Any]) -> str:
    rows = []
    timing = line.get("timing")
    if isinstance(timing, dict):
        for key, value in timing.items():
            shown = f"{value:.3f}" if isinstance(value, int | float) else value
            rows.append((key, shown))
    for key in ("agent", "action_format", "prompt_tokens", "completion_tokens",
                "parse_retries", "model_endpoint", "model_version",
                "action_timestamp"):  # fmt: skip
        if line.get(key) is not None:
            rows.append((key, line[key]))
    info = line.get("info")
    if isinstance(info, dict):
        rows.extend((f"info.{k}", v) for k, v in info.items() if v is not None)
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="timing">{cells}</table>'


def episode_page(
    episode: Episode, lines: list[dict[str, Any]], problems: list[Problem],
    image_dir: Path, slug: str,
) -> str:  # fmt: skip
    """The HTML of one episode; its screenshots are placed in ``image_dir`` (a text
    episode's page: ``text_episode_page``)."""
    if _is_text(episode):
        return text_episode_page(episode, lines, problems)
    reward = "-" if episode.reward is None else f"{episode.reward:g}"
    duration = fmt_float(episode.duration_s)
    facts = [
        ("status", episode.status), ("reward", reward), ("steps", episode.steps),
        ("duration s", duration), ("infeasible", episode.infeasible),
        ("error", episode.error),
    ]  # fmt: skip
    for key in ("model_version", "desktop", "last_action", "attempt", "parse_failures"):
        if episode.record.get(key) is not None:
            facts.append((key, episode.record[key]))
    timing = episode.record.get("timing")
    if isinstance(timing, dict):
        facts.append(("timing s", ", ".join(f"{k} {v}" for k, v in timing.items())))
    marker = read_marker(episode.dir) if episode.dir is not None else None
    if marker is not None:
        facts.append(("retention", marker.describe()))
    parts = _page_top(episode, f'<p class="instruction">{_e(episode.instruction)}</p>',
                      facts, problems)
    if not lines:
        parts.append('<p class="warn">no steps recorded (traj.jsonl missing or empty)</p>')
    for i, line in enumerate(lines):
        n = line.get("step_num", i + 1)
        actions = line.get("actions") if isinstance(line.get("actions"), list) else []
        actions = [_common(a) for a in actions]
        name = _observation_name(lines, i)
        marks = line.get("marks_file")
        if isinstance(marks, str) and marks:  # the set-of-marks screenshot it was shown
            name = marks
        figure = _figure(episode, name, image_dir, slug, f"{name}: what the model saw",
                         actions, f"s{i}")  # fmt: skip
        listed = "".join(f"<li>{_e(_action_label(a))}{_e(_where(a))}</li>"
                         for a in actions if isinstance(a, dict))  # fmt: skip
        thought = line.get("thought")
        parts.append(
            f'<section class="step" id="step-{_e(n)}"><h2>Step {_e(n)}</h2><div class="cols">'
            f'{figure}<div class="text">'
            + (f'<h3>Thought</h3><p class="thought">{_e(thought)}</p>' if thought else "")
            + (f'<h3>Actions</h3><ul class="actions">{listed}</ul>' if listed else "")
            + _tree_section(episode, line)
            + f'<h3>Code</h3><pre class="code">{_e(line.get("action"))}</pre>'
            + f'<h3>Response</h3><pre class="response">{_e(line.get("response"))}</pre>'
            + f"<h3>Timing</h3>{_timing_rows(line)}</div></div></section>"
        )
    if lines:
        last = lines[-1].get("screenshot_file")
        if isinstance(last, str) and last:
            figure = _figure(episode, Path(last).name, image_dir, slug,
                             f"{Path(last).name}: the screen at the end", [], "final")  # fmt: skip
            parts.append(f'<section class="final"><h2>Final screen</h2>{figure}</section>')
    return _page(episode.episode_id, "\n".join(parts))


def _where(action: dict[str, Any]) -> str:
    point, end = _point(action.get("point")), _point(action.get("end_point"))
    if point and end:
        return f" at ({point[0]:g}, {point[1]:g}) to ({end[0]:g}, {end[1]:g})"
    return f" at ({point[0]:g}, {point[1]:g})" if point else ""


# --------------------------------------------------------------------------- text episodes


def _is_text(episode: Episode) -> bool:
    """A text episode (math, py, rag, web): its result line has a ``text`` object."""
    return isinstance(episode.record.get("text"), dict)


def _read_json(episode: Episode, name: str) -> Any:
    """The JSON of one of the episode's files, or None when it is missing or unreadable."""
    if episode.dir is None:
        return None
    try:
        return json.loads((episode.dir / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _arguments(raw: Any) -> str:
    """A tool call's arguments (JSON text) pretty-printed; a multi-line string argument (a
    snippet of code) also as plain text; arguments that are not JSON as they came."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return (f'<p class="tool-error">arguments: not JSON</p>'
                    f'<pre class="arguments">{_e(raw)}</pre>')  # fmt: skip
    else:
        parsed = raw
    pretty = json.dumps(parsed, indent=2, ensure_ascii=False)
    out = f'<p>arguments:</p><pre class="arguments">{_e(pretty)}</pre>'
    if isinstance(parsed, dict):
        for key, value in parsed.items():
            if isinstance(value, str) and "\n" in value:
                out += f'<p>{_e(key)}:</p><pre class="argument-text">{_e(value)}</pre>'
    return out


def _tool_call(call: dict[str, Any]) -> str:
    """One tool call of a turn: name, arguments, output, and the return code and error,
    highlighted when the call did not run cleanly."""
    rc, error = call.get("returncode"), call.get("error")
    failed = rc not in (0, None) or bool(error)
    state = "ok" if not failed else _TOOL_RETURNCODES.get(rc, "failed")
    duration = call.get("duration_s")
    head = (
        f'<h4><code class="tool-name">{_e(call.get("name"))}</code> '
        f'<span class="rc">{_e(state)} (return code {_e(rc if rc is not None else "-")})</span>'
        + (f" &middot; {duration:.3f} s" if isinstance(duration, int | float) else "")
        + (f' &middot; <span class="call-id">{_e(call.get("id"))}</span>' if call.get("id")
           else "")
        + "</h4>"
    )  # fmt: skip
    output = call.get("output")
    return (
        f'<div class="tool-call{" failed" if failed else ""}">{head}'
        f"{_arguments(call.get('arguments'))}"
        + (f'<p class="tool-error">error: {_e(error)}</p>' if error else "")
        + ('<p class="empty">no output</p>' if output is None
           else f'<p>output:</p><pre class="tool-output">{_e(output)}</pre>')
        + "</div>"
    )  # fmt: skip


def _unrun_calls(line: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply's calls (``response_tool_calls``, the wire format) that ``tool_calls`` does
    not hold, by id: the call of the answer tool that ended the episode."""
    ran = line.get("tool_calls") if isinstance(line.get("tool_calls"), list) else []
    ran_ids = {c.get("id") for c in ran if isinstance(c, dict)}
    wire = line.get("response_tool_calls")
    calls = []
    for w in wire if isinstance(wire, list) else []:
        function = w.get("function") if isinstance(w, dict) else None
        if isinstance(function, dict) and w.get("id") and w.get("id") not in ran_ids:
            calls.append({"id": w.get("id"), "name": function.get("name"),
                          "arguments": function.get("arguments")})  # fmt: skip
    return calls


def _turn(line: dict[str, Any], n: Any) -> str:
    calls = [c for c in (line.get("tool_calls") or []) if isinstance(c, dict)]
    unrun = _unrun_calls(line)
    response = line.get("response")
    if response:
        reply = f'<pre class="response">{_e(response)}</pre>'
    else:
        reply = ('<p class="empty">no text: the reply only called tools</p>' if calls or unrun
                 else '<p class="empty">an empty reply</p>')  # fmt: skip
    listed = "".join(_tool_call(c) for c in calls)
    listed += "".join(
        f'<div class="tool-call answer-call"><h4><code class="tool-name">{_e(c["name"])}'
        f"</code> (the reply's call that ends the episode)</h4>{_arguments(c['arguments'])}</div>"
        for c in unrun
    )
    answer = line.get("answer")
    return (
        f'<section class="turn" id="turn-{_e(n)}"><h2>Turn {_e(n)}</h2>'
        f"<h3>Reply</h3>{reply}"
        + (f'<h3>Tool calls</h3><div class="tool-calls">{listed}</div>' if listed else "")
        + (f'<h3>Answer</h3><pre class="turn-answer">{_e(answer)}</pre>'
           if answer is not None else "")
        + f"<h3>Timing</h3>{_timing_rows(line)}</section>"
    )  # fmt: skip


def _reference(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def text_episode_page(episode: Episode, lines: list[dict[str, Any]],
                      problems: list[Problem]) -> str:  # fmt: skip
    """The HTML of a text episode: the question, the final answer against the reference
    answer (task_config.json's ``answer``), the metric and the score, then each turn's reply,
    tool calls and answer. No images: a text episode has none."""
    text = episode.record["text"]
    task = _read_json(episode, TASK_CONFIG_FILE)
    task = task if isinstance(task, dict) else {}
    metric = task.get("metric") if isinstance(task.get("metric"), dict) else {}
    metric_name = metric.get("name") or text.get("metric")
    variant = metric.get("variant") or text.get("variant")
    question = task.get("question") if isinstance(task.get("question"), str) else None
    reward = "-" if episode.reward is None else f"{episode.reward:g}"
    facts = [
        ("status", episode.status), ("score", reward), ("turns", episode.steps),
        ("duration s", fmt_float(episode.duration_s)), ("error", episode.error),
        ("mode", text.get("mode")), ("benchmark", text.get("benchmark")),
        ("metric", text.get("metric")), ("variant", text.get("variant")),
        ("tool calls", text.get("tool_calls")),
        ("tool errors / malformed / unknown / over limit",
         "/".join(str(text.get(k, 0)) for k in ("tool_errors", "malformed_calls",
                                                 "unknown_tools", "over_limit"))),
    ]  # fmt: skip
    by_tool = text.get("by_tool")
    if isinstance(by_tool, dict) and by_tool:
        facts.append(("by tool", ", ".join(f"{k} {v}" for k, v in by_tool.items())))
    for key in ("model_version", "attempt", "last_action"):
        if episode.record.get(key) is not None:
            facts.append((key, episode.record[key]))
    timing = episode.record.get("timing")
    if isinstance(timing, dict):
        facts.append(("timing s", ", ".join(f"{k} {v}" for k, v in timing.items())))
    answer = text.get("answer")
    if "answer" in task:
        reference = f'<pre class="reference">{_e(_reference(task["answer"]))}</pre>'
        if isinstance(task["answer"], list) and len(task["answer"]) > 1:
            reference += "<p>(any one of these)</p>"
    else:
        reference = f'<p class="warn">not found ({TASK_CONFIG_FILE} missing or without one)</p>'
    score = reward if episode.status != "infra_error" else "- (an infra error: 0 in the score)"
    answer_rows = (
        "<tr><th>final answer</th><td>"
        + ('<p class="empty">no answer</p>' if answer is None
           else f'<pre class="final-answer">{_e(answer)}</pre>')
        + f"</td></tr><tr><th>reference</th><td>{reference}</td></tr>"
        f"<tr><th>metric</th><td>{_e(metric_name)}"
        + (f" ({_e(variant)})" if variant else "")
        + f'</td></tr><tr class="st-{_e(episode.status)}"><th>score</th><td>{_e(score)}</td></tr>'
    )  # fmt: skip
    parts = _page_top(episode, f'<h2>Question</h2><pre class="instruction">'
                               f'{_e(question or episode.instruction)}</pre>', facts, problems)
    parts.append(f'<section class="answer"><h2>Answer</h2>'
                 f'<table class="answer">{answer_rows}</table></section>')  # fmt: skip
    messages = _read_json(episode, MESSAGES_FILE)
    first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, dict) and first.get("role") == "system":
        parts.append("<details><summary>System prompt</summary>"
                     f'<pre class="system">{_e(first.get("content"))}</pre></details>')  # fmt: skip
    if not lines:
        parts.append('<p class="warn">no turns recorded (traj.jsonl missing or empty)</p>')
    for i, line in enumerate(lines):
        parts.append(_turn(line, line.get("step_num", i + 1)))
    return _page(episode.episode_id, "\n".join(parts), css=_TEXT_CSS)


def _page_top(episode: Any, statement: str, facts: list[tuple[str, Any]],
              problems: list[str]) -> list[str]:
    """An episode page's top: the way back, its id (coloured by status), the task's
    statement (HTML), its facts (those that are not None) and the problems reading it."""
    head = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts if v is not None)
    return [
        '<p><a href="../index.html">&larr; all episodes</a></p>',
        f'<h1 class="st-{_e(episode.status)}">{_e(episode.episode_id)}</h1>',
        statement,
        f'<table class="episode">{head}</table>',
        *(f'<p class="warn">{_e(p)}</p>' for p in problems),
    ]


def _plots_section(plots: list[str]) -> str:
    """The run's timeline (``plots``: the RUN_PLOTS placed next to index.html, relative
    paths), or how to draw it."""
    timeline = [p for p in plots if Path(p).name == RUN_PLOTS[0]]
    more = " &middot; ".join(f'<a href="{_e(quote(p))}">{_e(Path(p).stem)}</a>'
                             for p in plots if p not in timeline)  # fmt: skip
    if not timeline:
        return (
            '<p class="timeline">No run timeline yet: <code>scripts/plot_run.py RUN_DIR '
            "--plots timeline utilization</code> draws it (then write this report again)."
            f"{' Plots: ' + more if more else ''}</p>"
        )
    url = _e(quote(timeline[0]))
    return (
        '<details class="timeline" open><summary>Run timeline: what each desktop did over '
        f"time{' (also: ' + more + ')' if more else ''}</summary>"
        f'<a href="{url}"><img src="{url}" alt="run timeline"></a></details>'
    )


def place_run_plots(plots_dir: Path, out_dir: Path) -> list[str]:
    """plot_run.py's RUN_PLOTS found in ``plots_dir``, hard-linked (copied across file
    systems) into ``out_dir/plots``; their paths relative to ``out_dir``."""
    placed = []
    for name in RUN_PLOTS:
        src = plots_dir / name
        if src.is_file():
            (out_dir / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
            _place_image(src, out_dir / PLOTS_DIR / name)
            placed.append(f"{PLOTS_DIR}/{name}")
    return placed


def index_page(run: Run, episodes: list[Episode], links: dict[str, str],
               plots: list[str] | None = None) -> str:  # fmt: skip
    """The tasks x rollouts table; ``links`` maps episode ids to their pages; ``plots`` the
    run's figures placed next to it (``place_run_plots``), the timeline shown above the
    table.

    The only script is a small inline table sorter; ``index.html#sort=<column>[:asc|:desc]``
    sorts on load through the same click handler a user triggers (columns: domain, task,
    instruction, reward, solved, r0, r1, ...)."""
    tasks = summarize_tasks(episodes)
    by_task: dict[tuple[str, str], dict[int, Episode]] = {}
    for e in episodes:
        by_task.setdefault(e.task_key, {})[e.rollout] = e
    rollouts = sorted({e.rollout for e in episodes})
    header = (
        '<th data-col="domain">domain</th><th data-col="task">task</th>'
        '<th data-col="instruction">instruction</th>'
        '<th data-col="reward" data-type="num">mean reward</th>'
        '<th data-col="solved" data-type="num">solved</th>'
        + "".join(f'<th data-col="r{r}" data-type="num">r{r}</th>' for r in rollouts)
    )
    rows = []
    for key, task in tasks.items():
        mean = task.mean_reward
        cells = [
            f"<td>{_e(task.domain)}</td><td>{_e(task.task_id)}</td>",
            f"<td>{_e(task.instruction)}{' (infeasible)' if task.infeasible else ''}</td>",
            f'<td class="num" data-sort="{"" if mean is None else f"{mean:.6f}"}">'
            f"{'-' if mean is None else f'{mean:.2f}'}</td>",
            f'<td class="num" data-sort="{int(task.solved)}">{"yes" if task.solved else ""}</td>',
        ]
        for r in rollouts:
            e = by_task[key].get(r)
            if e is None:
                cells.append('<td data-sort=""></td>')
                continue
            reward = "" if e.reward is None else f"{e.reward:g}"
            cells.append(
                f'<td class="st-{_e(e.status)}" data-sort="{reward}">'
                f'<a href="{_e(links[e.episode_id])}">{_e(e.status)}</a><br>'
                f"{reward or '-'} &middot; {_e(e.steps if e.steps is not None else '-')} "
                f"{'turns' if _is_text(e) else 'steps'}"
                f" &middot; {fmt_float(e.duration_s)} s</td>"
            )
        rows.append(f'<tr data-task="{_e(key[0])}/{_e(key[1])}">{"".join(cells)}</tr>')
    rates = compute_rates(episodes)
    k = k_label(rates.to_json())
    summary = (
        f"{rates.scored_episodes} scored episodes of {rates.episodes}; success "
        f"{fmt_rate(rates.success_rate)}, avg@{k} {fmt_rate(rates.avg_at_k)}, "
        f"pass@{k} {fmt_rate(rates.pass_at_k)}; infra_error "
        f"{rates.status_counts['infra_error']}, cancelled {rates.status_counts['cancelled']}"
    )
    body = (
        f"<h1>{_e(run.path)}</h1><p>{_e(summary)}. Click a column header to sort.</p>"
        f"{_text_scores(episodes)}{_plots_section(plots or [])}"
        f'<table id="episodes"><thead><tr>{header}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    return _page(f"{run.name}: trajectories", body, script=_SORT_JS)


def _text_scores(episodes: list[Episode]) -> str:
    """The text benchmarks' scores (cua_rollout/results/text.py), when the run has text
    episodes."""
    section = text_summary(episodes)
    if section is None:
        return ""
    rows = section["rows"]
    scores = "; ".join(f"{name} {fmt_rate(row['score'])} ({row['episodes']} episodes)"
                       for name, row in rows["benchmarks"].items())  # fmt: skip
    return (
        f'<p class="text-scores">Text benchmarks: {_e(scores)}; all '
        f"{fmt_rate(rows['all']['score'])}. The score is the mean of the answer metric over "
        "the final episodes; an infra error or a missing answer counts 0.</p>"
    )


def _slug(episode_id: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", episode_id.replace("/", "__")).strip(".") or "ep"
    slug, n = base, 1
    while slug in taken:
        n += 1
        slug = f"{base}-{n}"
    taken.add(slug)
    return slug


def build(run: Run, out_dir: Path, task: str | None = None,
          plots_dir: Path | None = None) -> list[Episode]:  # fmt: skip
    """Write index.html and the episode pages into ``out_dir``; return the episodes shown.
    Screenshots (and the run's timeline from ``plots_dir``, default RUN_DIR/plots) are
    hard-linked (copied across file systems) into ``out_dir`` and referenced by relative
    paths, lazily loaded: the report needs no network and no server."""
    episodes = [
        e for e in run.episodes
        if task is None or task in (e.task_id, f"{e.domain}/{e.task_id}")
    ]  # fmt: skip
    episodes.sort(key=lambda e: (e.domain, e.task_id, e.rollout))
    pages_dir = out_dir / EPISODES_DIR
    pages_dir.mkdir(parents=True, exist_ok=True)
    links: dict[str, str] = {}
    taken: set[str] = set()
    for e in episodes:
        slug = _slug(e.episode_id, taken)
        lines, problems = read_traj(e)
        report_problems(problems)
        page = episode_page(e, lines, problems, pages_dir / slug, slug)
        (pages_dir / f"{slug}.html").write_text(page, encoding="utf-8")
        links[e.episode_id] = f"{EPISODES_DIR}/{slug}.html"
    plots = place_run_plots(plots_dir if plots_dir is not None else run.path / PLOTS_DIR,
                            out_dir)  # fmt: skip
    (out_dir / "index.html").write_text(index_page(run, episodes, links, plots),
                                        encoding="utf-8")  # fmt: skip
    return episodes


def _parser() -> argparse.ArgumentParser:
    parser = results_parser(
        "view_trajectory.py",
        "Write a static HTML report of a run's episodes: index.html (tasks x "
        "rollouts, sortable) and a page per episode with each step's screenshot, the action "
        "drawn on it, the thought, the raw response and the timings (a text episode's: each "
        "turn's reply and tool calls, and the answer against the reference).",
    )
    parser.add_argument("--task", metavar="ID", help="only this task (task_id or domain/task_id)")
    parser.add_argument(
        "--plots-dir", metavar="DIR", type=Path,
        help="where plot_run.py wrote the run's timeline.png (shown above the table), "
        "timeline_runners.png and utilization.png (default: RUN_DIR/plots)",
    )  # fmt: skip
    add_out_dir(parser, "viewer")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    run = open_run(parser, args.run_dir)
    out_dir = make_out_dir(parser, args.out if args.out is not None else run.path / "viewer")
    if args.task is not None and not any(
        args.task in (e.task_id, f"{e.domain}/{e.task_id}") for e in run.episodes
    ):
        fail(parser, f"--task {args.task}: no episode in {run.path}")
    episodes = build(run, out_dir, args.task, args.plots_dir)
    if not episodes:
        print(f"{run.path}: no finished episodes")
    print(f"wrote {out_dir / 'index.html'} ({len(episodes)} episodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
