"""cua_rollout/model/server_metrics.py: vLLM's /metrics text (0.32's names and layout, older names),
rates between two scrapes, and the scraper against real HTTP servers on loopback (up,
hanging, failing, answering something else, gone)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from cua_rollout.core.http import ThreadedServer
from cua_rollout.model.fleet.replica_api import parse_vllm_load
from cua_rollout.model.server_metrics import (
    EndpointUtilization,
    ServerMetricsScraper,
    VLLMSample,
    metrics_url,
    parse_vllm_metrics,
    utilization,
)


def vllm_text(*, running=(2, 1), waiting=(3, 0), kv=(0.25, 0.75), prompt=(100, 20),
              generation=(40, 8), preemptions=(1, 0), success=((5, 1), (2, 0)),
              queue_sum=(0.5, 0.25), queue_count=(4, 2)) -> str:
    """A /metrics reply as vLLM 0.32 writes it (prometheus_client's text format 0.0.4) for
    a server of two engines: a value per engine (``success``: per engine, (stop, length))."""
    def go(value: float) -> str:  # how prometheus_client writes a value
        return "NaN" if math.isnan(value) else repr(float(value))

    def per_engine(name: str, values, extra: str = "") -> str:
        return "".join(f'{name}{{engine="{e}",{extra}model_name="tiny"}} {go(v)}\n'
                       for e, v in enumerate(values))

    def head(name: str, kind: str, help_: str) -> str:
        return f"# HELP {name} {help_}\n# TYPE {name} {kind}\n"

    def counter(name: str, values, help_: str) -> str:
        return (head(name + "_total", "counter", help_) + per_engine(name + "_total", values)
                + head(name + "_created", "gauge", help_)
                + per_engine(name + "_created", [1.7795e9, 1.7795e9]))

    buckets = "".join(
        f'vllm:request_queue_time_seconds_bucket{{engine="{e}",le="{le}",model_name="tiny"}} '
        f"{float(n)!r}\n"
        for e, count in enumerate(queue_count)
        for le, n in (("0.3", count // 2), ("0.5", count), ("+Inf", count))
    )
    return "".join([
        head("python_gc_objects_collected_total", "counter", "Objects collected during gc"),
        'python_gc_objects_collected_total{generation="0"} 1234.0\n',
        head("process_cpu_seconds_total", "counter", "Total user and system CPU time."),
        "process_cpu_seconds_total 52.31\n",
        head("vllm:num_requests_running", "gauge",
             "Number of requests in model execution batches."),
        per_engine("vllm:num_requests_running", running),
        head("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
        per_engine("vllm:num_requests_waiting", waiting),
        head("vllm:num_requests_waiting_by_reason", "gauge", "Number of waiting requests."),
        per_engine("vllm:num_requests_waiting_by_reason", (9, 9), 'reason="capacity",'),
        head("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
        per_engine("vllm:kv_cache_usage_perc", kv),
        counter("vllm:num_preemptions", preemptions,
                "Cumulative number of preemption from the engine."),
        counter("vllm:prompt_tokens", prompt, "Number of prefill tokens processed."),
        head("vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens."),
        per_engine("vllm:prompt_tokens_by_source_total", (999, 999), 'source="local_compute",'),
        counter("vllm:generation_tokens", generation, "Number of generation tokens processed."),
        head("vllm:request_success_total", "counter", "Count of successfully processed requests."),
        *(per_engine("vllm:request_success_total", [s[i] for s in success],
                     f'finished_reason="{reason}",')
          for i, reason in enumerate(("stop", "length"))),
        head("vllm:request_queue_time_seconds", "histogram",
             "Histogram of time spent in WAITING phase for request."),
        buckets,
        per_engine("vllm:request_queue_time_seconds_count", queue_count),
        per_engine("vllm:request_queue_time_seconds_sum", queue_sum),
        head("vllm:request_queue_time_seconds_created", "gauge", "Histogram of queue time."),
        per_engine("vllm:request_queue_time_seconds_created", [1.7795e9, 1.7795e9]),
    ])


# --------------------------------------------------------------------------- parsing


def test_parses_vllm_032_exposition_summed_over_engines():
    sample = parse_vllm_metrics(vllm_text(), at=12.5)
    assert sample == VLLMSample(
        running=3, waiting=3, kv_cache_usage=0.5, prompt_tokens_total=120.0,
        generation_tokens_total=48.0, preemptions_total=1.0, requests_finished_total=8.0,
        queue_time_s_sum=0.75, queue_time_s_count=6.0, at=12.5,
    )
    before = time.monotonic()
    assert before <= parse_vllm_metrics(vllm_text()).at <= time.monotonic()


def test_older_kv_cache_names_are_fallbacks():
    text = vllm_text().replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_vllm_metrics(text).kv_cache_usage == 0.5
    cpu = vllm_text(kv=(0.1, 0.3)).replace("vllm:kv_cache_usage_perc",
                                           "vllm:cpu_cache_usage_perc")
    assert parse_vllm_metrics(cpu).kv_cache_usage == pytest.approx(0.2)
    both = vllm_text(kv=(0.1, 0.3)) + (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny"} 0.9\n')
    assert parse_vllm_metrics(both).kv_cache_usage == pytest.approx(0.2)  # the new name wins


def test_untyped_text_counters_without_total_and_absent_metrics():
    text = (
        "# HELP vllm:num_requests_running Number of requests\n"  # no # TYPE
        'vllm:num_requests_running{engine="0"} 3.0\n'
        "vllm:prompt_tokens_total 10\n"       # untyped: its family keeps the "_total"
        "vllm:generation_tokens 7\n"          # a counter written without "_total"
    )
    sample = parse_vllm_metrics(text, at=0.0)
    assert (sample.running, sample.waiting) == (3, 0)
    assert (sample.prompt_tokens_total, sample.generation_tokens_total) == (10.0, 7.0)
    assert sample.kv_cache_usage is None and sample.preemptions_total is None
    assert sample.requests_finished_total is None
    assert sample.queue_time_s_sum is None and sample.queue_time_s_count is None
    empty = parse_vllm_metrics("", at=1.0)
    assert (empty.running, empty.waiting, empty.generation_tokens_total) == (0, 0, None)


def test_nan_values_are_ignored():
    text = vllm_text(running=(2, math.nan), kv=(math.nan, 0.5), prompt=(math.nan, 20))
    assert "} NaN\n" in text
    sample = parse_vllm_metrics(text)
    assert sample.running == 2 and sample.kv_cache_usage == 0.5
    assert sample.prompt_tokens_total == 20.0
    sample = parse_vllm_metrics(vllm_text(kv=(math.nan, math.nan), prompt=(math.nan,) * 2))
    assert sample.kv_cache_usage is None and sample.prompt_tokens_total is None


@pytest.mark.parametrize(("text", "named"), [
    ("<html><body>502 Bad Gateway</body></html>", "line 1: '<html>"),
    ('{"error": {"message": "not found"}}', 'line 1: \'{"error"'),
    ("Internal Server Error", "line 1: 'Internal Server Error'"),
    ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
     'vllm:num_requests_waiting{engine="0" 2\n', "line 3: 'vllm:num_requests_waiting{"),
])
def test_text_that_is_not_prometheus_is_a_value_error_naming_the_line(text, named):
    with pytest.raises(ValueError, match="not Prometheus exposition text") as info:
        parse_vllm_metrics(text)
    assert named in str(info.value)
    assert parse_vllm_load(text) == (0, 0)  # the supervisor's view: no load known


def test_replica_load_is_the_same_reading():
    assert parse_vllm_load(vllm_text()) == (3, 3)


@pytest.mark.parametrize(("url", "expected"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/metrics"),
    ("https://models.example/pool-a/v1", "https://models.example/pool-a/metrics"),
    ("http://host:8000/v10", "http://host:8000/v10/metrics"),
])
def test_metrics_live_at_the_server_root(url, expected):
    assert metrics_url(url) == expected


# --------------------------------------------------------------------------- rates


def test_rates_and_queue_time_between_two_samples():
    old = parse_vllm_metrics(vllm_text(), at=100.0)
    new = parse_vllm_metrics(vllm_text(prompt=(150, 50), generation=(60, 28), queue_count=(5, 3),
                                       queue_sum=(1.0, 0.75)), at=102.0)
    first = utilization("http://h/v1", old)
    assert first.up and first.error is None and (first.running, first.waiting) == (3, 3)
    assert first.prompt_tokens_per_s is None and first.mean_queue_time_s is None
    util = utilization("http://h/v1", new, old)
    assert util.prompt_tokens_per_s == pytest.approx(40.0)      # (200 - 120) / 2 s
    assert util.generation_tokens_per_s == pytest.approx(20.0)  # (88 - 48) / 2 s
    assert util.mean_queue_time_s == pytest.approx(0.5)         # (1.75 - 0.75) / (8 - 6)
    assert util.kv_cache_usage == 0.5
    idle = utilization("u", parse_vllm_metrics(vllm_text(), at=103.0), old)
    assert idle.generation_tokens_per_s == 0.0 and idle.mean_queue_time_s is None
    assert json.loads(json.dumps(util.to_dict())) == util.to_dict()


def test_a_counter_that_went_down_is_a_restart_not_a_negative_rate():
    old = parse_vllm_metrics(vllm_text(), at=100.0)
    restarted = parse_vllm_metrics(vllm_text(prompt=(500, 500), generation=(3, 0),
                                             queue_count=(1, 0), queue_sum=(0.1, 0)), at=102.0)
    util = utilization("u", restarted, old)
    assert util.up and util.running == 3
    assert util.generation_tokens_per_s is None and util.mean_queue_time_s is None
    assert util.prompt_tokens_per_s is None  # went up, but since the restart: unknown


def test_to_dict_hides_credentials():
    util = EndpointUtilization("http://user:pw@h:1/v1", False, "no route to http://user:pw@h")
    data = util.to_dict()
    assert data["url"] == "http://***@h:1/v1" and "pw" not in data["error"]
    assert data["running"] is None and data["up"] is False


# --------------------------------------------------------------------------- the scraper


@dataclass
class MetricsServer:
    """An HTTP server on loopback: ``routes`` maps a path to (status, body) or "hang"."""

    routes: dict[str, tuple[int, str] | str] = field(default_factory=dict)
    headers: list[dict[str, str]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def start(self) -> MetricsServer:
        self.server = ThreadedServer(self._app).start()
        return self

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        route = self.routes.get(scope["path"], (404, '{"detail": "Not Found"}'))
        if route == "hang":
            deadline = time.monotonic() + 30
            while not self.release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return  # no reply: the connection closes without one
        status, body = route
        data = body.encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.release.set()
        self.server.stop()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer().start()
    try:
        yield srv
    finally:
        srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_scraper_reports_every_endpoint_and_never_raises(server: MetricsServer):
    server.routes.update({
        "/a/metrics": (200, vllm_text()),
        "/b/metrics": (200, vllm_text(running=(1, 0), waiting=(0, 0), kv=(0.0, 0.5))),
        "/hang/metrics": "hang",
        "/err/metrics": (500, '{"error": {"message": "engine is dead"}}'),
        "/garbage/metrics": (200, "<html><body>a login page</body></html>"),
    })
    base = server.url
    dead = f"http://127.0.0.1:{free_port()}/v1"
    urls = [f"{base}/a/v1", f"{base}/b/v1/", f"{base}/hang", f"{base}/err/v1",
            f"{base}/garbage/v1", dead]
    # Generous for the endpoints that answer (CI's loaded machine once took over 0.5 s to
    # answer all of them), short enough to show the hang is bounded.
    scraper = ServerMetricsScraper(urls, timeout_s=2.0, headers={"Authorization": "Bearer k"})
    try:
        started = time.monotonic()
        first = await scraper.scrape()
        first_done = time.monotonic()
        assert first_done - started < 5.0  # polled concurrently, the hang bounded
        assert [u.url for u in first] == urls
        a, b, hang, err, garbage, gone = first
        assert a.up and (a.running, a.waiting, a.kv_cache_usage) == (3, 3, 0.5)
        assert a.generation_tokens_per_s is None  # one scrape: no rate yet
        assert b.up and b.running == 1 and b.kv_cache_usage == 0.25
        assert not hang.up and hang.error == "timed out after 2s" and hang.running is None
        assert not err.up and err.error == "HTTP 500 from /metrics: engine is dead"
        assert not garbage.up and garbage.error.startswith(
            "bad /metrics reply: not Prometheus exposition text")
        assert not gone.up and gone.error.startswith("ConnectError")
        assert all(h.get("authorization") == "Bearer k" for h in server.headers)

        server.routes["/a/metrics"] = (200, vllm_text(generation=(140, 8), prompt=(300, 20),
                                                      queue_count=(6, 2), queue_sum=(1.5, .25)))
        server.routes["/err/metrics"] = (200, vllm_text())
        second_start = time.monotonic()
        a, b, _, err, *_ = await scraper.scrape()
        second_done = time.monotonic()
        # 100 more tokens over the time between the two scrapes (bounded by what we saw).
        assert 100 / (second_done - started) <= a.generation_tokens_per_s
        assert a.generation_tokens_per_s <= 100 / (second_start - first_done)
        assert a.prompt_tokens_per_s == pytest.approx(2 * a.generation_tokens_per_s)
        assert a.mean_queue_time_s == pytest.approx(0.5)
        assert b.generation_tokens_per_s == 0.0 and b.mean_queue_time_s is None
        assert err.up and err.generation_tokens_per_s is None  # back: no previous scrape

        summary = scraper.summary([a, b, err])
        assert summary == {
            "running": 7, "waiting": 6, "kv_cache_usage": pytest.approx(0.4166667),
            "prompt_tokens_per_s": pytest.approx(a.prompt_tokens_per_s),
            "generation_tokens_per_s": pytest.approx(a.generation_tokens_per_s),
            "mean_queue_time_s": pytest.approx(a.mean_queue_time_s),
            "mean_inference_time_s": None,
            "endpoints_up": 3, "endpoints": 3,
        }
        everything = scraper.summary(await scraper.scrape())
        assert (everything["endpoints_up"], everything["endpoints"]) == (3, 6)
        assert json.dumps([u.to_dict() for u in await scraper.scrape()])
    finally:
        await scraper.aclose()


async def test_scraper_restart_and_changed_endpoints(server: MetricsServer):
    server.routes["/a/metrics"] = (200, vllm_text())
    server.routes["/b/metrics"] = (200, vllm_text())
    a, b = f"{server.url}/a/v1", f"{server.url}/b"
    scraper = ServerMetricsScraper([a, b], timeout_s=2.0)
    try:
        await scraper.scrape()
        server.routes["/a/metrics"] = (200, vllm_text(generation=(2, 0), prompt=(5, 0),
                                                      queue_count=(1, 0)))  # restarted
        util_a, _ = await scraper.scrape()
        assert util_a.up and util_a.running == 3
        assert util_a.generation_tokens_per_s is None and util_a.prompt_tokens_per_s is None
        server.routes["/a/metrics"] = (200, vllm_text(generation=(12, 0), prompt=(5, 0),
                                                      queue_count=(1, 0)))
        util_a, _ = await scraper.scrape()
        assert util_a.generation_tokens_per_s > 0  # counting again from the restart

        scraper.set_urls([a])
        assert [u.url for u in await scraper.scrape()] == [a]
        scraper.set_urls([a, b, a])
        assert scraper.urls == [a, b]
        util_a, util_b = await scraper.scrape()
        assert util_a.generation_tokens_per_s == 0.0
        assert util_b.up and util_b.generation_tokens_per_s is None  # its state was dropped
        await scraper.aclose()
        assert (await scraper.scrape())[0].up  # a new client after aclose
    finally:
        await scraper.aclose()


def test_mean_inference_time_between_two_samples():
    def text(count: float, total: float) -> str:
        return ("# TYPE vllm:request_inference_time_seconds histogram\n"
                f'vllm:request_inference_time_seconds_bucket{{engine="0",le="+Inf"}} {count}\n'
                f'vllm:request_inference_time_seconds_count{{engine="0"}} {count}\n'
                f'vllm:request_inference_time_seconds_sum{{engine="0"}} {total}\n')

    old = parse_vllm_metrics(text(2, 3.0), at=10.0)
    new = parse_vllm_metrics(text(6, 9.0), at=20.0)
    assert (new.inference_time_s_count, new.inference_time_s_sum) == (6, 9.0)
    assert utilization("u", new, old).mean_inference_time_s == pytest.approx(1.5)
    assert utilization("u", new, new).mean_inference_time_s is None
