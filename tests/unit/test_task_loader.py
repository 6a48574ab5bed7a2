"""task_loader: the demo suite as real input, JSONL and directory sources, filters, resume
from results.jsonl, service-mode polling, malformed task files and dynamic rollouts."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import DynamicRolloutsConfig, TasksConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.types import EpisodeSpec
from cua_rollout.runtime.loader import TaskLoader
from cua_rollout.runtime.task_sources import validate_task
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
SUITE = ROOT / "tasks" / "demo"
TASK_LIST = SUITE / "test_all.json"
DEMO_DOMAINS = {"terminal": 7, "editor": 6, "calculator": 5}


def _demo_task(task_id: str = "calc-add", domain: str = "calculator") -> dict[str, Any]:
    return json.loads((SUITE / "examples" / domain / f"{task_id}.json").read_text())


def _write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _touch_later(path: Path) -> None:
    """Move the mtime forward: filesystems with coarse timestamps would hide a rewrite."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def _copy_suite(tmp_path: Path) -> Path:
    dest = tmp_path / "suite"
    shutil.copytree(SUITE, dest)
    return dest


def _loader(tmp_path: Path, **cfg: Any) -> TaskLoader:
    cfg.setdefault("source", TASK_LIST)
    return TaskLoader(TasksConfig(**cfg), tmp_path / "run")


