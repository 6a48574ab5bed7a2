"""Text modes as a user runs them: ``run.py --config configs/text_demo.yaml`` (a subprocess on
real Ray, the scripted policy replaying each item's tool calls) runs math, py (the real
sandbox), rag (the real embedding model and index) and web (the corpus served over real HTTP)
episodes and prints the table; a rerun resumes with nothing left to do; ``llm_judgement``
asks the judge endpoint of ``text.judge`` with the key from its environment variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.doubles.fake_openai import FakeOpenAIServer
from tests.support import REPO_ROOT, run_py_command

TEXT_DEMO = REPO_ROOT / "configs" / "text_demo.yaml"


def _command(tmp: Path, config: Path = TEXT_DEMO, *sets: str) -> list[str]:
    return run_py_command(config, tmp / "results", f"text.rag.cache_dir={tmp / 'rag-cache'}",
                          *sets)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=420)


def _results(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    by_item: dict[str, list[dict[str, Any]]] = {}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_item.setdefault(record["task_id"], []).append(record)
    return by_item


def _turns(run_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    path = run_dir / record["domain"] / record["task_id"] / str(record["rollout"]) / "traj.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.slow
def test_the_text_demo_runs_all_four_modes_and_resumes(tmp):
    done = _run(_command(tmp), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp / "results" / "text_demo"
    results = _results(run_dir)
    items = [json.loads(x) for name in ("math", "py", "rag", "web")
             for x in (REPO_ROOT / "tasks" / "text_demo" / f"{name}.jsonl").read_text()
             .splitlines()]
    assert sorted(results) == sorted(item["id"] for item in items)
    for item_id, records in results.items():
        assert len(records) == 2, item_id  # rollouts_per_task
        for r in records:
            assert r["text"]["mode"] == r["domain"]
            expected = "failure" if item_id == "math-006" else "success"  # 540 is wrong
            assert r["status"] == expected, (item_id, r["status"], r.get("error"),
                                             r["text"]["answer"])
            assert r["reward"] == (0.0 if expected == "failure" else 1.0)
            assert r.get("desktop") is None
    # The table, per benchmark, mode and metric.
    for row in ("math", "py", "rag", "web", "mode py", "metric numeric_match",
                "metric llm_judgement", "all"):
        assert f"│ {row} " in done.stdout, row
    # The model's mistakes, answered to it as errors and counted: a tool math does not have,
    # a top_k retrieve refuses, arguments that are not JSON.
    counts = {i: (r[0]["text"]["unknown_tools"], r[0]["text"]["tool_errors"],
                  r[0]["text"]["malformed_calls"]) for i, r in results.items()}
    assert counts["math-002"] == (1, 0, 0)
    assert counts["rag-004"] == (0, 1, 0)
    assert counts["web-003"] == (0, 0, 1)
    assert sum(sum(c) for c in counts.values()) == 3
    unknown = _turns(run_dir, results["math-002"][0])[0]["tool_calls"][0]
    assert "no tool named 'calculator'" in unknown["output"]
    summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["text"]["rows"]["benchmarks"]["math"]["score"] == pytest.approx(10 / 12)
    assert summary["text"]["rows"]["modes"]["py"]["tool_calls_per_episode"] > 1

    # py: the code ran in the sandbox, files persisted across calls, a runaway was killed.
    fib = _turns(run_dir, results["py-001"][0])
    assert fib[0]["tool_calls"][0]["output"].startswith("832040")
    files = _turns(run_dir, results["py-004"][0])
    assert files[1]["tool_calls"][0]["output"].startswith("5050")
    loop = _turns(run_dir, results["py-005"][0])
    assert "killed" in loop[0]["tool_calls"][0]["output"].lower()
    assert loop[0]["tool_calls"][0]["duration_s"] < 15
    parallel = _turns(run_dir, results["py-003"][0])
    assert [c["name"] for c in parallel[0]["tool_calls"]] == ["python", "python"]
    assert parallel[0]["tool_calls"][0]["output"].startswith("a4fa034cc780")
    # rag: the planted passage came back from the real embedding model's index.
    lamp = _turns(run_dir, results["rag-001"][0])
    assert "Orlen" in lamp[0]["tool_calls"][0]["output"].split("[2]")[0]
    # web: search over the served corpus, then the page itself over HTTP.
    rail = _turns(run_dir, results["web-001"][0])
    assert [c["name"] for t in rail for c in t.get("tool_calls") or []] == ["search", "fetch"]
    assert "Passenger service ended in 1961" in rail[1]["tool_calls"][0]["output"]
    assert "not part of the text" not in rail[1]["tool_calls"][0]["output"]  # no <script>
    assert rail[-1]["done"] is True and rail[-1]["reward"] == 1.0
    messages = json.loads((run_dir / "web" / "web-001" / "0" / "messages.json").read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool",
                                            "assistant", "tool", "assistant"]

    # The trainer's hand-off: groups per item, step rows with the turns' tool calls.
    out = tmp / "steps.parquet"
    exported = subprocess.run([sys.executable, "-m", "cua_rollout.training", "--run-dir",
                               str(run_dir), "export", "--per", "step", str(out)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    assert len(rows) == sum(len(_turns(run_dir, r)) for v in results.values() for r in v)
    fetched = [r for r in rows if r["episode_id"] == "web/web-001/0"]
    assert [r["action"] for r in fetched] == ["search", "fetch", "answer"]
    assert json.loads(fetched[0]["tool_calls"])[0]["name"] == "search"
    assert fetched[-1]["answer"] == "1961" and fetched[-1]["reward"] == 1.0

    again = _run(_command(tmp), cwd=REPO_ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sum(len(v) for v in _results(run_dir).values()) == 2 * len(items)


@pytest.mark.integration
@pytest.mark.slow
def test_llm_judgement_asks_the_judge_endpoint_with_its_key(tmp, monkeypatch):
    bench = tmp / "judged.jsonl"
    items = [
        {"id": "j-ok", "question": "Name the red planet.", "answer": "Mars",
         "metadata": {"reference_solution": [{"answer": "It is Mars."}]}},
        {"id": "j-no", "question": "Name the largest planet.", "answer": "Jupiter",
         "metadata": {"reference_solution": [{"answer": "Saturn"}]}},
        {"id": "j-garbage", "question": "Name the ringed planet.", "answer": "Saturn",
         "metadata": {"reference_solution": [{"answer": "Saturn"}]}},
    ]
    bench.write_text("".join(json.dumps(i) + "\n" for i in items))
    config = tmp / "judged.yaml"
    config.write_text(json.dumps({
        "run": {"name": "judged"},
        # No stand-in pass for j-garbage's failed group (an infra error): one judgement each.
        "tasks": {"benchmarks": [{"source": str(bench), "mode": "math",
                                  "metric": "llm_judgement"}], "failed_group_reruns": 0},
        "model": {"scripted": True},
        "coordinator": {"max_concurrent_episodes": 3, "episodes_per_runner": 3,
                        "max_retries": 0},
    }))

    def verdict(body: dict[str, Any]) -> str:
        question = body["messages"][-1]["content"]
        if "ringed" in question:
            return "I cannot say."  # neither verdict: a failed judgement
        answer = question.split("Model's answer:\n", 1)[1].split("\n\n", 1)[0]
        return "Correct" if answer in ("It is Mars.",) else "Incorrect"

    with FakeOpenAIServer(model="judge-model", reply=verdict) as judge:
        env = {**os.environ, "JUDGE_KEY": "s3cret-judge"}
        args = _command(tmp, config, f"text.judge.endpoints={json.dumps([judge.url])}",
                        "text.judge.name=judge-model", "text.judge.api_key_env=JUDGE_KEY")
        done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=420, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        asked = list(judge.requests)
        headers = list(judge.headers)
    assert len(asked) == 3
    assert {body["model"] for body in asked} == {"judge-model"}
    assert all(h.get("authorization") == "Bearer s3cret-judge" for h in headers)
    results = _results(tmp / "results" / "judged")
    assert results["j-ok"][0]["status"] == "success"
    assert results["j-no"][0]["status"] == "failure"
    garbage = results["j-garbage"][0]
    assert garbage["status"] == "infra_error"
    assert "llm_judgement" in garbage["error"] and "neither" in garbage["error"]
    assert "s3cret" not in (tmp / "results" / "judged" / "run.json").read_text()
    # The failed judgement counts 0 in the score: (1 + 0 + 0) / 3.
    assert "33.3%" in done.stdout


@pytest.mark.integration
@pytest.mark.slow
def test_py_rag_and_web_episodes_side_by_side_in_one_runner_lose_no_descriptor(tmp):
    """The EBADF hunt's proof (issue 34): py sandboxes (pipes, pidfds, /proc listings), the
    rag tool (its corpus and index read from threads) and web fetches (sockets) run side by
    side in ONE runner process, 16 episodes at a time, 104 episodes: a descriptor closed
    twice anywhere in that process (uvloop's pipe transports did it) makes one of them fail
    with EBADF or ENOTDIR, an infra error here. Every episode must score as the demo does."""
    import yaml

    cfg = yaml.safe_load(TEXT_DEMO.read_text())
    cfg["tasks"]["benchmarks"] = [b for b in cfg["tasks"]["benchmarks"]
                                  if b["mode"] in ("py", "rag", "web")]
    cfg["tasks"]["rollouts_per_task"] = 8
    cfg["coordinator"].update(max_concurrent_episodes=16, episodes_per_runner=16)
    config = tmp / "side_by_side.yaml"
    config.write_text(yaml.safe_dump(cfg))
    done = _run(_command(tmp, config), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = _results(tmp / "results" / "text_demo")
    assert sum(len(v) for v in results.values()) == 13 * 8
    wrong = {(item, r["rollout"]): (r["status"], r.get("error"))
             for item, records in results.items() for r in records
             if r["status"] != "success"}
    assert wrong == {}
    runners = {r.get("runner") for records in results.values() for r in records}
    assert len(runners) == 1, runners
