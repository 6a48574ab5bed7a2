"""deploy/grafana/rollout-dashboard.json against cua_rollout/runtime/monitoring.py, without
Grafana: the
JSON's structure (ids, positions, variables), every query's syntax at the level of brackets,
every metric it names is one Ray exports for a declared metric, every declared metric is
shown, every query is filtered by the run. And the metrics outside Ray: ``Metrics`` is a
no-op, ``sample_values`` turns any sample (partial, None, malformed) into gauge values
without raising, and the breakdown gauges fall to 0 when a state or endpoint disappears.
(tests/integration/test_ray_metrics_export.py checks the names on a real Ray.)"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

import pytest

from cua_rollout.runtime.monitoring import (
    DESKTOP_STATES,
    METRICS,
    PREFIX,
    STEP_PHASES,
    Metrics,
    Value,
    exported_names,
    sample_values,
)
from tests.support import REPO_ROOT

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "rollout-dashboard.json"
METRIC_NAME = re.compile(r"\bray_rollout_[A-Za-z0-9_]+")
RUN_FILTER = 'run=~"$run"'
BRACKETS = {"(": ")", "[": "]", "{": "}"}

FULL_SAMPLE: dict[str, Any] = {
    "desktops": {"free": 1, "leased": 2, "resetting": 0, "quarantined": 0, "starting": 0},
    "episodes_in_flight": 2,
    "episodes_queued": 5,
    "model_in_flight_by_endpoint": {"http://a:8000/v1": 1, "http://b:8000/v1": 0},
    "success_rate": 0.5,
    "utilization": {
        "window_s": 30.0, "desktops": 3.0,
        "desktop": {"leased": 0.6, "acting": 0.2, "model_wait": 0.3, "pause": 0.05,
                    "other": 0.05, "resetting": 0.1, "idle": 0.3},
        "actions_per_min": 42.0,
        "step_s": {"model": 1.5, "action": 0.2, "pause": 0.5, "screenshot": 0.1,
                   "overhead": 0.05, "steps": 12},
    },
    "model_servers": {
        "endpoints": [
            {"url": "http://a:8000/v1", "up": True, "error": None, "running": 2, "waiting": 1,
             "kv_cache_usage": 0.25, "prompt_tokens_per_s": 900.0,
             "generation_tokens_per_s": 120.0, "mean_queue_time_s": 0.02,
             "mean_inference_time_s": 1.1},
            {"url": "http://b:8000/v1", "up": False, "error": "refused", "running": None,
             "waiting": None, "kv_cache_usage": None, "prompt_tokens_per_s": None,
             "generation_tokens_per_s": None, "mean_queue_time_s": None,
             "mean_inference_time_s": None},
        ],
        "summary": {"running": 2, "waiting": 1, "endpoints_up": 1, "endpoints": 2},
    },
    "fleet": {"replicas": {"serving": 2, "starting": 1}, "restarts": 3, "reloads": 1},
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row's panels
    return out


def _exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target."""
    return [(p["title"], t.get("expr", "")) for p in _panels(dashboard)
            for t in p.get("targets", [])]


def _balanced(expr: str) -> bool:
    stack: list[str] = []
    in_string = False
    for i, ch in enumerate(expr):
        if in_string:
            if ch == '"' and expr[i - 1] != "\\":
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in BRACKETS:
            stack.append(BRACKETS[ch])
        elif ch in BRACKETS.values() and (not stack or stack.pop() != ch):
            return False
    return not stack and not in_string


# ----------------------------------------------------------------- the dashboard