def _results(tmp_path: Path, lines: list[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.jsonl").write_text("".join(line + "\n" for line in lines))


# --------------------------------------------------------------------------- demo suite


def test_demo_suite_expands_to_grouped_rollouts(tmp_path: Path) -> None:
    loader = _loader(tmp_path, rollouts_per_task=3)
    specs = loader.poll()

    assert loader.problems == []
    assert len(specs) == 3 * 18
    assert loader.total_known() == 3 * 18
    groups = [s.group for s in specs]
    assert len(set(groups)) == 18
    for i in range(0, len(specs), 3):
        group = specs[i : i + 3]
        assert {s.group for s in group} == {group[0].group}
        assert [s.rollout for s in group] == [0, 1, 2]
    per_domain = {d: sum(1 for s in specs if s.domain == d) // 3 for d in DEMO_DOMAINS}
    assert per_domain == DEMO_DOMAINS
    # List order is kept: the first domain of test_all.json, its first id.
    first = specs[0]
    assert (first.domain, first.task_id) == ("terminal", "terminal-hello-file")
    assert first.episode_id == "terminal/terminal-hello-file/0"
    assert first.group == "terminal/terminal-hello-file"
    assert first.attempt == 0
    assert first.task["id"] == "terminal-hello-file" and first.task["instruction"]


def test_one_shot_second_poll_is_empty(tmp_path: Path) -> None:
    loader = _loader(tmp_path)
    assert len(loader.poll()) == 18
    assert loader.poll() == []
    assert loader.total_known() == 18


def test_episode_spec_is_frozen_picklable_and_derives_ids() -> None:
    task = _demo_task()
    spec = EpisodeSpec("calc-add", "calculator", 1, task)
    assert spec.episode_id == "calculator/calc-add/1"
    assert spec.group == "calculator/calc-add"
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again.task == task and again.episode_id == spec.episode_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rollout = 2  # type: ignore[misc]
    retry = dataclasses.replace(spec, attempt=1)
    assert retry.attempt == 1 and retry.episode_id == spec.episode_id


def test_examples_dir_override(tmp_path: Path) -> None:
    list_only = _write_json(tmp_path / "lists" / "l.json", {"calculator": ["calc-add"]})
    loader = _loader(tmp_path, source=list_only, examples_dir=SUITE / "examples")
    assert [s.episode_id for s in loader.poll()] == ["calculator/calc-add/0"]


# --------------------------------------------------------------------------- filters


def test_domain_filter(tmp_path: Path) -> None:
    specs = _loader(tmp_path, domains=["editor", "calculator"]).poll()
    assert {s.domain for s in specs} == {"editor", "calculator"}
    assert len(specs) == 11


def test_task_id_filter(tmp_path: Path) -> None:
    loader = _loader(tmp_path, task_ids=["calc-add", "editor-uppercase"], rollouts_per_task=2)
    specs = loader.poll()
    assert [s.episode_id for s in specs] == [
        "editor/editor-uppercase/0",
        "editor/editor-uppercase/1",
        "calculator/calc-add/0",
        "calculator/calc-add/1",
    ]


def test_domain_and_task_id_filters_combine(tmp_path: Path) -> None:
    specs = _loader(tmp_path, domains=["editor"], task_ids=["calc-add"]).poll()
    assert specs == []


# --------------------------------------------------------------------------- other sources


def test_jsonl_source(tmp_path: Path) -> None:
    source = tmp_path / "tasks.jsonl"
    rows = [
        {"id": "a", "instruction": "do a", "domain": "web"},
        {"id": "b", "instruction": "do b"},
        {"id": "c", "instruction": "do c", "domain": "web", "config": [], "evaluator": {}},
    ]
    rows[2]["evaluator"] = {"func": "exact_match"}
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loader = _loader(tmp_path, source=source, rollouts_per_task=2)
    specs = loader.poll()
    assert loader.problems == []
    assert [s.episode_id for s in specs] == [
        "web/a/0",
        "web/a/1",
        "default/b/0",
        "default/b/1",
        "web/c/0",
        "web/c/1",
    ]
    assert specs[2].task == rows[1]


def test_jsonl_bad_lines_reported_with_line_and_field(tmp_path: Path) -> None:
    source = tmp_path / "tasks.jsonl"
    source.write_text(
        "\n".join(
            [
                json.dumps({"id": "ok", "instruction": "fine"}),
                "{not json",
                json.dumps({"id": "no-instruction"}),
                json.dumps({"id": 7, "instruction": "x"}),
                json.dumps({"id": "bad-config", "instruction": "x", "config": {"type": "a"}}),
            ]
        )
    )
    loader = _loader(tmp_path, source=source)
    assert [s.task_id for s in loader.poll()] == ["ok"]
    found = {(p.line, p.field) for p in loader.problems}
    assert found == {(2, None), (3, "instruction"), (4, "id"), (5, "config")}
    assert all(p.path == source for p in loader.problems)
    assert str(loader.problems[0]).startswith(f"{source}:2: ")


def test_directory_source_domain_is_parent_dir(tmp_path: Path) -> None:
    loader = _loader(tmp_path, source=SUITE / "examples")
    specs = loader.poll()
    assert loader.problems == []
    assert len(specs) == 18
    assert {d: sum(s.domain == d for s in specs) for d in DEMO_DOMAINS} == DEMO_DOMAINS
    for spec in specs:
        assert spec.task["id"] == spec.task_id


def test_directory_source_filters(tmp_path: Path) -> None:
    specs = _loader(
        tmp_path, source=SUITE / "examples", domains=["terminal"], task_ids=["terminal-make-dirs"]
    ).poll()
    assert [s.episode_id for s in specs] == ["terminal/terminal-make-dirs/0"]


# --------------------------------------------------------------------------- resume


def test_resume_skips_finished_episodes_and_survives_a_broken_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _results(
        tmp_path,
        [
            json.dumps(
                {
                    "task_id": "calc-add",
                    "domain": "calculator",
                    "rollout": 0,
                    "status": "success",
                    "reward": 1.0,
                }
            ),
            json.dumps(
                {
                    "task_id": "calc-add",
                    "domain": "calculator",
                    "rollout": 1,
                    "status": "infra_error",
                    "reward": None,
                }
            ),
            '{"task_id": "calc-sqrt", "domain": "calcul',  # cut short by a crash
            json.dumps(
                {"episode_id": "editor/editor-uppercase/0", "status": "failure", "reward": 0.0}
            ),
            json.dumps({"task_id": "calc-sqrt", "status": "success"}),  # no domain/rollout
            json.dumps(
                {
                    "task_id": "terminal-make-dirs",
                    "domain": "terminal",
                    "rollout": 1,
                    "status": "max_steps",
                    "reward": 0.0,
                }
            ),
        ],
    )
    with caplog.at_level(logging.WARNING, logger="task_loader"):
        loader = _loader(tmp_path, rollouts_per_task=2)
    results = tmp_path / "run" / "results.jsonl"
    warned = [r.getMessage() for r in caplog.records]
    assert any(f"{results}:3:" in m for m in warned)
    assert any(f"{results}:5:" in m for m in warned)

    specs = loader.poll()
    ids = {s.episode_id for s in specs}
    assert len(specs) == 2 * 18 - 3
    assert "calculator/calc-add/0" not in ids
    assert "calculator/calc-add/1" in ids  # infra_error: rerun (tasks.rerun_infra_errors)
    assert "editor/editor-uppercase/0" not in ids
    assert "terminal/terminal-make-dirs/1" not in ids
    assert {
        "calculator/calc-sqrt/0",
        "calculator/calc-sqrt/1",
        "editor/editor-uppercase/1",
        "terminal/terminal-make-dirs/0",
    } <= ids
    assert loader.total_known() == 2 * 18
    assert loader.finished_before() == 3
    # A resumed run's scored results seed the success-rate window; infra errors do not.
    assert loader.success_rate("calc-add", "calculator") == 1.0
    assert loader.success_rate("calc-sqrt", "calculator") is None
    # Kept as final when the user says so.
    kept = _loader(tmp_path, rollouts_per_task=2, rerun_infra_errors=False)
    assert "calculator/calc-add/1" not in {s.episode_id for s in kept.poll()}


def test_a_rerun_line_supersedes_the_earlier_one_on_resume(tmp_path: Path) -> None:
    first = {"task_id": "calc-add", "domain": "calculator", "rollout": 0}
    _results(tmp_path, [json.dumps({**first, "status": "success", "reward": 1.0}),
                        json.dumps({**first, "status": "infra_error", "reward": None})])
    loader = _loader(tmp_path)
    assert "calculator/calc-add/0" in {s.episode_id for s in loader.poll()}


def test_resume_everything_finished_polls_nothing(tmp_path: Path) -> None:
    _results(
        tmp_path,
        [
            json.dumps(
                {
                    "task_id": "calc-add",
                    "domain": "calculator",
                    "rollout": r,
                    "status": "failure",
                    "reward": 0,
                }
            )
            for r in range(2)
        ],
    )
    loader = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2)
    assert loader.poll() == []
    assert loader.total_known() == 2


# --------------------------------------------------------------------------- service mode


def test_service_mode_picks_up_new_file_in_directory(tmp_path: Path) -> None:
    suite = _copy_suite(tmp_path)
    loader = _loader(tmp_path, source=suite / "examples", poll_interval_s=1.0, rollouts_per_task=2)
    assert len(loader.poll()) == 36
    assert loader.poll() == []

    new = _demo_task()
    new["id"] = "calc-new"
    _write_json(suite / "examples" / "calculator" / "calc-new.json", new)
    _write_json(suite / "examples" / "browser" / "web-1.json", {**new, "id": "web-1"})
    assert [s.episode_id for s in loader.poll()] == [
        "browser/web-1/0",
        "browser/web-1/1",
        "calculator/calc-new/0",
        "calculator/calc-new/1",
    ]
    assert loader.poll() == []
    assert loader.total_known() == 40


def test_service_mode_picks_up_new_id_in_list(tmp_path: Path) -> None:
    suite = _copy_suite(tmp_path)
    task_list = suite / "test_all.json"
    loader = _loader(tmp_path, source=task_list, poll_interval_s=0.5)
    assert len(loader.poll()) == 18

    new = _demo_task()
    new["id"] = "calc-new"
    _write_json(suite / "examples" / "calculator" / "calc-new.json", new)
    assert loader.poll() == []  # not in the list yet

    listed = json.loads(task_list.read_text())
    listed["calculator"].append("calc-new")
    task_list.write_text(json.dumps(listed))
    _touch_later(task_list)
    assert [s.episode_id for s in loader.poll()] == ["calculator/calc-new/0"]
    assert loader.poll() == []
    assert loader.total_known() == 19


def test_service_mode_list_naming_a_missing_file_loads_it_when_it_appears(
    tmp_path: Path,
) -> None:
    suite = _copy_suite(tmp_path)
    task_list = suite / "test_all.json"
    listed = json.loads(task_list.read_text())
    listed["calculator"].append("calc-later")
    task_list.write_text(json.dumps(listed))
    loader = _loader(tmp_path, source=task_list, poll_interval_s=0.5)

    assert len(loader.poll()) == 18
    missing = suite / "examples" / "calculator" / "calc-later.json"
    assert [(p.path, p.message) for p in loader.problems] == [(missing, "file not found")]

    _write_json(missing, {**_demo_task(), "id": "calc-later"})
    assert [s.episode_id for s in loader.poll()] == ["calculator/calc-later/0"]
    assert loader.problems == []


def test_service_mode_fixed_file_loads_on_next_poll(tmp_path: Path) -> None:
    suite = _copy_suite(tmp_path)
    path = suite / "examples" / "editor" / "editor-uppercase.json"
    good = path.read_text()
    path.write_text(good[: len(good) // 2])  # half written
    loader = _loader(tmp_path, source=suite / "examples", poll_interval_s=1.0)
    assert len(loader.poll()) == 17
    assert [p.path for p in loader.problems] == [path]

    path.write_text(good)
    _touch_later(path)
    assert [s.episode_id for s in loader.poll()] == ["editor/editor-uppercase/0"]
    assert loader.problems == []


def test_service_mode_unchanged_files_are_not_reread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite = _copy_suite(tmp_path)
    loader = _loader(tmp_path, source=suite / "test_all.json", poll_interval_s=1.0)
    loader.poll()
    reads: list[Path] = []
    real = Path.read_text

    def counting(self: Path, *args: Any, **kwargs: Any) -> str:
        reads.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    assert loader.poll() == []
    assert reads == []


def test_service_mode_broken_list_keeps_the_last_good_one(tmp_path: Path) -> None:
    suite = _copy_suite(tmp_path)
    task_list = suite / "test_all.json"
    loader = _loader(tmp_path, source=task_list, poll_interval_s=1.0)
    assert len(loader.poll()) == 18
    task_list.write_text('{"calculator": [')
    _touch_later(task_list)
    assert loader.poll() == []
    assert loader.total_known() == 18
    assert [p.path for p in loader.problems] == [task_list]


# --------------------------------------------------------------------------- malformed tasks


def test_malformed_task_files_reported_with_path_and_field(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    suite = _copy_suite(tmp_path)
    examples = suite / "examples"
    bad_json = examples / "terminal" / "terminal-make-dirs.json"
    bad_json.write_text("{ not json")
    no_instruction = examples / "editor" / "editor-uppercase.json"
    task = json.loads(no_instruction.read_text())
    del task["instruction"]
    _write_json(no_instruction, task)
    no_evaluator = examples / "calculator" / "calc-sqrt.json"
    task = json.loads(no_evaluator.read_text())
    del task["evaluator"]
    _write_json(no_evaluator, task)
    bad_step = examples / "calculator" / "calc-add.json"
    task = json.loads(bad_step.read_text())
    task["config"][1]["type"] = 3
    _write_json(bad_step, task)
    wrong_id = examples / "editor" / "editor-append-line.json"
    task = json.loads(wrong_id.read_text())
    task["id"] = "something-else"
    _write_json(wrong_id, task)

    with caplog.at_level(logging.WARNING, logger="task_loader"):
        loader = _loader(tmp_path, source=suite / "test_all.json")
        specs = loader.poll()

    assert len(specs) == 18 - 5
    found = {(p.path, p.field) for p in loader.problems}
    assert found == {
        (bad_json, None),
        (no_instruction, "instruction"),
        (no_evaluator, "evaluator"),
        (bad_step, "config[1].type"),
        (wrong_id, "id"),
    }
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for path in (bad_json, no_instruction, no_evaluator, bad_step, wrong_id):
        assert str(path) in logged
    # Logged once, not at every poll.
    caplog.clear()
    loader.poll()
    assert caplog.records == []


def test_duplicate_task_in_directory_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    task = _demo_task()
    first = _write_json(root / "calculator" / "a.json", task)
    second = _write_json(root / "calculator" / "b.json", task)
    loader = _loader(tmp_path, source=root)
    assert [s.episode_id for s in loader.poll()] == ["calculator/calc-add/0"]
    assert [(p.path, p.field) for p in loader.problems] == [(second, "id")]
    assert str(first) in loader.problems[0].message


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda t: t.update(id=""), "id"),
        (lambda t: t.update(id="a/b"), "id"),
        (lambda t: t.update(instruction=["x"]), "instruction"),
        (lambda t: t.update(config=[1]), "config[0]"),
        (lambda t: t["config"][0].update(parameters=[]), "config[0].parameters"),
        (lambda t: t.update(evaluator=[]), "evaluator"),
        (lambda t: t["evaluator"].update(func=3), "evaluator.func"),
        (lambda t: t["evaluator"].update(func=[]), "evaluator.func"),
    ],
)
def test_validate_task_names_the_field(mutate: Any, field: str) -> None:
    task = copy.deepcopy(_demo_task())
    assert validate_task(task, path=Path("t.json"), osworld=True) == []
    mutate(task)
    assert [p.field for p in validate_task(task, path=Path("t.json"), osworld=True)] == [field]


def test_every_demo_task_validates() -> None:
    for path in sorted((SUITE / "examples").rglob("*.json")):
        assert validate_task(json.loads(path.read_text()), path=path, osworld=True) == []


# --------------------------------------------------------------------------- config errors


def test_missing_task_list_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        _loader(tmp_path, source=missing)


def test_missing_examples_dir_is_a_config_error(tmp_path: Path) -> None:
    lone = _write_json(tmp_path / "lists" / "l.json", {"calculator": ["calc-add"]})
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "lists" / "examples"))):
        _loader(tmp_path, source=lone)
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "elsewhere"))):
        _loader(tmp_path, source=lone, examples_dir=tmp_path / "elsewhere")


