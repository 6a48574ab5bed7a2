"""The model client: model endpoints, their health, and the routing of chat generations to
them over the wire format of ``cua_rollout.model.openai_protocol``. Screenshot data URLs are sent
as they
are (``RequestBody``), so megabytes of base64 are neither escaped again nor copied per request."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from cua_rollout.config import ModelConfig, SamplingConfig, secret_from_env
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import ContextTooShort, ModelRequestError, ModelUnavailable
from cua_rollout.core.http import error_text, redact_url, ssl_context
from cua_rollout.core.screenshot import DataURL
from cua_rollout.model.fleet.state import ENDPOINTS_FILE
from cua_rollout.model.openai_protocol import (
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    chat_request_body,
    parse_chat_completion,
    served_card,
)

__all__ = [
    "ENDPOINTS_FILE",
    "IMAGE_MARK",
    "Endpoint",
    "Generation",
    "LeastOutstandingPolicy",
    "ModelServicePool",
    "OutageStatus",
    "RequestBody",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "StickyLeastOutstandingPolicy",
    "make_policy",
]

log = logging.getLogger(__name__)

_STICKY_SESSIONS_MAX = 100_000     # sessions remembered for stickiness (LRU beyond this)
# How often the state file's mtime is looked at: about every request (a stat), so a request
# sent after run_model.py published a replica's new version or its draining is labelled and
# routed by it (the version a step records is exact, not up to a second late).
_STATE_CHECK_INTERVAL_S = 0.02
_STATE_URL_INTERVAL_S = 1.0        # how often endpoints_url is asked (a request, not a stat)
# While no endpoint is live, how often (at most) they are probed again: a reload or a restart
# is noticed within this much of its end.
_OUTAGE_PROBE_MAX_S = 2.0
_OUTAGE_PROBE_INITIAL_S = 0.25


@dataclass
class Generation:
    """One model reply and where it came from."""

    text: str
    endpoint: str
    model_version: str | None
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    attempts: int
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # the reply's tool calls, as on the wire


@dataclass
class Endpoint:
    """A model server and what routing knows about it."""

    url: str
    model_version: str | None = None
    draining: bool = False          # set by run_model.py during a rolling reload
    outstanding: int = 0            # requests in flight from this process
    served: int = 0
    consecutive_failures: int = 0
    ejected: bool = False
    last_error: str | None = None
    max_model_len: int | None = None   # its context, from GET /v1/models (None: unknown)
    context_asked: bool = False        # that question was answered (once per endpoint)
    published: bool = False            # listed by run_model.py (its version is the list's)

    @functools.cached_property
    def label(self) -> str:
        """The URL as records, statistics and logs show it (credentials redacted); made once,
        not on every generation (``url`` never changes)."""
        return redact_url(self.url)

    def snapshot(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "url": self.label}


# --------------------------------------------------------------------------- routing policies


class RoutingPolicy(abc.ABC):
    """Chooses an endpoint for a request; one method to override."""

    @abc.abstractmethod
    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        """The endpoint for this request, among ``candidates`` (never empty)."""

    def forget(self, session_id: str) -> None:  # noqa: B027 — optional hook, no-op by default
        """Drop what is remembered about a finished session (stateless policies: nothing)."""


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen


class LeastOutstandingPolicy(RoutingPolicy):
    """Fewest requests in flight; ties go to the endpoint that has served least."""

    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        return min(candidates, key=lambda e: (e.outstanding, e.served))


class StickyLeastOutstandingPolicy(LeastOutstandingPolicy):
    """Keep an episode on one endpoint (its prefix cache holds the history) unless that
    endpoint has ``max_extra_outstanding`` more requests in flight than the least loaded."""

    def __init__(self, max_extra_outstanding: int) -> None:
        self.max_extra_outstanding = max_extra_outstanding
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self.hits = 0
        self.moves = 0

    def choose(self, candidates: list[Endpoint], session_id: str | None) -> Endpoint:
        least = super().choose(candidates, session_id)
        if session_id is None:
            return least
        url = self._sticky.get(session_id)
        current = next((e for e in candidates if e.url == url), None)
        if current is not None and (
            current.outstanding <= least.outstanding + self.max_extra_outstanding
        ):
            self.hits += 1
            self._sticky.move_to_end(session_id)
            return current
        if url is not None:
            self.moves += 1
        self._sticky[session_id] = least.url
        self._sticky.move_to_end(session_id)
        while len(self._sticky) > _STICKY_SESSIONS_MAX:
            self._sticky.popitem(last=False)
        return least

    def forget(self, session_id: str) -> None:
        self._sticky.pop(session_id, None)


def make_policy(cfg: ModelConfig) -> RoutingPolicy:
    if cfg.routing == "round_robin":
        return RoundRobinPolicy()
    if cfg.routing == "least_outstanding":
        return LeastOutstandingPolicy()
    return StickyLeastOutstandingPolicy(cfg.sticky_max_extra_outstanding)


# --------------------------------------------------------------------------- the pool


class _Transient(Exception):
    """A failure worth retrying elsewhere (connection, timeout, 5xx, 429, garbage reply).
    ``capacity``: the server was not there or had no room (connection refused, dropped
    mid-request, 503, 429), a state of the service; otherwise the server took this request
    and failed on it (500, read timeout, malformed reply), which may be the request's doing."""

    def __init__(self, reason: str, *, capacity: bool) -> None:
        super().__init__(reason)
        self.capacity = capacity


