"""Where tasks come from: an OSWorld task list with its examples folder, a JSONL file, a
directory of task files, and the text benchmarks; each source re-reads only files whose mtime or
size changed. Also what makes a task valid (``validate_task``) and its problems."""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cua_rollout.config import BenchmarkConfig, TasksConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.files import iter_jsonl
from cua_rollout.text.benchmark import ItemProblem, text_task

__all__ = ["DEFAULT_DOMAIN", "BenchmarkSource", "SourceTask", "TaskProblem", "TaskSource",
           "Wanted", "make_source", "name_problem", "validate_task"]

DEFAULT_DOMAIN = "default"


# --------------------------------------------------------------------------- public types


@dataclass(frozen=True)
class TaskProblem:
    """A task that could not be loaded: the file (and line of a JSONL file), the field at
    fault (``None`` when the whole file is unreadable) and what is wrong."""

    path: Path
    field: str | None
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else str(self.path)
        return (
            f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        )


# Task ids and domains name directories of the run (<run>/<domain>/<id>/<rollout>): one
# path component each, never "." or "..", so no two tasks share a directory and none
# leaves the run directory. OSWorld's ids (UUIDs) and domains (libreoffice_calc ...) fit.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_NAME_MAX_CHARS = 128


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a task id or domain (a directory of the run), or None."""
    if name in (".", "..") or not _NAME_RE.fullmatch(name):
        return (f"must be letters, digits, '.', '_' or '-' (one path component, not '.' "
                f"or '..'), got {name!r}")
    if len(name) > _NAME_MAX_CHARS:
        return f"must be at most {_NAME_MAX_CHARS} characters, got {len(name)}"
    return None


def validate_task(
    task: Any, *, path: Path, osworld: bool, line: int | None = None
) -> list[TaskProblem]:
    """Problems of one task dict. ``osworld``: ``evaluator`` is required (OSWorld task
    files); otherwise only ``id`` and ``instruction`` are, and the others are type-checked
    when present (``config`` may be missing: no setup steps, as OSWorld reads it)."""

    def problem(name: str | None, message: str) -> TaskProblem:
        return TaskProblem(path, name, message, line)

    if not isinstance(task, dict):
        return [problem(None, f"a task must be a JSON object, not {type(task).__name__}")]
    problems: list[TaskProblem] = []
    for name in ("id", "instruction"):
        value = task.get(name)
        if name not in task:
            problems.append(problem(name, "missing"))
        elif not isinstance(value, str) or not value.strip():
            problems.append(problem(name, f"must be a non-empty string, got {value!r}"))
    if (isinstance(task.get("id"), str) and task["id"].strip()
            and (bad := name_problem(task["id"])) is not None):
        problems.append(problem("id", bad))
    if "domain" in task:
        if not isinstance(task["domain"], str) or not task["domain"]:
            problems.append(problem("domain",
                                    f"must be a non-empty string, got {task['domain']!r}"))
        elif (bad := name_problem(task["domain"])) is not None:
            problems.append(problem("domain", bad))

    # A task file without "config" has no setup steps (OSWorld reads it so).
    if "config" not in task:
        pass
    elif not isinstance(task["config"], list):
        problems.append(problem("config", f"must be a list, got {type(task['config']).__name__}"))
    else:
        for i, step in enumerate(task["config"]):
            if not isinstance(step, dict):
                problems.append(problem(f"config[{i}]", "a setup step must be an object"))
            elif not isinstance(step.get("type"), str):
                problems.append(problem(f"config[{i}].type", "missing or not a string"))
            elif not isinstance(step.get("parameters", {}), dict):
                problems.append(problem(f"config[{i}].parameters", "must be an object"))

    if "evaluator" not in task:
        if osworld:
            problems.append(problem("evaluator", "missing"))
    elif not isinstance(task["evaluator"], dict):
        problems.append(problem("evaluator", "must be an object"))
    else:
        func = task["evaluator"].get("func")
        ok = isinstance(func, str) or (
            isinstance(func, list) and func and all(isinstance(f, str) for f in func)
        )
        if not ok:
            problems.append(
                problem("evaluator.func", f"must be a string or a list of strings, got {func!r}")
            )
    return problems


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourceTask:
    """One task as a source found it: its domain, id, the task dict and its file."""

    domain: str
    task_id: str
    task: dict[str, Any]
    path: Path


# Filter on (domain, task_id); task_id None asks "could any task of this domain pass?".
Wanted = Callable[[str, str | None], bool]
_Signature = tuple[int, int]  # (mtime_ns, size): a file is re-read only when this changes


def _signature(path: Path) -> _Signature | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


@dataclass
class _Parsed:
    signature: _Signature | None
    tasks: list[SourceTask]
    problems: list[TaskProblem]


def _read_json(path: Path) -> tuple[Any, TaskProblem | None]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, TaskProblem(path, None, "file not found")
    except (OSError, UnicodeDecodeError) as exc:
        return None, TaskProblem(path, None, f"cannot read: {exc}")
    except json.JSONDecodeError as exc:
        return None, TaskProblem(path, None, f"invalid JSON: {exc}")


def _parse_task_file(path: Path, domain: str, expected_id: str | None) -> _Parsed:
    signature = _signature(path)
    if (bad := name_problem(domain)) is not None:
        return _Parsed(signature, [], [TaskProblem(path, "domain", bad)])
    data, problem = _read_json(path)
    if problem is not None:
        return _Parsed(signature, [], [problem])
    problems = validate_task(data, path=path, osworld=True)
    if not problems and expected_id is not None and data["id"] != expected_id:
        problems.append(
            TaskProblem(path, "id", f"is {data['id']!r} but the task list names {expected_id!r}")
        )
    if problems:
        return _Parsed(signature, [], problems)
    return _Parsed(signature, [SourceTask(domain, data["id"], data, path)], [])


def _parse_jsonl(path: Path) -> _Parsed:
    signature = _signature(path)
    tasks: list[SourceTask] = []
    problems: list[TaskProblem] = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return _Parsed(signature, [], [TaskProblem(path, None, f"cannot read: {exc}")])
    for line in iter_jsonl(text):
        number, data = line.number, line.value
        if line.error is not None:
            problems.append(TaskProblem(path, None, f"invalid JSON: {line.error}", number))
            continue
        line_problems = validate_task(data, path=path, osworld=False, line=number)
        if line_problems:
            problems.extend(line_problems)
            continue
        tasks.append(SourceTask(data.get("domain", DEFAULT_DOMAIN), data["id"], data, path))
    return _Parsed(signature, tasks, problems)


class TaskSource(abc.ABC):
    """One kind of task source; ``scan()`` returns the current tasks in source order and the
    current problems, re-reading only files whose signature changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cache: dict[Path, _Parsed] = {}

    def _cached_task_file(self, path: Path, domain: str, expected_id: str | None) -> _Parsed:
        cached = self._cache.get(path)
        signature = _signature(path)
        if cached is None or cached.signature != signature or signature is None:
            cached = _parse_task_file(path, domain, expected_id)
            self._cache[path] = cached
        return cached

    def _scan_file(self, parse: Callable[[], _Parsed], wanted: Wanted
                   ) -> tuple[list[SourceTask], list[TaskProblem]]:
        """A one-file source's wanted tasks and problems, parsed again only when the file's
        signature changed."""
        cached = self._cache.get(self.path)
        if cached is None or cached.signature != _signature(self.path):
            cached = parse()
            self._cache[self.path] = cached
        return [t for t in cached.tasks if wanted(t.domain, t.task_id)], list(cached.problems)

    @abc.abstractmethod
    def scan(self, wanted: Wanted) -> tuple[list[SourceTask], list[TaskProblem]]:
        """The source's tasks (in source order) and its problems, as they are now."""