def test_unset_source_and_broken_list_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks\.source"):
        TaskLoader(TasksConfig(), tmp_path)
    suite = _copy_suite(tmp_path)
    (suite / "test_all.json").write_text(json.dumps({"calculator": "calc-add"}))
    with pytest.raises(ConfigError, match=re.escape("test_all.json")):
        _loader(tmp_path, source=suite / "test_all.json")


# --------------------------------------------------------------------------- dynamic rollouts
# (the formula itself: tests/unit/test_sampling.py)


@pytest.mark.parametrize(("wins", "n"), [(6, 8), (15, 5), (9, 3), (20, 2)])
def test_loader_follows_the_formula_from_recorded_results(wins: int, n: int) -> None:
    # wins out of a window of 10, 20 or 10 episodes: 0.6, 0.75, 0.9, 1.0
    window = {6: 10, 15: 20, 9: 10, 20: 20}[wins]
    cfg = TasksConfig(
        source=TASK_LIST,
        rollouts_per_task=8,
        dynamic_rollouts=DynamicRolloutsConfig(enabled=True, window=window),
    )
    loader = TaskLoader(cfg, Path("/nonexistent-run-dir"))
    for i in range(window * 2):  # older results fall out of the window
        reward = 0.0 if i < window else float(i - window < wins)
        _scored(loader, reward, rollout=i)
    assert loader.rollouts_for("calc-add", "calculator") == n
    assert loader.rollouts_for("calc-sqrt", "calculator") == 8