@dataclass(frozen=True)
class OutageStatus:
    """What routing sees while it waits for an endpoint: the status line's figures."""

    live: int
    draining: int
    down: int
    waiting: int        # generations of this process waiting for an endpoint
    since_s: float      # how long this process has been waiting (0 when it is not)

    def __str__(self) -> str:
        return f"{self.live} live, {self.draining} draining, {self.down} down"


class ModelServicePool:
    """Routes ``generate`` calls over the live endpoints, with retries and ejection.

    Endpoints come from ``cfg.endpoints``; else from run_model.py's endpoint list: over HTTP
    from its control server (``cfg.endpoints_url``, asked every second with its ETag, so an
    unchanged list costs a 304), or from ``endpoints.json`` in ``state_dir``, re-read whenever
    it changes. While the list cannot be read, the last one read is kept. Create one per
    process (one per runner actor); it opens its HTTP clients on the running loop at first
    use.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        state_dir: Path | None = None,
        *,
        policy: RoutingPolicy | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.policy = policy or make_policy(cfg)
        self._rng = rng or random.Random()
        self._clock = clock
        self._api_key = secret_from_env(cfg.api_key_env, "model.api_key_env")
        self._endpoints: dict[str, Endpoint] = {}
        self._state_url = None if cfg.endpoints else cfg.endpoints_url
        self._state_file = (
            Path(state_dir) / ENDPOINTS_FILE
            if not cfg.endpoints and self._state_url is None and state_dir else None
        )
        self._state_mtime_ns: int | None = None
        self._state_checked_at = float("-inf")
        self._state_etag: str | None = None
        self._state_error: str | None = None   # why the list could not be read last time
        self._state_client: httpx2.AsyncClient | None = None
        self._state_watch: asyncio.Task[None] | None = None
        if cfg.endpoints:
            for url in cfg.endpoints:
                self._endpoints[url.rstrip("/")] = Endpoint(url.rstrip("/"))
        elif self._state_file is None and self._state_url is None:
            raise ModelUnavailable(
                "no model endpoints: set model.endpoints, model.endpoints_url, model.scripted, "
                "or run run_model.py and point model_pool.state_dir at its state"
            )
        self._clients: dict[str, httpx2.AsyncClient] = {}  # endpoint URL -> its client
        self._closing: set[asyncio.Task[None]] = set()
        self._reprobe_task: asyncio.Task[None] | None = None
        self._outage_watch: asyncio.Task[None] | None = None
        self._live: asyncio.Event | None = None   # set while some endpoint is live
        self._waiting_since: float | None = None
        self.waiting = 0       # generations waiting for a live endpoint now
        self.requests = 0
        self.retries = 0
        self.outage_waits = 0

    # ----------------------------------------------------------------- public surface

    async def generate(
        self,
        messages: list[dict[str, Any]],
        session_id: str | None = None,
        sampling: SamplingConfig | None = None,
        *,
        regex: str | None = None,
        least_tokens: tuple[int, str] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> Generation:
        """One chat completion. Transient failures are retried on another endpoint with
        capped, fully jittered backoff; a 4xx raises ``ModelRequestError`` at once.

        ``regex``: the reply must match it whole (vLLM's structured outputs).
        ``tools`` / ``tool_choice``: OpenAI function tools the model may call (the reply's
        calls are ``Generation.tool_calls``).
        ``least_tokens``: (tokens the request needs at least, what they are): when that is
        more than the chosen endpoint's context, ``ContextTooShort`` is raised instead of
        sending a request the server would refuse.

        ``ModelUnavailable`` with ``outage`` set means no endpoint was there to answer (none
        live, or every attempt was refused or dropped): the caller waits with
        ``wait_until_live`` instead of counting it against the episode."""
        await self._watch_state_url()
        body = chat_request_body(self.cfg.name, messages, sampling or self.cfg.sampling,
                                 regex, tools=tools, tool_choice=tool_choice)
        content = RequestBody(body)  # serialised once, whatever the retries
        self.requests += 1
        tried: set[str] = set()
        last_error = "no attempt made"
        capacity_only = True
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(backoff_s(
                    attempt, self.cfg.backoff.initial_s, self.cfg.backoff.max_s, self._rng
                ))
            endpoint = self._pick(session_id, avoid=tried)
            if endpoint is None:
                listed = (f"; the endpoint list is not readable: {self._state_error}"
                          if self._state_error else "")
                raise ModelUnavailable(f"no model endpoint is serving ({self.outage_status()})"
                                       + (f"; last error: {last_error}" if attempt else "")
                                       + listed, outage=True)
            tried.add(endpoint.url)
            try:
                if not endpoint.context_asked:
                    endpoint.outstanding += 1  # picked: count it while asking, as routing does
                    try:
                        await self._describe(endpoint)
                    finally:
                        endpoint.outstanding -= 1
                if least_tokens is not None:
                    self._check_context(endpoint, *least_tokens)
                return await self._send(endpoint, content, attempt + 1)
            except _Transient as exc:
                last_error = f"{endpoint.label}: {exc}"
                capacity_only = capacity_only and exc.capacity
                log.warning("model request failed (attempt %d): %s", attempt + 1, last_error)
        raise ModelUnavailable(
            f"no reply after {self.cfg.retries + 1} attempts; last error: {last_error}",
            outage=capacity_only,
        )

    async def wait_until_live(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until an endpoint is live again; True if one is.
        One probe loop per process serves every waiting episode: endpoints are re-read from
        the state file and their ``/health`` asked with capped jittered backoff, so a
        hundred waiting episodes cost one probe per endpoint, not a hundred."""
        if self._live is None:
            self._live = asyncio.Event()
        self.waiting += 1
        self.outage_waits += 1
        if self._waiting_since is None:
            self._waiting_since = self._clock()
        if self._outage_watch is None or self._outage_watch.done():
            self._live.clear()
            self._outage_watch = asyncio.get_running_loop().create_task(self._watch_outage())
        try:
            async with asyncio.timeout(timeout_s):
                await self._live.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
            if not self.waiting:
                self._waiting_since = None

    async def probe(self) -> OutageStatus:
        """Ask every endpoint that is not draining for ``/health`` now (the state file re-read
        first); those answering 200 are routed to again, the others taken out."""
        self._state_checked_at = float("-inf")
        self._refresh_from_state_file()
        if self._state_url is not None:
            await self._read_state_url()
        candidates = [e for e in self._endpoints.values() if not e.draining]
        answers = await asyncio.gather(*(self._healthy(e) for e in candidates))
        for endpoint, ok in zip(candidates, answers, strict=True):
            if ok:
                if endpoint.ejected:
                    log.info("model endpoint %s is back", endpoint.label)
                endpoint.ejected = False
                endpoint.consecutive_failures = 0
            elif not endpoint.ejected:
                endpoint.ejected = True
                endpoint.last_error = "health check failed"
        return self.outage_status()

    def outage_status(self) -> OutageStatus:
        endpoints = list(self._endpoints.values())
        draining = sum(e.draining for e in endpoints)
        down = sum(e.ejected and not e.draining for e in endpoints)
        since = self._clock() - self._waiting_since if self._waiting_since is not None else 0.0
        return OutageStatus(len(endpoints) - draining - down, draining, down, self.waiting,
                            round(since, 1))

    def end_session(self, session_id: str) -> None:
        """Forget an episode's sticky endpoint (call when the episode ends)."""
        self.policy.forget(session_id)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests,
            "retries": self.retries,
            "outage_waits": self.outage_waits,
            "endpoints": [e.snapshot() for e in self._endpoints.values()],
        }
        if isinstance(self.policy, StickyLeastOutstandingPolicy):
            out["sticky_hits"] = self.policy.hits
            out["sticky_moves"] = self.policy.moves
        return out

    @property
    def in_flight(self) -> int:
        return sum(e.outstanding for e in self._endpoints.values())

    async def close(self) -> None:
        for task in (self._reprobe_task, self._outage_watch, self._state_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reprobe_task = self._outage_watch = self._state_watch = None
        clients, self._clients = list(self._clients.values()), {}
        if self._state_client is not None:
            clients.append(self._state_client)
            self._state_client = None
        await asyncio.gather(*(c.aclose() for c in clients), *self._closing,
                             return_exceptions=True)

    # ----------------------------------------------------------------- internals

    def _http(self, endpoint: Endpoint) -> httpx2.AsyncClient:
        """The endpoint's own client. Its pool holds that endpoint's connections only, so
        ``max_connections_per_endpoint`` limits each endpoint, and the work httpx2's pool
        does on every request (it probes each of its idle connections) stays proportional
        to one endpoint's share of the episodes, not to all of this process's connections."""
        client = self._clients.get(endpoint.url)
        if client is None or client.is_closed:
            n = self.cfg.max_connections_per_endpoint
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            client = httpx2.AsyncClient(
                timeout=httpx2.Timeout(
                    self.cfg.request_timeout_s, connect=self.cfg.connect_timeout_s
                ),
                limits=httpx2.Limits(max_connections=n, max_keepalive_connections=n),
                headers=headers,
                verify=ssl_context(),
            )
            self._clients[endpoint.url] = client
        return client

    def _pick(self, session_id: str | None, avoid: set[str]) -> Endpoint | None:
        """The endpoint for the next attempt, or None when none is live (all draining,
        unhealthy, taken out after failures, or absent): an outage, waited out by the caller
        while ``wait_until_live`` probes them back."""
        self._refresh_from_state_file()
        live = [e for e in self._endpoints.values() if not e.draining and not e.ejected]
        if not live:
            return None
        fresh = [e for e in live if e.url not in avoid]
        return self.policy.choose(fresh or live, session_id)

    async def _healthy(self, endpoint: Endpoint) -> bool:
        try:
            r = await self._http(endpoint).get(endpoint.url + HEALTH_PATH,
                                               timeout=self.cfg.connect_timeout_s)
        except httpx2.HTTPError:
            return False
        return r.status_code == 200

    async def _watch_outage(self) -> None:
        """Probe until an endpoint is live, then wake every waiter."""
        assert self._live is not None
        checks = 0
        while True:
            if (await self.probe()).live:
                self._live.set()
                return
            checks += 1
            await asyncio.sleep(backoff_s(checks, _OUTAGE_PROBE_INITIAL_S, _OUTAGE_PROBE_MAX_S,
                                          self._rng))

    async def _describe(self, endpoint: Endpoint) -> None:
        """Ask ``GET /v1/models`` once per endpoint (and again after a new checkpoint): its
        context (vLLM's ``max_model_len``) and, for an endpoint ``run_model.py`` does not
        publish, its version: ``model.version``, else the weights the server says it loaded
        (vLLM's ``root``), else none."""
        if endpoint.context_asked:
            return
        try:
            r = await self._http(endpoint).get(endpoint.url + MODELS_PATH,
                                               timeout=self.cfg.connect_timeout_s)
        except httpx2.HTTPError:
            return  # unreachable now: the request itself finds out, and is retried
        endpoint.context_asked = True
        card = served_card(r.content, self.cfg.name) if r.status_code == 200 else None
        endpoint.max_model_len = card.max_model_len if card is not None else None
        if not endpoint.published:
            endpoint.model_version = self.cfg.version or (card.root if card else None)
            if endpoint.model_version is None:
                log.warning("%s does not say which weights it serves (no root in GET %s) and "
                            "model.version is not set: its steps record no model version",
                            endpoint.label, MODELS_PATH)

    def _check_context(self, endpoint: Endpoint, needed: int, what: str) -> None:
        """Raise ``ContextTooShort`` when ``endpoint`` serves a context under ``needed``
        tokens (``_describe`` asked it; a server that does not say is not checked)."""
        if endpoint.max_model_len is not None and needed > endpoint.max_model_len:
            raise ContextTooShort(needed, endpoint.max_model_len, what, endpoint.label)

    async def _send(self, endpoint: Endpoint, content: RequestBody, attempt: int) -> Generation:
        endpoint.outstanding += 1
        started = self._clock()
        try:
            try:
                response = await self._http(endpoint).post(
                    endpoint.url + CHAT_COMPLETIONS_PATH,
                    content=content,
                    headers={"Content-Type": "application/json",
                             "Content-Length": str(content.length)},
                )
            except (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout,
                    httpx2.RemoteProtocolError) as exc:
                # Not there, or gone mid-request (a replica stopped or killed).
                raise self._failed(endpoint, f"{type(exc).__name__}: {exc}",
                                   capacity=True) from exc
            except httpx2.TimeoutException as exc:
                raise self._failed(endpoint, f"timed out ({type(exc).__name__})") from exc
            except httpx2.TransportError as exc:
                raise self._failed(endpoint, f"{type(exc).__name__}: {exc}") from exc
            if response.status_code >= 500 or response.status_code == 429:
                raise self._failed(
                    endpoint, f"HTTP {response.status_code}: {error_text(response)}",
                    capacity=response.status_code in (429, 503),
                )
            if response.status_code >= 400:
                # The request itself is wrong (too long, images to a text model ...).
                endpoint.consecutive_failures = 0
                raise ModelRequestError(
                    response.status_code, error_text(response), endpoint.label
                )
            try:
                # Not JSON, or JSON but not a completion: both raise ValueError.
                reply = parse_chat_completion(response.content)
            except ValueError as exc:
                raise self._failed(endpoint, f"malformed reply: {exc}") from exc
            endpoint.consecutive_failures = 0
            endpoint.served += 1
            return Generation(
                text=reply.text,
                endpoint=endpoint.label,
                model_version=endpoint.model_version,
                latency_s=self._clock() - started,
                prompt_tokens=reply.prompt_tokens,
                completion_tokens=reply.completion_tokens,
                finish_reason=reply.finish_reason,
                attempts=attempt,
                token_ids=reply.token_ids,
                prompt_token_ids=reply.prompt_token_ids,
                logprobs=reply.logprobs,
                tool_calls=reply.tool_calls,
            )
        finally:
            endpoint.outstanding -= 1

    def _failed(self, endpoint: Endpoint, reason: str, *, capacity: bool = False
                ) -> _Transient:
        endpoint.consecutive_failures += 1
        endpoint.last_error = reason
        failures = endpoint.consecutive_failures
        if failures >= self.cfg.endpoint_failures_to_eject and not endpoint.ejected:
            endpoint.ejected = True
            log.warning("model endpoint %s taken out after %d failures: %s",
                        endpoint.label, failures, reason)
            self._ensure_reprobe()
        return _Transient(reason, capacity=capacity)

    def _ensure_reprobe(self) -> None:
        if self._reprobe_task is None or self._reprobe_task.done():
            self._reprobe_task = asyncio.get_running_loop().create_task(self._reprobe_loop())

    async def _reprobe_loop(self) -> None:
        """Bring ejected endpoints back once their ``/health`` answers 200."""
        while any(e.ejected for e in self._endpoints.values()):
            await asyncio.sleep(self.cfg.reprobe_interval_s)
            for endpoint in [e for e in self._endpoints.values() if e.ejected]:
                if await self._healthy(endpoint):
                    endpoint.ejected = False
                    endpoint.consecutive_failures = 0
                    log.info("model endpoint %s is back", endpoint.label)

    def _refresh_from_state_file(self) -> None:
        if self._state_file is None:
            return
        now = self._clock()
        if now - self._state_checked_at < _STATE_CHECK_INTERVAL_S and self._endpoints:
            return
        self._state_checked_at = now
        try:
            mtime = self._state_file.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._state_mtime_ns:
            return
        try:
            entries = _endpoint_entries(json.loads(self._state_file.read_text()))
        except (OSError, ValueError) as exc:
            # run_model.py writes atomically, so this is a foreign or broken file.
            log.error("cannot read %s: %s", self._state_file, exc)
            return
        self._state_mtime_ns = mtime
        self._apply_state(entries)

    async def _watch_state_url(self) -> None:
        """With ``endpoints_url``: the list read once before the first request, then
        re-read every second in the background by one task of this process."""
        if self._state_url is None or (self._state_watch is not None
                                       and not self._state_watch.done()):
            return
        if self._state_etag is None:
            await self._read_state_url()
        self._state_watch = asyncio.get_running_loop().create_task(self._state_url_loop())

    async def _state_url_loop(self) -> None:
        while True:
            await asyncio.sleep(_STATE_URL_INTERVAL_S)
            await self._read_state_url()

    async def _read_state_url(self) -> None:
        """``GET endpoints_url`` (304 when unchanged). A failure keeps the list read last
        (held endpoints keep serving while the control server is away) and is logged once."""
        assert self._state_url is not None
        if self._state_client is None:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._state_client = httpx2.AsyncClient(
                timeout=httpx2.Timeout(self.cfg.connect_timeout_s), headers=headers,
                verify=ssl_context())
        where = redact_url(self._state_url)
        try:
            r = await self._state_client.get(
                self._state_url,
                headers={"If-None-Match": self._state_etag} if self._state_etag else None)
            if r.status_code == 304:
                error = None
            elif r.status_code != 200:
                error = f"{where}: HTTP {r.status_code}: {error_text(r)}"
            else:
                entries = _endpoint_entries(r.json())
                self._state_etag = r.headers.get("etag")
                self._apply_state(entries)
                error = None
        except httpx2.HTTPError as exc:
            error = f"{where}: {type(exc).__name__}: {exc}"
        except ValueError as exc:
            error = f"{where}: not an endpoint list: {exc}"
        if error and error != self._state_error:
            log.warning("cannot read the model endpoint list (keeping the last one read, "
                        "%d endpoints): %s", len(self._endpoints), error)
        elif error is None and self._state_error:
            log.info("the model endpoint list at %s is readable again", where)
        self._state_error = error

    def _apply_state(self, entries: list[dict[str, Any]]) -> None:
        """Route to the endpoints of a published list (``endpoints.json``'s schema)."""
        seen = set()
        for entry in entries:
            url = str(entry["url"]).rstrip("/")
            seen.add(url)
            endpoint = self._endpoints.setdefault(url, Endpoint(url))
            endpoint.published = True
            if endpoint.model_version != entry.get("model_version"):
                endpoint.context_asked = False  # a new checkpoint may serve another context
            endpoint.model_version = entry.get("model_version")
            endpoint.draining = bool(entry.get("draining", False)) or not entry.get(
                "healthy", True
            )
        for url in list(self._endpoints):
            if url not in seen and self._endpoints[url].outstanding == 0:
                del self._endpoints[url]
                client = self._clients.pop(url, None)
                if client is not None:
                    task = asyncio.get_running_loop().create_task(client.aclose())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)


