"""Model-server utilization from each vLLM endpoint's Prometheus ``/metrics``.

vLLM's names (``vllm/v1/metrics/loggers.py``): the gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (0..1; older versions:
``vllm:gpu_cache_usage_perc``, ``vllm:cpu_cache_usage_perc``), the counters
``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:num_preemptions`` and
``vllm:request_success`` (exposed as ``<name>_total``) and the histogram
``vllm:request_queue_time_seconds``. A server runs one or more engines, each its own label
set (``engine``, ``model_name``): gauges and counters are summed over them, the KV-cache
usage is their mean.

``parse_vllm_metrics`` reads one reply; ``ServerMetricsScraper`` polls every endpoint and
turns the counters of its last two scrapes into rates.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from cua_rollout.core.http import error_text, redact_url

if TYPE_CHECKING:
    import httpx

__all__ = [
    "EndpointUtilization",
    "ServerMetricsScraper",
    "VLLMSample",
    "metrics_url",
    "parse_vllm_metrics",
    "utilization",
    "vllm_metrics_text",
]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# The KV-cache usage, by the name of each vLLM generation: the first present is used.
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                  "vllm:cpu_cache_usage_perc")
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
PREEMPTIONS = "vllm:num_preemptions"
REQUESTS_FINISHED = "vllm:request_success"
QUEUE_TIME = "vllm:request_queue_time_seconds"
# Prefill + decode of a request, once it left the queue (the "generation" of a step).
INFERENCE_TIME = "vllm:request_inference_time_seconds"


@dataclass(frozen=True)
class VLLMSample:
    """One scrape of one server, summed over its engines. A counter or histogram the
    server does not expose is None; ``at`` is the ``time.monotonic()`` of the scrape."""

    running: int
    waiting: int
    kv_cache_usage: float | None
    prompt_tokens_total: float | None
    generation_tokens_total: float | None
    preemptions_total: float | None
    requests_finished_total: float | None
    queue_time_s_sum: float | None
    queue_time_s_count: float | None
    at: float
    inference_time_s_sum: float | None = None
    inference_time_s_count: float | None = None


def _bad_line(text: str) -> str:
    """The first line of ``text`` the parser refuses on its own, quoted, for the error."""
    from prometheus_client.parser import text_string_to_metric_families

    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            shown = line if len(line) <= 80 else line[:77] + "..."
            return f" (line {number}: {shown!r})"
    return ""


def parse_vllm_metrics(text: str, at: float | None = None) -> VLLMSample:
    """A ``VLLMSample`` from the text of vLLM's ``/metrics`` (Prometheus exposition format).
    NaN values are ignored. Raises ``ValueError`` naming the problem (and the first bad
    line) when ``text`` is not Prometheus exposition text. ``at`` defaults to now."""
    from prometheus_client.parser import text_string_to_metric_families

    at = time.monotonic() if at is None else at
    # Every sample by its own name (not its family's: a counter's family drops "_total",
    # an untyped one keeps it), summed over label sets; the KV usage's values kept apart.
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                if math.isnan(value):
                    continue
                if sample.name in KV_CACHE_USAGE:
                    kv.setdefault(sample.name, []).append(value)
                else:
                    sums[sample.name] = sums.get(sample.name, 0.0) + value
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(
            f"not Prometheus exposition text: {exc}{_bad_line(text)}"
        ) from None

    def counter(name: str) -> float | None:
        for exposed in (name + "_total", name):
            if exposed in sums:
                return sums[exposed]
        return None

    usage = next((values for name in KV_CACHE_USAGE if (values := kv.get(name))), None)
    return VLLMSample(
        running=int(sums.get(RUNNING, 0.0)),
        waiting=int(sums.get(WAITING, 0.0)),
        kv_cache_usage=sum(usage) / len(usage) if usage else None,
        prompt_tokens_total=counter(PROMPT_TOKENS),
        generation_tokens_total=counter(GENERATION_TOKENS),
        preemptions_total=counter(PREEMPTIONS),
        requests_finished_total=counter(REQUESTS_FINISHED),
        queue_time_s_sum=sums.get(QUEUE_TIME + "_sum"),
        queue_time_s_count=sums.get(QUEUE_TIME + "_count"),
        at=at,
        inference_time_s_sum=sums.get(INFERENCE_TIME + "_sum"),
        inference_time_s_count=sums.get(INFERENCE_TIME + "_count"),
    )


def vllm_metrics_text(*, model_name: str, running: int, waiting: int = 0,
                      prompt_tokens_total: float = 0.0, generation_tokens_total: float = 0.0,
                      requests_finished_total: float | None = None,
                      queue_time_s: tuple[float, int] | None = None,
                      inference_time_s: tuple[float, int] | None = None,
                      kv_cache_usage: float | None = None) -> str:
    """The ``/metrics`` text a vLLM 0.32 server would give for these figures (one engine),
    for the servers that stand in for vLLM (the scripted policy, the benchmark's sim):
    the same names, types and labels this module reads. Histograms as ``(sum, count)``."""
    labels = f'engine="0",model_name="{model_name}"'
    lines = [f"# TYPE {RUNNING} gauge", f"{RUNNING}{{{labels}}} {float(running)}",
             f"# TYPE {WAITING} gauge", f"{WAITING}{{{labels}}} {float(waiting)}"]
    if kv_cache_usage is not None:
        lines += [f"# TYPE {KV_CACHE_USAGE[0]} gauge",
                  f"{KV_CACHE_USAGE[0]}{{{labels}}} {float(kv_cache_usage)}"]
    counters = [(PROMPT_TOKENS, prompt_tokens_total),
                (GENERATION_TOKENS, generation_tokens_total)]
    if requests_finished_total is not None:
        counters.append((REQUESTS_FINISHED, requests_finished_total))
    for name, value in counters:
        lines += [f"# TYPE {name} counter", f"{name}_total{{{labels}}} {float(value)}"]
    for name, hist in ((QUEUE_TIME, queue_time_s), (INFERENCE_TIME, inference_time_s)):
        if hist is not None:
            total, count = hist
            lines += [f"# TYPE {name} histogram",
                      f'{name}_bucket{{{labels},le="+Inf"}} {float(count)}',
                      f"{name}_count{{{labels}}} {float(count)}",
                      f"{name}_sum{{{labels}}} {float(total)}"]
    return "\n".join(lines) + "\n"


def metrics_url(url: str) -> str:
    """Where a model endpoint's server exposes ``/metrics``: at its root, i.e. ``url``
    without a trailing ``/v1`` (as endpoints may be written for OpenAI clients)."""
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/metrics"


@dataclass
class EndpointUtilization:
    """What one scrape says of one endpoint. ``up`` False: it did not answer usable
    metrics (``error`` says why) and every measure is None. The rates and the mean queue
    time cover the interval since the previous scrape (None on the first, after a failed
    one, after a restart, or when the server does not expose the counter);
    ``mean_queue_time_s`` is also None when no request left the queue in it."""

    url: str
    up: bool
    error: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    mean_queue_time_s: float | None = None
    mean_inference_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: floats rounded, credentials in the URL and error replaced by ***."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 6)
        out["url"] = redact_url(self.url)
        if self.error is not None:
            out["error"] = redact_url(self.error)
        return out


def _delta(new: float | None, old: float | None) -> float | None:
    return None if new is None or old is None else new - old


def utilization(url: str, new: VLLMSample, old: VLLMSample | None = None
                ) -> EndpointUtilization:
    """``url``'s utilization from its scrape ``new`` and, for the rates and the mean queue
    time, its previous one ``old`` (the same server, scraped earlier). A counter lower in
    ``new`` than in ``old`` means the server restarted in between: every rate is then
    None, not negative."""
    util = EndpointUtilization(url, True, running=new.running, waiting=new.waiting,
                               kv_cache_usage=new.kv_cache_usage)
    if old is None or new.at <= old.at:
        return util
    deltas = {
        name: _delta(getattr(new, name), getattr(old, name))
        for name in ("prompt_tokens_total", "generation_tokens_total", "preemptions_total",
                     "requests_finished_total", "queue_time_s_sum", "queue_time_s_count",
                     "inference_time_s_sum", "inference_time_s_count")
    }
    if any(d is not None and d < 0 for d in deltas.values()):
        return util  # a counter went down: the server restarted, the interval is unknown
    elapsed = new.at - old.at
    if (d := deltas["prompt_tokens_total"]) is not None:
        util.prompt_tokens_per_s = d / elapsed
    if (d := deltas["generation_tokens_total"]) is not None:
        util.generation_tokens_per_s = d / elapsed
    count, total = deltas["queue_time_s_count"], deltas["queue_time_s_sum"]
    if count and total is not None:
        util.mean_queue_time_s = total / count
    count, total = deltas["inference_time_s_count"], deltas["inference_time_s_sum"]
    if count and total is not None:
        util.mean_inference_time_s = total / count
    return util


class ServerMetricsScraper:
    """Polls the ``/metrics`` of model endpoints (their URLs as the model client stores
    them, a trailing ``/v1`` allowed) and reports their utilization; rates come from the
    counters of each endpoint's previous successful scrape. Use it on one event loop: its
    HTTP client is made on the first ``scrape`` and closed by ``aclose``. ``timeout_s``
    bounds each endpoint's whole request; ``headers`` go with every request."""

    def __init__(self, urls: Iterable[str], timeout_s: float = 2.0,
                 headers: dict[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.urls: list[str] = []
        self._previous: dict[str, VLLMSample] = {}
        self._http: httpx.AsyncClient | None = None
        self.set_urls(urls)

    def set_urls(self, urls: Iterable[str]) -> None:
        """The endpoints to poll from now on; what was kept of the others is dropped."""
        self.urls = list(dict.fromkeys(urls))
        self._previous = {u: s for u, s in self._previous.items() if u in self.urls}

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    async def scrape(self) -> list[EndpointUtilization]:
        """Every endpoint's utilization, polled concurrently, in ``urls`` order. Never
        raises for an endpoint that is down, slow or answers something else."""
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers)
        urls = list(self.urls)
        return list(await asyncio.gather(*(self._scrape_one(url) for url in urls)))

    async def _scrape_one(self, url: str) -> EndpointUtilization:
        import httpx

        assert self._http is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self._http.get(metrics_url(url))
        except (TimeoutError, httpx.TimeoutException):
            return self._down(url, f"timed out after {self.timeout_s:g}s")
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
            return self._down(url, f"{type(exc).__name__}: {exc}".rstrip(": "))
        if response.status_code != 200:
            return self._down(url, f"HTTP {response.status_code} from /metrics: "
                                   f"{error_text(response)}")
        try:
            sample = parse_vllm_metrics(response.text)
        except ValueError as exc:
            return self._down(url, f"bad /metrics reply: {exc}")
        if url not in self.urls:  # removed while it was being polled
            return utilization(url, sample, None)
        old, self._previous[url] = self._previous.get(url), sample
        return utilization(url, sample, old)

    def _down(self, url: str, error: str) -> EndpointUtilization:
        # Continuity is unknown across a failure (the server may have restarted).
        self._previous.pop(url, None)
        return EndpointUtilization(url, False, error)

    @staticmethod
    def summary(utils: Iterable[EndpointUtilization]) -> dict[str, Any]:
        """Totals over the endpoints that are up: requests running and waiting, the mean
        KV-cache usage, tokens per second (summed over those whose rate is known; None if
        none is), and how many endpoints are up of how many."""
        utils = list(utils)
        up = [u for u in utils if u.up]
        kv = [u.kv_cache_usage for u in up if u.kv_cache_usage is not None]

        def total(name: str) -> float | None:
            known = [v for u in up if (v := getattr(u, name)) is not None]
            return round(sum(known), 6) if known else None

        def mean(name: str) -> float | None:
            known = [v for u in up if (v := getattr(u, name)) is not None]
            return round(sum(known) / len(known), 6) if known else None

        return {
            "running": sum(u.running or 0 for u in up),
            "waiting": sum(u.waiting or 0 for u in up),
            "kv_cache_usage": round(sum(kv) / len(kv), 6) if kv else None,
            "prompt_tokens_per_s": total("prompt_tokens_per_s"),
            "generation_tokens_per_s": total("generation_tokens_per_s"),
            "mean_queue_time_s": mean("mean_queue_time_s"),
            "mean_inference_time_s": mean("mean_inference_time_s"),
            "endpoints_up": len(up),
            "endpoints": len(utils),
        }