def _scored(loader: TaskLoader, reward: float | None, rollout: int = 0,
            task: str = "calc-add", domain: str = "calculator") -> None:
    """Feed the loader a final result (reward None: an infra error)."""
    status = "infra_error" if reward is None else "success" if reward >= 1 else "failure"
    loader.record_result({"task_id": task, "domain": domain, "rollout": rollout,
                          "status": status, "reward": reward})


def test_dynamic_rollouts_size_each_new_group(tmp_path: Path) -> None:
    """A group is sized when it is planned; a later change of the rate sizes the next one."""
    cfg = TasksConfig(
        source=SUITE / "examples",
        task_ids=["calc-add"],
        rollouts_per_task=4,
        passes=3,
        dynamic_rollouts=DynamicRolloutsConfig(enabled=True, window=4),
    )
    loader = TaskLoader(cfg, tmp_path)
    first = loader.poll()
    assert [(s.rollout, s.pass_index, s.group_size) for s in first] == [
        (r, 0, 4) for r in range(4)]
    assert loader.total_known() == 12  # this group, and two more at 4 for now
    for spec in first:
        _scored(loader, 1.0, rollout=spec.rollout)
    second = loader.poll()  # solved: min_n
    assert [(s.rollout, s.pass_index, s.group_size) for s in second] == [(4, 1, 2), (5, 1, 2)]
    assert loader.total_known() == 4 + 2 + 2
    for spec in second:
        _scored(loader, 0.0, rollout=spec.rollout)
    # Failing again (the window of 4 holds 1, 1, 0, 0): the next group gets 4 back.
    third = loader.poll()
    assert [(s.rollout, s.group_size, s.group_id) for s in third] == [
        (r, 4, "calculator/calc-add/pass-2") for r in (8, 9, 10, 11)]
    assert loader.poll() == [] and loader.exhausted()


