"""The desktops of a run, for an operator: list them and act on one, on a live run, without
stopping it; or, with no run alive, list and sweep what a provider left behind.

    python scripts/desktops.py status --config C [--json]      # every desktop of the run
    python scripts/desktops.py release DESKTOP --config C      # take back a stuck lease
    python scripts/desktops.py quarantine DESKTOP --config C   # out of service (replaced)
    python scripts/desktops.py remove DESKTOP --config C       # stop it; another takes its place
    python scripts/desktops.py sweep --config C                # remove desktops of dead runs
    python scripts/desktops.py serve --config C                # the desktop service
    python scripts/desktops.py status --service URL [--token-env NAME]   # a service's desktops

A live run is found by its pool's Ray actors (``desktops:<run.name>``, or
``desktops:<run.name>/<shard>`` for each shard of a sharded pool, in ``ray.namespace``, on
the cluster at ``ray.address`` or the one the run's run.json names): ``status`` lists every
shard's desktops, an action goes to the shard that holds the desktop. Without one,
``status`` lists what the provider shows (containers by label, pods by label with their
heartbeat, local desktops by their state files). ``release`` quarantines the desktop rather
than resetting it under its episode: the episode fails at its next call and is retried on
another desktop (an infra_error).

``serve`` runs the desktop service (``cua_rollout/service/``, docs/desktop_service.md) on the
config's desktops until SIGTERM / SIGINT. ``--service URL`` points ``status``, ``release``,
``quarantine`` and ``remove`` at such a service instead of a run, with the operator's token
from the variable ``--token-env`` names (default ``CUA_SERVICE_TOKEN``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from cua_rollout.config import Config, add_config_arguments, config_from_args
from cua_rollout.core.errors import ConfigError, DesktopError, RolloutError
from cua_rollout.core.files import read_json
from cua_rollout.core.layout import RUN_FILE
from cua_rollout.runtime.pool_shards import PoolShards, ShardedPool, find_run_shards

__all__ = ["main"]

T = TypeVar("T")

# The variable holding a desktop service's operator token, unless --token-env names another.
_SERVICE_TOKEN_ENV = "CUA_SERVICE_TOKEN"

_COLUMNS = ("id", "state", "tenant", "owner", "lease_age_s", "leases", "failures", "url",
            "provider", "last_error")


def _live_pool(cfg: Config) -> PoolShards | None:
    """The run's pool shards, or None when no run of that name is alive."""
    import ray

    # The run's own cluster (run.json says where it is): "auto" could find another
    # cluster of this host.
    info = read_json(cfg.run_dir / RUN_FILE) or {}
    if info and info.get("status") != "running":
        return None  # that run ended (its cluster with it)
    address = cfg.ray.address or info.get("ray_address")
    if not address:
        # No run.json naming its cluster (and no ray.address): no live run of this run
        # directory. "auto" would attach to any cluster of this host, and a run of another
        # directory with the same name there would be taken for this one.
        return None
    try:
        ray.init(address=address, namespace=cfg.ray.namespace, logging_level="ERROR",
                 log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError):
        return None
    return find_run_shards(cfg.run.name)


