"""Evaluator rules (FAIL, infeasible, conj, postconfig, options) and each getter and metric,
against a recording fake desktop that subclasses the real client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cua_rollout.core.errors import UnsupportedEvaluator
from cua_rollout.evaluation import evaluate
from tests.doubles.fake_desktop import FakeDesktop


class ScoredDesktop(FakeDesktop):
    """A fake desktop with the files, command output, terminal and tree these tests read."""

    def __init__(self, cache_dir: Path, files: dict[str, bytes]) -> None:
        super().__init__(
            files=files,
            execute_func=lambda command, shell: {"status": "success",
                                                 "output": f"ran {command}\n", "error": "",
                                                 "returncode": 0},
            terminal="$ echo hi\nhi\n",
            accessibility="<root><label name='Result'>408</label></root>",
        )
        self.cache_dir = cache_dir

    @property
    def commands(self) -> list[Any]:
        return [arg for kind, arg in self.calls if kind == "execute"]


async def score(env: ScoredDesktop, t: dict, last_action: str | None) -> float:
    return await evaluate(env, t, last_action, cache_dir=env.cache_dir, task_id="t1")


def task(evaluator: dict) -> dict:
    return {"id": "t1", "instruction": "x", "evaluator": evaluator}


@pytest.fixture
def env(tmp_path) -> ScoredDesktop:
    return ScoredDesktop(tmp_path, {"/root/a.txt": b"hello\nworld\n", "/root/b.txt": b"x\n"})


async def test_infeasible_scores_only_a_final_fail(env):
    t = task({"func": "infeasible"})
    assert await score(env, t, "FAIL") == 1.0
    assert await score(env, t, "DONE") == 0.0
    assert await score(env, t, None) == 0.0


async def test_a_final_fail_scores_zero_on_a_feasible_task(env):
    t = task({"func": "exact_match", "result": {"type": "rule", "rules": {"expected": 1}},
              "expected": {"type": "rule", "rules": {"expected": 1}}})
    assert await score(env, t, "FAIL") == 0.0


async def test_vm_command_line_with_exact_match_and_postconfig(env):
    t = task({
        "postconfig": [{"type": "sleep", "parameters": {"seconds": 0}},
                       {"type": "launch", "parameters": {"command": ["xterm"]}}],
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["echo", "x"]},
        "expected": {"type": "rule", "rules": {"expected": "ran ['echo', 'x']\n"}},
    })
    assert await score(env, t, "DONE") == 1.0
    assert ("launch", ["xterm"]) in env.calls  # postconfig ran before scoring
    assert env.commands == [["echo", "x"]]


async def test_vm_file_and_check_list(env):
    t = task({"func": "check_list", "result": {"type": "vm_file", "path": "/root/a.txt",
                                                 "dest": "a.txt"},
              "expected": {"type": "rule", "rules": {"expect": ["^hel", "wor"],
                                                     "unexpect": ["bye"]}}})
    assert await score(env, t, None) == 1.0
    t["evaluator"]["expected"]["rules"]["unexpect"] = ["world"]
    assert await score(env, t, None) == 0.0
    t["evaluator"]["result"]["path"] = "/root/missing.txt"
    assert await score(env, t, None) == 0.0


async def test_compare_text_file_with_cache_file_and_options(env, tmp_path):
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "expected.txt").write_text("HELLO   world\n")
    t = task({"func": "compare_text_file",
              "result": {"type": "vm_file", "path": "/root/a.txt", "dest": "a.txt"},
              "expected": {"type": "cache_file", "path": "expected.txt"},
              "options": {"ignore_blanks": True, "ignore_case": True}})
    assert await score(env, t, None) == 1.0
    t["evaluator"]["options"] = {}
    assert await score(env, t, None) == 0.0


async def test_accessibility_tree_and_terminal_with_include_exclude(env):
    t = task({"func": ["check_include_exclude", "check_include_exclude"], "conj": "and",
              "result": [{"type": "accessibility_tree"}, {"type": "vm_terminal_output"}],
              "expected": [{"type": "rule", "rules": {"include": ["408"], "exclude": ["409"]}},
                           {"type": "rule", "rules": {"include": ["hi"]}}]})
    assert await score(env, t, None) == 1.0
    env.accessibility = "<root>409 408</root>"
    assert await score(env, t, None) == 0.0


async def test_conj_or_takes_the_best_and_and_short_circuits(env):
    def value(v):
        return {"type": "rule", "rules": v}

    def rule(v):
        return {"type": "rule", "rules": {"expected": v}}

    t = task({"func": ["exact_match", "check_include_exclude"], "conj": "or",
              "result": [value("a"), value("abcd")],
              "expected": [rule("b"), {"type": "rule", "rules": {"include": ["bc"]}}]})
    assert await score(env, t, None) == 1.0  # the second metric scored 1
    t["evaluator"]["conj"] = "and"
    assert await score(env, t, None) == 0.0  # the first metric scored 0
    t["evaluator"]["result"][0] = value("b")
    assert await score(env, t, None) == 1.0
    t["evaluator"]["expected"][1]["rules"]["exclude"] = ["d"]
    t["evaluator"]["conj"] = "or"
    assert await score(env, t, None) == 1.0  # the first metric scored 1: the second not run


async def test_is_in_list(env):
    t = task({"func": "is_in_list", "result": {"type": "rule", "rules": ["a", "b"]},
              "expected": {"type": "rule", "rules": {"expected": "b"}}})
    assert await score(env, t, None) == 1.0


@pytest.mark.parametrize("evaluator, fragment", [
    ({"func": "compare_pdf", "result": {"type": "rule", "rules": 1}}, "metric:compare_pdf"),
    ({"func": "exact_match", "result": {"type": "cloud_thing"}}, "getter:cloud_thing"),
    ({"func": ["exact_match", "exact_match"], "result": [{"type": "rule", "rules": 1}]},
     "2 funcs"),
    ({"func": ["exact_match"], "conj": "xor", "result": [{"type": "rule", "rules": 1}]},
     "conj 'xor'"),
    ({"result": {}}, "no evaluator"),
])
async def test_unknown_parts_raise_unsupported_evaluator(env, evaluator, fragment):
    with pytest.raises(UnsupportedEvaluator, match=fragment):
        await score(env, task(evaluator), None)
    assert env.commands == []  # nothing ran on the desktop before the error


async def test_what_the_setup_saved_is_in_the_task_cache_as_osworld_keeps_it(env):
    """OSWorld's ``execute`` step writes its stdout/stderr into the task's cache under the
    names given; the ``cache_file`` getter then reads them (9 of OSWorld's tasks do)."""
    outputs = iter([{"output": "not yet\n", "error": "", "returncode": 1},
                    {"output": "3 files\n", "error": "warn: slow\n", "returncode": 0}])
    env._execute_func = lambda command, shell: next(outputs)
    await env.reset({"id": "t1", "config": [{"type": "execute", "parameters": {
        "command": ["ls"], "stdout": "listing.txt", "stderr": "logs/err.txt",
        "until": {"returncode": 0}}}]})
    # The last answer's texts, as OSWorld's loop leaves them (it rewrites them each time).
    assert env.task_cache == {"listing.txt": "3 files\n", "logs/err.txt": "warn: slow\n"}
    (env.cache_dir / "t1").mkdir()
    (env.cache_dir / "t1" / "expected.txt").write_text("3 files\n")
    (env.cache_dir / "t1" / "expected-err.txt").write_text("warn: slow\n")
    t = task({"func": ["compare_text_file", "compare_text_file"],
              "result": [{"type": "cache_file", "path": "listing.txt"},
                         {"type": "cache_file", "path": "logs/err.txt"}],
              "expected": [{"type": "cache_file", "path": "expected.txt"},
                           {"type": "cache_file", "path": "expected-err.txt"}]})
    assert await score(env, t, "DONE") == 1.0
    env.task_cache["listing.txt"] = "2 files\n"
    assert await score(env, t, "DONE") == 0.0
    await env.reset({"id": "t1"})  # the next episode's cache starts empty
    with pytest.raises(UnsupportedEvaluator, match="nor saved by the task's setup"):
        await score(env, task({"func": "compare_text_file",
                               "result": {"type": "cache_file", "path": "listing.txt"},
                               "expected": {"type": "cache_file", "path": "expected.txt"}}),
                    "DONE")


async def test_a_metric_that_raises_on_what_the_agent_left_is_evaluator_raised(env):
    from cua_rollout.core.errors import EvaluatorRaised

    t = task({"func": "is_in_list",
              "result": {"type": "vm_file", "path": "/root/never-written.txt", "dest": "n.txt"},
              "expected": {"type": "rule", "rules": {"expected": "x"}}})
    with pytest.raises(EvaluatorRaised, match="metric is_in_list raised TypeError"):
        await score(env, t, "DONE")


def test_the_osworld_worker_tells_a_desktop_that_did_not_answer_from_a_metric_that_raised():
    from cua_rollout.core.errors import DesktopError, EvaluatorRaised
    from cua_rollout.evaluation.osworld_bridge import error_of_reply
    from cua_rollout.evaluation.osworld_worker import is_transport

    class ConnectTimeout(Exception):
        pass

    ConnectTimeout.__module__ = "requests.exceptions"
    assert is_transport(ConnectionRefusedError()) and is_transport(ConnectTimeout())
    assert not is_transport(ValueError("bad xlsx")) and not is_transport(KeyError("x"))
    assert error_of_reply({"kind": "transport"}) is DesktopError
    assert error_of_reply({"kind": "error"}) is EvaluatorRaised
