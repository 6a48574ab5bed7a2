"""The runner's decisions on a parsed reply (terminal actions, call_user, unparseable
replies) and the shape of its results; the episode loop itself runs on real Ray and real
desktops in test_agent_coordinator.py and test_run.py."""

from __future__ import annotations

from pathlib import Path

from config import load_config
from task_loader import EpisodeSpec
from trajectory_runner import STATUSES, TrajectoryRunner, _Episode, infra_result
from ui_tars_utils import DONE, FAIL, WAIT, parse_response

ROOT = Path(__file__).resolve().parent.parent
TASK = {"id": "t1", "instruction": "do it", "evaluator": {"func": "infeasible"}}


def _episode(*sets: str) -> _Episode:
    cfg = load_config(ROOT / "configs" / "demo.yaml", list(sets))
    runner = TrajectoryRunner(cfg, desktop_pool=None, storage=None, runner_id="r")
    return _Episode(runner, EpisodeSpec("t1", "d", 0, TASK), [])


def _parsed(action: str):
    return parse_response(f"Thought: x\nAction: {action}", 1280, 720)


def test_terminal_actions_and_what_runs_before_them():
    episode = _episode()
    assert episode._decide(_parsed("finished(content='ok')")) == (None, DONE)
    assert episode._decide(_parsed("wait()")) == (None, WAIT)
    code, terminal = episode._decide(_parsed("click(start_box='(10,10)')\n\nfinished()"))
    assert terminal == DONE and code.startswith("pyautogui.click(")
    code, terminal = episode._decide(_parsed("hotkey(key='ctrl s')"))
    assert terminal is None and "hotkey" in code
    assert episode._decide(None) == (None, FAIL)  # unparseable after every retry


def test_call_user_fails_or_waits_up_to_the_configured_number():
    assert _episode()._decide(_parsed("call_user()")) == (None, FAIL)
    waiting = _episode("runner.call_user=wait", "runner.call_user_max_waits=2")
    decisions = [waiting._decide(_parsed("call_user()"))[1] for _ in range(3)]
    assert decisions == [WAIT, WAIT, FAIL]


def test_an_infra_result_is_never_a_score():
    spec = EpisodeSpec("t1", "d", 2, TASK, attempt=1)
    result = infra_result(spec, "runner died", runner="r")
    record = result.record()
    assert record["status"] == "infra_error" and record["reward"] is None
    assert record["episode_id"] == "d/t1/2" and record["attempt"] == 1
    assert record["infeasible"] is True and "retryable" not in record
    assert set(STATUSES) == {"success", "failure", "max_steps", "timeout", "infra_error",
                             "cancelled"}
