"""Synthetic run directories for the tests of cua_rollout.results and the result scripts, written as
docs/results_format.md describes (and one in OSWorld's own layout), with figures small
enough to work out by hand in the tests."""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

SCREEN_W, SCREEN_H = 1280, 720


@dataclass(frozen=True)
class Ep:
    """One episode of a synthetic run."""

    domain: str
    task_id: str
    rollout: int
    status: str
    reward: float | None
    steps: int = 2
    duration_s: float = 10.0
    infeasible: bool = False
    # The model versions its steps used, in order: None writes a record of before the
    # version fields (model_version "m-1" only); () an episode no step of which reached a
    # model. With versions, the record has every field of today's writer.
    versions: tuple[str, ...] | None = None
    pass_index: int = 0
    started_at: float | None = None  # None: right after the previous episode of the run


# Run A: 13 episodes, 9 scored (rewards sum 4.5), 4 scored tasks of which 3 solved.
RUN_A = [
    Ep("chrome", "t1", 0, "success", 1.0, steps=3, duration_s=30.0),
    Ep("chrome", "t1", 1, "failure", 0.0, steps=5, duration_s=50.0),
    Ep("chrome", "t1", 2, "infra_error", None, steps=1, duration_s=5.0),
    Ep("chrome", "t2", 0, "failure", 0.0, steps=4, duration_s=40.0),
    Ep("chrome", "t2", 1, "max_steps", 0.5, steps=15, duration_s=150.0),
    Ep("chrome", "t2", 2, "cancelled", None, steps=0, duration_s=1.0),
    Ep("gimp", "t3", 0, "success", 1.0, steps=2, duration_s=20.0),
    Ep("gimp", "t3", 1, "success", 1.0, steps=2, duration_s=20.0),
    Ep("gimp", "t3", 2, "timeout", 0.0, steps=6, duration_s=600.0),
    Ep("os", "t4", 0, "failure", 0.0, steps=1, duration_s=10.0, infeasible=True),
    Ep("os", "t4", 1, "success", 1.0, steps=1, duration_s=10.0, infeasible=True),
    Ep("os", "t5", 0, "infra_error", None, steps=0, duration_s=2.0),
    Ep("os", "t5", 1, "infra_error", None, steps=0, duration_s=2.0),
]

# Run B against A: chrome/t1/0 A better, chrome/t2/0 B better, chrome/t1/2 and os/t5/1
# status changed, os/t4 only in A, os/t6 only in B.
RUN_B = [
    Ep("chrome", "t1", 0, "failure", 0.0),
    Ep("chrome", "t1", 1, "failure", 0.0),
    Ep("chrome", "t1", 2, "success", 1.0),
    Ep("chrome", "t2", 0, "success", 1.0),
    Ep("chrome", "t2", 1, "max_steps", 0.5),
    Ep("chrome", "t2", 2, "cancelled", None),
    Ep("gimp", "t3", 0, "success", 1.0),
    Ep("gimp", "t3", 1, "success", 1.0),
    Ep("gimp", "t3", 2, "timeout", 0.0),
    Ep("os", "t5", 0, "infra_error", None),
    Ep("os", "t5", 1, "failure", 0.0),
    Ep("os", "t6", 0, "failure", 0.0),
]

# A run of three model versions whose names sort neither by name nor by file order: first
# used (by started_at) in the order zz-ckpt, aa-ckpt, mm-ckpt. The file lists chrome/d/0
# (mm-ckpt, started last but two) first, so numbering by file order would be wrong.
V1, V2, V3 = "zz-ckpt", "aa-ckpt", "mm-ckpt"
RUN_V = [
    Ep("chrome", "d", 0, "success", 1.0, versions=(V3,), pass_index=1, started_at=160.0),
    Ep("os", "a", 0, "success", 1.0, versions=(V1,), started_at=100.0),
    Ep("os", "a", 1, "failure", 0.0, versions=(V1,), started_at=110.0),
    # Mixed across the V1 -> V2 boundary: started on V1, ended on V2.
    Ep("os", "b", 0, "success", 1.0, versions=(V1, V2), started_at=120.0),
    Ep("os", "b", 1, "failure", 0.0, versions=(V2,), started_at=130.0),
    Ep("chrome", "c", 0, "success", 1.0, versions=(V2,), started_at=140.0),
    Ep("chrome", "c", 1, "failure", 0.5, versions=(V2, V3), started_at=150.0),  # mixed
    Ep("chrome", "d", 1, "infra_error", None, versions=(V3,), pass_index=1, started_at=170.0),
    # No step reached a model: no version at all.
    Ep("chrome", "e", 0, "infra_error", None, steps=0, versions=(), pass_index=1,
       started_at=180.0),
]  # fmt: skip

