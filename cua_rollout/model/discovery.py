"""Where the model endpoints come from: ``model.endpoints`` (a static list), the fleet's
state file ``endpoints.json`` (re-read when it changes), or the control server's URL (asked
every second); while a list cannot be read, the last one read is kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2

from cua_rollout.config import ModelConfig
from cua_rollout.core.errors import ModelUnavailable
from cua_rollout.core.http import error_text, redact_url, ssl_context
from cua_rollout.model.fleet.state import ENDPOINTS_FILE
from cua_rollout.model.routing import Endpoint

__all__ = ["EndpointDiscovery"]

log = logging.getLogger(__name__)

# How often the state file's mtime is looked at: about every request (a stat), so a request
# sent after run_model.py published a replica's new version or its draining is labelled and
# routed by it (the version a step records is exact, not up to a second late).
_STATE_CHECK_INTERVAL_S = 0.02
_STATE_URL_INTERVAL_S = 1.0        # how often endpoints_url is asked (a request, not a stat)


class EndpointDiscovery:
    """The table of endpoints (``endpoints``, URL -> ``Endpoint``), kept as their source says.

    From ``cfg.endpoints`` when set (once); else from run_model.py's endpoint list: over HTTP
    from its control server (``cfg.endpoints_url``, asked every second with its ETag, so an
    unchanged list costs a 304), or from ``endpoints.json`` in ``state_dir``, re-read whenever
    it changes. An endpoint that leaves the list is dropped once it has no request in flight,
    and ``on_removed`` is told its URL (to close its connections)."""

    def __init__(
        self,
        cfg: ModelConfig,
        state_dir: Path | None,
        *,
        api_key: str | None,
        clock: Callable[[], float],
        on_removed: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.endpoints: dict[str, Endpoint] = {}
        self._api_key = api_key
        self._clock = clock
        self._on_removed = on_removed
        self._url = None if cfg.endpoints else cfg.endpoints_url
        self._file = (
            Path(state_dir) / ENDPOINTS_FILE
            if not cfg.endpoints and self._url is None and state_dir else None
        )
        self._mtime_ns: int | None = None
        self._checked_at = float("-inf")
        self._etag: str | None = None
        self.error: str | None = None   # why the list could not be read last time
        self._client: httpx2.AsyncClient | None = None
        self._watch: asyncio.Task[None] | None = None
        if cfg.endpoints:
            for url in cfg.endpoints:
                self.endpoints[url.rstrip("/")] = Endpoint(url.rstrip("/"))
        elif self._file is None and self._url is None:
            raise ModelUnavailable(
                "no model endpoints: set model.endpoints, model.endpoints_url, model.scripted, "
                "or run run_model.py and point model_pool.state_dir at its state"
            )

    def refresh(self) -> None:
        """Re-read the state file if it changed (its mtime looked at most every
        ``_STATE_CHECK_INTERVAL_S`` while some endpoint is known)."""
        if self._file is None:
            return
        now = self._clock()
        if now - self._checked_at < _STATE_CHECK_INTERVAL_S and self.endpoints:
            return
        self._checked_at = now
        try:
            mtime = self._file.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._mtime_ns:
            return
        try:
            entries = _endpoint_entries(json.loads(self._file.read_text()))
        except (OSError, ValueError) as exc:
            # run_model.py writes atomically, so this is a foreign or broken file.
            log.error("cannot read %s: %s", self._file, exc)
            return
        self._mtime_ns = mtime
        self._apply(entries)

    async def watch(self) -> None:
        """With ``endpoints_url``: the list read once before the first request, then
        re-read every second in the background by one task of this process."""
        if self._url is None or (self._watch is not None and not self._watch.done()):
            return
        if self._etag is None:
            await self._read_url()
        self._watch = asyncio.get_running_loop().create_task(self._url_loop())

    async def reread(self) -> None:
        """Read the list now, whatever was read when (the state file's mtime looked at, the
        control server asked)."""
        self._checked_at = float("-inf")
        self.refresh()
        if self._url is not None:
            await self._read_url()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _url_loop(self) -> None:
        while True:
            await asyncio.sleep(_STATE_URL_INTERVAL_S)
            await self._read_url()

    async def _read_url(self) -> None:
        """``GET endpoints_url`` (304 when unchanged). A failure keeps the list read last
        (held endpoints keep serving while the control server is away) and is logged once."""
        assert self._url is not None
        if self._client is None:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._client = httpx2.AsyncClient(
                timeout=httpx2.Timeout(self.cfg.connect_timeout_s), headers=headers,
                verify=ssl_context())
        where = redact_url(self._url)
        try:
            r = await self._client.get(
                self._url, headers={"If-None-Match": self._etag} if self._etag else None)
            if r.status_code == 304:
                error = None
            elif r.status_code != 200:
                error = f"{where}: HTTP {r.status_code}: {error_text(r)}"
            else:
                entries = _endpoint_entries(r.json())
                self._etag = r.headers.get("etag")
                self._apply(entries)
                error = None
        except httpx2.HTTPError as exc:
            error = f"{where}: {type(exc).__name__}: {exc}"
        except ValueError as exc:
            error = f"{where}: not an endpoint list: {exc}"
        if error and error != self.error:
            log.warning("cannot read the model endpoint list (keeping the last one read, "
                        "%d endpoints): %s", len(self.endpoints), error)
        elif error is None and self.error:
            log.info("the model endpoint list at %s is readable again", where)
        self.error = error

    def _apply(self, entries: list[dict[str, Any]]) -> None:
        """Route to the endpoints of a published list (``endpoints.json``'s schema)."""
        seen = set()
        for entry in entries:
            url = str(entry["url"]).rstrip("/")
            seen.add(url)
            endpoint = self.endpoints.setdefault(url, Endpoint(url))
            endpoint.published = True
            if endpoint.model_version != entry.get("model_version"):
                endpoint.context_asked = False  # a new checkpoint may serve another context
            endpoint.model_version = entry.get("model_version")
            endpoint.draining = bool(entry.get("draining", False)) or not entry.get(
                "healthy", True
            )
        for url in list(self.endpoints):
            if url not in seen and self.endpoints[url].outstanding == 0:
                del self.endpoints[url]
                self._on_removed(url)


def _endpoint_entries(state: Any) -> list[dict[str, Any]]:
    """The endpoints of a published list (``endpoints.json`` or ``GET /endpoints``);
    ``ValueError`` naming what is wrong when it is not one."""
    entries = state.get("endpoints") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("url"), str) for e in entries):
        raise ValueError("expected {\"endpoints\": [{\"url\": ...}, ...]}")
    return entries
