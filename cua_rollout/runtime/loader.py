"""Tasks to episode specs: reads the task source (an OSWorld task list, a JSONL file or a
directory of task files), filters it, skips episodes already in the run's ``results.jsonl``,
picks up new tasks in service mode; which rollouts of them start when is the sampling plan's
(cua_rollout/runtime/sampling.py), which the loader feeds.

Never touches Ray or desktops: ``TaskLoader.poll()`` is plain file I/O on the driver.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cua_rollout.config import BenchmarkConfig, TasksConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.files import iter_jsonl, iter_jsonl_lines
from cua_rollout.core.layout import RESULTS_FILE
from cua_rollout.core.types import EpisodeSpec
from cua_rollout.runtime.sampling import SamplingPlan
from cua_rollout.text.benchmark import ItemProblem, text_task

__all__ = ["DEFAULT_DOMAIN", "EpisodeSpec", "TaskLoader", "TaskProblem", "load_benchmark",
           "load_tasks", "name_problem", "validate_task"]

logger = logging.getLogger(__name__)

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
class _Task:
    domain: str
    task_id: str
    task: dict[str, Any]
    path: Path


# Filter on (domain, task_id); task_id None asks "could any task of this domain pass?".
_Wanted = Callable[[str, str | None], bool]
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
    tasks: list[_Task]
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
    return _Parsed(signature, [_Task(domain, data["id"], data, path)], [])


def _parse_jsonl(path: Path) -> _Parsed:
    signature = _signature(path)
    tasks: list[_Task] = []
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
        tasks.append(_Task(data.get("domain", DEFAULT_DOMAIN), data["id"], data, path))
    return _Parsed(signature, tasks, problems)


class _Source(abc.ABC):
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

    def _scan_file(self, parse: Callable[[], _Parsed], wanted: _Wanted
                   ) -> tuple[list[_Task], list[TaskProblem]]:
        """A one-file source's wanted tasks and problems, parsed again only when the file's
        signature changed."""
        cached = self._cache.get(self.path)
        if cached is None or cached.signature != _signature(self.path):
            cached = parse()
            self._cache[self.path] = cached
        return [t for t in cached.tasks if wanted(t.domain, t.task_id)], list(cached.problems)

    @abc.abstractmethod
    def scan(self, wanted: _Wanted) -> tuple[list[_Task], list[TaskProblem]]:
        """The source's tasks (in source order) and its problems, as they are now."""


class _TaskListSource(_Source):
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

    def scan(self, wanted: _Wanted) -> tuple[list[_Task], list[TaskProblem]]:
        self._read_list()
        tasks: list[_Task] = []
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


class _JsonlSource(_Source):
    """A JSONL file, one task per line; domain from the task's ``domain`` or ``default``."""

    def scan(self, wanted: _Wanted) -> tuple[list[_Task], list[TaskProblem]]:
        return self._scan_file(lambda: _parse_jsonl(self.path), wanted)


class _DirectorySource(_Source):
    """A directory tree of task JSON files; a task's domain is its file's parent directory."""

    def _files(self) -> Iterator[Path]:
        for root, dirs, files in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                # Hidden and temporary names are files still being written (temp + rename).
                if name.endswith(".json") and not name.startswith("."):
                    yield Path(root) / name

    def scan(self, wanted: _Wanted) -> tuple[list[_Task], list[TaskProblem]]:
        tasks: list[_Task] = []
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


class _BenchmarkSource(_Source):
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
        tasks: list[_Task] = []
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
            tasks.append(_Task(bench.domain, task["id"], task, path))
        return _Parsed(signature, tasks, problems)

    def scan(self, wanted: _Wanted) -> tuple[list[_Task], list[TaskProblem]]:
        return self._scan_file(self._parse, wanted)


class _Sources(_Source):
    """Several sources as one (the desktop source and the text benchmarks), in order."""

    def __init__(self, sources: list[_Source]) -> None:
        super().__init__(sources[0].path)
        self.sources = sources

    def scan(self, wanted: _Wanted) -> tuple[list[_Task], list[TaskProblem]]:
        tasks: list[_Task] = []
        problems: list[TaskProblem] = []
        for source in self.sources:
            found, bad = source.scan(wanted)
            tasks += found
            problems += bad
        return tasks, problems


