"""The rollout_* metrics through a real Ray: an actor updates every metric of
cua_rollout/runtime/monitoring.py, and the node's metrics agent (its Prometheus endpoint, the one
Prometheus scrapes) must then export every series the Grafana dashboard queries, under the
names ``exported_names`` gives, with the run's label."""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
import ray

from cua_rollout.runtime.monitoring import METRICS, Metrics, exported_names
from tests.support import REPO_ROOT
from tests.unit.test_grafana_dashboard import DASHBOARD, FULL_SAMPLE, METRIC_NAME

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "test-run"
# Workers report to the agent every metrics_report_interval_ms (10 s by default); 1 s here.
REPORT_INTERVAL_MS = 1000
DEADLINE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_port() -> Iterator[int]:
    # Workers import the project from the repository.
    old_path = os.environ.get("PYTHONPATH")
    paths = [str(REPO_ROOT), *filter(None, (old_path or "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    try:
        ray.init(num_cpus=1, include_dashboard=False, namespace="test-metrics-export",
                 logging_level="WARNING", _metrics_export_port=port,
                 _system_config={"metrics_report_interval_ms": REPORT_INTERVAL_MS})
        try:
            yield ray._private.worker.global_worker.node.metrics_export_port
        finally:
            ray.shutdown()
    finally:
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


class _Emitter:
    """An actor that updates every rollout metric once, as a runner and the coordinator do."""

    def __init__(self, run: str) -> None:
        self.metrics = Metrics(True, run=run)

    def emit(self, sample: dict) -> bool:
        m = self.metrics
        for i in range(3):
            m.step(0.2 * (i + 1), 0.5, 0.01)
        m.episode("success", "chrome")
        m.episode("infra_error", "os")
        m.retry()
        m.sample(sample)
        return m.enabled


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _series(text: str) -> dict[str, list[str]]:
    """Series name -> its sample lines (comments left out)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            out.setdefault(re.split(r"[{ ]", line, maxsplit=1)[0], []).append(line)
    return out


def test_every_series_of_the_dashboard_is_exported(metrics_port):
    assert metrics_port > 0
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queried = {name for panel in dashboard["panels"] for t in panel.get("targets", [])
               for name in METRIC_NAME.findall(t["expr"])}
    every = {s for name in METRICS for s in exported_names(name)}
    assert queried <= every

    emitter = ray.remote(num_cpus=0)(_Emitter).remote(RUN)
    assert ray.get(emitter.emit.remote(FULL_SAMPLE), timeout=60) is True

    deadline = time.monotonic() + DEADLINE_S
    series: dict[str, list[str]] = {}
    while time.monotonic() < deadline:
        series = _series(_scrape(metrics_port))
        if every <= series.keys():
            break
        time.sleep(1)
    missing = sorted(every - series.keys())
    assert not missing, f"not exported within {DEADLINE_S:g}s: {missing}"
    # Nothing else is exported under the rollout's names (e.g. no gauge twin of a counter).
    assert {s for s in series if s.startswith("ray_rollout_")} == every

    for name in every:
        for line in series[name]:
            assert f'run="{RUN}"' in line, line
            assert 'SessionName="session_' in line, line
    assert any('status="success"' in line and 'domain="chrome"' in line and line.endswith(" 1.0")
               for line in series["ray_rollout_episodes_total"])
    assert any(line.endswith(" 3.0") for line in series["ray_rollout_steps_total"])
    assert any('le="+Inf"' in line and line.endswith(" 3.0")
               for line in series["ray_rollout_step_model_seconds_bucket"])
    assert any('endpoint="http://a:8000/v1"' in line and 'kind="prompt"' in line
               and line.endswith(" 900.0")
               for line in series["ray_rollout_model_server_tokens_per_second"])
    assert any('state="model_wait"' in line and line.endswith(" 0.3")
               for line in series["ray_rollout_desktop_utilization"])
    ray.kill(emitter)
