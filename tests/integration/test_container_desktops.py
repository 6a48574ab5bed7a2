"""Desktops as containers of the desktop image on a real engine (podman with runc here):
the conformance checker on one, start and reset in place, a leaked container of a dead run
swept by label (never one of a live run), a container killed mid-episode retried elsewhere and
replaced, and the demo end to end with ``desktops.provider: container``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.checker import check_desktop_env
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.providers.base import LABEL_RUN, run_label
from cua_rollout.envs.providers.container import ContainerProvider
from cua_rollout.runtime.pool import DesktopPool
from tests.support import (
    REPO_ROOT,
    assert_every_episode_succeeded,
    desktop_image,
    slow_scripted_policy,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUILD = REPO_ROOT / "scripts" / "build_desktop_image.sh"
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def image() -> str:
    return desktop_image("demo")


def _cfg(image: str, **kw) -> DesktopsConfig:
    base = dict(provider="container", count=1, warm_spares=0, screen_width=1280,
                screen_height=720, lease_timeout_s=60, reset_timeout_s=60,
                container={"image": image, "start_timeout_s": 90})
    base.update(kw)
    return DesktopsConfig(**base)


def _ours(label: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "-aq", "--filter", f"label={LABEL_RUN}={label}"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


async def test_a_container_desktop_conforms_and_resets_in_place(image):
    cfg = _cfg(image)
    provider = ContainerProvider(cfg)
    starts, resets = [], []
    desktop = await provider.start(0)
    try:
        starts.append(desktop.info["start_s"])
        env = RemoteDesktopEnv.for_lease(desktop.url, cfg, name=desktop.id)
        seen = await check_desktop_env(env, screen_size=(1280, 720))
        assert seen["step"].returncode == 0  # pyautogui ran on the container's display
        # What an episode leaves (a file in HOME, an app) is gone after the reset.
        env = RemoteDesktopEnv.for_lease(desktop.url, cfg, name=desktop.id)
        try:
            await env.execute(["bash", "-c", "echo x > ~/Desktop/left.txt; xterm & sleep 1"])
            for _ in range(3):
                t0 = time.monotonic()
                await provider.reset(desktop)
                resets.append(time.monotonic() - t0)
            assert await env.get_file("/home/user/Desktop/left.txt") is None
            listing = await env.execute(["pgrep", "-x", "xterm"])
            assert listing.get("returncode") == 1, listing  # no xterm left
        finally:
            await env.close()
        assert await provider.health(desktop)
        # Container start as a user sees it: run -> the server answers.
        for i in (1, 2):
            other = await provider.start(i)
            starts.append(other.info["start_s"])
            await provider.stop(other)
    finally:
        await provider.stop(desktop)
    assert _ours(provider.run) == [], "containers left after stop"
    print(f"\ncontainer start s: {starts} (median {statistics.median(starts):.2f}); "
          f"reset s: {[round(r, 2) for r in resets]}")


async def test_a_leaked_container_of_a_dead_run_is_swept_and_a_live_runs_is_not(image):
    cfg = _cfg(image)
    # A "run" that is gone: a process started and ended here, its label on a container.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_label = run_label(gone.pid)
    gone.wait()
    leaked = subprocess.run(
        ["podman", "run", "-d", "--runtime", "runc", "--ulimit", "nofile=1024:1024",
         "--ulimit", "nproc=4096:4096", "--label", f"{LABEL_RUN}={dead_label}",
         "--label", "cua.desktop=ctr-leaked", "-e", "CUA_DESKTOP_INSECURE_NO_TOKEN=1", image],
        capture_output=True, text=True, check=True).stdout.strip()
    live = ContainerProvider(cfg)
    desktop = await live.start(0)
    try:
        assert "ctr-leaked" in live.stale_removed
        assert _ours(dead_label) == []
        # A second pool (another run, alive) sweeps nothing of the first one's.
        second = ContainerProvider(cfg)
        assert await second.sweep() == []
        assert await live.health(desktop)
    finally:
        await live.stop(desktop)
        subprocess.run(["podman", "rm", "-f", leaked], capture_output=True)


async def test_a_container_killed_mid_lease_is_replaced(image):
    cfg = _cfg(image, count=2)
    pool = DesktopPool(cfg)
    await pool.start()
    try:
        lease = await pool.lease("victim")
        container = pool.provider._containers[lease.desktop_id]
        subprocess.run(["podman", "kill", container], capture_output=True, check=True)
        await pool.release(lease.lease_id, healthy=False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ids = set(pool.provider._containers)
            if lease.desktop_id not in ids and len(ids) == 2:
                break
            await asyncio.sleep(0.5)
        assert lease.desktop_id not in pool.provider._containers
        again = await pool.lease("next")
        assert again.desktop_id != lease.desktop_id
        await pool.release(again.lease_id)
    finally:
        await pool.stop()
    assert _ours(pool.provider.run) == []


def _test_mark() -> str:
    """A ``--set`` giving this test's containers a label of their own: what is left after
    the run is counted among them only, whatever else runs containers on this machine."""
    return ("desktops.container.extra_args="
            + json.dumps(["--label", f"cua.test={uuid.uuid4().hex[:12]}"]))


def _marked(mark: str) -> list[str]:
    label = json.loads(mark.split("=", 1)[1])[1]
    return subprocess.run(["podman", "ps", "-aq", "--filter", f"label={label}"],
                          capture_output=True, text=True, check=True).stdout.split()


def test_the_demo_on_container_desktops(tmp, image):
    """The whole demo (every task once: a second rollout adds only time) as users run it,
    on container desktops: the tasks' reference solutions hold there too (a non-root desktop
    shows no root warning bar, so pixel positions recorded on a root desktop would not)."""
    tasks = [json.loads(p.read_text())["id"]
             for p in sorted((REPO_ROOT / "tasks" / "demo" / "examples").glob("*/*.json"))]
    assert len(tasks) >= 18
    args = [sys.executable, str(REPO_ROOT / "run.py"), "--config",
            str(REPO_ROOT / "configs" / "demo.yaml")]
    mark = _test_mark()
    for s in (f"run.output_dir={tmp / 'results'}", "desktops.provider=container",
              f"desktops.container.image={image}", "ray.include_dashboard=false",
              "tasks.rollouts_per_task=1", mark):
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    results = assert_every_episode_succeeded(tmp / "results" / "demo", tasks, rollouts=1)
    assert all(r["desktop"].startswith("ctr-") for r in results)
    assert len({r["desktop"] for r in results}) >= 2  # both desktops ran episodes
    assert _marked(mark) == [], "containers left running after the run"


def test_containers_killed_mid_episode_are_retried_elsewhere_and_replaced(tmp, image):
    """The desktop containers killed while episodes have just started on them (the run's
    leases, as scripts/desktops.py shows them): those episodes are infra_errors retried on new
    containers, and the run completes with every episode."""
    tasks = ["terminal-hello-file", "calc-add"]
    mark = _test_mark()
    sets = [f"run.output_dir={tmp / 'results'}", "desktops.provider=container",
            f"desktops.container.image={image}", f"tasks.task_ids={json.dumps(tasks)}",
            "ray.include_dashboard=false", mark]
    demo = str(REPO_ROOT / "configs" / "demo.yaml")
    with slow_scripted_policy(demo, sets, latency_s=1.5) as slow:
        args = [sys.executable, str(REPO_ROOT / "run.py"), "--config", demo]
        status = [sys.executable, str(REPO_ROOT / "scripts" / "desktops.py"), "status", "--json",
                  "--config", demo]
        for s in [*sets, *slow]:
            args += ["--set", s]
            status += ["--set", s]
        run_dir = tmp / "results" / "demo"
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        killed: list[str] = []
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not killed:
                assert proc.poll() is None, "the run ended before its desktops were killed"
                assert time.monotonic() < deadline
                done = subprocess.run(status, cwd=REPO_ROOT, capture_output=True, text=True)
                rows = json.loads(done.stdout)["desktops"] if done.returncode == 0 else []
                fresh = [r["id"] for r in rows
                         if r["state"] == "leased" and (r["lease_age_s"] or 99) < 4]
                for desktop in fresh:  # episodes that have just started on these
                    ids = subprocess.run(["podman", "ps", "-q", "--filter",
                                          f"label=cua.desktop={desktop}"],
                                         capture_output=True, text=True, check=True).stdout.split()
                    subprocess.run(["podman", "kill", *ids], capture_output=True, check=False)
                    killed += ids
            _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    results = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["rollout"]) for r in results) == sorted(
        (t, k) for t in tasks for k in range(2))
    assert {r["status"] for r in results} == {"success"}
    retried = [r for r in results if r["attempt"] > 0]
    assert retried, [(r["episode_id"], r["desktop"], r["attempt"]) for r in results]
    for r in retried:  # ... on another desktop than the one that died
        assert len(r["desktops_tried"]) >= 2 and r["desktop"] != r["desktops_tried"][0]
    assert _marked(mark) == [], "containers left after the run"


def test_the_build_saves_the_image_to_its_cache_and_loads_it_from_there(image, tmp_path):
    """A fresh machine with a restored cache (CUA_IMAGE_CACHE) loads the image instead of
    building it: here the tag is removed from the engine and comes back from the archive."""
    env = {**os.environ, "CUA_IMAGE_CACHE": str(tmp_path / "cache")}

    def build() -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["bash", str(BUILD), "--profile", "demo"], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    first = build()
    assert first.stdout.split()[-1] == image and "saved" in first.stderr
    archives = list((tmp_path / "cache").glob("*.tar"))
    assert [a.name for a in archives] == [image.replace("/", "+").replace(":", "=") + ".tar"]
    subprocess.run(["podman", "untag", image, image], check=True, timeout=60)
    second = build()
    assert second.stdout.split()[-1] == image
    assert "loading" in second.stderr and "building" not in second.stderr, second.stderr
    assert subprocess.run(["podman", "image", "exists", image], timeout=60).returncode == 0


def test_the_image_declares_its_apps_and_the_pre_flight_reads_them(image):
    """The demo image's label lists what its packages provide; a task needing an app it
    lacks (vs_code, chrome) is not runnable on it, one needing its apps is."""
    from cua_rollout.config import load_config
    from cua_rollout.envs.apps import desktop_apps
    from cua_rollout.evaluation.preflight import TaskChecker

    cfg = load_config(None, ["desktops.provider=container", f"desktops.container.image={image}"])
    apps = desktop_apps(cfg.desktops)
    assert apps.apps == {"galculator", "mousepad", "xterm"}
    assert image in apps.source
    check = TaskChecker(cfg)
    task = {"id": "t", "instruction": "x", "config": [],
            "evaluator": {"func": "infeasible"}}
    assert check({**task, "related_apps": ["os", "mousepad"]}) == []
    problems = check({**task, "related_apps": ["vs_code", "os", "chrome"]})
    assert [p.key for p in problems] == ["app:vs_code", "app:chrome"]