def _offline_rows(cfg: Config) -> list[dict[str, Any]]:
    """What the provider shows without a live pool."""
    provider = cfg.desktops.provider
    if provider == "container":
        import subprocess

        from cua_rollout.envs.providers.container import ContainerProvider

        engine = ContainerProvider(cfg.desktops).engine
        out = subprocess.run([engine, "ps", "-a", "--filter", "label=cua.desktop", "--format",
                              "{{.ID}}\t{{.Label \"cua.desktop\"}}\t{{.Status}}\t"
                              "{{.Label \"cua.run\"}}\t{{.Ports}}"],
                             capture_output=True, text=True, check=True).stdout
        rows = []
        for line in out.splitlines():
            cid, desktop, status, run, ports = (line.split("\t") + [""] * 5)[:5]
            rows.append({"id": desktop, "state": status, "owner": run, "url": ports,
                         "provider": {"container": cid}})
        return rows
    if provider == "kubernetes":
        return asyncio.run(_with_kubernetes(cfg, "list_pods"))
    if provider == "local":
        rows = []
        for session in sorted(Path(cfg.desktops.local.state_dir).glob("*/session.json")):
            data = json.loads(session.read_text())
            rows.append({"id": session.parent.name, "state": "running (no live pool)",
                         "url": data.get("url"), "provider": {"pids": data.get("pids")}})
        return rows
    return [{"id": url, "state": "given by URL", "url": url}
            for url in cfg.desktops.static.urls]


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no desktops"
    columns = _COLUMNS
    if len({r.get("shard") for r in rows}) > 1:  # a sharded pool: which shard holds each
        columns = (_COLUMNS[0], "shard", *_COLUMNS[1:])
    cells = [[str(r.get(c) if r.get(c) is not None else "-") for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
              for row in cells]
    return "\n".join(lines)


async def _with_kubernetes(cfg: Config, act: str) -> Any:
    """``list_pods`` or ``sweep`` of the Kubernetes provider, its client closed after."""
    from cua_rollout.envs.providers.kubernetes import KubernetesProvider

    provider = KubernetesProvider(cfg.desktops)
    try:
        return await getattr(provider, act)()
    finally:
        await provider.close()


def _sweep(cfg: Config) -> list[str]:
    if cfg.desktops.provider == "kubernetes":
        return asyncio.run(_with_kubernetes(cfg, "sweep"))
    if cfg.desktops.provider == "container":
        from cua_rollout.envs.providers.container import ContainerProvider

        return asyncio.run(ContainerProvider(cfg.desktops).sweep())
    if cfg.desktops.provider == "local":
        from cua_rollout.envs.local_session import sweep_stale_sessions

        return sweep_stale_sessions(cfg.desktops.local.state_dir)
    return []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from cua_rollout.service.serve import main as serve

        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="scripts/desktops.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["status", "release", "quarantine", "remove",
                                            "sweep", "serve"])
    parser.add_argument("desktop", nargs="?", help="the desktop's id (release, quarantine, "
                        "remove)")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    add_config_arguments(parser, required=False)  # a run's
    parser.add_argument("--service", metavar="URL", help="a desktop service instead of a run")
    parser.add_argument("--token-env", default=_SERVICE_TOKEN_ENV, metavar="NAME",
                        help="--service: the variable holding the operator's token (default "
                        f"{_SERVICE_TOKEN_ENV})")
    args = parser.parse_args(argv)
    acts = args.command in ("release", "quarantine", "remove")
    if acts != (args.desktop is not None):
        parser.error(f"{args.command} " + ("needs a desktop id" if acts
                                           else "takes no desktop id"))
    if args.service is not None:
        if args.command == "sweep":
            parser.error("sweep is for a provider's leftovers: use --config, not --service")
        return _on_service(args)
    if args.config is None:
        parser.error("--config (or --service URL) is required")
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "sweep":
        removed = _sweep(cfg)
        print(f"removed {len(removed)} desktop(s) of runs that are gone"
              + (": " + ", ".join(removed) if removed else ""))
        return 0
    # A cluster run.py started authenticates with this user's token (Ray's token mode); a
    # driver that only connects uses it when told so before Ray is imported.
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    pool = _live_pool(cfg)
    if args.command == "status":
        rows = _ask(pool, ShardedPool.describe) if pool is not None else _offline_rows(cfg)
        if args.json:
            print(json.dumps({"live": pool is not None, "desktops": rows}, indent=1))
        else:
            print(f"run {cfg.run.name}: " + ("live" if pool is not None else
                                             "no live run; what the provider shows"))
            print(_table(rows))
        return 0
    if pool is None:
        print(f"no live run named {cfg.run.name!r} in namespace {cfg.ray.namespace!r}",
              file=sys.stderr)
        return 1
    method = {"release": ShardedPool.release_desktop, "quarantine": ShardedPool.quarantine,
              "remove": ShardedPool.remove}[args.command]
    try:
        print(_ask(pool, lambda client: method(client, args.desktop)))
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, RolloutError) else exc
        print(f"error: {cause}", file=sys.stderr)
        return 1
    except DesktopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _on_service(args: argparse.Namespace) -> int:
    """``status`` / ``release`` / ``quarantine`` / ``remove`` on a desktop service."""
    from cua_rollout.envs.service_client import DesktopServiceClient, ServiceError

    token = os.environ.get(args.token_env)
    if not token:
        print(f"--token-env names ${args.token_env}, which is not set (the service's "
              "operator token)", file=sys.stderr)
        return 2

    async def ask() -> Any:
        async with DesktopServiceClient(args.service, token, timeout_s=60) as client:
            if args.command == "status":
                return await client.desktops()
            return await client.desktop_action(args.desktop, args.command)

    try:
        reply = asyncio.run(ask())
    except (ServiceError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.command != "status":
        print(reply.result)
        return 0
    rows = [row.model_dump() for row in reply.desktops]
    if args.json:
        print(json.dumps({"live": True, "service": args.service, "desktops": rows}, indent=1))
    else:
        print(f"desktop service {args.service}")
        print(_table(rows))
    return 0


def _ask(pool: PoolShards, question: Callable[[ShardedPool], Awaitable[T]]) -> T:
    """One question to the live pool's shards, awaited (their errors raised as ``ray.get``
    raises them: a ``RayTaskError`` that is also its cause)."""

    async def answer() -> T:
        return await question(ShardedPool(pool))

    return asyncio.run(answer())


if __name__ == "__main__":
    raise SystemExit(main())