def test_dashboard_structure(dashboard):
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        pos = p["gridPos"]
        assert {"x", "y", "w", "h"} <= pos.keys(), p["title"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert {t["refId"] for t in p["targets"]} == {
                chr(65 + i) for i in range(len(p["targets"]))}, p["title"]


def test_dashboard_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("run", "SessionName"):
        query = variables[name]["query"]["query"]
        assert query.startswith("label_values(ray_rollout_") and query.endswith(f", {name})")
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        (metric,) = METRIC_NAME.findall(query)
        assert any(metric in exported_names(n) for n in METRICS), metric
    assert 'SessionName=~"$SessionName"' in variables["run"]["query"]["query"]


def test_every_query_is_well_formed_and_filtered_by_run(dashboard):
    exprs = _exprs(dashboard)
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert expr.strip(), title
        assert _balanced(expr), (title, expr)
        assert RUN_FILTER in expr, (title, expr)
        # Each metric's own selector has the filter, not only some other part of the query.
        for match in METRIC_NAME.finditer(expr):
            rest = expr[match.end():]
            assert rest.startswith("{"), (title, expr)
            selector = rest[: rest.index("}") + 1]
            assert RUN_FILTER in selector and 'SessionName=~"$SessionName"' in selector, (
                title, expr)


def test_every_metric_queried_is_exported_and_every_metric_is_shown(dashboard):
    exported = {series: name for name in METRICS for series in exported_names(name)}
    used: set[str] = set()
    for title, expr in _exprs(dashboard):
        for series in METRIC_NAME.findall(expr):
            assert series in exported, f"{title}: {series} is not exported by any metric"
            used.add(exported[series])
    assert set(METRICS) - used == set(), "metrics no panel shows"


# ----------------------------------------------------------------- the registry


def test_registry_and_exported_names():
    assert METRICS and all(name.startswith(PREFIX) for name in METRICS)
    assert set(METRICS.values()) == {"counter", "gauge", "histogram"}
    assert exported_names(PREFIX + "steps") == ["ray_rollout_steps_total"]
    assert exported_names(PREFIX + "episodes_in_flight") == ["ray_rollout_episodes_in_flight"]
    assert exported_names(PREFIX + "step_model_seconds") == [
        "ray_rollout_step_model_seconds_bucket", "ray_rollout_step_model_seconds_sum",
        "ray_rollout_step_model_seconds_count"]
    every = [s for name in METRICS for s in exported_names(name)]
    assert len(every) == len(set(every))
    with pytest.raises(KeyError):
        exported_names("rollout_nope")


def test_every_gauge_is_set_by_a_full_sample_and_nothing_else():
    values = sample_values(FULL_SAMPLE)
    names = {v.name for v in values}
    assert names == {n for n, kind in METRICS.items() if kind == "gauge"}
    for v in values:
        assert isinstance(v.value, float) and all(isinstance(t, str) for t in v.tags.values())
        assert "run" not in v.tags
    by_key = {(v.name, tuple(sorted(v.tags.items()))): v.value for v in values}
    assert by_key[(PREFIX + "model_server_up", (("endpoint", "http://a:8000/v1"),))] == 1.0
    assert by_key[(PREFIX + "model_server_up", (("endpoint", "http://b:8000/v1"),))] == 0.0
    assert by_key[(PREFIX + "model_server_tokens_per_second",
                   (("endpoint", "http://a:8000/v1"), ("kind", "generation")))] == 120.0
    assert by_key[(PREFIX + "model_server_requests",
                   (("endpoint", "http://a:8000/v1"), ("state", "waiting")))] == 1.0
    assert by_key[(PREFIX + "desktop_utilization", (("state", "model_wait"),))] == 0.3
    assert by_key[(PREFIX + "step_phase_seconds", (("phase", "screenshot"),))] == 0.1
    assert by_key[(PREFIX + "fleet_replicas", (("state", "starting"),))] == 1.0
    assert by_key[(PREFIX + "fleet_restarts", ())] == 3.0
    assert by_key[(PREFIX + "actions_per_minute", ())] == 42.0
    # The down endpoint's unknown measures are skipped, not exported as 0.
    assert not any(v.tags.get("endpoint") == "http://b:8000/v1"
                   and v.name != PREFIX + "model_server_up"
                   and v.name != PREFIX + "model_in_flight" for v in values)
    states = {v.tags["state"] for v in values if v.name == PREFIX + "desktop_utilization"}
    assert states == set(DESKTOP_STATES)
    phases = {v.tags["phase"] for v in values if v.name == PREFIX + "step_phase_seconds"}
    assert phases == set(STEP_PHASES)


@pytest.mark.parametrize("sample", [
    None, {}, [], "text", {"utilization": None, "model_servers": None, "fleet": None},
    {"utilization": {"desktop": None, "step_s": None, "actions_per_min": None}},
    {"utilization": {"desktop": {"idle": "lots", "acting": float("nan")}, "step_s": [1, 2]}},
    {"model_servers": {"endpoints": None}}, {"model_servers": {"endpoints": [None, 3, {}]}},
    {"model_servers": {"endpoints": [{"url": 5, "up": True}, {"url": "u"}]}},
    {"fleet": {"replicas": None, "restarts": None, "reloads": "2"}},
    {"desktops": [1, 2], "episodes_in_flight": None, "success_rate": float("inf")},
])
def test_partial_samples_never_raise(sample):
    values = sample_values(sample)
    assert all(isinstance(v, Value) for v in values)
    assert values == []
    Metrics(enabled=False).sample(sample)


def test_partial_sample_keeps_what_is_there():
    values = sample_values({"utilization": {"actions_per_min": 7, "step_s": {"model": 2}},
                            "fleet": {"restarts": 0}})
    assert values == [Value(PREFIX + "actions_per_minute", {}, 7.0),
                      Value(PREFIX + "step_phase_seconds", {"phase": "model"}, 2.0),
                      Value(PREFIX + "fleet_restarts", {}, 0.0)]


# ----------------------------------------------------------------- Metrics outside Ray


def test_metrics_outside_ray_are_a_no_op():
    for enabled in (False, True):  # True outside a Ray worker is disabled too
        metrics = Metrics(enabled, run="r")
        assert not metrics.enabled and metrics.run == "r"
        metrics.step(1.0, 2.0, -0.5)
        metrics.episode("success", "chrome")
        metrics.retry()
        metrics.sample(FULL_SAMPLE)
    assert Metrics().run == "run" and Metrics(run=None).run == "run"


class _FakeMetric:
    def __init__(self) -> None:
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def set(self, value: float, tags: dict[str, str]) -> None:
        if value == 666:
            raise ValueError("refused")
        self.values[tuple(sorted(tags.items()))] = value


def test_breakdowns_fall_to_zero_when_a_series_disappears():
    metrics = Metrics(False, run="r")
    metrics.enabled = True  # as in a Ray worker, with fakes for Ray's gauges
    fakes: defaultdict[str, _FakeMetric] = defaultdict(_FakeMetric)
    metrics._metrics = fakes
    metrics.sample({"fleet": {"replicas": {"starting": 2}}, "desktops": {"free": 1}})
    metrics.sample({"fleet": {"replicas": {"serving": 2}}})
    replicas = fakes[PREFIX + "fleet_replicas"].values
    assert replicas == {(("state", "starting"),): 0.0, (("state", "serving"),): 2.0}
    # A sample without the section leaves the last values alone.
    assert fakes[PREFIX + "desktops"].values == {(("state", "free"),): 1.0}
    metrics.sample({"fleet": {"replicas": {}}, "desktops": {}})
    assert set(replicas.values()) == {0.0}
    assert fakes[PREFIX + "desktops"].values == {(("state", "free"),): 0.0}
    # A value Ray refuses is skipped; the others are set.
    metrics.sample({"episodes_queued": 666, "episodes_in_flight": 3})
    assert fakes[PREFIX + "episodes_in_flight"].values == {(): 3.0}