def test_passes_shrink_a_solved_task_to_min_n_and_keep_a_hard_one_at_the_maximum(
        tmp_path: Path) -> None:
    cfg = TasksConfig(source=SUITE / "examples", task_ids=["calc-add", "calc-sqrt"],
                      rollouts_per_task=8, passes=4,
                      dynamic_rollouts=DynamicRolloutsConfig(enabled=True, window=16))
    loader = TaskLoader(cfg, tmp_path)
    sizes: dict[str, list[int]] = {"calc-add": [], "calc-sqrt": []}
    for _ in range(4):
        specs = loader.poll()
        by_task: dict[str, list[EpisodeSpec]] = {}
        for spec in specs:
            by_task.setdefault(spec.task_id, []).append(spec)
        for task, group in by_task.items():
            assert {s.group_size for s in group} == {len(group)}
            sizes[task].append(len(group))
            for spec in group:  # calc-add always solved, calc-sqrt never
                _scored(loader, 1.0 if task == "calc-add" else 0.0, rollout=spec.rollout,
                        task=task)
        assert not loader.exhausted() or len(sizes["calc-add"]) == 4
    assert sizes == {"calc-add": [8, 2, 2, 2], "calc-sqrt": [8, 8, 8, 8]}
    assert loader.poll() == [] and loader.exhausted()


def test_a_new_pass_waits_until_the_tasks_group_is_final(tmp_path: Path) -> None:
    loader = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2, passes=0)
    assert [s.rollout for s in loader.poll()] == [0, 1]
    _scored(loader, 1.0, rollout=0)
    assert loader.poll() == []  # rollout 1 still runs
    loader.record_result({"task_id": "calc-add", "domain": "calculator", "rollout": 1,
                          "status": "cancelled", "reward": None})
    assert loader.poll() == []  # cancelled is not final
    _scored(loader, None, rollout=1)  # an infra error after its retries is final
    assert [(s.rollout, s.pass_index) for s in loader.poll()] == [(2, 1), (3, 1)]
    assert not loader.exhausted()  # passes: 0 never ends