# What each step of a synthetic trajectory does, cycled: (parsed action, pyautogui code).
STEP_ACTIONS: list[tuple[dict[str, Any], str]] = [
    (
        {"kind": "click", "point": [300, 200], "end_point": None, "content": None,
         "keys": [], "direction": None},
        "import pyautogui\npyautogui.click(300, 200)",
    ),
    (
        {"kind": "drag", "point": [200, 500], "end_point": [900, 300], "content": None,
         "keys": [], "direction": None},
        "import pyautogui\npyautogui.moveTo(200, 500)\npyautogui.dragTo(900, 300)",
    ),
    (
        {"kind": "type", "point": None, "end_point": None, "content": "hello <world> & 'you'",
         "keys": [], "direction": None},
        "import pyautogui\npyautogui.write('hello <world> & \\'you\\'')",
    ),
    (
        {"kind": "hotkey", "point": None, "end_point": None, "content": None,
         "keys": ["ctrl", "s"], "direction": None},
        "import pyautogui\npyautogui.hotkey('ctrl', 's')",
    ),
    (
        {"kind": "scroll", "point": [1000, 400], "end_point": None, "content": None,
         "keys": [], "direction": "down"},
        "import pyautogui\npyautogui.scroll(-5, x=1000, y=400)",
    ),
]  # fmt: skip


