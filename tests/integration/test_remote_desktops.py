"""``desktops.provider: remote`` with ``kind: gui-docker-env`` against the GUI-Docker-Env
stand-in (tests/doubles/gui_docker_env.py: their manager's API, each emulator a real local
desktop): a desktop's own ports reach its client and OSWorld's evaluator bridge, a reset is
a new emulator, a full quota is waited out, a refused token stops the start, a failed start
falls through to the next manager, an emulator gone behind our back is replaced, and every
exit path stops what was started; then the demo end to end through run.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.desktop.actions import WORKER_FILE
from cua_rollout.envs.local_session import MARKER, SESSION_FILE, sweep_stale_sessions
from cua_rollout.envs.providers.remote import RemoteProvider
from cua_rollout.envs.service_client import DesktopServiceClient
from cua_rollout.runtime.desktop_episode import open_leased_desktop
from cua_rollout.runtime.pool import DesktopPool
from tests.doubles.gui_docker_env import GuiDockerEnvManager
from tests.support import (
    REPO_ROOT,
    assert_every_episode_succeeded,
    run_py_command,
    run_results,
    slow_scripted_policy,
    until,
)

pytestmark = [pytest.mark.integration]

TOKEN_VAR = "CUA_TEST_GDE_TOKEN"
RUN_TIMEOUT_S = 900


@pytest.fixture
def token(monkeypatch) -> str:
    monkeypatch.setenv(TOKEN_VAR, "alpha")
    return "alpha"


@pytest.fixture
def manager(tmp_path, token):
    with GuiDockerEnvManager(tmp_path / "gde", {token: 2, "other": 1}) as m:
        yield m


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch) -> Path:
    """Each test's own record of the emulators it holds (desktops.remote.state_dir)."""
    monkeypatch.setattr(sys.modules[__name__], "LEDGER", tmp_path / "ledger")
    return tmp_path / "ledger"


LEDGER = Path("unset")


def _cfg(*urls: str, **kw) -> DesktopsConfig:
    remote = {"kind": "gui-docker-env", "urls": list(urls), "token_env": TOKEN_VAR,
              "wait_s": 3, "start_timeout_s": 120, "state_dir": str(LEDGER),
              **kw.pop("remote", {})}
    base = dict(provider="remote", count=1, warm_spares=0, screen_width=1280,
                screen_height=720, lease_timeout_s=60, reset_timeout_s=120,
                health_interval_s=0.5, remote=remote)
    base.update(kw)
    return DesktopsConfig(**base)


async def test_an_emulator_is_a_desktop_with_its_own_ports_and_a_reset_is_a_new_one(manager):
    pool = DesktopPool(_cfg(manager.url))
    await pool.start()
    try:
        lease = await pool.lease("e0")
        [first] = manager.running()
        emu = manager.emulators[first]
        assert lease.access is not None and lease.access.chromium_port == emu.chromium_port
        assert lease.url == f"http://127.0.0.1:{emu.server_port}"
        env = open_leased_desktop(lease, pool.cfg)
        try:
            shot = await env.observe()
            assert shot.size == (1280, 720)
            address = env.address()  # what OSWorld's evaluator code is given
            assert (address.url, address.chromium_port, address.vlc_port) == (
                lease.url, emu.chromium_port, emu.vlc_port)
            reply = await env.execute(["bash", "-c", "echo left > ~/left.txt"])
            assert reply["returncode"] == 0
        finally:
            await env.close()
        await pool.release(lease.lease_id)
        await until(lambda: pool.stats()["free"] == 1, 120, 0.1)
        [second] = manager.running()
        assert second != first  # given back and a new one taken
        again = await pool.lease("e1")
        env = open_leased_desktop(again, pool.cfg)
        try:
            assert await env.get_file("/home/user/left.txt") is None
        finally:
            await env.close()
        await pool.release(again.lease_id)
    finally:
        await pool.stop()
    assert manager.running() == [] and manager.stopped == manager.starts >= 2


async def test_a_full_quota_is_waited_out_and_the_pool_refills(manager, token):
    manager.tokens[token] = 1
    pool = DesktopPool(_cfg(manager.url, count=2))
    await pool.start()  # one desktop now; the other start was refused (429) past wait_s
    try:
        assert len(manager.running()) == 1 and manager.refusals >= 1
        assert pool.stats()["free"] == 1
        manager.tokens[token] = 2
        manager.usage[token]["limit"] = 2  # what their /set_token_limit does
        await until(lambda: len(manager.running()) == 2, 240, 0.2)  # the refill, backoff
        await until(lambda: pool.stats()["free"] == 2, 60, 0.1)
    finally:
        await pool.stop()
    assert manager.running() == []