def test_a_failed_group_is_replaced_by_another_pass_a_bounded_number_of_times(
        tmp_path: Path) -> None:
    """Issue 34: a group with an infra error (retries used up) failed as a whole and does
    not count as a pass: another group stands in, failed_group_reruns times per task."""
    loader = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2, passes=1,
                     failed_group_reruns=2)
    for expected_pass in (0, 1, 2):
        group = loader.poll()
        assert loader.total_known() == 2 * (expected_pass + 1)
        assert [(s.rollout, s.pass_index) for s in group] == [
            (2 * expected_pass, expected_pass), (2 * expected_pass + 1, expected_pass)]
        _scored(loader, 1.0, rollout=group[0].rollout)
        _scored(loader, None, rollout=group[1].rollout)  # the group fails
        assert loader.exhausted() == (expected_pass == 2)  # a replacement is due, or not
    # Two replacements used: the third failure ends the task.
    assert loader.poll() == [] and loader.exhausted()
    assert loader.total_known() == 6

    # A resumed run reads the same from its lines: three groups, each failed, nothing more.
    _results(tmp_path, [json.dumps({
        "domain": "calculator", "task_id": "calc-add", "rollout": r, "pass_index": r // 2,
        "group_size": 2, "status": "infra_error" if r % 2 else "success",
        "reward": None if r % 2 else 1.0}) for r in range(6)])
    again = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2, passes=1,
                    failed_group_reruns=2, rerun_infra_errors=False)
    assert again.poll() == [] and again.exhausted()


def test_a_group_scored_whole_is_a_pass_and_zero_reruns_keep_the_failed_one(
        tmp_path: Path) -> None:
    loader = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2, passes=1,
                     failed_group_reruns=0)
    group = loader.poll()
    for spec in group:
        _scored(loader, None, rollout=spec.rollout)
    assert loader.poll() == [] and loader.exhausted() and loader.total_known() == 2


def test_a_resumed_run_finds_its_groups_again(tmp_path: Path) -> None:
    """Pass 1 of 3 planned with 3 of 4 rollouts, one done: its other two run, as planned
    (not resized), and pass 2 waits for them."""
    def line(rollout: int, pass_index: int, size: int, status: str = "success") -> str:
        return json.dumps({"domain": "calculator", "task_id": "calc-add", "rollout": rollout,
                           "status": status, "reward": 1.0, "pass_index": pass_index,
                           "group_size": size})
    _results(tmp_path, [line(0, 0, 4), line(1, 0, 4), line(2, 0, 4), line(3, 0, 4),
                        line(4, 1, 3)])
    loader = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=4, passes=3,
                     dynamic_rollouts=DynamicRolloutsConfig(enabled=True, window=4))
    assert [(s.rollout, s.pass_index, s.group_size) for s in loader.poll()] == [
        (5, 1, 3), (6, 1, 3)]
    assert loader.total_known() == 4 + 3 + 2  # pass 2 at min_n for now
    for rollout in (5, 6):
        _scored(loader, 1.0, rollout=rollout)
    assert [(s.rollout, s.group_size) for s in loader.poll()] == [(8, 2), (9, 2)]
    # A different rollouts_per_task cannot place the recorded groups: a clear error.
    with pytest.raises(ConfigError, match="rollouts_per_task"):
        _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2, passes=3)


def test_the_checkpoint_barrier_holds_new_groups_only(tmp_path: Path) -> None:
    from cua_rollout.config import CheckpointBarrierConfig

    reason: list[str | None] = ["reload 3 to ckpt-2 under way"]
    _results(tmp_path, [json.dumps({"domain": "calculator", "task_id": "calc-add",
                                    "rollout": 0, "status": "failure", "reward": 0.0,
                                    "pass_index": 0, "group_size": 2})])
    loader = TaskLoader(TasksConfig(source=TASK_LIST, task_ids=["calc-add", "calc-sqrt"],
                                    rollouts_per_task=2, passes=2,
                                    checkpoint_barrier=CheckpointBarrierConfig(enabled=True)),
                        tmp_path / "run", barrier=lambda: reason[0])
    # The resumed group's missing rollout runs; no new group starts (calc-sqrt waits).
    assert [(s.task_id, s.rollout) for s in loader.poll()] == [("calc-add", 1)]
    assert loader.waiting is not None and "ckpt-2" in loader.waiting
    reason[0] = None
    assert [(s.task_id, s.rollout) for s in loader.poll()] == [("calc-sqrt", 0),
                                                                ("calc-sqrt", 1)]
    assert loader.waiting is None


def test_the_checkpoint_barrier_gives_way_after_its_timeout(tmp_path: Path) -> None:
    from cua_rollout.config import CheckpointBarrierConfig

    loader = TaskLoader(TasksConfig(source=TASK_LIST, task_ids=["calc-add"],
                                    checkpoint_barrier=CheckpointBarrierConfig(
                                        enabled=True, timeout_s=0.2)),
                        tmp_path / "run", barrier=lambda: "replicas serve v1, v2")
    assert loader.poll() == []
    import time

    time.sleep(0.25)
    assert [s.rollout for s in loader.poll()] == [0]


