"""The HTTP API of a running vLLM replica as the supervisor uses it: ``/health``, the load
from ``/metrics``, and the in-place weight swap of the dev endpoints (``/pause``,
``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache``, ``/resume``)."""

from __future__ import annotations

import logging

import httpx

from cua_rollout.model.openai_protocol import HEALTH_PATH
from cua_rollout.model.server_metrics import parse_vllm_metrics

__all__ = ["ReplicaAPI", "parse_vllm_load"]

log = logging.getLogger(__name__)


def parse_vllm_load(metrics_text: str) -> tuple[int, int]:
    """(running, waiting) requests from vLLM's Prometheus ``/metrics`` text, summed over
    its engines; (0, 0) for text that is not Prometheus exposition text."""
    try:
        sample = parse_vllm_metrics(metrics_text)
    except ValueError as exc:
        log.debug("unreadable /metrics reply: %s", exc)
        return 0, 0
    return sample.running, sample.waiting


class ReplicaAPI:
    """One HTTP client for every replica; make it on the supervisor's running loop.
    ``timeout_s`` bounds each health and metrics request."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def healthy(self, url: str) -> bool:
        """Whether ``url`` (a replica's base URL plus a path) answers 200."""
        try:
            response = await self._http.get(url, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def load(self, base_url: str) -> tuple[int, int] | None:
        """(running, waiting) requests of a replica, None if it does not answer."""
        try:
            response = await self._http.get(base_url + "/metrics", timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return parse_vllm_load(response.text)

    async def reload_weights(self, index: int, base_url: str, checkpoint: str, *,
                             pause_timeout_s: float, reload_timeout_s: float) -> bool:
        """Swap weights inside the running server: pause (in-flight ones finish, new ones
        wait), ``reload_weights`` from ``checkpoint``, drop the prefix cache, resume. False
        (and logged, naming replica ``index``) when the server cannot or did not."""
        http, base = self._http, base_url
        try:
            response = await http.post(base + "/pause", params={"mode": "wait"},
                                       timeout=pause_timeout_s)
        except httpx.HTTPError as exc:
            log.warning("replica %d: /pause failed: %s", index, exc)
            return False
        if response.status_code != 200:
            log.info("replica %d offers no in-place reload (HTTP %d from /pause)",
                     index, response.status_code)
            return False
        reloaded = False
        try:
            response = await http.post(
                base + "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": checkpoint}},
                timeout=reload_timeout_s,
            )
            if response.status_code != 200:
                log.warning("replica %d: reload_weights failed (HTTP %d): %s",
                            index, response.status_code, response.text[:500])
                return False
            reset = await http.post(base + "/reset_prefix_cache")
            if reset.status_code != 200:
                log.warning("replica %d: /reset_prefix_cache answered HTTP %d",
                            index, reset.status_code)
            reloaded = True
        except httpx.HTTPError as exc:
            log.warning("replica %d: in-place reload failed: %s", index, exc)
            return False
        finally:
            try:
                resumed = await http.post(base + "/resume")
                if resumed.status_code != 200:
                    reloaded = False
            except httpx.HTTPError:
                reloaded = False
        return reloaded and await self.healthy(base + HEALTH_PATH)