def _endpoint_entries(state: Any) -> list[dict[str, Any]]:
    """The endpoints of a published list (``endpoints.json`` or ``GET /endpoints``);
    ``ValueError`` naming what is wrong when it is not one."""
    entries = state.get("endpoints") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("url"), str) for e in entries):
        raise ValueError("expected {\"endpoints\": [{\"url\": ...}, ...]}")
    return entries


# Stands in for a data URL while the rest of a body is serialised; letters, digits and
# underscores only, so JSON leaves it as it is, and random, so no prompt text contains it.
IMAGE_MARK = f"cua_image_{uuid.uuid4().hex}_"


class RequestBody:
    """A request body as the pieces of ``json.dumps(body)``: the JSON text around the
    ``DataURL`` strings of the messages' images, and those strings themselves, which JSON
    escaping leaves unchanged. Serialising them again would cost ~1 ms per 500 KB image per
    request, and joining the pieces would hold a copy of every image for as long as the
    request waits for the model. The bytes sent are exactly ``json.dumps(body).encode()``;
    each image is encoded (ASCII, a plain copy) only while it is being sent, and the body can
    be sent again for a retry."""

    def __init__(self, body: dict[str, Any]) -> None:
        urls: list[DataURL] = []
        text = json.dumps({**body, "messages": _mark_images(body["messages"], urls)})
        parts = text.split(IMAGE_MARK) if urls else [text]
        if len(parts) != 2 * len(urls) + 1:  # the mark occurs elsewhere: serialise it all
            self._pieces: list[bytes | DataURL] = [json.dumps(body).encode()]
        else:
            # parts: text, index, text, index, ..., text (the marks are "<IMAGE_MARK>i<IMAGE_MARK>")
            self._pieces = [parts[0].encode()]
            for i, url in enumerate(urls):
                if parts[2 * i + 1] != str(i):
                    self._pieces = [json.dumps(body).encode()]
                    break
                self._pieces += [url, parts[2 * i + 2].encode()]
        self.length = sum(len(p) for p in self._pieces)  # a DataURL is ASCII: 1 byte a char

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece.encode("ascii") if isinstance(piece, str) else piece

    def __bytes__(self) -> bytes:
        return b"".join(p.encode("ascii") if isinstance(p, str) else p for p in self._pieces)


def _mark_images(messages: list[dict[str, Any]], urls: list[DataURL]) -> list[Any]:
    """``messages`` with each ``DataURL`` image replaced by a numbered mark (appended to
    ``urls``); everything else is shared with the caller's messages, not copied."""
    out: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        for part in content:
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else None
            if type(url) is DataURL:
                mark = f"{IMAGE_MARK}{len(urls)}{IMAGE_MARK}"
                parts.append({**part, "image_url": {**image, "url": mark}})
                urls.append(url)
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out