class _TaskListSource(TaskSource):
    """OSWorld ``{domain: [ids]}`` with ``<examples_dir>/<domain>/<id>.json``."""

    def __init__(self, path: Path, examples_dir: Path) -> None:
        super().__init__(path)
        self.examples_dir = examples_dir
        self._list_signature: _Signature | None = None
        self._entries: list[tuple[str, str]] = []
        self._list_problem: TaskProblem | None = None
        self._loaded_once = False

    def _read_list(self) -> None:
        signature = _signature(self.path)
        if self._loaded_once and signature == self._list_signature:
            return
        data, problem = _read_json(self.path)
        if problem is None:
            problem = self._check_list(data)
        if problem is not None:
            if not self._loaded_once:
                raise ConfigError(f"tasks.source: {problem}")
            # A list being rewritten in place: keep the last good one until it parses again.
            self._list_problem = problem
            self._list_signature = signature
            return
        self._entries = [(domain, task_id) for domain, ids in data.items() for task_id in ids]
        self._list_signature = signature
        self._list_problem = None
        self._loaded_once = True

    def _check_list(self, data: Any) -> TaskProblem | None:
        if not isinstance(data, dict):
            return TaskProblem(self.path, None, "a task list must be an object {domain: [ids]}")
        for domain, ids in data.items():
            if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
                return TaskProblem(self.path, domain, "must be a list of task id strings")
        return None

    def scan(self, wanted: Wanted) -> tuple[list[SourceTask], list[TaskProblem]]:
        self._read_list()
        tasks: list[SourceTask] = []
        problems = [self._list_problem] if self._list_problem else []
        for domain, task_id in self._entries:
            if not wanted(domain, task_id):
                continue  # filtered before reading: a big list costs a stat per wanted task
            bad = [(f, m) for f, v in (("domain", domain), ("id", task_id))
                   if (m := name_problem(v)) is not None]
            if bad:  # never a path built from it: it could leave examples_dir
                problems += [TaskProblem(self.path, f"{domain}: {f}", m) for f, m in bad]
                continue
            path = self.examples_dir / domain / f"{task_id}.json"
            parsed = self._cached_task_file(path, domain, task_id)
            tasks.extend(parsed.tasks)
            problems.extend(parsed.problems)
        return tasks, problems


