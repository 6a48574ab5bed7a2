"""Plain actions, and the warm interpreter that runs them without a new process each.

OSWorld's client posts every agent action to ``/execute`` as ``["python", "-c", "import
pyautogui; import time; pyautogui.FAILSAFE = False; <code>"]``. A fresh interpreter per action
costs about a third of a CPU-second (Python, pyautogui and python-xlib imported, the display
opened) for a few X requests. Actions that are *plain* run instead in ``ActionExecutor``, one
long-lived worker process per server (``cua_rollout.desktop.action_worker``) that imported
pyautogui once;
what they print, their exit status and their time limit are those of a fresh process.

Which commands are plain (``plain_action``) is a safety boundary, kept small on purpose: the
worker outlives every action, so nothing it runs may change it for the next one. The accepted
grammar is:

    command    exactly [PYTHON, "-c", code], not through a shell, where PYTHON is one of
               "python", "python3", "python3.<minor>" (the server's version) or the server's
               own interpreter path; the server takes only the names that resolve, on its
               children's PATH, to its own interpreter (``interpreter_names``)
    code       a module (it must compile) whose statements are each one of
                   import pyautogui  |  import time  |  import pyautogui, time
                   pyautogui.FAILSAFE = True | False
                   pass
                   pyautogui.F(LITERAL, ..., NAME=LITERAL, ...)     F in PYAUTOGUI_FUNCTIONS
                   time.sleep(LITERAL, ...)
    LITERAL    an int or float (an optional leading - or +), a str, True, False, None, or a
               tuple or list of LITERALs (nested at most MAX_LITERAL_DEPTH deep)

No other statement, name, attribute, operator, f-string, comprehension, ``*args`` /
``**kwargs``, ``import ... as`` or ``from ... import`` is plain: such a command (and the
code ``ui_tars_utils`` generates for non-ASCII text, which defines a helper and runs xclip)
runs as before, in a fresh process. The worker runs plain code in a fresh namespace holding
only the builtins (the code's own imports bind ``pyautogui`` and ``time``), with pyautogui's
settings put back to their import-time values first (``cua_rollout.desktop.action_worker``).

``ActionExecutor`` runs one action at a time (a lock, fair: first come, first served), under
the time limit ``/execute`` gives the command: past it the worker's process group is killed,
``CommandTimeout`` raised as for a fresh process, and a new worker started for the next
action. A worker that died (crashed, killed by a reset) is replaced transparently; an action
it was running when it died answers like a killed process (negative status, stderr saying
so). A worker that cannot start (no pyautogui, no display) leaves plain actions to fresh
processes, and the executor tries again ``retry_after_s`` later. The worker is not among the
apps of ``cua_rollout.desktop.processes.AppTracker``: ``/apps/kill`` ends only an action it is
running
(``interrupt``), never the idle worker; the server's shutdown ends it (``close``).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cua_rollout.desktop.errors import CommandTimeout
from cua_rollout.desktop.processes import MAX_OUTPUT_BYTES, Completed, wait_exit
from cua_rollout.desktop.protocol import CommandRequest

__all__ = [
    "MAX_LITERAL_DEPTH",
    "PYAUTOGUI_FUNCTIONS",
    "PYTHON_NAMES",
    "TIME_FUNCTIONS",
    "WORKER_FILE",
    "ActionExecutor",
    "interpreter_names",
    "plain_action",
]

log = logging.getLogger(__name__)

PYAUTOGUI_FUNCTIONS = frozenset({
    "click", "doubleClick", "tripleClick", "rightClick", "middleClick",
    "moveTo", "moveRel", "move", "dragTo", "dragRel", "drag",
    "mouseDown", "mouseUp", "scroll", "hscroll", "vscroll",
    "press", "hotkey", "write", "typewrite", "keyDown", "keyUp",
})  # fmt: skip
"""The pyautogui functions a plain action may call: input only (no screenshots by name, no
message boxes, no settings)."""
TIME_FUNCTIONS = frozenset({"sleep"})
"""The functions of ``time`` a plain action may call."""
MAX_LITERAL_DEPTH = 3
"""How deep tuples and lists of literals may nest in a plain action's arguments."""
PYTHON_NAMES: frozenset[str] = frozenset(
    {"python", "python3", f"python3.{sys.version_info.minor}", sys.executable}
)
"""The interpreters a plain command may name (before checking where they resolve)."""
WORKER_FILE = Path(__file__).resolve().with_name("action_worker.py")
"""The worker's source, run by path (``cua_rollout.desktop.action_worker``)."""

