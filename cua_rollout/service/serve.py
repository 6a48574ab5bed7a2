"""Start the desktop service and stop it cleanly: the pool's desktops (any provider; the
local and container providers sweep what a dead earlier instance left), the service, its
app under uvicorn; on SIGTERM / SIGINT every lease ends (lease tokens cleared), then the
pool stops its desktops.

    cua-rollout desktops serve --config C [--set k=v ...]
    python -m cua_rollout.service --config C
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from cua_rollout.config import Config, add_config_arguments, config_from_args
from cua_rollout.core.errors import ConfigError, RolloutError
from cua_rollout.core.http import reachable_host
from cua_rollout.runtime.pool import DesktopPool
from cua_rollout.service.app import create_app
from cua_rollout.service.core import DesktopService
from cua_rollout.service.relay import Relay
from cua_rollout.service.tenants import AddressAllowList, Tenants

__all__ = ["check_service_config", "main", "serve", "service_pool_config"]

log = logging.getLogger(__name__)

# The pool's own reclaiming of leases stays out of the way: the service's lease_ttl_s (no
# heartbeat) decides when a lease ends. A year.
_POOL_LEASE_MAX_S = 365 * 24 * 3600.0


def check_service_config(cfg: Config) -> None:
    """What serving needs beyond the schema: tenants, and a desktop token for direct access."""
    if not cfg.service.tenants:
        raise ConfigError("service.tenants is empty: name at least one tenant (name, "
                          "token_env, max_leases)")
    if cfg.service.default_access == "direct" and cfg.desktops.token_env is None:
        raise ConfigError(
            "service.default_access is direct: set desktops.token_env (the desktops' own "
            "token; each lease gets a token of its own beside it), or service.default_access: "
            "relay")


def service_pool_config(cfg: Config) -> Config:
    """``cfg`` with the pool's lease reclaiming out of the way of the service's expiry."""
    desktops = cfg.desktops.model_copy(update={"lease_max_s": _POOL_LEASE_MAX_S})
    return cfg.model_copy(update={"desktops": desktops})


async def serve(cfg: Config, *, ready: asyncio.Event | None = None) -> None:
    """Run the service until SIGTERM / SIGINT (uvicorn's handlers), then stop it."""
    import uvicorn

    check_service_config(cfg)
    cfg = service_pool_config(cfg)
    tenants = Tenants.from_config(cfg.service)
    allow = AddressAllowList(cfg.service.allow)
    pool = DesktopPool(cfg.desktops)
    log.info("starting %d %s desktop(s)", pool.target_size(), cfg.desktops.provider)
    await pool.start()
    service = DesktopService(cfg, pool, tenants)
    relay = Relay(service.metrics, cfg.desktops.request_timeout_s)
    try:
        await service.start()
        app = create_app(service, allow, relay)
        server = uvicorn.Server(uvicorn.Config(
            app, host=cfg.service.host, port=cfg.service.port, log_level="warning",
            lifespan="off", timeout_graceful_shutdown=5, interface="asgi3"))
        # uvicorn's own handlers raise the signal again once it stops serving, which would
        # end the process before the leases and desktops are stopped: ours only stop it.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, _stop_serving, server, signum)
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if serving.done():
            await serving  # uvicorn could not bind: its error
            raise ConfigError(f"service.host/port {cfg.service.host}:{cfg.service.port}: "
                              "cannot serve there")
        port = server.servers[0].sockets[0].getsockname()[1]
        # One line a supervisor (or a test) reads: where the service answers.
        print(f"desktop service on http://{reachable_host(cfg.service.host)}:{port} "
              f"(boot {service.table.boot}, {pool.target_size()} desktop(s))", flush=True)
        if ready is not None:
            ready.set()
        await serving
    finally:
        log.info("stopping: ending %d lease(s), stopping the desktops", len(service.table))
        await service.stop()
        await relay.close()
        await pool.stop()


def _stop_serving(server: Any, signum: int) -> None:
    if server.should_exit:  # a second signal: stop now, without the graceful wait
        server.force_exit = True
    log.info("%s: stopping", signal.Signals(signum).name)
    server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cua-rollout desktops serve",
                                     description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    try:
        asyncio.run(serve(cfg))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