def load_benchmark(bench: BenchmarkConfig
                   ) -> tuple[list[dict[str, Any]], list[TaskProblem]]:
    """Every item of a text benchmark as its task (``cua_rollout.text.benchmark.text_task``) and
    the problems of those that could not be read."""
    tasks, problems = _BenchmarkSource(bench).scan(lambda domain, task_id: True)
    return [t.task for t in tasks], problems


def load_tasks(source: Path, examples_dir: Path | None = None
               ) -> tuple[list[tuple[str, str, dict[str, Any]]], list[TaskProblem]]:
    """Every task of ``source`` (a task list with its examples folder, a JSONL file or a
    folder of task files) as ``(domain, task_id, task)``, and the problems of those that could
    not be read: what the loader sees, for tools that check a task set."""
    loader_cfg = TasksConfig(source=source, examples_dir=examples_dir)
    tasks, problems = TaskLoader._make_source(loader_cfg).scan(lambda domain, task_id: True)
    return [(t.domain, t.task_id, t.task) for t in tasks], problems


# --------------------------------------------------------------------------- loader


class TaskLoader:
    """Hands out each episode of the configured tasks once.

    ``poll()`` returns the episodes not handed out before and not finished in
    ``<run_dir>/results.jsonl``, the rollouts of one task next to each other, as its
    ``SamplingPlan`` plans them (passes, group sizes, the checkpoint ``barrier``; results fed
    in with ``record_result``). With ``poll_interval_s == 0`` the source is read once; in
    service mode ``poll(refresh=True)`` re-reads it (only files whose mtime or size changed)
    and adds what is new. ``problems`` lists the tasks that could not be loaded right now.
    """

    def __init__(self, cfg: TasksConfig, run_dir: Path,
                 check: Callable[[dict[str, Any]], list[Any]] | None = None,
                 barrier: Callable[[], str | None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # Pre-flight (cua_rollout.evaluation.preflight.TaskChecker): a task it finds problems
        # in is reported and skipped before any desktop or model time is spent on it.
        self._check = check
        self._checked: dict[tuple[str, str], tuple[dict[str, Any], list[Any]]] = {}
        self._source = self._make_source(cfg)
        self._domains = set(cfg.domains) if cfg.domains is not None else None
        self._task_ids = set(cfg.task_ids) if cfg.task_ids is not None else None
        self._service = cfg.poll_interval_s > 0
        self._polled = False
        self._tasks: list[_Task] = []
        self._problems: list[TaskProblem] = []
        self._logged: set[TaskProblem] = set()
        self.plan = SamplingPlan(cfg, barrier)
        self._read_results()

    # ----------------------------------------------------------------- public

    @property
    def problems(self) -> list[TaskProblem]:
        """Tasks that could not be loaded at the last poll (path, field at fault, message)."""
        return list(self._problems)

    @property
    def waiting(self) -> str | None:
        """Why new groups are held (the checkpoint barrier), or None."""
        return self.plan.waiting

    def poll(self, refresh: bool = True) -> list[EpisodeSpec]:
        """Episodes to start now: rollouts of groups already planned (a resumed run's), and
        the next group of each task whose groups so far are final. ``refresh``: re-read the
        source first (the first poll always reads it; later ones only in service mode)."""
        if not self._polled or (refresh and self._service):
            self._refresh()
            self.plan.changed()
        self._polled = True
        return self.plan.hand_out(self._tasks)

    def exhausted(self) -> bool:
        """Nothing more will be handed out: not a service, every pass of every task
        planned and handed out (results may still be coming)."""
        if self._service or not self._polled:
            return False
        return self.plan.exhausted(self._tasks)

    def record_result(self, record: dict[str, Any]) -> None:
        """An episode is final (a results.jsonl record): the plan hears of it."""
        self.plan.record_result(record)

    def success_rate(self, task_id: str, domain: str) -> float | None:
        """Mean reward of the task's recent episodes (``None`` before any)."""
        return self.plan.success_rate(task_id, domain)

    def rollouts_for(self, task_id: str, domain: str) -> int:
        """How many rollouts the task gets now (``SamplingPlan.rollouts_for``)."""
        return self.plan.rollouts_for(task_id, domain)

    def total_known(self) -> int:
        """Episodes of all tasks known so far, finished ones included (the progress total)."""
        return self.plan.total_known(self._tasks)

    def finished_before(self) -> int:
        """Episodes of known tasks already in ``results.jsonl`` when the loader started."""
        return self.plan.finished_of(self._tasks)

    # ----------------------------------------------------------------- internals

    @staticmethod
    def _make_source(cfg: TasksConfig) -> _Source:
        benchmarks: list[_Source] = [_BenchmarkSource(b) for b in cfg.text_benchmarks()]
        if not cfg.needs_desktops:
            if not benchmarks:
                raise ConfigError("tasks.source is not set: give a task list, a JSONL file or "
                                  "a dir (or text benchmarks in tasks.benchmarks)")
            return benchmarks[0] if len(benchmarks) == 1 else _Sources(benchmarks)
        desktop = TaskLoader._desktop_source(cfg)
        return _Sources([desktop, *benchmarks]) if benchmarks else desktop

    @staticmethod
    def _desktop_source(cfg: TasksConfig) -> _Source:
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

    def _wanted(self, domain: str, task_id: str | None) -> bool:
        if self._domains is not None and domain not in self._domains:
            return False
        return task_id is None or self._task_ids is None or task_id in self._task_ids

    def _refresh(self) -> None:
        tasks, problems = self._source.scan(self._wanted)
        unique: list[_Task] = []
        first: dict[tuple[str, str], Path] = {}
        for t in tasks:
            key = (t.domain, t.task_id)
            if key in first:
                problems.append(
                    TaskProblem(
                        t.path,
                        "id",
                        f"duplicate task {t.task_id!r} in domain "
                        f"{t.domain!r}, first defined in {first[key]}; ignored",
                    )
                )
                continue
            first[key] = t.path
            found = self._preflight(t)
            if found:
                problems.append(TaskProblem(t.path, "cannot run here",
                                            "; ".join(map(str, found))))
                continue
            unique.append(t)
        self._tasks = unique
        self._problems = problems
        for problem in problems:
            if problem not in self._logged:
                self._logged.add(problem)
                logger.warning("task skipped: %s", problem)

    def _preflight(self, t: _Task) -> list[Any]:
        """The checker's problems of a task, checked again only when its file changed (the
        source hands out a new dict then)."""
        if self._check is None:
            return []
        key = (t.domain, t.task_id)
        cached = self._checked.get(key)
        if cached is None or cached[0] is not t.task:
            cached = (t.task, list(self._check(t.task)))
            self._checked[key] = cached
        return cached[1]

    def _read_results(self) -> None:
        """Resume: each episode's last line in results.jsonl (a rerun's line supersedes an
        earlier one) goes to the plan (``SamplingPlan.resume``). Read as a stream: what is
        kept is the last status, reward and group per episode, not the records."""
        path = self.run_dir / RESULTS_FILE
        last: dict[tuple[str, str, int], tuple[Any, Any, Any, Any]] = {}
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in iter_jsonl_lines(f):
                    record = line.value
                    try:
                        if line.error is not None:
                            raise line.error
                        key = self._episode_key(record)
                    except (KeyError, TypeError, ValueError) as exc:
                        # A crash can cut the last line short; that episode simply runs again.
                        logger.warning("%s:%d: unreadable result line skipped (%s)", path,
                                       line.number, exc)
                        continue
                    last[key] = (record.get("status"), record.get("reward"),
                                 record.get("pass_index"), record.get("group_size"))
        except FileNotFoundError:
            return
        self.plan.resume(path, last)

    @staticmethod
    def _episode_key(record: Any) -> tuple[str, str, int]:
        if not isinstance(record, dict):
            raise TypeError("not a JSON object")
        if all(k in record for k in ("domain", "task_id", "rollout")):
            domain, task_id, rollout = record["domain"], record["task_id"], record["rollout"]
        elif isinstance(record.get("episode_id"), str):
            domain, rest = record["episode_id"].split("/", 1)
            task_id, rollout = rest.rsplit("/", 1)
        else:
            raise KeyError("needs domain, task_id and rollout (or episode_id)")
        if not isinstance(domain, str) or not isinstance(task_id, str):
            raise TypeError("domain and task_id must be strings")
        if isinstance(rollout, bool) or not isinstance(rollout, int | str):
            raise TypeError(f"rollout must be an integer, got {rollout!r}")
        rollout = int(rollout)
        if rollout < 0:
            raise ValueError(f"rollout must be >= 0, got {rollout}")
        return domain, task_id, rollout