async def test_a_refused_token_stops_the_start_with_the_key_named(manager, monkeypatch):
    monkeypatch.setenv(TOKEN_VAR, "nobody")
    pool = DesktopPool(_cfg(manager.url))
    with pytest.raises(ConfigError, match=r"desktops\.remote\.token_env.*403"):
        await pool.start()
    await pool.stop()
    monkeypatch.delenv(TOKEN_VAR)
    with pytest.raises(ConfigError, match=f"desktops.remote.token_env names \\${TOKEN_VAR}"):
        RemoteProvider(_cfg(manager.url))


async def test_a_failed_start_falls_through_to_the_next_manager(manager, tmp_path, token):
    with GuiDockerEnvManager(tmp_path / "second", {token: 1}) as second:
        manager.fail_next_starts = 5
        provider = RemoteProvider(_cfg(manager.url, second.url))
        desktop = await provider.start(0)
        try:
            assert manager.running() == [] and len(second.running()) == 1
            assert manager.usage[token]["current"] == 0  # their rollback
            assert desktop.info["manager"] == second.url
        finally:
            await provider.stop(desktop)
            await provider.close()
        assert second.running() == []


async def test_an_emulator_stopped_behind_our_back_is_replaced(manager, token):
    pool = DesktopPool(_cfg(manager.url))
    await pool.start()
    try:
        [first] = manager.running()
        async with __import__("httpx2").AsyncClient() as http:
            r = await http.delete(f"{manager.url}/emulators/{first}",
                                  headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200
        await until(lambda: manager.running() not in ([], [first]), 240, 0.2)
        await until(lambda: pool.stats()["free"] == 1, 60, 0.1)
        assert pool.counters["quarantined"] >= 1
    finally:
        await pool.stop()
    assert manager.running() == []


async def test_a_reset_cut_by_its_deadline_gives_back_what_it_brings_later(manager):
    provider = RemoteProvider(_cfg(manager.url))
    desktop = await provider.start(0)
    task = asyncio.create_task(provider.reset(desktop))
    await until(lambda: manager.boots == 2, 60, 0.01)
    task.cancel()  # the pool's reset deadline, while the new emulator boots
    with pytest.raises(asyncio.CancelledError):
        await task
    await provider.close()  # waits for the late start and stops what it brought
    assert manager.starts == manager.stopped == 2
    assert manager.running() == [] and manager.usage["alpha"]["current"] == 0


# A run of its own that holds one emulator until it is killed (its pool's provider).
_HOLDER = """
import asyncio, json, sys, time
from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.providers.remote import RemoteProvider

async def main():
    provider = RemoteProvider(DesktopsConfig(**json.loads(sys.argv[1])))
    desktop = await provider.start(0)
    print(desktop.info["emulator_id"], flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _holder(cfg: DesktopsConfig, holders: list[subprocess.Popen[str]]
            ) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, cfg.model_dump_json()],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    holders.append(proc)
    assert proc.stdout is not None
    emulator_id = proc.stdout.readline().strip()
    assert emulator_id, f"the holder ended with {proc.wait(60)}"
    return proc, emulator_id


async def test_emulators_of_a_run_killed_with_sigkill_are_stopped_by_the_next_run(
        manager, token, ledger):
    """GUI-Docker-Env never expires an emulator: the next run's start stops those a dead run
    of this machine recorded (their quota is freed before it takes its own), and leaves a
    live run's alone; what cannot be stopped now keeps its record for later."""
    manager.tokens[token] = 3
    cfg = _cfg(manager.url)
    holders: list[subprocess.Popen[str]] = []
    try:
        dead, dead_id = _holder(cfg, holders)
        _, live_id = _holder(cfg, holders)
        dead.kill()  # SIGKILL: nothing of it runs to stop its emulator
        dead.communicate(timeout=30)
        assert sorted(manager.running()) == sorted([dead_id, live_id])
        assert len(list(ledger.glob("*.json"))) == 2
        (ledger / "junk.json").write_text("[1, 2]")  # not a record: named, left alone

        provider = RemoteProvider(cfg)
        desktop = await provider.start(0)
        try:
            assert provider.backend.stale_stopped == [dead_id]
            assert sorted(manager.running()) == sorted([live_id, desktop.info["emulator_id"]])
            assert len(list(ledger.glob("*.json"))) == 3  # live, ours, the junk
        finally:
            await provider.stop(desktop)
            await provider.close()
        assert manager.running() == [live_id]
    finally:
        for proc in holders:
            proc.kill()
            proc.communicate(timeout=30)
    # The manager cannot be reached: the dead run's record stays for a later run.
    manager.stop()
    provider = RemoteProvider(cfg)
    assert await provider.backend.sweep() == []
    await provider.close()
    assert len(list(ledger.glob("*.json"))) == 2  # the live run (now dead) and the junk


def test_the_demo_through_run_py_on_gui_docker_env_emulators(tmp_path, token):
    """The demo as users run it, its desktops emulators of the stand-in. Another
    client holds one of the token's two slots while the run starts and its first episodes
    run: the run's second desktop is refused (429) until that client stops its emulator,
    then the pool's refill gets it. Every episode is scored as on local desktops, a full
    quota is never an episode's failure, and no emulator is left after the run."""
    # Two tasks of each app (an infeasible one among them): every reset is a new emulator,
    # so the whole demo here took 134 s of CI; the whole demo runs on our service below (and
    # ran 36/36 against their own server.py: docs/remote_desktops.md).
    tasks = ["terminal-hello-file", "terminal-wifi-infeasible", "editor-save-new-file",
             "editor-uppercase", "calc-add", "calc-sqrt"]
    run_dir = tmp_path / "results" / "demo"
    with GuiDockerEnvManager(tmp_path / "gde", {token: 2}) as manager:
        auth = {"Authorization": f"Bearer {token}"}
        other = httpx.post(f"{manager.url}/start_emulator", headers=auth, timeout=120).json()
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config",
                str(REPO_ROOT / "configs" / "demo.yaml")]
        for s in (f"run.output_dir={tmp_path / 'results'}", "desktops.provider=remote",
                  "desktops.remote.kind=gui-docker-env",
                  f"desktops.remote.urls={json.dumps([manager.url])}",
                  f"desktops.remote.token_env={TOKEN_VAR}", "desktops.remote.wait_s=5",
                  f"desktops.remote.state_dir={LEDGER}",
                  "ray.include_dashboard=false", f"tasks.task_ids={json.dumps(tasks)}"):
            args += ["--set", s]
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, TOKEN_VAR: token})
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            results = run_dir / "results.jsonl"
            while not (results.exists() and len(results.read_text().splitlines()) >= 2):
                assert proc.poll() is None, "the run ended early"
                assert time.monotonic() < deadline
                time.sleep(0.5)
            assert manager.refusals >= 1  # the run's second desktop: refused so far
            httpx.delete(f"{manager.url}/emulators/{other['data']['emulator_id']}",
                         headers=auth, timeout=60)
            _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        records = assert_every_episode_succeeded(run_dir, tasks)
        assert all(r["desktop"].startswith("remote-") for r in records)
        # The refill's desktop (the next index) ran episodes too, beside the first one.
        assert len({r["desktop"] for r in records}) == 2
        assert manager.running() == [], "emulators left after the run"
        assert manager.starts == manager.stopped
    assert not list(Path(tmp_path / "gde").glob("*/session.json"))


