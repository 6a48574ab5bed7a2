"""What a running driver tells operators: ``GET /healthz`` (ok, or why not: for probes) and
``GET /status`` (what the run is doing, as JSON), served from a thread while
``Rollout.results()`` runs; and the stall rule (episodes to run, no progress for
``monitoring.stall_s``).

The driver's loop publishes a snapshot each pass (``StatusBoard.publish``: a new read-only
mapping replaces the old one, so the server's thread reads a whole snapshot without a lock);
the server only reads it. The Kubernetes probe is ``runtime/status_probe.py``."""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cua_rollout.config import status_bind
from cua_rollout.core.errors import FatalSetupError
from cua_rollout.core.files import write_atomic
from cua_rollout.core.http import ThreadedServer
from cua_rollout.core.layout import STATUS_URL_FILE

__all__ = ["StallWatch", "StatusBoard", "StatusServer", "create_app", "serve_status"]

log = logging.getLogger(__name__)

# What the driver's loop is doing (Rollout.results()).
_RUN_STATES = ("running", "draining", "cancelling", "stopping")


class StallWatch:
    """Whether a run is stalled: episodes running or queued, and neither an episode finished
    nor the step counter moved for ``stall_s`` (None: never). Time spent idle (nothing to
    run) or in an outage wait does not count: the clock starts again when either ends."""

    def __init__(self, stall_s: float | None, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self._wall = wall
        self._seen: tuple[int, int] | None = None
        self._since = 0.0
        self.last_progress_t: float | None = None  # wall time of the last progress seen

    def observe(self, *, done: int, steps: int, active: bool, waiting: bool) -> float:
        """Record a pass of the loop; the seconds without progress that count (0 when idle
        or waiting)."""
        now = self._clock()
        progressed = self._seen is not None and (done, steps) != self._seen
        if progressed:
            self.last_progress_t = self._wall()
        if progressed or self._seen is None or not active or waiting:
            self._since = now
        self._seen = (done, steps)
        return now - self._since

    def stalled(self, quiet_s: float) -> bool:
        return self.stall_s is not None and quiet_s >= self.stall_s


def stall_note(quiet_s: float) -> str:
    return f"stalled: no progress for {quiet_s:.0f} s"


class StatusBoard:
    """The snapshot the driver's loop publishes and the server reads. ``loop_late_s``: the
    loop is "not iterating" once its last pass is that old (a pass makes a few Ray calls of
    bounded time, and waits while the caller of ``results()`` holds a record)."""

    def __init__(self, run_name: str, *, stall_s: float | None, loop_late_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.run_name = run_name
        self.loop_late_s = loop_late_s
        self.watch = StallWatch(stall_s, clock=clock, wall=wall)
        self._clock = clock
        self._wall = wall
        self._snapshot: Mapping[str, Any] = MappingProxyType({
            "run": run_name, "status": "starting", "_loop_t": clock(), "fatal": None,
            "stall": {"stalled": False, "no_progress_s": 0.0, "stall_s": stall_s},
        })

    def publish(self, *, status: str, done: int, done_before: int, total: int,
                stats: Mapping[str, Any], waiting: str | None, poll_s: float) -> str:
        """One pass of the loop: ``done`` episodes finished in this start (``done_before``
        before it), ``total`` known, the coordinator's ``stats``, the wait the run is in
        (the model or desktops down, a checkpoint barrier), how long the coordinator's poll
        took. Returns the stall note for the progress line ("" when not stalled)."""
        if status not in _RUN_STATES:
            raise ValueError(f"status {status!r} is none of {_RUN_STATES}")
        running = int(stats.get("episodes_in_flight", 0))
        queued = int(stats.get("episodes_queued", 0))
        quiet_s = self.watch.observe(done=done, steps=int(stats.get("steps", 0)),
                                     active=bool(running or queued), waiting=bool(waiting))
        stalled = self.watch.stalled(quiet_s)
        self._snapshot = MappingProxyType({
            "run": self.run_name,
            "status": status,
            "episodes": {"done": done_before + done, "done_this_start": done,
                         "done_before": done_before, "running": running, "queued": queued,
                         "total_known": total},
            "steps": stats.get("steps"),
            "last_progress_t": self.watch.last_progress_t,
            "stall": {"stalled": stalled, "no_progress_s": round(quiet_s, 1),
                      "stall_s": self.watch.stall_s},
            "waiting": waiting,
            "outages": stats.get("outages") or {},
            "fatal": stats.get("fatal"),
            "desktops": stats.get("desktops") or {},
            "model_servers": stats.get("model_servers"),
            "runners": {"alive": stats.get("runners"),
                        "replaced": stats.get("runners_replaced")},
            # Results waiting for their results.jsonl line, and the oldest one's age.
            "storage_lag": stats.get("storage_lag"),
            "poll_s": round(poll_s, 4),
            "t": self._wall(),
            "_loop_t": self._clock(),
        })
        return stall_note(quiet_s) if stalled else ""

    def health(self) -> tuple[bool, str]:
        """Ok, or why not: the run stopping on a fatal error, the loop not iterating, the run
        stalled."""
        snap = self._snapshot
        if snap.get("fatal"):
            return False, f"stopping: {snap['fatal']}"
        late_s = self._clock() - snap["_loop_t"]
        if late_s >= self.loop_late_s:
            return False, f"driver loop not iterating for {late_s:.0f} s"
        if snap["stall"]["stalled"]:
            return False, stall_note(snap["stall"]["no_progress_s"])
        return True, "ok"

    def status(self) -> dict[str, Any]:
        """The last snapshot with its health and age, as ``/status`` answers it."""
        snap = self._snapshot
        ok, reason = self.health()
        body = {k: v for k, v in snap.items() if not k.startswith("_")}
        body["healthy"] = {"ok": ok, "reason": None if ok else reason}
        body["snapshot_age_s"] = round(self._clock() - snap["_loop_t"], 3)
        return body


def create_app(board: StatusBoard, token: str | None) -> Any:
    """``/healthz`` (open) and ``/status`` (the bearer ``token`` when given) of ``board``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    expected = f"Bearer {token}".encode() if token else None

    async def healthz(request: Request) -> JSONResponse:
        ok, reason = board.health()
        return JSONResponse({"ok": True} if ok else {"ok": False, "reason": reason},
                            status_code=200 if ok else 503)

    async def status(request: Request) -> JSONResponse:
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse(
                    {"error": "unauthorized: send 'Authorization: Bearer <token>' with the "
                              "token of monitoring.status_token_env"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return JSONResponse(_finite(board.status()))

    return Starlette(routes=[Route("/healthz", healthz, methods=["GET"]),
                             Route("/status", status, methods=["GET"])])


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity (a rate of an empty window): null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class StatusServer(ThreadedServer):
    """``create_app(board, token)`` served from a thread on ``host:port`` (0: a free one)."""

    def __init__(self, board: StatusBoard, token: str | None, host: str, port: int) -> None:
        super().__init__(create_app(board, token), host, port)


def serve_status(board: StatusBoard, address: str, token: str | None,
                 run_dir: Path) -> StatusServer:
    """``board`` served on ``address`` (``monitoring.status_address``), its URL logged and
    written to ``<run_dir>/status.url``. Raises ``FatalSetupError`` when it cannot listen."""
    host, port = status_bind(address)
    server = StatusServer(board, token, host, port)
    try:
        server.start()
    except (RuntimeError, OSError):
        raise FatalSetupError(f"monitoring.status_address {address!r}: cannot listen there "
                              "(the port in use, or the address not this host's); set another "
                              "or null") from None
    write_atomic(run_dir / STATUS_URL_FILE, (server.url + "\n").encode())
    log.info("status: %s/status, health: %s/healthz", server.url, server.url)
    return server
