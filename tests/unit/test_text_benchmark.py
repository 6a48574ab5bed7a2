"""Text benchmarks as tasks: one item checked and turned into a task
(``cua_rollout.text.benchmark``), and the task loader reading benchmark files (JSON lists and
JSONL) next to or instead of desktop tasks, with the problems of bad items named by file,
line and field, and a resumed run skipping finished episodes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cua_rollout.config import BenchmarkConfig, TasksConfig, load_config
from cua_rollout.core.errors import ConfigError
from cua_rollout.runtime.loader import TaskLoader, load_benchmark
from cua_rollout.text.benchmark import ItemProblem, is_text_task, task_metric, text_task
from tests.support import REPO_ROOT

DEMO_TASK_LIST = REPO_ROOT / "tasks" / "demo" / "test_all.json"
DEMO_TASKS = 18  # tasks/demo/test_all.json: terminal 7, editor 6, calculator 5

DEFAULTS: dict[str, Any] = {"mode": "math", "benchmark": "gsm", "metric": "exact_match",
                            "variant": "normalized", "tolerance": 1e-6}


def _task(item: Any, **overrides: Any) -> dict[str, Any]:
    return text_task(item, **{**DEFAULTS, **overrides})


def _problem(item: Any, **overrides: Any) -> ItemProblem:
    with pytest.raises(ItemProblem) as info:
        _task(item, **overrides)
    return info.value


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return path


def _write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _item(item_id: Any, answer: Any = "4", **extra: Any) -> dict[str, Any]:
    return {"id": item_id, "question": f"question {item_id}?", "answer": answer, **extra}


# --------------------------------------------------------------------------- text_task


def test_an_item_becomes_a_task() -> None:
    item = {"id": "q1", "question": "What is 2+2?", "answer": "4",
            "metadata": {"source": "gsm8k", "level": 1}}
    task = _task(item, mode="py", benchmark="arith", metric="numeric_match",
                 variant="original", tolerance=0.5)
    assert task == {
        "id": "q1",
        "instruction": "What is 2+2?",
        "question": "What is 2+2?",
        "answer": "4",
        "metadata": {"source": "gsm8k", "level": 1},
        "mode": "py",
        "benchmark": "arith",
        "metric": {"name": "numeric_match", "variant": "original", "tolerance": 0.5},
    }
    assert is_text_task(task)
    assert task_metric(task) == ("numeric_match", "original", 0.5)


@pytest.mark.parametrize(("item_id", "expected"), [(7, "7"), (0, "0"), (-3, "-3"),
                                                     ("abc", "abc")])
def test_integer_ids_become_strings(item_id: Any, expected: str) -> None:
    assert _task(_item(item_id))["id"] == expected


@pytest.mark.parametrize("answer", ["4", 4, 4.5, -1, ["4", "four"], [4, "four", 4.0], [""]])
def test_answers_may_be_strings_numbers_or_lists_of_them(answer: Any) -> None:
    assert _task(_item("q", answer))["answer"] == answer


def test_metadata_is_optional_and_null_is_none() -> None:
    assert _task(_item("q"))["metadata"] == {}
    assert _task(_item("q", metadata=None))["metadata"] == {}


def test_an_items_evaluation_metric_overrides_the_files() -> None:
    item = _item("q", metadata={"evaluation_metric": "f1_score"})
    assert _task(item, metric="numeric_match")["metric"]["name"] == "f1_score"
    assert _task(_item("q"), metric="numeric_match")["metric"]["name"] == "numeric_match"


def test_an_unknown_evaluation_metric_is_a_problem_of_the_metadata() -> None:
    problem = _problem(_item("q7", metadata={"evaluation_metric": "bleu"}))
    assert problem.field == "metadata.evaluation_metric"
    assert "'q7'" in problem.message and "'bleu'" in problem.message
    assert "exact_match" in problem.message  # the known ones are listed


@pytest.mark.parametrize(("item", "field", "message"), [
    ({"question": "q", "answer": "a"}, "id", "missing"),
    ({"id": "x", "answer": "a"}, "question", "missing"),
    ({"id": "x", "question": "q"}, "answer", "missing"),
    ({"id": "", "question": "q", "answer": "a"}, "id", "non-empty string or an integer"),
    ({"id": True, "question": "q", "answer": "a"}, "id", "non-empty string or an integer"),
    ({"id": 1.5, "question": "q", "answer": "a"}, "id", "non-empty string or an integer"),
    ({"id": None, "question": "q", "answer": "a"}, "id", "non-empty string or an integer"),
    ({"id": "x", "question": "   ", "answer": "a"}, "question", "non-empty string"),
    ({"id": "x", "question": 5, "answer": "a"}, "question", "non-empty string"),
    ({"id": "x", "question": None, "answer": "a"}, "question", "non-empty string"),
    ({"id": "x", "question": "q", "answer": []}, "answer", "must not be an empty list"),
    ({"id": "x", "question": "q", "answer": True}, "answer", "a string, a number or a list"),
    ({"id": "x", "question": "q", "answer": [1, False]}, "answer", "a string, a number"),
    ({"id": "x", "question": "q", "answer": None}, "answer", "a string, a number"),
    ({"id": "x", "question": "q", "answer": {"v": 1}}, "answer", "a string, a number"),
    ({"id": "x", "question": "q", "answer": [["a"]]}, "answer", "a string, a number"),
    ({"id": "x", "question": "q", "answer": "a", "metadata": "easy"}, "metadata",
     "must be an object, got str"),
    ({"id": "x", "question": "q", "answer": "a", "metadata": [1]}, "metadata",
     "must be an object, got list"),
])
def test_item_problems_name_the_field(item: dict[str, Any], field: str, message: str) -> None:
    problem = _problem(item)
    assert problem.field == field
    assert message in problem.message
    assert str(problem) == problem.message
    assert isinstance(problem, ValueError)


@pytest.mark.parametrize("metadata", [[], 0, "", False])
def test_a_falsy_metadata_that_is_not_an_object_is_a_problem(metadata: Any) -> None:
    assert _problem(_item("x", metadata=metadata)).field == "metadata"


@pytest.mark.parametrize("item", [[1, 2], "q", 3, None])
def test_an_item_that_is_not_an_object_is_a_problem_of_the_whole_item(item: Any) -> None:
    problem = _problem(item)
    assert problem.field is None
    assert f"not {type(item).__name__}" in problem.message


def test_unknown_mode_or_variant_is_the_callers_error_not_the_items() -> None:
    with pytest.raises(ValueError, match="unknown text mode 'desktop'") as info:
        _task(_item("q"), mode="desktop")
    assert not isinstance(info.value, ItemProblem)
    with pytest.raises(ValueError, match="unknown metric variant 'loose'") as info:
        _task(_item("q"), variant="loose")
    assert not isinstance(info.value, ItemProblem)


# --------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(("task", "text"), [
    ({"mode": "math"}, True), ({"mode": "py"}, True), ({"mode": "rag"}, True),
    ({"mode": "web"}, True), ({"mode": "desktop"}, False), ({}, False),
    ({"id": "calc-add", "instruction": "add", "config": [], "evaluator": {"func": "x"}}, False),
])
def test_is_text_task(task: dict[str, Any], text: bool) -> None:
    assert is_text_task(task) is text


def test_task_metric_defaults_and_coerces_the_tolerance() -> None:
    assert task_metric({}) == ("exact_match", "normalized", 1e-6)
    assert task_metric({"metric": None}) == ("exact_match", "normalized", 1e-6)
    assert task_metric({"metric": {"name": "similarity"}}) == ("similarity", "normalized", 1e-6)
    tolerance = task_metric({"metric": {"name": "numeric_match", "tolerance": "0.25"}})[2]
    assert tolerance == 0.25 and isinstance(tolerance, float)


def test_task_metric_refuses_an_unknown_metric_naming_the_task() -> None:
    with pytest.raises(ValueError, match=r"task 'q3': unknown metric 'bleu'"):
        task_metric({"id": "q3", "metric": {"name": "bleu"}})


# --------------------------------------------------------------------------- load_benchmark


def test_a_jsonl_benchmark_loads_with_the_files_settings(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "arith.jsonl", [
        _item(1, "2"),
        "",  # blank lines are skipped
        _item("b", [3, "three"], metadata={"evaluation_metric": "contains_answer"}),
        _item("c", 4.5),
    ])
    bench = BenchmarkConfig(source=path, mode="py", metric="numeric_match",
                            metric_variant="original", numeric_tolerance=0.1)
    tasks, problems = load_benchmark(bench)
    assert problems == []
    assert [t["id"] for t in tasks] == ["1", "b", "c"]
    assert [t["answer"] for t in tasks] == ["2", [3, "three"], 4.5]
    assert {t["mode"] for t in tasks} == {"py"}
    assert {t["benchmark"] for t in tasks} == {"arith"}  # the file's stem
    assert [t["metric"] for t in tasks] == [
        {"name": "numeric_match", "variant": "original", "tolerance": 0.1},
        {"name": "contains_answer", "variant": "original", "tolerance": 0.1},
        {"name": "numeric_match", "variant": "original", "tolerance": 0.1}]
    assert tasks[0]["instruction"] == tasks[0]["question"] == "question 1?"


def test_a_json_list_benchmark_loads_and_a_name_replaces_the_stem(tmp_path: Path) -> None:
    path = _write_json(tmp_path / "file-stem.json", [_item(1), _item(2, ["a", "b"])])
    tasks, problems = load_benchmark(BenchmarkConfig(source=path, mode="rag", name="trivia"))
    assert problems == []
    assert [(t["id"], t["benchmark"], t["mode"]) for t in tasks] == [
        ("1", "trivia", "rag"), ("2", "trivia", "rag")]


def test_jsonl_problems_name_the_file_line_and_field_and_good_lines_still_load(
        tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [
        _item("ok1"),                                                   # 1
        '{"id": "cut", "question": "q", "ans',                         # 2: bad JSON
        {"question": "q", "answer": "a"},                               # 3: no id
        _item("slash/id"),                                              # 4: not a dir name
        ["not", "an", "object"],                                        # 5
        _item("m", metadata={"evaluation_metric": "bleu"}),             # 6
        _item("e", []),                                                 # 7
        {"id": "nq", "answer": "a"},                                    # 8
        _item("b", True),                                               # 9
        _item("md", metadata="x"),                                      # 10
        _item(".."),                                                    # 11
        _item("ok2", 5),                                                # 12
    ])
    tasks, problems = load_benchmark(BenchmarkConfig(source=path, mode="math"))
    assert [t["id"] for t in tasks] == ["ok1", "ok2"]
    assert [(p.line, p.field) for p in problems] == [
        (2, None), (3, "id"), (4, "id"), (5, None), (6, "metadata.evaluation_metric"),
        (7, "answer"), (8, "question"), (9, "answer"), (10, "metadata"), (11, "id")]
    assert all(p.path == path for p in problems)
    text = [str(p) for p in problems]
    assert text[0].startswith(f"{path}:2: invalid JSON")
    assert text[2].startswith(f"{path}:4: id: must be letters, digits")
    assert "'slash/id'" in text[2]
    assert text[3] == f"{path}:5: an item must be a JSON object, not list"
    assert text[4].startswith(f"{path}:6: metadata.evaluation_metric: item 'm': unknown "
                              "evaluation_metric 'bleu'")


def test_json_list_problems_name_the_items_index(tmp_path: Path) -> None:
    path = _write_json(tmp_path / "list.json", [
        _item("good"), _item("empty", []), 5, _item("a/b"), {"id": 3, "question": "q"},
        _item("m", metadata={"evaluation_metric": 7})])
    tasks, problems = load_benchmark(BenchmarkConfig(source=path, mode="math"))
    assert [t["id"] for t in tasks] == ["good"]
    assert [(p.line, p.field) for p in problems] == [
        (None, "[1].answer"), (None, "[2]"), (None, "[3].id"), (None, "[4].answer"),
        (None, "[5].metadata.evaluation_metric")]
    assert str(problems[0]) == f"{path}: [1].answer: must not be an empty list"
    assert str(problems[1]) == f"{path}: [2]: an item must be a JSON object, not int"


@pytest.mark.parametrize(("text", "message"), [
    ('{"id": "q1", "question": "q", "answer": "a"}', "must be a list of items"),
    ('[{"id": "q1", "question": "q", "answer": "a"},', "invalid JSON"),
])
def test_a_json_file_that_is_not_a_list_is_one_problem(tmp_path: Path, text: str,
                                                       message: str) -> None:
    path = tmp_path / "whole.json"
    path.write_text(text)
    tasks, problems = load_benchmark(BenchmarkConfig(source=path, mode="math"))
    assert tasks == []
    assert len(problems) == 1
    assert problems[0].path == path and problems[0].field is None
    assert message in problems[0].message


def test_a_missing_benchmark_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"benchmark .*nowhere\.jsonl does not exist"):
        load_benchmark(BenchmarkConfig(source=tmp_path / "nowhere.jsonl", mode="math"))


# --------------------------------------------------------------------------- config


def test_two_benchmarks_of_the_same_stem_need_a_name(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a" / "gsm.jsonl", [_item(1)])
    b = _write_json(tmp_path / "b" / "gsm.json", [_item(1)])
    with pytest.raises(ValidationError,
                       match=r"tasks\.benchmarks\[1\] \(.*b/gsm\.json\): benchmark name "
                             r"'gsm' is also tasks\.benchmarks\[0\] \(.*a/gsm"):
        TasksConfig(benchmarks=[{"source": a, "mode": "math"}, {"source": b, "mode": "py"}])
    # a name tells them apart
    cfg = TasksConfig(benchmarks=[{"source": a, "mode": "math"},
                                  {"source": b, "mode": "py", "name": "gsm-py"}])
    assert [x.domain for x in cfg.text_benchmarks()] == ["gsm", "gsm-py"]


def test_same_stem_benchmarks_in_a_config_file_are_a_config_error(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a" / "gsm.jsonl", [_item(1)])
    b = _write_json(tmp_path / "b" / "gsm.json", [_item(1)])
    config = tmp_path / "run.yaml"
    config.write_text(f"tasks:\n  benchmarks:\n    - {{source: {a}, mode: math}}\n"
                      f"    - {{source: {b}, mode: web}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(config) in str(info.value)
    assert "tasks.benchmarks[1]" in str(info.value) and "tasks.benchmarks[0]" in str(info.value)


def test_a_text_source_and_a_benchmark_of_the_same_stem_clash(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a" / "gsm.jsonl", [_item(1)])
    b = _write_json(tmp_path / "b" / "gsm.json", [_item(1)])
    with pytest.raises(ValidationError, match=r"is also tasks\.source \("):
        TasksConfig(mode="math", source=a, benchmarks=[{"source": b, "mode": "py"}])


def test_the_clash_with_a_text_source_names_the_benchmarks_own_index(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a" / "gsm.jsonl", [_item(1)])
    b = _write_json(tmp_path / "b" / "gsm.json", [_item(1)])
    with pytest.raises(ValidationError,
                       match=r"tasks\.benchmarks\[0\] \(.*b/gsm\.json\): benchmark "
                             r"name 'gsm' is also tasks\.source \("):
        TasksConfig(mode="math", source=a, benchmarks=[{"source": b, "mode": "py"}])


def test_domain_is_the_name_or_the_stem(tmp_path: Path) -> None:
    assert BenchmarkConfig(source=tmp_path / "x" / "hotpot.v2.jsonl", mode="rag").domain \
        == "hotpot.v2"
    assert BenchmarkConfig(source=tmp_path / "x.json", mode="rag", name="hp").domain == "hp"
    with pytest.raises(ValidationError):
        BenchmarkConfig(source=tmp_path / "x.json", mode="rag", name="a/b")


def test_needs_desktops_only_with_a_desktop_source(tmp_path: Path) -> None:
    bench = {"source": tmp_path / "b.jsonl", "mode": "math"}
    assert not TasksConfig(benchmarks=[bench]).needs_desktops
    assert not TasksConfig(mode="web", source=tmp_path / "w.jsonl").needs_desktops
    assert TasksConfig(source=DEMO_TASK_LIST, benchmarks=[bench]).needs_desktops
    assert TasksConfig(source=DEMO_TASK_LIST).needs_desktops
    assert not TasksConfig().needs_desktops


# --------------------------------------------------------------------------- TaskLoader


def test_loader_hands_out_benchmark_items_as_episodes(tmp_path: Path) -> None:
    math = _write_jsonl(tmp_path / "arith.jsonl", [_item(1), _item("two"), _item("a/b")])
    web = _write_json(tmp_path / "facts.json", [_item("f1", ["Paris", "paris"])])
    cfg = TasksConfig(benchmarks=[{"source": math, "mode": "math"},
                                  {"source": web, "mode": "web", "name": "web-facts",
                                   "metric": "contains_answer"}],
                      rollouts_per_task=2)
    loader = TaskLoader(cfg, tmp_path / "run")
    specs = loader.poll()
    assert [s.episode_id for s in specs] == [
        "arith/1/0", "arith/1/1", "arith/two/0", "arith/two/1",
        "web-facts/f1/0", "web-facts/f1/1"]
    assert all(s.group_size == 2 and s.pass_index == 0 for s in specs)
    by_id = {s.episode_id: s for s in specs}
    assert by_id["arith/1/0"].task["mode"] == "math"
    assert by_id["arith/1/0"].task["question"] == "question 1?"
    assert by_id["web-facts/f1/1"].task["mode"] == "web"
    assert by_id["web-facts/f1/1"].task["metric"]["name"] == "contains_answer"
    assert by_id["web-facts/f1/1"].domain == "web-facts"
    # the bad id is reported, not handed out
    assert [(p.path, p.line, p.field) for p in loader.problems] == [(math, 3, "id")]
    assert loader.total_known() == 6
    assert loader.poll() == []
    assert loader.exhausted()


def test_a_text_mode_source_is_a_benchmark(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "gsm.jsonl", [_item(1, 3), _item(2, "4.0")])
    cfg = TasksConfig(mode="math", source=path, metric="numeric_match",
                      metric_variant="original")
    assert not cfg.needs_desktops
    specs = TaskLoader(cfg, tmp_path / "run").poll()
    assert [s.episode_id for s in specs] == ["gsm/1/0", "gsm/2/0"]
    assert specs[0].task["metric"] == {"name": "numeric_match", "variant": "original",
                                       "tolerance": 1e-6}
    assert specs[1].task["mode"] == "math" and specs[1].task["benchmark"] == "gsm"


def test_desktop_tasks_and_benchmarks_load_together(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "arith.jsonl", [_item(1), _item(2)])
    cfg = TasksConfig(source=DEMO_TASK_LIST, benchmarks=[{"source": path, "mode": "py"}])
    assert cfg.needs_desktops
    loader = TaskLoader(cfg, tmp_path / "run")
    specs = loader.poll()
    assert len(specs) == DEMO_TASKS + 2
    assert [s.episode_id for s in specs[-2:]] == ["arith/1/0", "arith/2/0"]
    assert not any(is_text_task(s.task) for s in specs[:-2])
    assert all(is_text_task(s.task) for s in specs[-2:])
    assert loader.problems == []


def test_duplicate_ids_in_a_benchmark_are_reported_once_loaded(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "dup.jsonl", [_item(1, "a"), _item("1", "b")])
    loader = TaskLoader(TasksConfig(benchmarks=[{"source": path, "mode": "math"}]),
                        tmp_path / "run")
    specs = loader.poll()
    assert [(s.episode_id, s.task["answer"]) for s in specs] == [("dup/1/0", "a")]
    assert len(loader.problems) == 1 and "duplicate task '1'" in loader.problems[0].message


def test_loader_filters_benchmarks_by_domain_and_id(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", [_item(1), _item(2)])
    b = _write_jsonl(tmp_path / "b.jsonl", [_item(1), _item(2)])
    benches = [{"source": a, "mode": "math"}, {"source": b, "mode": "py"}]
    only_b = TaskLoader(TasksConfig(benchmarks=benches, domains=["b"]), tmp_path / "r1")
    assert [s.episode_id for s in only_b.poll()] == ["b/1/0", "b/2/0"]
    only_2 = TaskLoader(TasksConfig(benchmarks=benches, task_ids=["2"]), tmp_path / "r2")
    assert [s.episode_id for s in only_2.poll()] == ["a/2/0", "b/2/0"]


def test_no_source_and_no_benchmark_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks\.source is not set"):
        TaskLoader(TasksConfig(), tmp_path / "run")
    with pytest.raises(ConfigError, match="does not exist"):
        TaskLoader(TasksConfig(benchmarks=[{"source": tmp_path / "gone.json",
                                            "mode": "math"}]), tmp_path / "run")


def test_a_resumed_run_does_not_hand_out_finished_text_episodes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write_jsonl(tmp_path / "gsm.jsonl", [_item(1), _item("q2"), _item("q3")])
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"task_id": "1", "domain": "gsm", "rollout": 0, "status": "success", "reward": 1.0},
        {"task_id": "1", "domain": "gsm", "rollout": 1, "status": "failure", "reward": 0.0},
        {"episode_id": "gsm/q2/0", "status": "max_steps", "reward": 0.0},
        {"task_id": "q2", "domain": "gsm", "rollout": 1, "status": "infra_error",
         "reward": None},  # rerun
        {"task_id": "q3", "domain": "other", "rollout": 0, "status": "success",
         "reward": 1.0},  # another benchmark's q3
    ]
    (run / "results.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"task_id": "q3", "dom')
    cfg = TasksConfig(mode="math", source=path, rollouts_per_task=2)
    with caplog.at_level(logging.WARNING, logger="task_loader"):
        loader = TaskLoader(cfg, run)
    assert any(f"{run / 'results.jsonl'}:6:" in r.getMessage() for r in caplog.records)
    specs = loader.poll()
    assert [s.episode_id for s in specs] == ["gsm/q2/1", "gsm/q3/0", "gsm/q3/1"]
    assert loader.finished_before() == 3
    assert loader.total_known() == 6
    assert loader.success_rate("1", "gsm") == 0.5
    assert loader.success_rate("q3", "gsm") is None