# --------------------------------------------------------------------------- kind: cua

TENANT_VAR = "CUA_TEST_TENANT_TOKEN"
OPERATOR_VAR = "CUA_TEST_OPERATOR_TOKEN"
DEMO = REPO_ROOT / "configs" / "demo.yaml"
DESKTOP_VAR = "CUA_TEST_DESKTOP_TOKEN"


def _serve(tmp_path: Path, env: dict[str, str], *, port: int = 0, ttl_s: float = 15
           ) -> tuple[subprocess.Popen[str], str]:
    """Our desktop service on 2 local desktops (state dir ``tmp_path/svc-desktops``), as a
    subprocess: it and its URL. The same ``tmp_path`` and ``port`` again: the same service
    restarted, its sweep removing what a killed earlier instance left."""
    config = tmp_path / "service.yaml"
    config.write_text(
        "desktops: {provider: local, count: 2, warm_spares: 0, screen_width: 1280,\n"
        f"  screen_height: 720, token_env: {DESKTOP_VAR},\n"
        f"  local: {{state_dir: {tmp_path / 'svc-desktops'}}}}}\n"
        f"service: {{port: {port}, lease_ttl_s: {ttl_s}, operator_token_env: {OPERATOR_VAR},\n"
        f"  tenants: [{{name: run, token_env: {TENANT_VAR}, max_leases: 2}}]}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "cua_rollout.service", "--config",
                             str(config)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("desktop service on "), (line, proc.stderr.read()[-3000:]
                                                     if proc.poll() is not None else "")
    return proc, line.split()[3]


def _stop(service: subprocess.Popen[str]) -> None:
    if service.poll() is None:
        service.send_signal(signal.SIGTERM)
    service.communicate(timeout=120)


def _service_env() -> dict[str, str]:
    return {**os.environ, TENANT_VAR: "tenant-secret", DESKTOP_VAR: "desktop-secret",
            OPERATOR_VAR: "operator-secret"}


def _status(url: str) -> dict[str, Any]:
    """The operator's /status: every lease, every desktop."""
    return httpx.get(url + "/status", headers={"Authorization": "Bearer operator-secret"},
                     timeout=10).json()


def _lease_ends(url: str, why: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer operator-secret"},
                     timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cua_service_lease_ends_total{")
               and 'tenant="run"' in line and f'why="{why}"' in line)


def _desktop_processes(state_dir: Path) -> dict[tuple[int, float], str]:
    """Every process of the local desktops recorded under ``state_dir``, by (pid, start
    time): the desktop's id for its machinery (what session.json records and what those
    spawned, and the server's action interpreter: what a reset keeps), ``<id>+app`` for an
    app (tagged with the desktop's id, or the server's child: what a reset kills)."""
    found: dict[tuple[int, float], str] = {}
    for path in state_dir.glob(f"*/{SESSION_FILE}"):
        state = json.loads(path.read_text())
        machinery: set[int] = set()
        for e in state["processes"]:
            with contextlib.suppress(psutil.Error):
                core = psutil.Process(e["pid"])
                machinery.add(core.pid)
                if "cua_rollout.desktop.server" not in core.cmdline():
                    machinery |= {c.pid for c in core.children(recursive=True)}
                    continue
                for child in core.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if child.ppid() == core.pid and str(WORKER_FILE) in child.cmdline():
                            machinery.add(child.pid)
                        else:
                            found[(child.pid, child.create_time())] = state["id"] + "+app"
        for proc in psutil.process_iter(["pid", "create_time"]):
            with contextlib.suppress(psutil.Error):
                key = (proc.pid, proc.info["create_time"])
                if proc.pid in machinery:
                    found[key] = state["id"]
                elif proc.environ().get(MARKER) == state["id"]:
                    found[key] = state["id"] + "+app"
    return found


def _alive(pid: int, create_time: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return (abs(proc.create_time() - create_time) < 0.01
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _cua_run(url: str, tmp_path: Path, tasks: list[str], *extra: str) -> list[str]:
    return run_py_command(
        DEMO, tmp_path / "results", "desktops.provider=remote", "desktops.remote.kind=cua",
        f"desktops.remote.urls={json.dumps([url])}", f"desktops.remote.token_env={TENANT_VAR}",
        "desktops.remote.wait_s=10", f"tasks.task_ids={json.dumps(tasks)}", *extra)


def _wait_results(run: subprocess.Popen[Any], run_dir: Path, count: int,
                  also: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ((count == 0 or ((run_dir / "results.jsonl").exists()
                               and len(run_results(run_dir)) >= count)) and also()):
        assert run.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


def test_the_demo_through_run_py_on_leases_of_our_desktop_service(tmp_path):
    """run.py with ``kind: cua`` against the real service (a subprocess on local desktops):
    the whole demo (every task once), every episode scored, and when the run has ended the
    service holds no lease of it."""
    tasks = [json.loads(p.read_text())["id"]
             for p in sorted((REPO_ROOT / "tasks" / "demo" / "examples").glob("*/*.json"))]
    env = _service_env()
    service, url = _serve(tmp_path, env)
    try:
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config",
                str(REPO_ROOT / "configs" / "demo.yaml")]
        for s in (f"run.output_dir={tmp_path / 'results'}", "desktops.provider=remote",
                  "desktops.remote.kind=cua", f"desktops.remote.urls={json.dumps([url])}",
                  f"desktops.remote.token_env={TENANT_VAR}", "ray.include_dashboard=false",
                  f"tasks.task_ids={json.dumps(tasks)}", "tasks.rollouts_per_task=1"):
            args += ["--set", s]
        done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, env={**env, DESKTOP_VAR: ""})
        assert done.returncode == 0, done.stderr[-4000:]
        records = assert_every_episode_succeeded(tmp_path / "results" / "demo", tasks,
                                                 rollouts=1)
        assert all(r["desktop"].startswith("remote-") for r in records)
        status = httpx.get(url + "/status", headers={"Authorization": "Bearer tenant-secret"},
                           timeout=10).json()
        assert not status.get("leases"), status
    finally:
        service.send_signal(signal.SIGTERM)
        service.communicate(timeout=120)
    assert not list((tmp_path / "svc-desktops").glob("*/session.json"))


def _run_tree(pid: int, seen: list[psutil.Process]) -> list[psutil.Process]:
    """``seen`` plus the processes of the run started as ``pid`` (driver, Ray, workers),
    looked for while it lives: Ray's processes are re-parented once their parent dies."""
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        known = {(p.pid, p.create_time()) for p in seen}
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if (proc.pid, proc.create_time()) not in known:
                    seen.append(proc)
    return seen


def test_a_run_killed_with_sigkill_leaves_leases_that_expire_and_are_lent_again(tmp_path):
    """kill -9 of a run (its driver, Ray and workers) while its episodes run on two leases:
    the heartbeats stop, both leases expire at the service (``lease_ttl_s``, not a release),
    the desktops are reset (the apps the run's episodes started on them are gone, by pid)
    and lent again: another client of the tenant leases both."""
    tasks = ["terminal-hello-file", "calc-divide-keyboard", "editor-save-new-file",
             "calc-add"]
    env = _service_env()
    service, url = _serve(tmp_path, env, ttl_s=6)
    run_dir, state_dir = tmp_path / "results" / "demo", tmp_path / "svc-desktops"
    tree: list[psutil.Process] = []
    try:
        desktops = {d["id"] for d in _status(url)["desktops"]}
        assert len(desktops) == 2
        with slow_scripted_policy(DEMO, [f"tasks.task_ids={json.dumps(tasks)}"],
                                  latency_s=0.5) as slow:
            run = subprocess.Popen(_cua_run(url, tmp_path, tasks, *slow), cwd=REPO_ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**env, DESKTOP_VAR: ""}, start_new_session=True)
            try:
                before: dict[tuple[int, float], str] = {}

                def busy() -> bool:  # holding both desktops, an app of an episode open
                    before.clear()
                    before.update(_desktop_processes(state_dir))
                    return (len(_run_tree(run.pid, tree) and _status(url)["leases"]) == 2
                            and any(t.endswith("+app") for t in before.values()))

                _wait_results(run, run_dir, 1, busy)  # mid-run: an episode recorded
                core = [(e["pid"], e["create_time"])  # the desktops' own processes
                        for path in state_dir.glob(f"*/{SESSION_FILE}")
                        for e in json.loads(path.read_text())["processes"]]
                os.killpg(run.pid, signal.SIGKILL)
                for proc in _run_tree(run.pid, tree):
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                run.wait()
                # What the dead run held (a reset between giving a lease back and taking
                # the next could have been cut between the two: one or two leases).
                held = {e["env_id"] for e in _status(url)["leases"]}
                released = _lease_ends(url, "released")
            finally:
                for proc in tree:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
        assert len(run_results(run_dir)) < 2 * len(tasks), "the run ended before the kill"
        assert not [p.pid for p in tree if _alive(p.pid, p.create_time())]

        assert held, "the run held no lease at the kill"
        asyncio.run(until(lambda: not _status(url)["leases"], 120, 0.5))
        # Each ended: by its expiry, or by a release the run sent just before it died (still
        # in transit at the snapshot); expiry ended at least one.
        expired = _lease_ends(url, "expired")
        assert expired >= 1 and expired + _lease_ends(url, "released") - released >= len(held)

        async def lease_both() -> set[str]:
            client = DesktopServiceClient(url, "tenant-secret")
            try:
                replies = [await client.lease(None, wait_s=120, observe=())
                           for _ in range(2)]  # the tenant's quota (2) is free again
                for reply in replies:
                    await client.release(reply.env_id)
                return {r.desktop_id for r in replies}
            finally:
                await client.close()

        assert asyncio.run(lease_both()) == desktops  # the same two, reset and lent again
        # What the run's episodes started on the desktops is gone; the desktops' own
        # processes are those recorded before (reset, not replaced).
        apps = {key: tag for key, tag in before.items() if tag.endswith("+app")}
        assert apps, "no app of the run's episodes ran at the kill"
        assert not {key: tag for key, tag in apps.items() if _alive(*key)}
        assert core and all(_alive(*key) for key in core)  # reset, not replaced
        assert not [t for t in _desktop_processes(state_dir).values() if t.endswith("+app")]
    finally:
        _stop(service)
    assert not list(state_dir.glob(f"*/{SESSION_FILE}"))


def test_a_service_killed_mid_run_loses_leases_cleanly_and_the_run_completes(tmp_path):
    """kill -9 of the service while a run's episodes run on its two leases (each episode's
    app open, steps still to come), then the service started again on the same port and
    state dir: its sweep removes the old instance's desktops (none of their processes
    survives, by pid); the episodes on the lost leases (their desktops gone, the heartbeats
    refused, then 410 lease_lost) are infra errors retried on new leases once the service
    is back; every episode is recorded exactly once, scored."""
    # The editor's episodes: 6 steps, 3.5 s each. At the kill each has at least 4 steps
    # (14 s) to go, against ~3 s for the restart and its sweep: the sweep ends their
    # desktops under them (what this test is about) with a wide margin on a loaded machine.
    # Its two rollouts are the two episodes in flight (a further task would only add time).
    tasks = ["editor-save-new-file"]
    env = _service_env()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service, url = _serve(tmp_path, env, port=port, ttl_s=6)
    run_dir, state_dir = tmp_path / "results" / "demo", tmp_path / "svc-desktops"
    tree: list[psutil.Process] = []
    try:
        with slow_scripted_policy(DEMO, [f"tasks.task_ids={json.dumps(tasks)}"],
                                  latency_s=3.5) as slow, \
                open(tmp_path / "run.stderr", "w+") as err:
            run = subprocess.Popen(_cua_run(url, tmp_path, tasks, *slow), cwd=REPO_ROOT,
                                   stdout=subprocess.DEVNULL, stderr=err,
                                   env={**env, DESKTOP_VAR: ""}, start_new_session=True)
            try:
                old: dict[tuple[int, float], str] = {}

                def in_flight() -> bool:
                    """Both editor episodes acting (1-2 of their 12 steps made), none ended."""
                    old.clear()
                    old.update(_desktop_processes(state_dir))
                    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (
                        run_dir / "metrics.jsonl").exists() else []
                    last = json.loads(lines[-1]) if lines else {}
                    return (len(_run_tree(run.pid, tree) and _status(url)["leases"]) == 2
                            and last.get("episodes_in_flight") == 2
                            and last.get("episodes_done") == 0
                            and 1 <= last.get("steps", 0) <= 2)

                _wait_results(run, run_dir, 0, in_flight)
                old_boot = _status(url)["boot"]
                service.kill()
                service.communicate(timeout=60)
                assert not (run_dir / "results.jsonl").exists() or not run_results(run_dir)
                service, again = _serve(tmp_path, env, port=port, ttl_s=6)
                assert again == url and _status(url)["boot"] != old_boot
                # The sweep of the new instance: nothing of the old desktops runs on.
                assert not [(key, tag) for key, tag in old.items() if _alive(*key)]
                run.wait(timeout=RUN_TIMEOUT_S)
            finally:
                if run.poll() is None:
                    os.killpg(run.pid, signal.SIGINT)
                    run.wait(timeout=120)
                for proc in _run_tree(run.pid, tree):
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
            err.seek(0)
            assert run.returncode == 0, err.read()[-4000:]
        records = assert_every_episode_succeeded(run_dir, tasks)  # once each, scored
        assert all(r["desktop"].startswith("remote-") for r in records)
        # The two episodes in flight at the kill failed (infra) and were run again.
        assert [r["attempt"] >= 1 for r in records] == [True, True], records
        assert not _status(url)["leases"]
    finally:
        _stop(service)
        left = list(state_dir.glob(f"*/{SESSION_FILE}"))
        # Had the test failed between the kill and the restart: the old desktops, by pid.
        sweep_stale_sessions(state_dir)
    assert not left
