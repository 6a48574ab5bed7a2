"""The runner's side of OSWorld's own evaluator code: a warm worker process
(``osworld_worker.py`` under OSWorld's interpreter) asked to score one evaluator block
against one desktop, and the catalog of what that environment can run.

    bridge = OSWorldBridge.from_config(cfg.evaluation)   # None: no OSWorld environment
    catalog = await bridge.catalog()                      # metrics, getters, unavailable
    score = await bridge.evaluate(evaluator, address, scratch_dir, timeout_s=300)

One worker per bridge, one evaluation at a time on it (a lock): metrics are CPU-bound and
OSWorld's code is synchronous. The worker starts on first use and stays; one that dies or
misses a deadline is killed (its whole process group: Chromium helpers of playwright
included) and the next call starts a new one. The catalog is also kept on disk
(``catalog_of``), keyed by the interpreter, the OSWorld checkout and the worker's source,
so a driver can check tasks without paying the worker's import each start.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cua_rollout.core.errors import (
    ConfigError,
    DesktopError,
    EvaluationError,
    EvaluatorRaised,
    RolloutError,
    UnsupportedEvaluator,
)
from cua_rollout.core.files import write_atomic
from cua_rollout.envs.contract import DesktopAddress

__all__ = ["WORKER", "Catalog", "OSWorldBridge", "catalog_of", "default_python",
           "error_of_reply"]

log = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().with_name("osworld_worker.py")
_PROJECT = Path(__file__).resolve().parents[2]
_LINE_LIMIT = 16 * 1024 * 1024


@dataclass(frozen=True)
class Catalog:
    """What an OSWorld evaluator environment can run, by the names task files use."""

    metrics: frozenset[str]
    getters: frozenset[str]
    unavailable: Mapping[str, str] = field(default_factory=dict)  # "metric:X" -> why
    source: str = ""  # the desktop_env package it came from

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Catalog:
        return cls(frozenset(data.get("metrics", ())), frozenset(data.get("getters", ())),
                   dict(data.get("unavailable", {})), str(data.get("desktop_env", "")))

    def problem(self, kind: str, name: str) -> str | None:
        """Why ``kind`` ("metric"/"getter") ``name`` cannot run here, or None."""
        why = self.unavailable.get(f"{kind}:{name}")
        if why:
            return why
        if name not in (self.metrics if kind == "metric" else self.getters):
            return f"OSWorld ({self.source or 'desktop_env'}) has no {kind} {name!r}"
        return None


def default_python() -> Path:
    """The project's OSWorld evaluator environment (``setup_env.sh --osworld``)."""
    return _PROJECT / ".venv-osworld" / "bin" / "python"