def test_dynamic_rollouts_off_ignores_results(tmp_path: Path) -> None:
    loader = _loader(tmp_path, rollouts_per_task=8, task_ids=["calc-add"])
    for i in range(5):
        _scored(loader, 1.0, rollout=i + 100)
    assert len(loader.poll()) == 8


# --------------------------------------------------------------------------- names (review M2)


def test_ids_and_domains_that_would_share_or_leave_a_directory_are_task_problems(
        tmp_path: Path) -> None:
    """``.`` as an id resolved to its task's domain dir; ``x/../y`` to another domain's; a
    lone surrogate broke the storage's hashing; each is now a reported problem and the
    other tasks run."""
    source = tmp_path / "tasks.jsonl"
    rows = [
        {"id": "ok", "instruction": "fine"},
        {"id": ".", "instruction": "x"},
        {"id": "..", "instruction": "x"},
        {"id": "a b", "instruction": "x"},
        {"id": "\ud800", "instruction": "x"},
        {"id": "x" * 129, "instruction": "x"},
        {"id": "t2", "instruction": "x", "domain": "x/../y"},
        {"id": "t3", "instruction": "x", "domain": ".."},
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows))
    loader = _loader(tmp_path, source=source)
    assert [s.episode_id for s in loader.poll()] == ["default/ok/0"]
    assert sorted((p.line, p.field) for p in loader.problems) == [
        (2, "id"), (3, "id"), (4, "id"), (5, "id"), (6, "id"), (7, "domain"), (8, "domain")]
    assert "at most 128 characters" in str(loader.problems[4])


def test_a_task_list_entry_with_a_bad_domain_or_id_is_skipped_not_followed(
        tmp_path: Path) -> None:
    suite = _copy_suite(tmp_path)
    listing = json.loads((suite / "test_all.json").read_text())
    (tmp_path / "secret.json").write_text(json.dumps({"id": "secret", "instruction": "x",
                                                      "config": [], "evaluator": {"func": "x"}}))
    listing[".."] = ["secret"]                  # examples/../secret.json would be read
    listing["terminal"] = [*listing["terminal"], "../../secret"]
    (suite / "test_all.json").write_text(json.dumps(listing))
    loader = _loader(tmp_path, source=suite / "test_all.json")
    specs = loader.poll()
    assert specs and all(s.domain != ".." and "secret" not in s.task_id for s in specs)
    assert sorted(p.field for p in loader.problems) == ["..: domain", "terminal: id"]