class _JsonlSource(TaskSource):
    """A JSONL file, one task per line; domain from the task's ``domain`` or ``default``."""

    def scan(self, wanted: Wanted) -> tuple[list[SourceTask], list[TaskProblem]]:
        return self._scan_file(lambda: _parse_jsonl(self.path), wanted)


class _DirectorySource(TaskSource):
    """A directory tree of task JSON files; a task's domain is its file's parent directory."""

    def _files(self) -> Iterator[Path]:
        for root, dirs, files in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                # Hidden and temporary names are files still being written (temp + rename).
                if name.endswith(".json") and not name.startswith("."):
                    yield Path(root) / name

    def scan(self, wanted: Wanted) -> tuple[list[SourceTask], list[TaskProblem]]:
        tasks: list[SourceTask] = []
        problems: list[TaskProblem] = []
        seen: set[Path] = set()
        for path in self._files():
            seen.add(path)
            domain = path.parent.name
            if not wanted(domain, None):
                continue
            parsed = self._cached_task_file(path, domain, None)
            tasks.extend(t for t in parsed.tasks if wanted(t.domain, t.task_id))
            problems.extend(parsed.problems)
        for gone in set(self._cache) - seen:
            del self._cache[gone]
        return tasks, problems


class BenchmarkSource(TaskSource):
    """A text benchmark (``tasks.benchmarks`` or a text-mode ``tasks.source``): a JSON list
    or a JSONL file of ``{id, question, answer, metadata}`` items, its name the domain."""

    def __init__(self, bench: BenchmarkConfig) -> None:
        super().__init__(Path(bench.source))
        self.bench = bench
        if not self.path.is_file():
            raise ConfigError(f"tasks: benchmark {self.path} does not exist")

    def _parse(self) -> _Parsed:
        path, bench = self.path, self.bench
        signature = _signature(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return _Parsed(signature, [], [TaskProblem(path, None, f"cannot read: {exc}")])
        numbered: list[tuple[int | None, str, Any]] = []  # (line, where, item)
        problems: list[TaskProblem] = []
        if path.suffix == ".jsonl":
            for line in iter_jsonl(text):
                if line.error is not None:
                    problems.append(TaskProblem(path, None, f"invalid JSON: {line.error}",
                                                line.number))
                else:
                    numbered.append((line.number, "", line.value))
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                return _Parsed(signature, [], [TaskProblem(path, None, f"invalid JSON: {exc}")])
            if not isinstance(data, list):
                return _Parsed(signature, [], [TaskProblem(
                    path, None, "a JSON benchmark must be a list of items (or use .jsonl)")])
            numbered = [(None, f"[{i}]", item) for i, item in enumerate(data)]
        tasks: list[SourceTask] = []
        for line, where, item in numbered:
            try:
                task = text_task(item, mode=bench.mode, benchmark=bench.domain,
                                 metric=bench.metric, variant=bench.metric_variant,
                                 tolerance=bench.numeric_tolerance)
            except ItemProblem as exc:
                field = f"{where}.{exc.field}" if where and exc.field else (exc.field or where
                                                                             or None)
                problems.append(TaskProblem(path, field, exc.message, line))
                continue
            if (bad := name_problem(task["id"])) is not None:
                problems.append(TaskProblem(path, f"{where}.id" if where else "id", bad, line))
                continue
            tasks.append(SourceTask(bench.domain, task["id"], task, path))
        return _Parsed(signature, tasks, problems)

    def scan(self, wanted: Wanted) -> tuple[list[SourceTask], list[TaskProblem]]:
        return self._scan_file(self._parse, wanted)


class _Sources(TaskSource):
    """Several sources as one (the desktop source and the text benchmarks), in order."""

    def __init__(self, sources: list[TaskSource]) -> None:
        super().__init__(sources[0].path)
        self.sources = sources

    def scan(self, wanted: Wanted) -> tuple[list[SourceTask], list[TaskProblem]]:
        tasks: list[SourceTask] = []
        problems: list[TaskProblem] = []
        for source in self.sources:
            found, bad = source.scan(wanted)
            tasks += found
            problems += bad
        return tasks, problems



def make_source(cfg: TasksConfig) -> TaskSource:
    """The configured task source: the desktop tasks' (a task list, a JSONL file or a
    directory) and the text benchmarks, in that order."""
    benchmarks: list[TaskSource] = [BenchmarkSource(b) for b in cfg.text_benchmarks()]
    if not cfg.needs_desktops:
        if not benchmarks:
            raise ConfigError("tasks.source is not set: give a task list, a JSONL file or "
                              "a dir (or text benchmarks in tasks.benchmarks)")
        return benchmarks[0] if len(benchmarks) == 1 else _Sources(benchmarks)
    desktop = _desktop_source(cfg)
    return _Sources([desktop, *benchmarks]) if benchmarks else desktop

def _desktop_source(cfg: TasksConfig) -> TaskSource:
    assert cfg.source is not None
    source = Path(cfg.source)
    if source.is_dir():
        return _DirectorySource(source)
    if not source.is_file():
        raise ConfigError(f"tasks.source: {source} does not exist")
    if source.suffix == ".jsonl":
        return _JsonlSource(source)
    examples = Path(cfg.examples_dir) if cfg.examples_dir else source.parent / "examples"
    if not examples.is_dir():
        raise ConfigError(
            f"tasks.examples_dir: {examples} does not exist (task files of {source})"
        )
    loaded = _TaskListSource(source, examples)
    loaded.scan(lambda domain, task_id: False)  # a broken list is a ConfigError up front
    return loaded
