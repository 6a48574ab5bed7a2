"""Helpers and paths shared by the tests of every tier."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent


def unavailable(reason: str) -> None:
    """Skip on a developer machine without the component; fail under CI, where a missing
    component means a missing install step, not a reason to pass."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs it with scripts/setup_env.sh --dev)")
    pytest.skip(reason)


async def until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(poll_s)


@contextlib.contextmanager
def small_filesystem(directory: Path, size_bytes: int) -> Iterator[Path]:
    """A real filesystem of ``size_bytes`` mounted on ``directory`` (a tmpfs), so writes hit
    a real ENOSPC; unmounted on exit. Needs root (CI runs as root)."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        unavailable("a small filesystem needs root to mount a tmpfs")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                             str(directory)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        unavailable(f"cannot mount a tmpfs on {directory}: {result.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@contextlib.asynccontextmanager
async def side_by_side(
    tmp: Path, count: int = 2
) -> AsyncIterator[tuple[Any, list[Any], list[Any]]]:
    """``count`` local desktops of one pool on this host (where apps' ports, names and pkill
    must not cross between desktops), each leased, with a client: ``(pool, leases, envs)``.
    The clients are closed and the pool stopped on leaving."""
    from cua_rollout.config import DesktopsConfig
    from cua_rollout.envs.client import RemoteDesktopEnv
    from cua_rollout.runtime.pool import DesktopPool

    cfg = DesktopsConfig(count=count, warm_spares=0, screen_width=1024, screen_height=768,
                         lease_timeout_s=30, reset_timeout_s=60, setup_timeout_s=60,
                         local={"state_dir": tmp / "desktops", "start_timeout_s": 60})
    pool = DesktopPool(cfg)
    envs: list[Any] = []
    try:
        await pool.start()
        leases = [await pool.lease(f"e{i}") for i in range(count)]
        envs = [RemoteDesktopEnv(lease.url, cfg, name=lease.desktop_id) for lease in leases]
        yield pool, leases, envs
    finally:
        for env in envs:
            await env.close()
        await pool.stop()


async def run_recorded(runner: Any, storage: Any, spec: Any) -> Any:
    """Run ``spec`` on ``runner`` as the coordinator dispatches and records it: a nonce of
    the dispatch, then (unless cancelled) its results line, which moves the files the
    runner staged into the episode's directory. Returns the result."""
    import dataclasses
    import uuid

    from cua_rollout.core.layout import staging_name

    spec = dataclasses.replace(spec, nonce=uuid.uuid4().hex[:12])
    result = await runner.run_episode(spec)
    if result.status != "cancelled":
        await storage.record_result(result.record(),
                                    staging_name(spec.episode_id, spec.attempt, spec.nonce))
    await storage.flush()
    return result


async def release_and_check(pool: Any, leases: list[Any], timeout_s: float = 30.0) -> None:
    """Release ``leases`` and wait for their resets; every reset must pass its check."""
    for lease in leases:
        await pool.release(lease.lease_id)
    deadline = time.monotonic() + timeout_s
    while pool.stats()["free"] < len(pool.stats(detail=True)["desktops"]):
        assert time.monotonic() < deadline, "the resets did not finish"
        await asyncio.sleep(0.1)
    stats = pool.stats(detail=True)
    assert stats["verify_failures"] == 0, [d["last_error"] for d in stats["desktops"]]


def require_vlm_serving() -> None:
    """vLLM and the isolated torchvision that vision-language replicas need."""
    import importlib.util

    from cua_rollout.config import load_config
    from cua_rollout.model.fleet.launch import vlm_cpu_site

    if importlib.util.find_spec("vllm") is None:
        unavailable("vLLM is not installed")
    pool = load_config(REPO_ROOT / "configs" / "demo_vlm.yaml").model_pool
    if not (vlm_cpu_site(pool) / "torchvision").is_dir():
        unavailable("torchvision for vision-language replicas is not installed "
                    "(scripts/setup_env.sh --vlm)")


def desktop_image(profile: str = "demo") -> str:
    """The desktop image of ``profile``, built (or found up to date) by the build script."""
    import shutil

    if shutil.which("podman") is None:
        unavailable("podman is not installed (scripts/setup_env.sh --containers)")
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "build_desktop_image.sh"),
                           "--profile", profile], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def run_py_command(config: Path, output_dir: Path, *sets: str) -> list[str]:
    """``run.py`` as a user runs it on ``config``, its results under ``output_dir``, without
    the dashboard, a metrics sample a second, and ``sets`` (``key=value``) after."""
    import sys

    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", str(config),
            "--set", f"run.output_dir={output_dir}", "--set", "ray.include_dashboard=false",
            "--set", "monitoring.metrics_interval_s=1"]
    for s in sets:
        args += ["--set", s]
    return args


@contextlib.contextmanager
def slow_scripted_policy(config: str | os.PathLike[str], sets: list[str], latency_s: float
                         ) -> Iterator[list[str]]:
    """The scripted policy that ``model.scripted`` would serve for ``config`` with ``sets``,
    served from this process with ``latency_s`` per reply (a run's config has no such knob):
    yields the ``--set`` items pointing run.py at it instead."""
    from cua_rollout.config import load_config
    from cua_rollout.runtime.launch import scripted_policy_server

    with contextlib.chdir(REPO_ROOT):  # the config's relative task paths, as run.py sees them
        server = scripted_policy_server(load_config(config, sets), latency_s=latency_s)
    with server:
        yield ["model.scripted=false", f"model.endpoints={json.dumps([server.url])}"]


