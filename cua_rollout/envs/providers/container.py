"""The ``container`` provider: desktops as containers of the desktop image
(``scripts/build_desktop_image.sh``) on podman or docker, through the engine's CLI.

Each desktop is one container (``run -d``) with CPU and memory limits, its server's port
published on ``desktops.container.publish_host`` (a free port the engine picks), and labels:
``cua.desktop`` (its id), ``cua.run`` (the pool's process: host, pid and start time) and
``cua.owner`` (the user). Reset is in place, by the server (the ``builtin`` reset of the static
provider: new windows closed, new processes ended, HOME restored from the first state); a
desktop that fails its reset or its verification is removed and a new container started (the
pool replaces it). At the first start, containers of runs whose process is gone from this host
are removed (by label, never by name). ``stop`` removes the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import os
import secrets
import shutil
import subprocess
import time

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError, DesktopError
from cua_rollout.core.http import reachable_host
from cua_rollout.envs.providers.base import (
    LABEL_DESKTOP,
    LABEL_OWNER,
    LABEL_RUN,
    Desktop,
    DesktopProvider,
    bring_up,
    builtin_reset,
    run_is_gone,
    run_label,
    server_answers,
    wait_serving,
)

__all__ = ["ContainerProvider"]

log = logging.getLogger(__name__)

SERVER_PORT = 5000            # the image's CUA_DESKTOP_PORT
_TOKEN_VAR = "CUA_DESKTOP_TOKEN"  # the image's CUA_DESKTOP_TOKEN_ENV
_ENGINE_TIMEOUT_S = 60.0
_POLL_S = 0.1


class ContainerProvider(DesktopProvider):
    """Desktops as containers of the desktop image on podman or docker."""

    replaceable = True

    def __init__(self, cfg: DesktopsConfig) -> None:
        self.cfg = cfg
        self.ccfg = cfg.container
        self.engine = self._engine()
        self.run = run_label()
        self._token: str | None = None
        self._flags: list[str] | None = None
        self._containers: dict[str, str] = {}  # desktop id -> container id
        self._swept = False
        self.stale_removed: list[str] = []

    def _engine(self) -> str:
        name = self.ccfg.engine
        if name == "auto":
            name = "podman" if shutil.which("podman") else "docker"
        path = shutil.which(name)
        if path is None:
            raise ConfigError(f"desktops.container.engine: {name} is not installed "
                              "(bash scripts/setup_env.sh --containers installs podman)")
        return path

    # ----------------------------------------------------------------- engine calls

    async def _cli(self, *args: str, timeout_s: float = _ENGINE_TIMEOUT_S,
                   env: dict[str, str] | None = None) -> str:
        """Run the engine's CLI in a thread (not an asyncio subprocess: an event loop in a
        thread of a Ray actor may never see its child exit); its stdout. ``DesktopError``
        with its stderr when it fails or overruns ``timeout_s``."""
        command = os.path.basename(self.engine)
        try:
            done = await asyncio.to_thread(
                subprocess.run, [self.engine, *args], stdin=subprocess.DEVNULL,
                capture_output=True, timeout=timeout_s, env=env, check=False)
        except subprocess.TimeoutExpired:
            raise DesktopError(f"{command} {args[0]} timed out after {timeout_s:g} s") from None
        if done.returncode != 0:
            problem = done.stderr.decode(errors="replace").strip()[-500:]
            raise DesktopError(f"{command} {' '.join(args[:2])} failed ({done.returncode}): "
                               f"{problem}")
        return done.stdout.decode().strip()

    async def _run_flags(self) -> list[str]:
        """Flags every ``run`` needs on this engine: podman on cgroups v1 needs runc and
        explicit ulimits (its default crun refuses hybrid cgroups)."""
        if self._flags is None:
            flags: list[str] = []
            runtime = self.ccfg.runtime
            if os.path.basename(self.engine) == "podman":
                flags += ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]
                if runtime is None:
                    version = await self._cli("info", "--format", "{{.Host.CgroupsVersion}}")
                    runtime = "runc" if version == "v1" and shutil.which("runc") else None
            if runtime:
                flags += ["--runtime", runtime]
            self._flags = flags
        return self._flags

    # ----------------------------------------------------------------- lifecycle

    async def start(self, index: int) -> Desktop:
        if not self._swept:
            self._swept = True
            self.stale_removed = await self.sweep()
            if self.stale_removed:
                log.warning("removed containers of runs that are gone: %s",
                            ", ".join(self.stale_removed))
        desktop_id = f"ctr-{os.getpid()}-{index}-{secrets.token_hex(2)}"
        started = time.monotonic()
        name = f"cua-{desktop_id}"
        # --no-healthcheck: the pool checks health itself, and podman runs an image's check
        # through systemd timers, which a host without systemd does not have.
        args = ["run", "-d", "--name", name, "--no-healthcheck", *await self._run_flags(),
                "--label", f"{LABEL_DESKTOP}={desktop_id}", "--label", f"{LABEL_RUN}={self.run}",
                "--label", f"{LABEL_OWNER}={getpass.getuser()}",
                "-e", f"SCREEN_WIDTH={self.cfg.screen_width}",
                "-e", f"SCREEN_HEIGHT={self.cfg.screen_height}",
                "-e", f"CUA_DESKTOP_ID={desktop_id}",
                "-p", f"{self.ccfg.publish_host}::{SERVER_PORT}"]
        env = dict(os.environ)
        token = os.environ.get(self.cfg.token_env) if self.cfg.token_env else None
        if token:
            env[_TOKEN_VAR] = token
            args += ["-e", _TOKEN_VAR]  # its value from the CLI's environment, not argv
        else:
            # Published on loopback only: reachable from this host, as a local desktop is.
            args += ["-e", "CUA_DESKTOP_INSECURE_NO_TOKEN=1"]
        if self.ccfg.cpus is not None:
            args += ["--cpus", f"{self.ccfg.cpus:g}"]
        if self.ccfg.memory is not None:
            args += ["--memory", self.ccfg.memory]
        if self.ccfg.network is not None:
            args += ["--network", self.ccfg.network]
        args += [*self.ccfg.extra_args, self.ccfg.image]
        try:
            container = await self._cli(*args, env=env)
        except BaseException:
            # It may have started though the CLI failed or timed out: remove it by its name.
            with contextlib.suppress(Exception):
                await self._cli("rm", "-f", "-t", "0", name, timeout_s=30)
            raise
        self._containers[desktop_id] = container

        async def serving() -> Desktop:
            mapped = await self._cli("port", container, f"{SERVER_PORT}/tcp")
            host_port = mapped.splitlines()[0].rsplit(":", 1)[1]
            url = f"http://{reachable_host(self.ccfg.publish_host)}:{host_port}"
            desktop = Desktop(id=desktop_id, url=url, info={"container": container[:12]})
            await self._wait_serving(desktop, started)
            return desktop

        return await bring_up(self, self.cfg, desktop_id, started, serving)

    async def _wait_serving(self, desktop: Desktop, started: float) -> None:
        async def gone() -> str | None:
            if await self._running(desktop.id):
                return None
            return f"the container exited; its log ends:\n{await self._logs(desktop.id)}"

        async def late() -> str:
            return (f" ({self.ccfg.start_timeout_s:g} s); the container's log ends:\n"
                    f"{await self._logs(desktop.id)}")

        await wait_serving(self.cfg, desktop, started + self.ccfg.start_timeout_s,
                           gone=gone, late=late, poll_s=_POLL_S)

    async def _logs(self, desktop_id: str) -> str:
        container = self._containers.get(desktop_id)
        if container is None:
            return ""
        try:  # the container's stdout and stderr, interleaved
            done = await asyncio.to_thread(
                subprocess.run, [self.engine, "logs", "--tail", "20", container],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"(no log: {exc})"
        return done.stdout.decode(errors="replace").strip()

    async def _running(self, desktop_id: str) -> bool:
        container = self._containers.get(desktop_id)
        if container is None:
            return False
        try:
            state = await self._cli("inspect", "--format", "{{.State.Running}}", container,
                                    timeout_s=15)
        except DesktopError:
            return False
        return state.strip().lower() == "true"

    async def reset(self, desktop: Desktop) -> None:
        started = time.monotonic()
        if not await self._running(desktop.id):
            raise DesktopError(f"{desktop.id}: the container is not running")
        await builtin_reset(self.cfg, desktop)
        desktop.info["last_reset"] = {"how": "in place", "seconds": time.monotonic() - started}

    async def stop(self, desktop: Desktop) -> None:
        container = self._containers.pop(desktop.id, None)
        if container is not None:
            await self._cli("rm", "-f", "-t", "2", container, timeout_s=30)

    async def health(self, desktop: Desktop) -> bool:
        return await self._running(desktop.id) and await server_answers(self.cfg, desktop)

    async def sweep(self) -> list[str]:
        """Remove the desktop containers of runs whose process is gone from this host (by
        their ``cua.run`` label); the ids of what was removed."""
        out = await self._cli("ps", "-a", "--filter", f"label={LABEL_RUN}", "--format",
                              "{{.ID}} {{.Labels}}")
        removed = []
        for line in out.splitlines():
            container, _, labels = line.partition(" ")
            run = _label(labels, LABEL_RUN)
            if run and run_is_gone(run):
                with contextlib.suppress(DesktopError):
                    await self._cli("rm", "-f", "-t", "0", container, timeout_s=30)
                    removed.append(_label(labels, LABEL_DESKTOP) or container)
        return removed

    def container_id(self, desktop_id: str) -> str | None:
        """The engine's id of a desktop's container (None: not one of this provider's)."""
        return self._containers.get(desktop_id)


def _label(labels: str, key: str) -> str | None:
    """A label's value from the engine's ``{{.Labels}}`` text (``map[k:v k2:v2]`` from podman
    and docker's Go templates, or ``k=v,k2=v2``)."""
    text = labels.strip()
    if text.startswith("map[") and text.endswith("]"):
        for item in text[4:-1].split(" "):
            k, _, v = item.partition(":")
            if k == key:
                return v
        return None
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict):
            return data.get(key)
    for item in text.split(","):
        k, _, v = item.partition("=")
        if k == key:
            return v
    return None