@functools.cache  # a handful of distinct images, written many times
def png_bytes(color: tuple[int, int, int], marks: tuple[tuple[int, int], ...] = ()) -> bytes:
    """A 1280x720 PNG of one colour, a 100 px grid, and a red square at each mark (where
    the step's action points, so a screenshot shows whether the overlay lands on it)."""
    image = Image.new("RGB", (SCREEN_W, SCREEN_H), color)
    draw = ImageDraw.Draw(image)
    for x in range(0, SCREEN_W, 100):
        draw.line([(x, 0), (x, SCREEN_H)], fill=(200, 200, 200))
    for y in range(0, SCREEN_H, 100):
        draw.line([(0, y), (SCREEN_W, y)], fill=(200, 200, 200))
    for x, y in marks:
        draw.rectangle([x - 6, y - 6, x + 6, y + 6], fill=(255, 0, 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _record(ep: Ep, started_at: float) -> dict[str, Any]:
    record = _legacy_record(ep, started_at)
    if ep.versions is not None:
        record |= {
            "model_version": ep.versions[-1] if ep.versions else None,
            "first_model_version": ep.versions[0] if ep.versions else None,
            "model_versions": list(ep.versions),
            "mixed_versions": len(ep.versions) > 1,
            "pass_index": ep.pass_index,
            "group_id": f"{ep.domain}/{ep.task_id}/pass-{ep.pass_index}",
            "group_size": 2,
        }
    return record


def _legacy_record(ep: Ep, started_at: float) -> dict[str, Any]:
    return {
        "episode_id": f"{ep.domain}/{ep.task_id}/{ep.rollout}",
        "task_id": ep.task_id,
        "domain": ep.domain,
        "rollout": ep.rollout,
        "attempt": 1 if ep.status == "infra_error" else 0,
        "status": ep.status,
        "reward": ep.reward,
        "steps": ep.steps,
        "started_at": started_at,
        "ended_at": started_at + ep.duration_s,
        "duration_s": ep.duration_s,
        "model_version": "m-1",
        "model_endpoints": ["http://127.0.0.1:8000/v1"],
        "desktop": "d0",
        "desktops_tried": ["d0"],
        "error": "desktop d0 stopped answering" if ep.status == "infra_error" else None,
        "instruction": f"Do the thing of {ep.task_id} <now> & \"quickly\"",
        "infeasible": ep.infeasible,
        "last_action": "DONE" if ep.status == "success" else None,
        "parse_failures": 0,
        "timing": {"model_s": 1.0, "env_s": 0.5, "overhead_s": 0.1, "reset_s": 0.2,
                   "evaluation_s": 0.1, "lease_wait_s": 0.0},
        "runner": "runner-0",
        "node": "node-0",
    }  # fmt: skip


def traj_line(n: int, reward: float, done: bool, *, model_s: float, env_s: float) -> dict:
    """Step ``n`` (1-based) as a traj.jsonl line with OSWorld's fields and ours."""
    action, code = STEP_ACTIONS[(n - 1) % len(STEP_ACTIONS)]
    return {
        "step_num": n,
        "action_timestamp": f"20250101@0000{n:02d}000000",
        "action": code,
        "response": f"Thought: step {n} <b>not bold</b>\nAction: {action['kind']}(...)",
        "reward": reward if done else 0,
        "done": done,
        "info": {"returncode": 0, "error": None},
        "screenshot_file": f"step_{n}.png",
        "observation_file": f"step_{n - 1}.png",
        "thought": f"step {n}: I <script>alert(1)</script> the {action['kind']}",
        "actions": [action],
        "model_endpoint": "http://127.0.0.1:8000/v1",
        "model_version": "m-1",
        "parse_retries": 0,
        "timing": {"model_s": model_s, "env_s": env_s, "overhead_s": 0.01,
                   "step_s": model_s + env_s + 0.01},
        "prompt_tokens": 1000 + n,
        "completion_tokens": 50,
    }  # fmt: skip


def make_run(
    root: Path,
    name: str,
    episodes: list[Ep],
    *,
    screenshots: bool = False,
    metrics: bool = True,
    t0: float = 1_700_000_000.0,
) -> Path:
    """A run directory of ``episodes`` (results.jsonl, run.json, per-episode files).
    ``screenshots``: step PNGs too (1280x720, a red mark where each step's action points)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    lines = []
    t = t0
    for i, ep in enumerate(episodes):
        record = _record(ep, t if ep.started_at is None else ep.started_at)
        t += ep.duration_s
        lines.append(json.dumps(record))
        ep_dir = run_dir / ep.domain / ep.task_id / str(ep.rollout)
        ep_dir.mkdir(parents=True, exist_ok=True)
        task = {
            "id": ep.task_id,
            "instruction": record["instruction"],
            "config": [],
            "evaluator": {"func": "infeasible" if ep.infeasible else "exact_match"},
        }
        (ep_dir / "task_config.json").write_text(json.dumps(task))
        (ep_dir / "episode.json").write_text(json.dumps(record))
        traj = [
            traj_line(n, ep.reward or 0.0, n == ep.steps, model_s=0.5 + 0.1 * (i % 5),
                      env_s=0.2 + 0.05 * n)
            for n in range(1, ep.steps + 1)
        ]  # fmt: skip
        (ep_dir / "traj.jsonl").write_text("".join(json.dumps(x) + "\n" for x in traj))
        if ep.reward is not None:
            (ep_dir / "result.txt").write_text(f"{ep.reward}\n")
        if screenshots:
            for n in range(1, ep.steps + 1):
                # step_n.png is what step n+1 sees: mark where step n+1 acts.
                action = STEP_ACTIONS[n % len(STEP_ACTIONS)][0]
                marks = [tuple(action["point"])] if action["point"] else []
                if action["end_point"]:
                    marks.append(tuple(action["end_point"]))
                (ep_dir / f"step_{n}.png").write_bytes(png_bytes((40, 60, 90), tuple(marks)))
            first = STEP_ACTIONS[0][0]
            (ep_dir / "step_0.png").write_bytes(png_bytes((40, 60, 90), (tuple(first["point"]),)))
    (run_dir / "results.jsonl").write_text("".join(line + "\n" for line in lines))
    (run_dir / "run.json").write_text(json.dumps({
        "run": name, "run_dir": str(run_dir), "started_at": t0, "ended_at": t,
        "status": "finished", "config": {}, "versions": {}, "host": "test", "command": "",
    }))  # fmt: skip
    if metrics:
        samples = []
        done = 0
        for k in range(6):
            done = min(len(episodes), done + 3)
            samples.append({
                "t": t0 + 10 * k, "elapsed_s": 10.0 * k, "episodes_done": done,
                "episodes_by_status": {"success": done // 2}, "episodes_in_flight": 2,
                "episodes_queued": max(0, len(episodes) - done), "steps": 7 * k,
                "steps_per_s": 0.7, "success_rate": 0.5 if done else None,
                "desktops": {"free": 4 - k % 3, "leased": k % 3, "resetting": 0,
                             "quarantined": 0, "starting": 0},
                "model_in_flight": k % 3, "model_in_flight_by_endpoint": {"e0": k % 3},
            })  # fmt: skip
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run_dir


def make_osworld_run(root: Path) -> Path:
    """OSWorld's layout: results/<action_space>/<observation>/<model>/<domain>/<task>/;
    rewards chrome/a 1.0, chrome/b 0.0, libreoffice_calc/c 0.5; one unfinished task."""
    run_dir = root / "osworld" / "pyautogui" / "screenshot" / "uitars"
    for domain, task_id, reward, steps in (
        ("chrome", "a", "1.0", 3),
        ("chrome", "b", "0.0", 2),
        ("libreoffice_calc", "c", "0.5", 1),
        ("vlc", "unfinished", None, 4),
    ):
        task_dir = run_dir / domain / task_id
        task_dir.mkdir(parents=True)
        if reward is not None:
            (task_dir / "result.txt").write_text(reward)
        lines = []
        for n in range(1, steps + 1):
            stamp = f"20250101@0000{n:02d}000000"
            lines.append(json.dumps({
                "step_num": n, "action_timestamp": stamp, "action": "pyautogui.click(10, 10)",
                "response": "Thought: x\nAction: click(start_box='(10,10)')",
                "reward": 0, "done": n == steps, "info": {},
                "screenshot_file": f"step_{n}_{stamp}.png",
            }))  # fmt: skip
            (task_dir / f"step_{n}_{stamp}.png").write_bytes(png_bytes((90, 90, 90)))
        (task_dir / "traj.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir
