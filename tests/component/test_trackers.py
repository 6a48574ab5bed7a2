"""A run logged to MLflow (monitoring.tracker): the real client on a local SQLite store in a
temporary directory (no server, no network), read back through MLflow's own client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cua_rollout.core.errors import ConfigError
from cua_rollout.results.trackers import check_tracker, curves, flatten, log_run, summary_metrics
from tests.results_fixtures import RUN_A, make_run

mlflow = pytest.importorskip("mlflow")  # a dev dependency: present wherever tests run


def _run(tmp_path: Path) -> Path:
    run_dir = make_run(tmp_path, "run_a", RUN_A)
    info = json.loads((run_dir / "run.json").read_text())
    info["config"] = {"run": {"name": "run_a"}, "coordinator": {"max_concurrent_episodes": 8},
                      "model": {"endpoints": ["http://m:8000/v1"], "api_key_env": "KEY"}}
    (run_dir / "run.json").write_text(json.dumps(info))
    samples = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for k, s in enumerate(samples):
        s["utilization"] = {"window_s": 10.0, "desktops": 4.0, "actions_per_min": 30.0 + k,
                            "desktop": {"leased": 0.5, "acting": 0.2, "model_wait": 0.25,
                                        "pause": 0.05, "other": 0.0, "resetting": 0.1,
                                        "idle": 0.4},
                            "step_s": {"model": 1.0, "action": 0.3, "pause": 0.1,
                                       "screenshot": 0.05, "overhead": 0.01, "steps": 7}}
        s["model_in_flight_by_endpoint"] = {"http://m:8000/v1": k}  # URLs as keys
        s["model_servers"] = {"endpoints": [{"url": "http://m:8000/v1", "up": True,
                                             "running": k, "generation_tokens_per_s": 10.0 * k}],
                              "summary": {"running": k, "generation_tokens_per_s": 10.0 * k}}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run_dir / "plots").mkdir()
    (run_dir / "plots" / "timeline.png").write_bytes(b"\x89PNG fake")
    return run_dir


# MLflow's own store triggers SQLAlchemy's deprecation warnings when the test reads back.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_run_is_logged_with_params_summary_curves_and_artifacts(tmp_path: Path):
    run_dir = _run(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    run_id = log_run(run_dir, uri=uri, experiment="exp")

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run_a"
    assert run.data.tags["cua.run_dir"] == str(run_dir.absolute())
    assert run.data.params["coordinator.max_concurrent_episodes"] == "8"
    assert run.data.params["model.api_key_env"] == '"KEY"'     # a name, never a secret
    metrics = run.data.metrics
    assert metrics["overall/episodes"] == len(RUN_A)
    assert 0.0 <= metrics["overall/success_rate"] <= 1.0
    assert any(k.startswith("domain/") and k.endswith("/success_rate") for k in metrics)
    # Curves: one point per metrics.jsonl sample, at its elapsed second.
    acting = client.get_metric_history(run_id, "utilization/desktop/acting")
    assert [(m.step, m.value) for m in acting] == [(10 * k, 0.2) for k in range(6)]
    tokens = client.get_metric_history(run_id, "model_servers/summary/generation_tokens_per_s")
    assert sorted((m.step, m.value) for m in tokens) == [(10 * k, 10.0 * k) for k in range(6)]
    assert client.get_metric_history(run_id, "model_servers/endpoints/http___m_8000_v1/running")
    assert client.get_metric_history(run_id, "episodes_done")[-1].value == len(RUN_A)
    assert client.get_metric_history(run_id, "model_in_flight_by_endpoint/http___m_8000_v1")
    # Artifacts beside the store, not in the working directory.
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"run.json", "metrics.jsonl", "summary.json", "plots"} <= names
    assert (tmp_path / "store" / "mlartifacts").is_dir() and not Path("mlruns").exists()
    # A second log of the same directory is a second run of the same experiment.
    again = log_run(run_dir, uri=uri, experiment="exp")
    assert again != run_id and len(client.search_runs(
        [client.get_experiment_by_name("exp").experiment_id])) == 2


def test_pure_pieces_and_a_clear_error_for_an_unknown_tracker():
    assert flatten({"a": {"b": 1, "c": [1, "x"]}, "d": None}) == {
        "a.b": "1", "a.c": '[1, "x"]', "d": "null"}
    assert summary_metrics({"overall": {"episodes": 3, "success_rate": None,
                                        "status_counts": {"success": 2}},
                            "domains": {"os": {"success_rate": 0.5}}}) == {
        "overall/episodes": 3.0, "overall/status/success": 2.0, "domain/os/success_rate": 0.5}
    points = list(curves([{"t": 10.0, "elapsed_s": 2.5, "steps": 4, "draining": False,
                           "waiting": None, "desktops": {"free": 1}},
                          {"elapsed_s": 3.0}]))  # no t: skipped
    assert points == [("steps", 4.0, 2, 10000), ("desktops/free", 1.0, 2, 10000)]
    with pytest.raises(ConfigError, match=r"monitoring\.tracker: unknown tracker 'wandb'"):
        check_tracker("wandb")
