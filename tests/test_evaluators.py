"""Evaluator rules (FAIL, infeasible, conj, postconfig, options) and each getter and metric,
against a recording fake desktop that subclasses the real client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import evaluators
from config import DesktopsConfig
from env_k8s import RemoteDesktopEnv
from rollout.errors import UnsupportedEvaluator


class FakeDesktop(RemoteDesktopEnv):
    """Answers the protocol calls evaluators make from in-memory state; records setup steps."""

    def __init__(self, cache_dir: Path, files: dict[str, bytes] | None = None) -> None:
        super().__init__("http://fake", DesktopsConfig(download_cache_dir=cache_dir))
        self.task_id = "t1"
        self.files = files or {}
        self.commands: list[Any] = []
        self.setup_steps: list[dict] = []
        self.tree = "<root><label name='Result'>408</label></root>"

    async def get_file(self, path: str) -> bytes | None:
        return self.files.get(path)

    async def execute(self, command, *, shell=False, timeout_s=None) -> dict[str, Any]:
        self.commands.append(command)
        return {"status": "success", "output": f"ran {command}\n", "error": "", "returncode": 0}

    async def accessibility_tree(self) -> str:
        return self.tree

    async def terminal_output(self) -> str:
        return "$ echo hi\nhi\n"

    async def run_setup_step(self, step, index: int = 0) -> None:
        self.setup_steps.append(dict(step))


def task(evaluator: dict) -> dict:
    return {"id": "t1", "instruction": "x", "evaluator": evaluator}


@pytest.fixture
def env(tmp_path) -> FakeDesktop:
    return FakeDesktop(tmp_path, {"/root/a.txt": b"hello\nworld\n", "/root/b.txt": b"x\n"})


async def test_infeasible_scores_only_a_final_fail(env):
    t = task({"func": "infeasible"})
    assert await evaluators.evaluate(env, t, "FAIL") == 1.0
    assert await evaluators.evaluate(env, t, "DONE") == 0.0
    assert await evaluators.evaluate(env, t, None) == 0.0


async def test_a_final_fail_scores_zero_on_a_feasible_task(env):
    t = task({"func": "exact_match", "result": {"type": "rule", "rules": {"expected": 1}},
              "expected": {"type": "rule", "rules": {"expected": 1}}})
    assert await evaluators.evaluate(env, t, "FAIL") == 0.0


async def test_vm_command_line_with_exact_match_and_postconfig(env):
    t = task({
        "postconfig": [{"type": "sleep", "parameters": {"seconds": 0}}],
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["echo", "x"]},
        "expected": {"type": "rule", "rules": {"expected": "ran ['echo', 'x']\n"}},
    })
    assert await evaluators.evaluate(env, t, "DONE") == 1.0
    assert env.setup_steps == [{"type": "sleep", "parameters": {"seconds": 0}}]
    assert env.commands == [["echo", "x"]]


async def test_vm_file_and_check_list(env):
    t = task({"func": "check_list", "result": {"type": "vm_file", "path": "/root/a.txt",
                                                 "dest": "a.txt"},
              "expected": {"type": "rule", "rules": {"expect": ["^hel", "wor"],
                                                     "unexpect": ["bye"]}}})
    assert await evaluators.evaluate(env, t, None) == 1.0
    t["evaluator"]["expected"]["rules"]["unexpect"] = ["world"]
    assert await evaluators.evaluate(env, t, None) == 0.0
    t["evaluator"]["result"]["path"] = "/root/missing.txt"
    assert await evaluators.evaluate(env, t, None) == 0.0


async def test_compare_text_file_with_cache_file_and_options(env, tmp_path):
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "expected.txt").write_text("HELLO   world\n")
    t = task({"func": "compare_text_file",
              "result": {"type": "vm_file", "path": "/root/a.txt", "dest": "a.txt"},
              "expected": {"type": "cache_file", "path": "expected.txt"},
              "options": {"ignore_blanks": True, "ignore_case": True}})
    assert await evaluators.evaluate(env, t, None) == 1.0
    t["evaluator"]["options"] = {}
    assert await evaluators.evaluate(env, t, None) == 0.0


async def test_accessibility_tree_and_terminal_with_include_exclude(env):
    t = task({"func": ["check_include_exclude", "check_include_exclude"], "conj": "and",
              "result": [{"type": "accessibility_tree"}, {"type": "vm_terminal_output"}],
              "expected": [{"type": "rule", "rules": {"include": ["408"], "exclude": ["409"]}},
                           {"type": "rule", "rules": {"include": ["hi"]}}]})
    assert await evaluators.evaluate(env, t, None) == 1.0
    env.tree = "<root>409 408</root>"
    assert await evaluators.evaluate(env, t, None) == 0.0


async def test_conj_or_takes_the_best_and_and_short_circuits(env):
    def value(v):
        return {"type": "rule", "rules": v}

    def rule(v):
        return {"type": "rule", "rules": {"expected": v}}

    t = task({"func": ["exact_match", "fuzzy_match"], "conj": "or",
              "result": [value("a"), value("abcd")],
              "expected": [rule("b"), rule("abce")]})
    assert await evaluators.evaluate(env, t, None) == pytest.approx(0.75)
    t["evaluator"]["conj"] = "and"
    assert await evaluators.evaluate(env, t, None) == 0.0  # the first metric scored 0
    t["evaluator"]["result"][0] = value("b")
    assert await evaluators.evaluate(env, t, None) == pytest.approx((1 + 0.75) / 2)


async def test_is_in_list(env):
    t = task({"func": "is_in_list", "result": {"type": "rule", "rules": ["a", "b"]},
              "expected": {"type": "rule", "rules": {"expected": "b"}}})
    assert await evaluators.evaluate(env, t, None) == 1.0


@pytest.mark.parametrize("evaluator, fragment", [
    ({"func": "compare_pdf", "result": {"type": "rule", "rules": 1}}, "metric 'compare_pdf'"),
    ({"func": "exact_match", "result": {"type": "cloud_thing"}}, "getter 'cloud_thing'"),
    ({"func": ["exact_match", "exact_match"], "result": [{"type": "rule", "rules": 1}]},
     "2 funcs"),
    ({"func": ["exact_match"], "conj": "xor", "result": [{"type": "rule", "rules": 1}]},
     "conj 'xor'"),
    ({"result": {}}, "no evaluator"),
])
async def test_unknown_parts_raise_unsupported_evaluator(env, evaluator, fragment):
    with pytest.raises(UnsupportedEvaluator, match=fragment):
        await evaluators.evaluate(env, task(evaluator), None)
    assert env.commands == []  # nothing ran on the desktop before the error