_CALLS: dict[str, frozenset[str]] = {"pyautogui": PYAUTOGUI_FUNCTIONS, "time": TIME_FUNCTIONS}
_SETTABLE = {("pyautogui", "FAILSAFE")}
_NUMBERS = (int, float)
_SCALARS = (int, float, str, bool, type(None))
# Runs the worker as a file with the import path of ``python -c`` (working directory first):
# the one a fresh action has. ``runpy.run_path`` of a file leaves that path as it is.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
# Longest reply line read from the worker: two outputs of MAX_OUTPUT_BYTES, JSON-escaped.
_LINE_LIMIT = 16 * MAX_OUTPUT_BYTES
_START_TIMEOUT_S = 30.0
_RETRY_AFTER_S = 30.0
# After the end of its stdin (close) the worker exits by itself; then it is killed.
_CLOSE_GRACE_S = 2.0
# How long to wait for a worker's exit status once it is killed, or its pipe ended.
_EXIT_WAIT_S = 5.0
# Deaths in a row (no action answered in between) after which a dead worker is replaced only
# when the next action needs one, not at once: no restart loop when something keeps killing it.
_EAGER_RESTART_LIMIT = 3


# ---------------------------------------------------------------------- the grammar


def plain_action(
    command: CommandRequest | Sequence[str] | str,
    *,
    pythons: Collection[str] = PYTHON_NAMES,
) -> str | None:
    """The Python code of ``command`` (an ``/execute`` request after ``read_command``, or its
    argv) when it is a plain action (the module's grammar), else None."""
    if isinstance(command, CommandRequest):
        if command.shell:
            return None
        command = command.command
    if isinstance(command, str) or len(command) != 3:
        return None
    python, flag, code = command
    if python not in pythons or flag != "-c" or not isinstance(code, str):
        return None
    try:
        code.encode("utf-8")  # a lone surrogate cannot be passed as an argument either
        tree = ast.parse(code, "<string>", "exec")
        if not all(_plain_statement(node) for node in tree.body):
            return None
        compile(tree, "<string>", "exec", dont_inherit=True)  # e.g. a repeated keyword
    except (SyntaxError, ValueError, UnicodeError, MemoryError, RecursionError):
        return None
    return code


def _plain_statement(node: ast.stmt) -> bool:
    if isinstance(node, ast.Pass):
        return True
    if isinstance(node, ast.Import):
        return all(alias.name in _CALLS and alias.asname is None for alias in node.names)
    if isinstance(node, ast.Assign):
        return (
            len(node.targets) == 1
            and _module_attribute(node.targets[0]) in _SETTABLE
            and isinstance(node.value, ast.Constant)
            and type(node.value.value) is bool
        )
    if isinstance(node, ast.Expr):
        return _plain_call(node.value)
    return False


