"""The model client, ``ModelServicePool``: sends chat generations to the endpoint routing
chooses, retries transient failures elsewhere with backoff, and waits out outages (no endpoint
live: ``ModelUnavailable``); each endpoint's context is asked once via ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cua_rollout.config import ModelConfig, SamplingConfig, secret_from_env
from cua_rollout.core.aio import backoff_s
from cua_rollout.core.errors import ContextTooShort, ModelRequestError, ModelUnavailable
from cua_rollout.core.http import Reply, TransportFailure, error_text, hot_request, hot_session
from cua_rollout.model.discovery import EndpointDiscovery
from cua_rollout.model.openai_protocol import (
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    RequestBody,
    chat_request_body,
    parse_chat_completion,
    served_card,
)
from cua_rollout.model.routing import Endpoint, Router, RoutingPolicy, make_policy

__all__ = ["Generation", "ModelServicePool", "OutageStatus"]

log = logging.getLogger(__name__)

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


class _Transient(Exception):
    """A failure worth retrying elsewhere (connection, timeout, 5xx, 429, garbage reply).
    ``capacity``: the server was not there or had no room (connection refused, dropped
    mid-request, 503, 429), a state of the service; otherwise the server took this request
    and failed on it (500, read timeout, malformed reply), which may be the request's doing."""

    def __init__(self, reason: str, *, capacity: bool) -> None:
        super().__init__(reason)
        self.capacity = capacity


class ModelServicePool:
    """Routes ``generate`` calls over the live endpoints, with retries and ejection.

    Endpoints come from ``EndpointDiscovery`` (``cfg.endpoints``, ``cfg.endpoints_url``, or
    ``endpoints.json`` in ``state_dir``); ``Router`` chooses among the live ones and keeps
    their health. Create one per process (one per runner actor); it opens its HTTP clients on
    the running loop at first use.
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
        self._rng = rng or random.Random()
        self._clock = clock
        self._api_key = secret_from_env(cfg.api_key_env, "model.api_key_env")
        self._clients: dict[str, aiohttp.ClientSession] = {}  # endpoint URL -> its session
        self._closing: set[asyncio.Task[None]] = set()
        self.discovery = EndpointDiscovery(cfg, state_dir, api_key=self._api_key, clock=clock,
                                           on_removed=self._drop_client)
        self.router = Router(
            self.discovery.endpoints, policy or make_policy(cfg),
            failures_to_eject=cfg.endpoint_failures_to_eject,
            reprobe_interval_s=cfg.reprobe_interval_s, healthy=self._healthy,
        )
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
        await self.discovery.watch()
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
            # An outage when None: waited out by the caller while wait_until_live probes.
            self.discovery.refresh()
            endpoint = self.router.pick(session_id, avoid=tried)
            if endpoint is None:
                unread = self.discovery.error
                listed = f"; the endpoint list is not readable: {unread}" if unread else ""
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
        """Ask every endpoint that is not draining for ``/health`` now (the endpoint list
        re-read first); those answering 200 are routed to again, the others taken out."""
        await self.discovery.reread()
        await self.router.check_all()
        return self.outage_status()

    def outage_status(self) -> OutageStatus:
        live, draining, down = self.router.counts()
        since = self._clock() - self._waiting_since if self._waiting_since is not None else 0.0
        return OutageStatus(live, draining, down, self.waiting, round(since, 1))

    def end_session(self, session_id: str) -> None:
        """Forget an episode's sticky endpoint (call when the episode ends)."""
        self.router.policy.forget(session_id)

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "retries": self.retries,
            "outage_waits": self.outage_waits,
            **self.router.stats(),
        }

    @property
    def in_flight(self) -> int:
        return self.router.in_flight

    async def close(self) -> None:
        await self.router.close()
        if self._outage_watch is not None:
            self._outage_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._outage_watch
            self._outage_watch = None
        await self.discovery.close()
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients), *self._closing,
                             return_exceptions=True)

    # ----------------------------------------------------------------- internals

    def _http(self, endpoint: Endpoint) -> aiohttp.ClientSession:
        """The endpoint's own session (``hot_session``: a chat completion is one of a step's
        three hot requests). Its pool holds that endpoint's connections only, so
        ``max_connections_per_endpoint`` limits each endpoint."""
        client = self._clients.get(endpoint.url)
        if client is None or client.closed:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            client = hot_session(self.cfg.max_connections_per_endpoint, headers=headers)
            self._clients[endpoint.url] = client
        return client

    async def _get(self, endpoint: Endpoint, path: str) -> Reply | None:
        """``GET path`` of the endpoint with the connect timeout; None if it did not answer."""
        try:
            return await hot_request(self._http(endpoint), "GET", endpoint.url + path,
                                     timeout_s=self.cfg.connect_timeout_s,
                                     connect_timeout_s=self.cfg.connect_timeout_s)
        except TransportFailure:
            return None

    def _drop_client(self, url: str) -> None:
        """Close the client of an endpoint the list no longer has (in the background)."""
        client = self._clients.pop(url, None)
        if client is not None:
            task = asyncio.get_running_loop().create_task(client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _healthy(self, endpoint: Endpoint) -> bool:
        r = await self._get(endpoint, HEALTH_PATH)
        return r is not None and r.status_code == 200

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
        r = await self._get(endpoint, MODELS_PATH)
        if r is None:
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
                response = await hot_request(
                    self._http(endpoint), "POST", endpoint.url + CHAT_COMPLETIONS_PATH,
                    body=content, content_length=content.length,
                    headers={"Content-Type": "application/json"},
                    timeout_s=self.cfg.request_timeout_s,
                    connect_timeout_s=self.cfg.connect_timeout_s)
            except TransportFailure as exc:
                if exc.kind in ("connect", "disconnected"):
                    # Not there, or gone mid-request (a replica stopped or killed).
                    raise self._failed(endpoint, str(exc), capacity=True) from exc
                if exc.kind == "timeout":
                    raise self._failed(endpoint, f"timed out ({exc.cause_name})") from exc
                raise self._failed(endpoint, str(exc)) from exc
            if response.status_code >= 500 or response.status_code == 429:
                raise self._failed(
                    endpoint, f"HTTP {response.status_code}: {error_text(response)}",
                    capacity=response.status_code in (429, 503),
                )
            if response.status_code >= 400:
                # The request itself is wrong (too long, images to a text model ...).
                self.router.answered(endpoint, served=False)
                raise ModelRequestError(
                    response.status_code, error_text(response), endpoint.label
                )
            try:
                # Not JSON, or JSON but not a completion: both raise ValueError.
                reply = parse_chat_completion(response.content)
            except ValueError as exc:
                raise self._failed(endpoint, f"malformed reply: {exc}") from exc
            self.router.answered(endpoint, served=True)
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
        self.router.failed(endpoint, reason)
        return _Transient(reason, capacity=capacity)