def get_json(url: str, token: str | None = None) -> tuple[int, Any]:
    """GET ``url`` (with ``token`` as a bearer token): the status and the JSON body, for an
    error status too."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def run_results(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's results.jsonl."""
    import json

    return [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]


def assert_every_episode_succeeded(run_dir: Path, tasks: list[str], rollouts: int = 2
                                   ) -> list[dict[str, Any]]:
    """Each task's ``rollouts`` episodes recorded once, every one a success; the records."""
    results = run_results(run_dir)
    assert sorted((r["task_id"], r["rollout"]) for r in results) == sorted(
        (t, k) for t in tasks for k in range(rollouts))
    assert {r["status"] for r in results} == {"success"}, [
        (r["task_id"], r["status"], r["error"]) for r in results]
    return results


class ProbeWindow:
    """The running probe app (tests/apps/probe_window.py): its JSON-lines log of X events, and
    its control channel on stdin (clear, sync, focus)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path,
                 stderr_path: Path | None = None, *, timeout_s: float = 10.0) -> None:
        self.proc = proc
        self.log_path = log_path
        self.stderr_path = stderr_path
        self.timeout_s = timeout_s
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""
        self._commands = 0

    def _read(self) -> None:
        with open(self.log_path, "rb") as log:
            log.seek(self._offset)
            data = log.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        self.events.extend(json.loads(line) for line in lines if line.strip())

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        what: str,
        *,
        start: int = 0,
        timeout_s: float | None = None,
    ) -> int:
        """Index of the first event from ``start`` on that satisfies ``predicate``."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        scanned = start
        while True:
            self._read()
            for i in range(scanned, len(self.events)):
                if predicate(self.events[i]):
                    return i
            scanned = max(scanned, len(self.events))
            if self.proc.poll() is not None:
                stderr = (self.stderr_path.read_text(errors="replace")
                          if self.stderr_path is not None else "(not kept)")
                pytest.fail(f"probe window exited ({self.proc.returncode}) while waiting for "
                            f"{what}; stderr:\n{stderr}")
            if time.monotonic() >= deadline:
                pytest.fail(f"no {what} within {timeout_s} s; last events: {self.events[-8:]}")
            time.sleep(0.01)

    def settle(self, start: int, releases: int) -> int:
        """Sync with the window once ``releases`` button releases since ``start`` have arrived;
        the index of the final "synced" answer.

        A sync alone covers only what the X server has delivered: a window manager that grabs
        clicks synchronously (openbox's stock click-to-focus) makes the server hold a click,
        and the pointer events after it, until it replays them, which can be after the sync.
        """
        end = self.command("sync")
        if releases:
            self.wait_for_count(lambda e: e["event"] == "release", releases, "releases", start)
            end = self.command("sync")
        return end

    def wait_for_count(
        self, predicate: Callable[[dict[str, Any]], bool], count: int, what: str, start: int
    ) -> int:
        """Index of the ``count``-th event from ``start`` on that satisfies ``predicate``."""
        index = start - 1
        for _ in range(count):
            index = self.wait_for(predicate, f"{count} {what}", start=index + 1)
        return index

    def command(self, name: str) -> int:
        """Send a control command and return the index of the probe's answer to it."""
        self._commands += 1
        n = self._commands
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{name} {n}\n".encode())
        self.proc.stdin.flush()
        answer = {"clear": "cleared", "sync": "synced", "focus": "focused"}[name]
        return self.wait_for(lambda e: e["event"] == answer and e.get("n") == n, f"{answer} {n}")

    def text_after(self, start: int, expected: str) -> None:
        """Wait for the text widget to hold ``expected`` (an event from ``start`` on)."""
        self.wait_for(lambda e: e["event"] == "text" and e["text"] == expected,
                      f"text {expected!r}", start=start)

    def errors(self) -> list[dict[str, Any]]:
        self._read()
        return [e for e in self.events if e["event"] == "error"]


def vm_test_guest():
    """The tiny QEMU guest of the VM tests (``tests.doubles.vm_guest``), built or found in
    its cache; the test is unavailable where QEMU or what the guest is built from is missing."""
    import shutil

    from tests.doubles.vm_guest import build_test_guest

    for tool in ("qemu-system-x86_64", "qemu-img", "cpio", "dpkg-deb"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/setup_env.sh --vm)")
    if not Path("/bin/busybox").exists():
        unavailable("busybox-static is not installed (scripts/setup_env.sh --vm)")
    return build_test_guest()


def qemu_children(parent: int | None = None) -> list[Any]:
    """The live QEMU processes under ``parent`` (this process), by their command line: QEMU
    names its process ``cua-vm`` (``-name ...,process=``), so ``name()`` does not show it."""
    import psutil

    found = []
    for proc in psutil.Process(parent).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and Path(
                    (proc.cmdline() or [""])[0]).name.startswith("qemu-system"):
                found.append(proc)
    return found


def kill_qemu_children() -> list[int]:
    """Kill the live QEMU processes under this process, so none is left for the next test;
    their pids (a test's teardown asserts there were none)."""
    import psutil

    left = qemu_children()
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return [p.pid for p in left]


async def release_and_lease(pool: Any, lease: Any, rounds: int) -> tuple[Any, list[float]]:
    """Give ``lease`` back and lease again, ``rounds`` times (each a reset of the desktop);
    the last lease and the seconds each round took."""
    took = []
    for round_ in range(rounds):
        t0 = time.monotonic()
        await pool.release(lease.lease_id)
        lease = await pool.lease(f"after-{round_}")
        took.append(time.monotonic() - t0)
    return lease, took