def test_a_directory_source_reports_a_folder_that_cannot_be_a_domain(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    shutil.copytree(SUITE / "examples" / "terminal", root / "terminal")
    shutil.copytree(SUITE / "examples" / "terminal", root / "two words")
    loader = _loader(tmp_path, source=root)
    domains = {s.domain for s in loader.poll()}
    assert domains == {"terminal"}
    assert {p.field for p in loader.problems} == {"domain"}


def test_a_cancelled_line_is_never_final(tmp_path: Path) -> None:
    """A cut straggler's (or a stopped run's) cancelled line: the episode runs again."""
    _results(tmp_path, [json.dumps({"domain": "calculator", "task_id": "calc-add",
                                    "rollout": r, "status": s, "reward": None})
                        for r, s in ((0, "cancelled"), (1, "failure"))])
    loader = _loader(tmp_path, task_ids=["calc-add"], rollouts_per_task=2)
    assert [s.rollout for s in loader.poll()] == [0]


# --------------------------------------------------------------------------- a long service run
# (issue 33: what the loader holds and what a poll looks at stay flat as passes go by)


def _service_loader(tmp_path: Path, **cfg: Any) -> TaskLoader:
    return _loader(tmp_path, source=SUITE / "examples", rollouts_per_task=4, passes=0,
                   poll_interval_s=3600.0, **cfg)


def _finish_all(loader: TaskLoader, specs: list[EpisodeSpec]) -> None:
    """Every episode of ``specs`` is final (some infra errors, some failures)."""
    for spec in specs:
        reward = None if spec.rollout % 7 == 3 else float(spec.rollout % 2)
        _scored(loader, reward, rollout=spec.rollout, task=spec.task_id, domain=spec.domain)


def _run_passes(loader: TaskLoader, passes: int) -> None:
    for _ in range(passes):
        specs = loader.poll(refresh=False)
        assert len(specs) == 18 * 4
        _finish_all(loader, specs)


def test_a_finished_pass_is_dropped_and_what_the_loader_holds_stays_flat(
        tmp_path: Path) -> None:
    loader = _service_loader(tmp_path)
    held = []
    done = 0
    for passes in (2, 30, 120):
        _run_passes(loader, passes - done)
        done = passes
        assert loader.plan.held() == {"tasks": 18, "open_groups": 0, "rollouts": 0}
        assert loader.total_known() == loader.finished_before() == done * 18 * 4
        specs = loader.poll(refresh=False)  # the next pass, handed out
        held.append(loader.plan.held())
        assert loader.total_known() == (done + 1) * 18 * 4
        _finish_all(loader, specs)
        done += 1
    assert held == [{"tasks": 18, "open_groups": 18, "rollouts": 18 * 4}] * 3


def test_a_poll_looks_at_open_groups_only_and_the_total_is_kept_not_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Structural, not timed: the rollouts a poll examines and the work total_known() does
    are the same after 2 passes and after 100."""
    from cua_rollout.runtime import sampling

    examined: list[int] = []
    real_rollouts = sampling._Group.rollouts

    def counting_rollouts(self: Any) -> range:
        found = real_rollouts(self)
        examined.append(len(found))
        return found

    monkeypatch.setattr(sampling._Group, "rollouts", counting_rollouts)
    recounts: list[int] = []
    real_known_of = sampling.SamplingPlan._known_of

    def counting_known_of(self: Any, state: Any) -> int:
        recounts.append(1)
        return real_known_of(self, state)

    monkeypatch.setattr(sampling.SamplingPlan, "_known_of", counting_known_of)

    def one_iteration(loader: TaskLoader, specs: list[EpisodeSpec]) -> tuple[int, int, int]:
        """The driver's loop when one group's results came in."""
        examined.clear()
        recounts.clear()
        for spec in specs[:4]:  # one task's group is final
            _scored(loader, 1.0, rollout=spec.rollout, task=spec.task_id, domain=spec.domain)
        fed = len(recounts)
        new = loader.poll(refresh=False)
        assert [s.group for s in new] == [specs[0].group] * 4
        recounts.clear()
        loader.total_known()
        return sum(examined), fed, len(recounts)

    costs = []
    for passes in (2, 100):
        loader = _service_loader(tmp_path / str(passes))
        _run_passes(loader, passes)
        costs.append(one_iteration(loader, loader.poll(refresh=False)))
    # 4 rollouts of the one new group; one recount per result; none to read the total.
    assert costs == [(4, 4, 0), (4, 4, 0)]


def _result_line(task: str, domain: str, rollout: int, status: str, stride: int = 4,
                 size: int = 4) -> str:
    reward = None if status in ("infra_error", "cancelled") else float(status == "success")
    return json.dumps({"episode_id": f"{domain}/{task}/{rollout}", "task_id": task,
                       "domain": domain, "rollout": rollout, "status": status,
                       "reward": reward, "pass_index": rollout // stride, "group_size": size,
                       "instruction": "x" * 200})


def test_resume_streams_a_long_service_runs_results(tmp_path: Path) -> None:
    """300 passes of 18 tasks in results.jsonl, the last one partly run (an infra error to
    rerun, a straggler cut and run again, a line cut by a crash): the loader keeps the open
    groups only, hands out exactly the episodes missing, and reads the file with memory that
    does not grow with it."""
    import tracemalloc

    tasks = [(p.stem, p.parent.name) for p in sorted((SUITE / "examples").rglob("*.json"))]
    lines = []
    passes = 300
    for p in range(passes - 1):
        for task, domain in tasks:
            lines += [_result_line(task, domain, p * 4 + i, "success" if i % 2 else "failure")
                      for i in range(4)]
    last = (passes - 1) * 4
    (t0, d0), (t1, d1) = tasks[0], tasks[1]
    lines += [_result_line(t0, d0, last, "success"), _result_line(t0, d0, last + 1, "infra_error"),
              _result_line(t1, d1, last, "cancelled"), _result_line(t1, d1, last + 1, "success"),
              _result_line(t1, d1, last, "failure")]
    _results(tmp_path, lines)
    path = tmp_path / "run" / "results.jsonl"
    with path.open("a") as f:
        f.write(_result_line(t1, d1, last + 2, "success")[:40])  # a crash cut it
    size = path.stat().st_size
    assert size > 6_000_000

    tracemalloc.start()
    try:
        loader = _service_loader(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"resume held {peak} bytes reading {size}"
    # Open: the two tasks' last groups; the other tasks' passes are all final.
    assert loader.plan.held() == {"tasks": 18, "open_groups": 2, "rollouts": 3}
    specs = loader.poll(refresh=False)
    assert loader.finished_before() == (passes - 1) * 18 * 4 + 3
    ids = {(s.task_id, s.rollout, s.pass_index, s.group_size) for s in specs}
    assert {(t0, last + i, passes - 1, 4) for i in (1, 2, 3)} <= ids  # the infra error reruns
    assert {(t1, last + i, passes - 1, 4) for i in (2, 3)} <= ids      # the cut line's too
    assert len(specs) == 3 + 2 + 16 * 4  # and every other task's next pass
    assert loader.total_known() == passes * 18 * 4