def _module_attribute(node: ast.expr) -> tuple[str, str] | None:
    """``(module, name)`` of ``module.name`` where ``module`` is a bare name."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def _plain_call(node: ast.expr) -> bool:
    if not isinstance(node, ast.Call):
        return False
    target = _module_attribute(node.func)
    if target is None or target[1] not in _CALLS.get(target[0], ()):
        return False
    return all(_literal(arg) for arg in node.args) and all(
        keyword.arg is not None and _literal(keyword.value) for keyword in node.keywords
    )


def _literal(node: ast.expr, depth: int = 0) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in _SCALARS
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = node.operand
        return isinstance(operand, ast.Constant) and type(operand.value) in _NUMBERS
    if isinstance(node, ast.Tuple | ast.List):
        return depth < MAX_LITERAL_DEPTH and all(_literal(e, depth + 1) for e in node.elts)
    return False


def interpreter_names(env: Mapping[str, str], python: str = sys.executable) -> frozenset[str]:
    """Those of ``PYTHON_NAMES`` that name ``python`` for a child with ``env``: found on its
    PATH in the same directory as ``python`` (a virtual environment's own), and the same
    file. A plain action must run in the interpreter a fresh process would have run."""
    path = env.get("PATH", os.defpath)
    found = {python}
    for name in PYTHON_NAMES - {python}:
        where = shutil.which(name, path=path)
        with contextlib.suppress(OSError):
            if (
                where is not None
                and os.path.samefile(os.path.dirname(where), os.path.dirname(python))
                and os.path.samefile(where, python)
            ):
                found.add(name)
    return frozenset(found)


# ---------------------------------------------------------------------- the warm interpreter


class _WorkerFailed(Exception):
    """A worker could not be started; ``killed``: something killed it while it started (a
    reset), which says nothing of the next start."""

    def __init__(self, message: str, *, killed: bool = False) -> None:
        super().__init__(message)
        self.killed = killed


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    reader: asyncio.StreamReader
    writer: asyncio.WriteTransport
    exited: asyncio.Task[int]
    discarded: bool = False
    """Ended by the executor (a time limit, a stale display, the shutdown): not a death."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self.discarded and not self.exited.done() and self.proc.poll() is None


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _status_text(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"


class ActionExecutor:
    """The warm interpreter of one server: runs plain actions one at a time in a worker
    process (``cua_rollout.desktop.action_worker``), started at ``prestart`` or on first use, with
    the
    children's environment ``env``, in a session of its own; replaced when it dies or is
    killed at a time limit; ended by ``close``. Statistics: ``stats()``."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        enabled: bool = True,
        python: str = sys.executable,
        start_timeout_s: float = _START_TIMEOUT_S,
        retry_after_s: float = _RETRY_AFTER_S,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        self.env = dict(env)
        self.enabled = enabled
        self.python = python
        self.pythons = interpreter_names(self.env, python) if enabled else frozenset()
        """The interpreter names a plain action may use on this server."""
        self.start_timeout_s = start_timeout_s
        self.retry_after_s = retry_after_s
        self.max_output_bytes = max_output_bytes
        self._lock = asyncio.Lock()
        self._worker: _Worker | None = None
        self._starting: asyncio.Task[None] | None = None
        self._running: _Worker | None = None
        self._failed_until = 0.0
        self._closed = False
        self._deaths_in_row = 0
        self._counts = dict.fromkeys(
            ("warm", "fresh", "fallbacks", "starts", "timeouts", "deaths", "start_failures"), 0
        )
        self._last_error: str | None = None

    # ------------------------------------------------------------------ the public side

    def plain(self, command: CommandRequest) -> str | None:
        """The code of ``command`` when this executor is to run it (``plain_action``)."""
        if not self.enabled or self._closed:
            return None
        return plain_action(command, pythons=self.pythons)

    def prestart(self) -> None:
        """Start the worker in the background (the first action then finds it ready)."""
        self._ensure_starting()

    async def run(
        self, code: str, argv: Sequence[str] | str, *, timeout_s: float
    ) -> Completed | None:
        """Run plain ``code`` (of the command ``argv``) in the worker within ``timeout_s``,
        waiting for the actions before it; its exit status and output. None when the worker
        cannot take it (disabled, not startable, or its display changed): the caller runs the
        command in a fresh process. Raises ``CommandTimeout``."""
        if not self.enabled or self._closed:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except TimeoutError:
            self._counts["timeouts"] += 1
            raise CommandTimeout(argv, timeout_s) from None
        try:
            worker = await self._ready_worker(deadline, argv, timeout_s)
            if worker is None:
                return None
            return await self._run_in(worker, code, deadline, argv, timeout_s)
        finally:
            self._lock.release()

    def count_fresh(self, *, plain: bool) -> None:
        """Count an ``/execute`` command run in a fresh process (``plain``: one the worker
        could not take)."""
        self._counts["fresh"] += 1
        if plain:
            self._counts["fallbacks"] += 1

    async def interrupt(self, grace_s: float) -> list[int]:
        """End the action running now, if any, as a reset ends a running command: SIGTERM to
        the worker's group, SIGKILL after ``grace_s``. The idle worker is left alone. The pids
        ended."""
        worker = self._running
        if worker is None or not worker.alive():
            return []
        _kill_group(worker.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(worker.exited), grace_s)
        except TimeoutError:
            _kill_group(worker.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(worker.exited), _EXIT_WAIT_S)
        return [worker.pid]

    async def close(self) -> None:
        """End the worker (the server stops): the end of its stdin, SIGKILL if it lingers."""
        self._closed = True
        starting = self._starting
        if starting is not None and not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.discarded = True
            worker.writer.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(worker.exited), _CLOSE_GRACE_S)
            await self._end(worker)

    def stats(self) -> dict[str, Any]:
        """``enabled``; ``worker_pid`` (None: none running); actions run ``warm`` (in the
        worker) and ``/execute`` commands run ``fresh`` (in a new process), of which
        ``fallbacks`` were plain actions the worker could not take; worker ``starts`` and
        ``restarts`` (starts after the first), ``timeouts``, ``deaths`` (not ended by the
        executor), ``start_failures`` and the ``last_error`` of a start."""
        worker = self._worker
        return {
            "enabled": self.enabled,
            "worker_pid": worker.pid if worker is not None and worker.alive() else None,
            **self._counts,
            "restarts": max(0, self._counts["starts"] - 1),
            "last_error": self._last_error,
        }

    # ------------------------------------------------------------------ the worker's life

    def _ensure_starting(self) -> asyncio.Task[None] | None:
        """The task starting a worker (a new one if none runs or starts); None when there
        will be none (disabled, closed, or waiting to retry after a failed start)."""
        if not self.enabled or self._closed:
            return None
        if self._worker is not None and self._worker.alive():
            return None
        if self._starting is None or self._starting.done():
            if time.monotonic() < self._failed_until:
                return None
            self._starting = asyncio.get_running_loop().create_task(self._start())
        return self._starting

    async def _ready_worker(
        self, deadline: float, argv: Sequence[str] | str, timeout_s: float
    ) -> _Worker | None:
        worker = self._worker
        if worker is not None and worker.alive():
            return worker
        starting = self._ensure_starting()
        if starting is None:
            return None
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            # Shielded: a start outlives an action that gave up on it (the next one uses it).
            await asyncio.wait_for(asyncio.shield(starting), max(remaining, 0.0))
        except TimeoutError:
            self._counts["timeouts"] += 1
            raise CommandTimeout(argv, timeout_s) from None
        worker = self._worker
        return worker if worker is not None and worker.alive() else None

    async def _start(self) -> None:
        self._counts["starts"] += 1
        try:
            worker = await self._spawn()
        except Exception as exc:  # no pyautogui, no display, no interpreter, killed...
            self._counts["start_failures"] += 1
            self._last_error = str(exc)
            if isinstance(exc, _WorkerFailed) and exc.killed:
                log.warning("the action executor's worker was killed while starting: %s", exc)
                return  # the next action tries again
            self._failed_until = time.monotonic() + self.retry_after_s
            log.warning("the action executor could not start (fresh processes run actions "
                        "for %g s): %s", self.retry_after_s, exc)
            return
        if self._closed:
            worker.discarded = True
            await self._end(worker)
            return
        self._worker = worker
        worker.exited.add_done_callback(lambda _: self._on_exit(worker))

    async def _spawn(self) -> _Worker:
        loop = asyncio.get_running_loop()
        proc = subprocess.Popen(
            [self.python, "-c", _BOOT, str(WORKER_FILE), str(self.max_output_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        exited = loop.create_task(wait_exit(proc))
        transports: list[asyncio.BaseTransport] = []
        try:
            reader = asyncio.StreamReader(limit=_LINE_LIMIT)
            read_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), proc.stdout
            )
            transports.append(read_transport)
            writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
            transports.append(writer)
            try:
                line = await asyncio.wait_for(reader.readline(), self.start_timeout_s)
            except TimeoutError:
                raise _WorkerFailed(
                    f"the worker did not import pyautogui within {self.start_timeout_s:g} s"
                ) from None
            try:
                hello = json.loads(line) if line else None
            except ValueError:
                hello = None
            if not isinstance(hello, dict) or not hello.get("ready"):
                if isinstance(hello, dict) and hello.get("error"):
                    raise _WorkerFailed(f"the worker failed: {str(hello['error']).strip()}")
                status = await self._status_after_end(proc, exited)
                raise _WorkerFailed(
                    f"the worker ended at its start ({_status_text(status)})",
                    killed=status in (-signal.SIGKILL, -signal.SIGTERM),
                )
            return _Worker(proc, reader, writer, exited)
        except BaseException:
            _kill_group(proc.pid)
            for transport in transports:
                transport.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), _EXIT_WAIT_S)
            raise

    def _on_exit(self, worker: _Worker) -> None:
        if self._worker is worker:
            self._worker = None
        if worker.discarded or self._closed:
            return
        worker.discarded = True
        self._counts["deaths"] += 1
        self._deaths_in_row += 1
        log.warning("the action executor's worker (pid %d) ended: %s", worker.pid,
                    _status_text(worker.exited.result()))
        if self._deaths_in_row < _EAGER_RESTART_LIMIT:
            self._ensure_starting()

    async def _discard(self, worker: _Worker) -> None:
        """End ``worker`` (its whole process group) and start its replacement."""
        worker.discarded = True
        if self._worker is worker:
            self._worker = None
        await self._end(worker)
        self._ensure_starting()

    async def _end(self, worker: _Worker) -> None:
        _kill_group(worker.pid)
        worker.writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(worker.exited), _EXIT_WAIT_S)

    @staticmethod
    async def _status_after_end(proc: subprocess.Popen[bytes], exited: asyncio.Task[int]) -> int:
        """The exit status of a worker whose pipe ended (killed if it lingers)."""
        try:
            return await asyncio.wait_for(asyncio.shield(exited), _EXIT_WAIT_S)
        except TimeoutError:
            _kill_group(proc.pid)
            return await asyncio.shield(exited)

    # ------------------------------------------------------------------ one action

    async def _run_in(
        self,
        worker: _Worker,
        code: str,
        deadline: float,
        argv: Sequence[str] | str,
        timeout_s: float,
    ) -> Completed | None:
        loop = asyncio.get_running_loop()
        self._running = worker
        self._counts["warm"] += 1
        try:
            worker.writer.write(json.dumps({"code": code}).encode() + b"\n")
            try:
                line = await asyncio.wait_for(
                    worker.reader.readline(), max(deadline - loop.time(), 0.0)
                )
            except TimeoutError:
                self._counts["timeouts"] += 1
                await self._discard(worker)
                raise CommandTimeout(argv, timeout_s) from None
            except (ValueError, OSError):  # a reply past the line limit, a broken pipe
                _kill_group(worker.pid)
                line = b""
            reply = _parse_reply(line)
            if reply is None:  # it died while running this action
                if not worker.discarded:  # a death, counted here (then not by _on_exit)
                    worker.discarded = True
                    self._counts["deaths"] += 1
                    self._deaths_in_row += 1
                status = await self._status_after_end(worker.proc, worker.exited)
                await self._discard(worker)
                message = (
                    f"the action executor's worker (pid {worker.pid}) ended while running "
                    f"this action ({_status_text(status)}); the next action gets a new one\n"
                )
                return Completed(status or -signal.SIGKILL, b"", message.encode())
            if "fallback" in reply:
                self._counts["warm"] -= 1
                log.info("the action executor's worker is stale (%s): a new one starts",
                         reply["fallback"])
                await self._discard(worker)
                return None
            self._deaths_in_row = 0
            return Completed(
                int(reply["returncode"]),
                str(reply.get("stdout", "")).encode(),
                str(reply.get("stderr", "")).encode(),
            )
        except BaseException:  # cancelled: the action must not run on, unseen
            if not worker.discarded:
                await asyncio.shield(self._discard(worker))
            raise
        finally:
            self._running = None


def _parse_reply(line: bytes) -> dict[str, Any] | None:
    if not line:
        return None
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    if not isinstance(reply, dict) or not ("fallback" in reply or "returncode" in reply):
        return None
    return reply