class OSWorldBridge:
    """A warm worker running OSWorld's evaluators; see the module docstring."""

    def __init__(self, python: Path, osworld_path: Path | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.python = Path(python)
        self.osworld_path = osworld_path
        self.start_timeout_s = start_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._catalog: Catalog | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self.started = 0  # workers started (a restart after a crash counts)
        self.evaluations = 0

    @classmethod
    def from_config(cls, cfg: Any) -> OSWorldBridge | None:
        """From ``cfg`` (an ``EvaluationConfig``); None when no OSWorld environment is set
        up and none was configured. A configured interpreter that does not exist is a
        ``ConfigError``."""
        python = cfg.osworld_python
        if python is None:
            python = default_python()
            if not python.exists():
                return None
        elif not Path(python).exists():
            raise ConfigError(f"evaluation.osworld_python: {python} does not exist (set up "
                              "OSWorld's evaluator environment: scripts/setup_env.sh "
                              "--osworld)")
        return cls(Path(python), cfg.osworld_path, cfg.worker_start_timeout_s)

    def argv(self) -> list[str]:
        return [str(self.python), "-X", "faulthandler", str(WORKER)]

    # ----------------------------------------------------------------- the worker

    async def _start(self) -> None:
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "SSL_CERT_FILE")}
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONNOUSERSITE"] = "1"
        if self.osworld_path is not None:  # a checkout's desktop_env before the installed one
            env["PYTHONPATH"] = str(self.osworld_path)
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
            env=env, start_new_session=True, limit=_LINE_LIMIT)
        self.started += 1
        try:
            ready = await asyncio.wait_for(self._read(), self.start_timeout_s)
        except TimeoutError:
            await self._kill()
            raise EvaluationError(
                f"OSWorld evaluator worker ({self.python}) gave no catalog within "
                f"{self.start_timeout_s:.0f} s (evaluation.worker_start_timeout_s)") from None
        if not ready.get("ready"):
            await self._kill()
            raise EvaluationError(f"OSWorld evaluator worker did not start: {ready}")
        self._catalog = Catalog.from_wire(ready)
        log.info("OSWorld evaluator worker pid %s: %d metrics, %d getters from %s in %.1f s",
                 self._proc.pid, len(self._catalog.metrics), len(self._catalog.getters),
                 self._catalog.source, ready.get("import_s", 0))

    async def _read(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if not line:
            code = await self._proc.wait()
            self._proc = None
            raise EvaluationError(f"OSWorld evaluator worker exited (code {code}); its "
                                  "stderr is in the runner's log")
        return json.loads(line)

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 10)

    async def _call(self, request: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                await self._start()
            assert self._proc is not None and self._proc.stdin is not None
            self._next_id += 1
            request = {**request, "id": self._next_id}
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                await self._proc.stdin.drain()
                reply = await asyncio.wait_for(self._read(), timeout_s)
            except TimeoutError:
                await self._kill()  # it may be stuck inside OSWorld's code: a new one next
                raise
            except (BrokenPipeError, ConnectionResetError) as exc:
                await self._kill()
                raise EvaluationError(f"OSWorld evaluator worker died: {exc}") from exc
            except asyncio.CancelledError:
                await self._kill()  # a reply would arrive for a request nobody waits for
                raise
            if reply.get("id") != request["id"]:
                await self._kill()
                raise EvaluationError(f"OSWorld evaluator worker answered {reply.get('id')} "
                                      f"to request {request['id']}")
            return reply

    # ----------------------------------------------------------------- the API

    async def catalog(self) -> Catalog:
        if self._catalog is None:
            await self._call({"op": "ping"}, self.start_timeout_s)
        assert self._catalog is not None
        return self._catalog

    async def evaluate(self, evaluator: Mapping[str, Any], desktop: DesktopAddress,
                       cache_dir: Path, timeout_s: float | None = None) -> float:
        """OSWorld's score of ``evaluator`` (without ``postconfig``: the caller runs it)
        on ``desktop``; files its getters fetch go to ``cache_dir``. ``UnsupportedEvaluator``
        for a function this environment lacks, ``EvaluationError`` when OSWorld's code
        raised (with its traceback's tail)."""
        block = {k: v for k, v in evaluator.items() if k != "postconfig"}
        reply = await self._call({"op": "evaluate", "evaluator": block,
                                  "desktop": desktop.wire(), "cache_dir": str(cache_dir)},
                                 timeout_s)
        self.evaluations += 1
        if reply.get("ok"):
            return float(reply["score"])
        if reply.get("kind") == "unsupported":
            raise UnsupportedEvaluator(f"OSWorld evaluator: {reply.get('error')}")
        tail = (reply.get("traceback") or "").strip().splitlines()[-6:]
        raise error_of_reply(reply)(f"OSWorld's evaluator code raised {reply.get('error')}"
                              + ("\n" + "\n".join(tail) if tail else ""))

    async def call(self, request: dict[str, Any], timeout_s: float | None = None) -> Any:
        """One ``metric`` or ``getter`` op (see the worker's protocol): the value OSWorld's
        function returned; ``EvaluatorRaised`` with its error when it raised, another
        ``EvaluationError`` when the worker failed or refused the request."""
        reply = await self._call(request, timeout_s)
        if not reply.get("ok"):
            if reply.get("kind") == "unsupported":
                raise UnsupportedEvaluator(str(reply.get("error")))
            raise error_of_reply(reply)(str(reply.get("error")))
        return reply.get("value")

    async def close(self) -> None:
        async with self._lock:
            proc = self._proc
            if proc is not None and proc.returncode is None and proc.stdin is not None:
                proc.stdin.close()  # EOF: the worker's loop ends by itself
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                    self._proc = None
                except TimeoutError:
                    pass
            await self._kill()


def catalog_of(bridge: OSWorldBridge, cache_dir: Path | None = None) -> Catalog:
    """The catalog of ``bridge``'s environment, from a file kept under ``cache_dir``
    (default ``~/.cache/cua-rollout``) when the interpreter, the OSWorld checkout and the
    worker are unchanged; else from a worker run once (blocking: for drivers and scripts)."""
    cache_dir = cache_dir or Path.home() / ".cache" / "cua-rollout"
    key = _catalog_key(bridge)
    path = cache_dir / f"osworld-catalog-{key}.json"
    with contextlib.suppress(OSError, ValueError):
        return Catalog.from_wire(json.loads(path.read_text()))

    async def fetch() -> Catalog:
        try:
            return await bridge.catalog()
        finally:
            await bridge.close()

    catalog = asyncio.run(fetch())
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({
            "metrics": sorted(catalog.metrics), "getters": sorted(catalog.getters),
            "unavailable": dict(catalog.unavailable), "desktop_env": catalog.source}).encode())
    return catalog


def _catalog_key(bridge: OSWorldBridge) -> str:
    """Changes when what the worker would report can change: the interpreter's environment
    (its site-packages' modification time moves on every install), the checkout's evaluator
    files, the worker's own source."""
    digest = hashlib.sha256()
    python = Path(bridge.python)
    digest.update(str(python.absolute()).encode())
    env_root = python.parent.parent
    for site in sorted(env_root.glob("lib/python*/site-packages")):
        digest.update(f"{site}:{site.stat().st_mtime_ns}".encode())
    if bridge.osworld_path is not None:
        evaluators = Path(bridge.osworld_path) / "desktop_env" / "evaluators"
        for f in sorted(evaluators.rglob("*.py")):
            digest.update(f"{f}:{f.stat().st_mtime_ns}".encode())
    digest.update(WORKER.read_bytes())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]



def error_of_reply(reply: dict[str, Any]) -> type[RolloutError]:
    """The error of a worker's failed reply: OSWorld's function raised on its input
    (``EvaluatorRaised``: the agent's failure), or could not reach the desktop ("transport":
    a ``DesktopError``, an infra_error); else the worker did not understand the request."""
    kind = reply.get("kind")
    if kind == "transport":
        return DesktopError
    return EvaluatorRaised if kind == "error" else EvaluationError
