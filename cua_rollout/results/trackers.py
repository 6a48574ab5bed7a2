"""A run's summary and curves, logged to an experiment tracker (MLflow; off by default).

``log_run(run_dir, ...)`` reads what the run wrote (run.json, results.jsonl through
``summarize``, metrics.jsonl) and logs one tracker run:

- params: the run's config, flattened (``coordinator.max_concurrent_episodes`` ...; it is
  the config as run.json keeps it, URLs redacted, secrets only as the names of their
  environment variables);
- metrics: the summary (``overall/success_rate``, ``overall/avg_at_k``, status counts,
  ``domain/<d>/success_rate`` ...) and, as curves over the run's elapsed seconds, every
  metrics.jsonl figure: progress, desktops, the utilization split, actions/min, the step
  split and the model servers' load;
- artifacts: run.json, metrics.jsonl, the summary as JSON, and the plots directory if any.

run.py calls it at the end of a run when ``monitoring.tracker`` is set. MLflow is optional
(``pip install '.[trackers]'``: the lean ``mlflow-skinny`` client and ``alembic`` for a
local SQLite store); nothing else here needs it. A local store (``sqlite:///path/mlflow.db``)
works with no server and no network; its artifacts go beside the database.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cua_rollout.core.errors import ConfigError
from cua_rollout.core.files import read_json
from cua_rollout.core.layout import METRICS_FILE, RUN_FILE
from cua_rollout.results.runs import load_run, read_metrics
from cua_rollout.results.summary import summarize

__all__ = ["TRACKERS", "check_tracker", "curves", "flatten", "log_run", "summary_metrics"]

TRACKERS = ("mlflow",)
_BATCH = 1000          # MLflow's limit of metrics per log_batch call
_PARAM_CHARS = 6000    # MLflow's limit of a param value


def check_tracker(tracker: str) -> None:
    """Raise ``ConfigError`` naming the setting when ``tracker`` cannot be used here."""
    if tracker not in TRACKERS:
        raise ConfigError(f"monitoring.tracker: unknown tracker {tracker!r} "
                          f"(known: none, {', '.join(TRACKERS)})")
    try:
        import alembic  # noqa: F401 — a local SQLite store needs it
        import mlflow  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"monitoring.tracker: mlflow is not installed ({exc}); install the "
                          "'trackers' extra: pip install '.[trackers]'") from None


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as ``a.b.c`` -> value text (lists and scalars as JSON)."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(data)[:_PARAM_CHARS]}


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The run's figures as ``name -> number``: overall, feasible, per domain and group."""
    out: dict[str, float] = {}

    def rates(name: str, r: dict[str, Any]) -> None:
        for key in ("episodes", "scored_episodes", "tasks", "solved_tasks", "success_rate",
                    "avg_at_k", "pass_at_k", "mean_steps", "mean_duration_s"):
            if _number(r.get(key)):
                out[f"{name}/{key}"] = float(r[key])
        for status, count in (r.get("status_counts") or {}).items():
            out[f"{name}/status/{status}"] = float(count)

    for section in ("overall", "feasible", "infeasible"):
        if summary.get(section):
            rates(section, summary[section])
    for kind in ("domains", "groups"):
        for name, r in (summary.get(kind) or {}).items():
            rates(f"{kind.removesuffix('s')}/{name}", r)
    return out


def curves(samples: list[dict[str, Any]]) -> Iterator[tuple[str, float, int, int]]:
    """Every number of every metrics.jsonl sample as (key, value, step, timestamp_ms); the
    step is the sample's elapsed second, keys follow the sample's nesting
    (``utilization/desktop/acting``, ``model_servers/summary/generation_tokens_per_s``)."""
    for sample in samples:
        elapsed, t = sample.get("elapsed_s"), sample.get("t")
        if not (_number(elapsed) and _number(t)):
            continue
        for key, value in _numbers(sample, ""):
            if key not in ("t", "elapsed_s"):
                yield key, value, int(elapsed), int(t * 1000)


def log_run(run_dir: Path, *, uri: str, experiment: str = "cua-rollout",
            run_name: str | None = None, tracker: str = "mlflow") -> str:
    """Log ``run_dir`` to the tracker at ``uri`` under ``experiment``; returns the tracker's
    run id. Raises ``ConfigError`` if the tracker is missing, the tracker's own errors
    otherwise (the caller reports them: the run's files are what count)."""
    check_tracker(tracker)
    with warnings.catch_warnings():
        # MLflow's store uses SQLAlchemy and alembic APIs they have deprecated: not ours
        # to act on, and not the user's.
        warnings.simplefilter("ignore", DeprecationWarning)
        return _log_mlflow(Path(run_dir), uri, experiment, run_name)


def _log_mlflow(run_dir: Path, uri: str, experiment: str, run_name: str | None) -> str:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    info = read_json(run_dir / RUN_FILE)
    info = info if isinstance(info, dict) else {}
    loaded = load_run(run_dir)
    summary = summarize(loaded) if loaded.episodes else None
    samples, _ = read_metrics(run_dir)

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(
        experiment, artifact_location=_local_artifacts(uri))
    name = run_name or str(info.get("run") or run_dir.name)
    tags = {"cua.run_dir": str(run_dir.absolute()), "cua.status": str(info.get("status"))}
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    run_id = run.info.run_id
    status = "FAILED"
    try:
        params = flatten(info.get("config") or {})
        _batches(client, run_id, params=[Param(k, v) for k, v in params.items()])
        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, 0) for k, v in
                   (summary_metrics(summary) if summary else {}).items()]
        metrics += [Metric(k, v, ts, step) for k, v, step, ts in curves(samples or [])]
        _batches(client, run_id, metrics=metrics)
        client.log_batch(run_id, tags=[RunTag("cua.episodes", str(len(loaded.episodes)))])
        for path in (run_dir / RUN_FILE, run_dir / METRICS_FILE):
            if path.is_file():
                client.log_artifact(run_id, str(path))
        if summary is not None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "summary.json"
                path.write_text(json.dumps(summary, indent=1), encoding="utf-8")
                client.log_artifact(run_id, str(path))
        plots = run_dir / "plots"
        if plots.is_dir():
            client.log_artifacts(run_id, str(plots), artifact_path="plots")
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status=status)
    return run_id


def _batches(client: Any, run_id: str, *, params: list[Any] | None = None,
             metrics: list[Any] | None = None) -> None:
    for items, key in ((params or [], "params"), (metrics or [], "metrics")):
        for i in range(0, len(items), _BATCH):
            client.log_batch(run_id, **{key: items[i:i + _BATCH]})


def _local_artifacts(uri: str) -> str | None:
    """Beside a local SQLite store, so its runs' files do not land in the working
    directory (MLflow's default, ``./mlruns``); a server decides for itself."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).absolute().parent
                / "mlartifacts").as_uri()
    return None


def _numbers(data: Any, prefix: str) -> Iterator[tuple[str, float]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers(value, f"{prefix}{_key(str(key))}/")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            # A list of endpoints: name each by its url when it has one.
            label = value.get("url") if isinstance(value, dict) else None
            yield from _numbers(value, f"{prefix}{_key(label) if label else i}/")
    elif _number(data):
        yield prefix.rstrip("/"), float(data)


def _key(text: str) -> str:
    """A metric-name-safe form of a key (an endpoint's URL: ``http___m_8000_v1``)."""
    return "".join(c if c.isalnum() or c in "_-. " else "_" for c in text)


def _number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))

