"""The agents beyond UI-TARS with a real vision-language model in the loop: the tiny random
Qwen2.5-VL on the session's real run_model.py pool (vLLM's CPU build,
tests/integration/conftest.py), driven by run.py on local desktops. A random model
rarely writes a readable action: every step must be either parsed or recorded as a parse
failure (its replies kept), every episode scored, nothing crash.

- ``osworld-prompt`` (screenshot + accessibility tree, pyautogui code);
- ``qwen-computer-use`` with the tool offered as OpenAI ``tools`` and vLLM's hermes tool
  parser (the tiny model's chat template renders tools and tool calls as Qwen2.5's does).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cua_rollout.core.types import SCORED_STATUSES
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEMO_VLM = REPO_ROOT / "configs" / "demo_vlm.yaml"
RUN_TIMEOUT_S = 900
TASKS = ["terminal-hello-file", "editor-save-new-file", "calc-add"]

CASES = {
    "osworld-prompt": ["agent.name=osworld-prompt", "agent.osworld_prompt.max_trajectory_length=2"],
    "qwen-computer-use": ["agent.name=qwen-computer-use"],
}


@pytest.mark.parametrize("agent", list(CASES))
def test_every_step_parsed_or_a_recorded_parse_failure(agent, tiny_vlm, tmp_path):
    # The session's pool (its hermes tool parser serves the qwen agent's tools); run.py's
    # own pool start is test_vlm.py's demo.
    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(DEMO_VLM)]
    for s in (*CASES[agent], "agent.constrain_actions=false", "agent.max_parse_retries=1",
              f"run.output_dir={tmp_path / 'results'}",
              f"model.endpoints={json.dumps([tiny_vlm.url])}", "model_pool.start_with_run=false",
              f"desktops.local.state_dir={tmp_path / 'd'}",
              f"tasks.task_ids={json.dumps(TASKS)}", "runner.max_steps=4",
              "model.sampling.max_tokens=120", "ray.include_dashboard=false"):
        args += ["--set", s]
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "results" / "demo_vlm"
    results = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in results) == sorted(TASKS)
    parsed = failed = 0
    fmt = {"osworld-prompt": "pyautogui", "qwen-computer-use": "qwen_tool_call"}[agent]
    for r in results:
        assert r["status"] in SCORED_STATUSES, r   # no infrastructure error, no crash
        episode = run_dir / r["domain"] / r["task_id"] / str(r["rollout"])
        steps = [json.loads(x) for x in (episode / "traj.jsonl").read_text().splitlines()]
        assert steps
        for s in steps:
            assert s["agent"] == agent and s["action_format"] == fmt, s
            if s["actions"]:
                parsed += 1
            else:   # a parse failure: FAIL, the reply and the re-asked one kept
                failed += 1
                assert s["action"] == "FAIL" and s["thought"] is None
                assert [d["error"] for d in s["discarded"]] and "response" in s
            if agent == "osworld-prompt":
                table = (episode / s["a11y_tree_file"]).read_text()
                assert table.startswith("tag\tname\ttext")
            else:
                assert "response_tool_calls" in s
        assert r["parse_failures"] >= sum(1 for s in steps if not s["actions"])
    print(f"\n{agent}: {len(results)} episodes, {parsed} steps parsed, {failed} parse "
          "failures recorded")
