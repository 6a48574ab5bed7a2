"""The central components a run still has one of, each alone at its highest rate (issue 33,
item 5): the coordinator, one desktop pool (a shard), the storage, the driver's task loader
and the model fleet's endpoint list server. Per component: the most steps (or episodes, or
requests) per second one core carries, the CPU each costs, and the desktops that makes at
4.8 s and at 2.0 s a step, against the issue's target: none fills a core below 10,000
desktops at a 2 s step (5,000 steps/s, ~500 episodes/s).

    python benchmarks/bench_singletons.py [--quick] [--json] [--out FILE.json]
        [--only coordinator pool storage loader endpoints] [--no-in-process]
        [--desktops 10000] [--episodes-per-s 1000] [--window-s 15]

Method. Each component is the real class, driven as a run drives it, with what it talks to
stubbed so that nothing else limits it. Its CPU is its process's user + system time
(psutil, every thread: the event loop, Ray's threads, file threads) over a window of wall
time; the rate is what it completed in that window, counted by the component itself.
``max /s`` = rate / (CPU as a fraction of one core): the component is one process with one
event loop, so one core is its ceiling; on this 2-core machine, shared with its stubs and
Ray, it is rarely saturated, hence the ratio rather than a rate reached. Costs that do not
grow with the rate (statistics loops, housekeeping, the driver's polls) are counted in,
so the figure is a lower bound. Details per row: ``idle_cpu_fraction``, the same
process's CPU with everything in flight and nothing finishing; ``stub_runners_cpu``, what
the stub runner processes used meanwhile (when they are near a core, they, not the
component, set the rate); ``system_share``, the kernel's part of the CPU; ``threads``, the
busiest threads by name (Ray's ``worker.io``, ``server.poll0`` ...).

Two figures per Ray component: ``Ray actor``, its primary figure: the class as a Ray actor
(``num_cpus=0``, max_concurrency as ``launch.start_actors`` sets it) in a local Ray
(``num_cpus=2``), called by stub runner processes (two ``BenchRunner`` actors, a
``TrajectoryRunner`` whose episodes are stand-ins) as runners call it; and ``in-process``:
the same class, stubs and driver in this one process without Ray (its CPU includes the
stubs', which are small), so the difference is what Ray costs. For scale, the CPU a Ray
call costs its callee is measured too (``ray_noop_call``: an async actor's method that
does nothing, called by the two stub runner processes with a ~0.8 KB record).

1. coordinator (episodes): the real ``AgentCoordinator`` with ``--desktops`` episodes in
   flight, ``episodes_per_runner`` 64, so ``desktops / 64`` runners, each a handle on one of
   the two stub runner processes (its statistics fan-out is the real one's); the pool and the
   storage are one stub answering at once. Each stub episode lasts a random time (uniform,
   mean ``desktops / episodes-per-s``), so the offered rate is ``--episodes-per-s``. The
   driver loop is run.py's: a poll every 0.5 s, new episodes submitted for those that
   ended (the queue kept at 4 s of the offered rate). Also: the CPU and wall time of one
   ``poll()`` with every episode in flight (``polls`` back to back: 200, 500 in the full
   run), and the wall time of the driver's polls under load.
2. desktop pool (episodes: a lease and a release, the reset in the background): a real
   ``DesktopPool`` of ``--desktops`` desktops plus spares from a provider whose resets are
   instant (``tests.doubles.FakeProvider``, reset verification off); every desktop leased by
   one of ``--desktops`` stub episodes that holds it a random time (mean as above) and
   gives it back; ``stats()`` asked every second as the coordinator does.
3. storage (a real ``StorageActor``, trainer index on, as by default): ``step files by
   runners`` (episodes; ``storage.step_files: runner``, the default where runners see the run
   directory): per episode the actor hears only its results line, batched with others by
   a ``ResultRecorder`` (the coordinator's, one per stub runner process here, so the
   batches are smaller than one coordinator's), which moves the attempt's staging
   directory into place, while the stub runners write the steps' files themselves
   (``EpisodeWriter``; small PNGs: their bytes never reach the actor);
   ``step files through the actor`` (steps; ``storage.step_files: storage``, the "before"):
   every step's traj.jsonl line and a 330 KB screenshot go to ``write_step`` in 64 KiB parts.
   Episodes of ``STEPS_PER_EPISODE`` steps, as fast as 2 x ``storage_at_once`` writers go.
   The in-process figure of the first: staging directories made beforehand (the runner's
   part), then their results lines recorded, batched as the coordinator batches them.
4. loader (episodes): the driver's ``TaskLoader`` in service mode (369 tasks x 8 rollouts a
   pass) after 10^4, 10^5, 10^6 recorded episodes (``benchmarks/bench_loader.py``'s
   ``fill_loader`` and ``time_iterations``): an iteration of run.py's loop (every 0.5 s:
   ``record_result`` per finished episode, ``poll``, ``total_known``) with
   ``episodes-per-s / 2`` results; CPU = its time (one thread, no waits). Also a poll's cost
   with 8 results (run.py's idle loop) and the cost of recording one episode.
5. endpoints server (requests): the fleet's control app (``model.fleet.control.create_app``,
   uvicorn in a thread, as ``run_model.py`` serves it) in a process of its own, publishing
   128 replicas, asked by 32 clients at once, each an ``httpx2`` client with the replicas'
   key, as ``model.discovery`` asks: with the ETag it got (``304``, the steady state) and
   without (``200``, the list). Runners ask once a second, one per runner process: its max
   /s is the runner processes it serves.

Desktops: an episode is ``STEPS_PER_EPISODE`` steps (the mean of the sim world's episode
lengths in benchmarks/bench_rollout.py: median 9, a 12% tail around 20, at most 24; ~10),
so ``desktops = episodes/s x STEPS_PER_EPISODE x step time`` (steps/s x step time for a
step row). A runner process drives ``1 / RUNNER_CPU_MS_PER_STEP`` steps/s (bench_rollout.py,
4.8 ms of CPU a step), so for the endpoints server ``desktops = processes x 208 x step time``.

Prints a table (or ``--json``); asserts nothing. ``--quick``: a CI-sized run (< 60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_loader, bench_rollout  # noqa: E402
from cua_rollout.config import Config, StorageConfig, load_config  # noqa: E402
from cua_rollout.core.layout import ATTEMPTS_DIR, TASK_CONFIG_FILE, TRAJ_FILE, staging_name  # noqa: E402
from cua_rollout.core.screenshot import Screenshot  # noqa: E402
from cua_rollout.core.types import EpisodeResult, EpisodeSpec  # noqa: E402
from cua_rollout.runtime.actors import CoordinatorClient, PoolClient, StorageClient, send  # noqa: E402
from cua_rollout.runtime.coordinator import AgentCoordinator  # noqa: E402
from cua_rollout.runtime.pool import DesktopPool  # noqa: E402
from cua_rollout.runtime.recorder import ResultRecorder  # noqa: E402
from cua_rollout.runtime.runner import TrajectoryRunner  # noqa: E402
from cua_rollout.runtime.storage import EpisodeWriter, StepFiles, StorageActor  # noqa: E402
from cua_rollout.runtime.trajectory import ScreenshotFiles, StepRecord  # noqa: E402
from tests.doubles.fake_desktop import FakeProvider, solid_png  # noqa: E402

__all__ = ["COMPONENTS", "FULL", "QUICK", "BenchRunner", "Row", "Settings", "main",
           "steps_per_episode"]

COMPONENTS = ("coordinator", "pool", "storage", "loader", "endpoints")
# The step times the issue asks about (the peers' pace, a fast one) and its target.
STEP_TIMES_S = (4.8, 2.0)
TARGET_DESKTOPS = 10_000
TARGET_STEP_S = 2.0
# A runner process's CPU per step (bench_rollout.py, 64 episodes, model.images: file: 4.6-4.8
# ms; 5.9 inline; 11.0 before the hot requests moved to aiohttp): the steps one runner
# process (one event loop) makes a second, so the runner processes N desktops need.
RUNNER_CPU_MS_PER_STEP = 4.8
# run.py's loop sleeps this long between iterations (cua_rollout/runtime/driver.py), and
# the coordinator asks the pool for statistics this often.
DRIVER_POLL_S = 0.5
POOL_STATS_S = 1.0
EPISODES_PER_RUNNER = 64
SCREENSHOT_BYTES = 330_000  # a 1920x1080 screenshot's PNG (README, "Screenshots")
STUB_RUNNERS = 2            # runner processes standing in for all the runners
TASK_FILE = ROOT / "tasks" / "demo" / "examples" / "editor" / "editor-fix-inventory.json"
LOADER_TASKS, LOADER_ROLLOUTS = 369, 8  # the scale review's service run


@dataclasses.dataclass(frozen=True)
class Settings:
    """One size of the benchmark (``QUICK``, ``FULL``)."""

    desktops: int            # episodes in flight (coordinator), desktops leased (pool)
    episodes_per_s: float    # the rate offered to the coordinator and the pool
    storage_at_once: int     # episodes each stub runner process writes at once
    idle_s: float            # the idle measurement (everything in flight, nothing moving)
    warmup_s: float
    window_s: float
    polls: int               # poll() calls back to back, for its cost
    staged_episodes: int     # the storage's in-process figure: episodes timed
    loader_sizes: tuple[int, ...]
    loader_iterations: int
    replicas: int            # in the published endpoint list
    endpoint_clients: int
    in_process: bool = True


QUICK = Settings(desktops=1000, episodes_per_s=500, storage_at_once=16, idle_s=0.5,
                 warmup_s=1.0, window_s=2.0, polls=200, staged_episodes=1000,
                 loader_sizes=(10_000, 100_000), loader_iterations=10, replicas=128,
                 endpoint_clients=16)
FULL = Settings(desktops=10_000, episodes_per_s=1000, storage_at_once=32, idle_s=4.0,
                warmup_s=4.0, window_s=15.0, polls=500, staged_episodes=10_000,
                loader_sizes=(10_000, 100_000, 1_000_000), loader_iterations=30,
                replicas=128, endpoint_clients=32)


def steps_per_episode() -> float:
    """The mean episode length of the sim world (bench_rollout's tasks, ``sim task <i>``)."""
    lengths = bench_rollout.FULL.lengths
    return statistics.fmean(lengths.draw(f"sim task {i}") for i in range(2000))


STEPS_PER_EPISODE = steps_per_episode()


# --------------------------------------------------------------------------- figures


@dataclasses.dataclass
class Row:
    """One component measured one way: ``units`` done in ``window_s`` for ``cpu_s`` of its
    process's CPU."""

    component: str
    how: str          # "Ray actor", "in-process", "HTTP"
    unit: str         # "episode", "step", "request"
    units: int
    window_s: float
    cpu_s: float
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rate_per_s(self) -> float:
        return self.units / self.window_s

    @property
    def cpu_fraction(self) -> float:
        return self.cpu_s / self.window_s

    @property
    def cpu_ms_per_unit(self) -> float:
        return 1000 * self.cpu_s / self.units

    @property
    def max_per_s(self) -> float:
        return self.rate_per_s / self.cpu_fraction

    def desktops_at(self, step_s: float) -> float:
        """Desktops whose steps keep this component busy at ``max_per_s``."""
        if self.unit == "episode":
            return self.max_per_s * STEPS_PER_EPISODE * step_s
        if self.unit == "step":
            return self.max_per_s * step_s
        # a request a second from each runner process, each driving its steps' worth
        return self.max_per_s * (1000 / RUNNER_CPU_MS_PER_STEP) * step_s

    @property
    def meets_target(self) -> bool:
        return self.desktops_at(TARGET_STEP_S) >= TARGET_DESKTOPS

    def as_dict(self) -> dict[str, Any]:
        return {
            "component": self.component, "how": self.how, "unit": self.unit,
            "units": self.units, "window_s": round(self.window_s, 3),
            "cpu_s": _significant(self.cpu_s, 6),
            "rate_per_s": round(self.rate_per_s, 1),
            "cpu_fraction": _significant(self.cpu_fraction, 4),
            "cpu_ms_per_unit": _significant(self.cpu_ms_per_unit, 4),
            "max_per_s": round(self.max_per_s, 1),
            "desktops": {f"at_{t:.1f}s": round(self.desktops_at(t)) for t in STEP_TIMES_S},
            "meets_target": self.meets_target,
            "detail": self.detail,
        }


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def _row(component: str, how: str, unit: str, units: int, window_s: float, cpu_s: float,
         **detail: Any) -> Row:
    if units <= 0 or cpu_s <= 0:
        raise RuntimeError(f"{component} ({how}): {units} {unit}s and {cpu_s:.3f} s of CPU in "
                           f"{window_s:.1f} s: nothing was measured")
    return Row(component, how, unit, units, window_s, cpu_s, detail)


class _Cpu:
    """User + system CPU seconds of one process (all its threads), and per thread name."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.process = psutil.Process(pid)

    def seconds(self) -> float:
        if self.pid == os.getpid():  # finer than /proc's clock ticks (10 ms)
            return time.process_time()
        times = self.process.cpu_times()
        return times.user + times.system

    def system_seconds(self) -> float:
        return self.process.cpu_times().system

    def by_thread(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for thread in self.process.threads():
            try:
                name = Path(f"/proc/{self.pid}/task/{thread.id}/comm").read_text().strip()
            except OSError:  # the thread ended meanwhile
                continue
            out[name] = out.get(name, 0.0) + thread.user_time + thread.system_time
        return out


@dataclasses.dataclass
class _Window:
    units: int
    wall_s: float
    cpu_s: float
    threads: dict[str, float]   # thread name -> its share of one core in the window
    others: float = 0.0         # the other processes' (stub runners') CPU, of one core
    system: float = 0.0         # the share of the CPU spent in the kernel

    @property
    def fraction(self) -> float:
        return self.cpu_s / self.wall_s


async def _window(cpu: _Cpu, count: Callable[[], Awaitable[int]], seconds: float,
                  others: tuple[_Cpu, ...] = ()) -> _Window:
    """What ``count`` grew by and the process's CPU over ``seconds`` of wall time (and
    that of ``others``)."""
    first = await count()
    threads, cpu_s, t0 = cpu.by_thread(), cpu.seconds(), time.monotonic()
    others_s, system_s = sum(o.seconds() for o in others), cpu.system_seconds()
    await asyncio.sleep(seconds)
    cpu_s, wall_s = cpu.seconds() - cpu_s, time.monotonic() - t0
    system_s = cpu.system_seconds() - system_s
    others_s = sum(o.seconds() for o in others) - others_s
    last = await count()
    after = cpu.by_thread()
    split = {name: round((after[name] - threads.get(name, 0.0)) / wall_s, 3) for name in after}
    top = dict(sorted(split.items(), key=lambda kv: -kv[1])[:4])
    return _Window(last - first, wall_s, cpu_s, top, round(others_s / wall_s, 3),
                   round(system_s / cpu_s, 3) if cpu_s > 0 else 0.0)


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.1)


# --------------------------------------------------------------------------- stand-ins


def _task() -> dict[str, Any]:
    return json.loads(TASK_FILE.read_text(encoding="utf-8"))


def _step_line(step: int) -> dict[str, Any]:
    """A UI-TARS step's traj.jsonl line, as a runner fills it."""
    return StepRecord(
        step, action="pyautogui.click(812, 377)\n",
        response=("Thought: The inventory list is open; item 57 says MISSING. I will click at "
                  "the end of that line to edit it.\nAction: click(start_box='(423,349)')"),
        info={"returncode": 0, "error": ""}, screenshot_file=f"step_{step}.png",
        observation_file=f"step_{step - 1}.png",
        thought="The inventory list is open; item 57 says MISSING.",
        actions=[{"action_type": "click", "action_inputs": {"start_box": [812, 377]}}],
        parse_retries=0, constrained=False, model_endpoint="http://10.0.3.17:8000/v1",
        model_version="ckpt-00012", prompt_tokens=14_912, completion_tokens=61,
        images=[{"file": f"step_{i}.png", "tokens": 2691} for i in range(max(0, step - 4),
                                                                          step + 1)],
        timing={"model_s": 1.62, "action_s": 0.31, "pause_s": 2.0, "screenshot_s": 0.05,
                "overhead_s": 0.004, "step_s": 3.98},
    ).line()


def _messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The last request of a 10-step episode as messages.json keeps it (images by file)."""
    from cua_rollout.agents.uitars.prompt import Turn, build_messages

    files = ScreenshotFiles()
    shots = [Screenshot(solid_png(64, 36, (i, 40, 40))) for i in range(10)]
    for i, shot in enumerate(shots):
        files.remember(shot, f"step_{i}.png")
    history = [Turn(shot, str(_step_line(i + 1)["response"])) for i, shot in
               enumerate(shots[:-1])]
    messages = build_messages(str(task["instruction"]), history, shots[-1])
    out = files.messages_for_disk(messages)
    assert out is not None
    return out


def _result(spec: EpisodeSpec, started_at: float) -> EpisodeResult:
    return bench_loader.example_result(
        spec.task_id, spec.domain, spec.rollout, attempt=spec.attempt,
        pass_index=spec.pass_index, group_size=spec.group_size, started_at=started_at)


class BenchRunner(TrajectoryRunner):
    """A runner process whose episodes are stand-ins: ``run_episode`` holds an episode for a
    while and returns a full result (the coordinator's rows); ``drive_pool`` and
    ``drive_storage`` make only the calls episodes make to the pool (a lease, a release) or
    to the storage (an attempt's files and its results line), many at once. ``hold(None)``
    holds every episode (and lease) until ``hold(mean_s)``: then each ends after a uniform
    random share of ``mean_s`` (so they do not end at once) and new ones last ``mean_s``
    on average (uniform in 0.5-1.5 x)."""

    def __init__(self, cfg: Config, desktop_pool: Any, storage: Any, runner_id: str = "runner",
                 model_state_dir: str | None = None) -> None:
        super().__init__(cfg, desktop_pool, storage, runner_id, model_state_dir)
        self._rng = random.Random(runner_id)
        self._mean_s: float | None = None
        self._gate: asyncio.Event | None = None
        self._driving: list[asyncio.Task[None]] = []
        self.driven = 0
        self._task = _task()

    def attach(self, desktop_pool: Any, storage: Any) -> None:
        self.desktop_pool, self.storage = desktop_pool, storage

    async def hold(self, mean_s: float | None) -> None:
        gate = self._the_gate()
        self._mean_s = mean_s
        if mean_s is None:
            gate.clear()
        else:
            gate.set()

    def _the_gate(self) -> asyncio.Event:
        if self._gate is None:  # made on the actor's loop
            self._gate = asyncio.Event()
        return self._gate

    async def _held(self) -> None:
        if self._mean_s is None:
            await self._the_gate().wait()
            await asyncio.sleep(self._rng.uniform(0.0, self._mean_s or 0.0))
        else:
            await asyncio.sleep(self._rng.uniform(0.5, 1.5) * self._mean_s)

    async def run_episode(self, spec: EpisodeSpec, avoid: list[str] | None = None
                          ) -> EpisodeResult:
        started_at = time.time()
        await self._held()
        self.counters["episodes"] += 1
        return _result(spec, started_at)

    async def drive_pool(self, at_once: int) -> int:
        """``at_once`` episodes that lease a desktop, hold it, give it back, again."""
        pool = PoolClient(self.desktop_pool)

        async def one(i: int) -> None:
            owner = f"{self.runner_id}/bench/t{i}/0"
            while True:
                lease = await pool.lease(owner, None, ())
                try:
                    await self._held()
                finally:
                    await pool.release(lease.lease_id, True)
                self.driven += 1

        return await self._drive([one(i) for i in range(at_once)])

    async def drive_storage(self, storage_cfg: StorageConfig, at_once: int, steps: int,
                            png: bytes) -> int:
        """``at_once`` episodes of ``steps`` steps writing their files as runners do
        (``EpisodeWriter``, ``StepFiles`` of ``storage_cfg``), and their results lines."""
        files = StepFiles(self.storage, storage_cfg, self.runner_id)
        recorder = ResultRecorder(StorageClient(self.storage), 300.0)
        lines = [_step_line(step) for step in range(1, steps + 1)]
        messages = _messages(self._task)

        async def one(i: int) -> None:
            for n in itertools.count():
                started_at = time.time()
                spec = EpisodeSpec(f"{self.runner_id}-{i}-{n}", "bench", 0, self._task)
                writer = EpisodeWriter(self.storage, spec.episode_id, 0, files)
                await writer.begin(self._task)
                for step, line in enumerate(lines, start=1):
                    await writer.step(line, f"step_{step}.png", png)
                record = _result(spec, started_at).record()
                failed = await writer.finish(record, messages)
                if failed is not None:
                    raise RuntimeError(f"storage: {spec.episode_id}: {failed}")
                await recorder.record(record, writer.staging)
                self.driven += 1

        try:
            return await self._drive([one(i) for i in range(at_once)])
        finally:
            files.close()

    async def drive_calls(self, target: Any, at_once: int) -> int:
        """``at_once`` loops calling ``target.call`` with a results record (~0.8 KB)."""
        record = _result(EpisodeSpec("t0", "bench", 0, {}), time.time()).record()

        async def one() -> None:
            while True:
                await send(target.call, record)
                self.driven += 1

        return await self._drive([one() for _ in range(at_once)])

    async def _drive(self, loops: list[Awaitable[None]]) -> int:
        self.driven = 0
        self._driving = [asyncio.ensure_future(loop) for loop in loops]
        done = await asyncio.gather(*self._driving, return_exceptions=True)
        errors = [e for e in done if not isinstance(e, asyncio.CancelledError)]
        if errors:
            raise errors[0]
        return self.driven

    async def stop_driving(self) -> None:
        """End the ``drive_*`` call under way (its leases are given back)."""
        for task in self._driving:
            task.cancel()


class _Noop:
    """An actor method that does nothing: what one Ray call costs the callee."""

    async def call(self, record: dict[str, Any]) -> None:
        return None


class _Stubs:
    """The desktop pool and the storage as the coordinator sees them, answering at once:
    a real pool's statistics, no results kept."""

    def __init__(self, pool_stats: dict[str, Any]) -> None:
        self._pool_stats = pool_stats
        self.results = 0

    def stats(self) -> dict[str, Any]:
        return self._pool_stats

    async def release_owned(self, owner_prefix: str, healthy: bool = True) -> int:
        return 0

    async def record_results(self, items: list[Any]) -> list[str | None]:
        self.results += len(items)
        return [None] * len(items)

    async def write_metrics(self, sample: dict[str, Any]) -> None:
        return None


class _BenchCoordinator(AgentCoordinator):
    """The real coordinator; its runners are ``runners`` in turn (one process stands for
    many runners, so the statistics fan-out is that of ``desktops / 64`` runners)."""

    def __init__(self, cfg: Config, stubs: Any, runners: list[Any], *, use_ray: bool) -> None:
        super().__init__(cfg, stubs, stubs, use_ray=use_ray)
        turn = itertools.cycle(runners)
        self.runner_factory = lambda *args: next(turn)


def _config(work: Path, s: Settings) -> Config:
    return load_config(ROOT / "configs" / "demo.yaml", [
        f"run.output_dir={work / 'results'}", "run.name=bench-singletons",
        f"coordinator.max_concurrent_episodes={s.desktops}",
        f"coordinator.episodes_per_runner={EPISODES_PER_RUNNER}",
        "coordinator.runner_num_cpus=0",
        f"desktops.count={s.desktops}", f"desktops.warm_spares={max(8, s.desktops // 100)}",
        f"desktops.download_cache_dir={work / 'downloads'}",
    ])


# --------------------------------------------------------------------------- Ray


def _ray_init() -> None:
    import ray

    # Workers import this checkout (as run.py's do).
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # address="local": a cluster of its own, never one another process left running here.
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             namespace="bench-singletons", logging_level="WARNING")


def _pid_of(handle: Any) -> int:
    import ray

    return int(ray.get(handle.__ray_call__.remote(lambda actor: os.getpid())))


def _concurrency(s: Settings) -> int:
    """An actor's max_concurrency as ``launch.start_actors`` sets it."""
    return 4 * s.desktops + 64


class _World:
    """The component under test and the stub runners that call it, as Ray actors or as
    objects in this process (``how``)."""

    def __init__(self, cfg: Config, s: Settings, how: str) -> None:
        self.cfg, self.s, self.how = cfg, s, how
        self.ray = how == "Ray actor"
        self.runners = [self.actor(BenchRunner, cfg, None, None, f"bench{i}")
                        for i in range(STUB_RUNNERS)]
        self._runner_cpus: tuple[_Cpu, ...] | None = None

    def actor(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        if not self.ray:
            return cls(*args, **kwargs)
        import ray

        return ray.remote(cls).options(num_cpus=0, max_concurrency=_concurrency(self.s)
                                       ).remote(*args, **kwargs)

    async def attach(self, pool: Any, storage: Any) -> None:
        """The stub runners call this pool and this storage from now on."""
        await self.on_runners("attach", pool, storage)

    def cpu(self, target: Any) -> _Cpu:
        return _Cpu(_pid_of(target) if self.ray else os.getpid())

    def runner_cpus(self) -> tuple[_Cpu, ...]:
        """The stub runner processes' CPU (none apart from this one in-process)."""
        if self._runner_cpus is None:
            self._runner_cpus = tuple(self.cpu(r) for r in self.runners) if self.ray else ()
        return self._runner_cpus

    def kill(self, *actors: Any) -> None:
        if self.ray:
            import ray

            for actor in actors:
                ray.kill(actor, no_restart=True)

    async def on_runners(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(send(getattr(r, method), *args)
                                           for r in self.runners)))


async def _ray_call(world: _World) -> dict[str, Any]:
    """The callee's CPU per call of a method that does nothing (an async actor, the two stub
    runner processes calling it as they call the storage): Ray's own share of a Ray row."""
    s = world.s
    target = world.actor(_Noop)
    cpu = world.cpu(target)

    async def calls() -> int:  # the stub runners' ``driven`` counters
        counts = await asyncio.gather(*(r.__ray_call__.remote(_driven)
                                        for r in world.runners))
        return sum(counts)

    drives = [send(r.drive_calls, target, s.storage_at_once) for r in world.runners]
    try:
        await asyncio.sleep(s.warmup_s)
        run = await _window(cpu, calls, max(1.0, s.window_s / 2))
    finally:
        await world.on_runners("stop_driving")
        await asyncio.gather(*drives, return_exceptions=True)
        world.kill(target)
    if run.units <= 0:
        raise RuntimeError("Ray call: no call was made in the window")
    return {"calls_per_s": round(run.units / run.wall_s, 1),
            "cpu_fraction": round(run.fraction, 3),
            "cpu_ms_per_call": round(1000 * run.cpu_s / run.units, 4),
            "system_share": run.system}


def _driven(runner: BenchRunner) -> int:
    return runner.driven


async def _coordinator(world: _World) -> Row:
    cfg, s, how, runners = world.cfg, world.s, world.how, world.runners
    pool_stats = DesktopPool(cfg.desktops, FakeProvider()).stats()
    stubs = world.actor(_Stubs, pool_stats)
    target = world.actor(_BenchCoordinator, cfg, stubs, runners, use_ray=world.ray)
    client = CoordinatorClient(target)
    await client.start(prestart=True)
    cpu = world.cpu(target)
    await world.on_runners("hold", None)
    task = _task()
    numbers = itertools.count()
    polls: list[float] = []
    asks: list[float] = []  # stats() right after each poll: a call with a small answer

    def specs(n: int) -> list[EpisodeSpec]:
        return [EpisodeSpec(f"t{next(numbers)}", "bench", 0, task) for _ in range(n)]

    async def stats() -> dict[str, Any]:
        return await send(target.stats)

    # Queued beyond the episodes in flight: what 4 s at the offered rate take, so that a
    # slow poll does not leave slots empty (the loader hands out a whole group at a time).
    queue = max(s.desktops // 4, round(4 * s.episodes_per_s))

    async def driver() -> None:
        """run.py's loop: poll every 0.5 s, hand out new episodes for those that ended."""
        await client.submit(specs(s.desktops + queue))
        while True:
            t0 = time.perf_counter()
            out = await client.poll()
            polls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await stats()
            asks.append(time.perf_counter() - t0)
            short = queue - int(out["stats"]["episodes_queued"])
            if out["finished"] or short > 0:
                await client.submit(specs(max(len(out["finished"]), short)))
            await asyncio.sleep(DRIVER_POLL_S)

    async def done() -> int:
        return int((await stats())["episodes_done"])

    loop = asyncio.ensure_future(driver())
    try:
        await _until(f"{s.desktops} episodes in flight",
                     lambda: _in_flight(stats, s.desktops), 120)
        idle = await _window(cpu, done, s.idle_s)
        burst_cpu, t0 = cpu.seconds(), time.perf_counter()
        for _ in range(s.polls):
            await send(target.poll)
        burst_wall = time.perf_counter() - t0
        burst_cpu = cpu.seconds() - burst_cpu
        await world.on_runners("hold", s.desktops / s.episodes_per_s)
        await asyncio.sleep(s.warmup_s)
        polls.clear()
        asks.clear()
        run = await _window(cpu, done, s.window_s, world.runner_cpus())
        last = await stats()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await _stop_coordinator(world, target, client)
    return _row("coordinator", how, "episode", run.units, run.wall_s, run.cpu_s,
                in_flight=last["episodes_in_flight"], runners=last["runners"],
                idle_cpu_fraction=round(idle.fraction, 3),
                poll_cpu_ms=round(1000 * max(0.0, burst_cpu - idle.fraction * burst_wall)
                                  / s.polls, 3),
                poll_wall_ms=round(1000 * burst_wall / s.polls, 3),
                driver_poll_wall_ms_p50=round(1000 * statistics.median(polls), 3)
                if polls else None,
                driver_stats_wall_ms_p50=round(1000 * statistics.median(asks), 3)
                if asks else None,
                stub_runners_cpu=run.others, system_share=run.system, threads=run.threads)


async def _in_flight(stats: Callable[[], Awaitable[dict[str, Any]]], want: int) -> bool:
    return int((await stats())["episodes_in_flight"]) >= want


async def _stop_coordinator(world: _World, target: Any, client: CoordinatorClient) -> None:
    if world.ray:  # its shutdown would stop the stub runners
        world.kill(target)
        return
    await client.shutdown()  # cancels what is in flight


async def _pool(world: _World) -> Row:
    cfg, s, how = world.cfg, world.s, world.how
    target = world.actor(DesktopPool, cfg.desktops, FakeProvider())
    await PoolClient(target).start()
    cpu = world.cpu(target)
    await world.attach(target, None)
    await world.on_runners("hold", None)
    drives = [send(r.drive_pool, s.desktops // STUB_RUNNERS) for r in world.runners]

    async def stats() -> dict[str, Any]:
        return await PoolClient(target).stats()

    async def coordinator_asks() -> None:
        while True:
            await stats()
            await asyncio.sleep(POOL_STATS_S)

    async def released() -> int:
        return int((await stats())["releases"])

    async def all_leased() -> bool:
        return int((await stats())["leased"]) >= s.desktops // STUB_RUNNERS * STUB_RUNNERS

    asker = asyncio.ensure_future(coordinator_asks())
    try:
        await _until(f"{s.desktops} desktops leased", all_leased, 120)
        idle = await _window(cpu, released, s.idle_s)
        await world.on_runners("hold", s.desktops / s.episodes_per_s)
        await asyncio.sleep(s.warmup_s)
        run = await _window(cpu, released, s.window_s, world.runner_cpus())
        last = await stats()
    finally:
        asker.cancel()
        await world.on_runners("stop_driving")
        await asyncio.gather(asker, *drives, return_exceptions=True)
        await PoolClient(target).stop()
        world.kill(target)
    return _row("desktop pool", how, "episode", run.units, run.wall_s, run.cpu_s,
                desktops=s.desktops, free=last["free"], leased=last["leased"],
                resetting=last["resetting"], quarantined=last["quarantined"],
                idle_cpu_fraction=round(idle.fraction, 3), stub_runners_cpu=run.others,
                system_share=run.system,
                threads=run.threads)


async def _storage(world: _World, run_dir: Path) -> list[Row]:
    """The storage with step files by the runners, then through the actor (Ray only:
    in-process, ``_storage_staged`` and ``_storage_steps``)."""
    target = world.actor(StorageActor, str(run_dir), world.cfg.storage)
    storage = StorageClient(target)
    await storage.start_run({"run": "bench-singletons"})
    cpu = world.cpu(target)
    await world.attach(None, target)
    steps = round(STEPS_PER_EPISODE)
    rows = []
    try:
        for mode, png in (("runner", solid_png(64, 36)), ("storage", os.urandom(SCREENSHOT_BYTES))):
            rows.append(await _storage_mode(world, target, cpu, mode, png, steps))
    finally:
        await storage.close()
        world.kill(target)
    return rows


async def _storage_mode(world: _World, target: Any, cpu: _Cpu, mode: str, png: bytes,
                        steps: int) -> Row:
    s = world.s
    scfg = world.cfg.storage.model_copy(update={"step_files": mode})
    unit = "episode" if mode == "runner" else "step"
    key = "results" if mode == "runner" else "steps"

    async def written() -> int:
        return int((await send(target.stats))[key])

    idle = await _window(cpu, written, s.idle_s)
    drives = [send(r.drive_storage, scfg, s.storage_at_once, steps, png) for r in world.runners]
    try:
        await asyncio.sleep(s.warmup_s)
        run = await _window(cpu, written, s.window_s, world.runner_cpus())
    finally:
        await world.on_runners("stop_driving")
        done = await asyncio.gather(*drives, return_exceptions=True)
    errors = [e for e in done if isinstance(e, BaseException)]
    if errors:
        raise RuntimeError(f"storage ({mode}): a stub runner failed: {errors[0]!r}")
    name = ("storage, step files by runners" if mode == "runner"
            else "storage, step files through it")
    return _row(name, world.how, unit, run.units, run.wall_s, run.cpu_s,
                steps_per_episode=steps, png_bytes=len(png),
                writers=s.storage_at_once * STUB_RUNNERS,
                idle_cpu_fraction=round(idle.fraction, 3), stub_runners_cpu=run.others,
                system_share=run.system,
                threads=run.threads)


async def _storage_staged(cfg: Config, s: Settings, run_dir: Path) -> Row:
    """In-process, step files by runners: the staging directories made first (the
    runners' part), then their results lines recorded as the coordinator does (batched by
    a ``ResultRecorder``), each moving its directory into place, timed."""
    storage = StorageActor(run_dir, cfg.storage)
    await storage.start_run({"run": "bench-singletons"})
    attempts = run_dir / ATTEMPTS_DIR
    task = json.dumps(_task()).encode()
    line = (json.dumps(_step_line(1)) + "\n").encode()
    staged = []
    for i in range(s.staged_episodes):
        spec = EpisodeSpec(f"s{i}", "bench", 0, {})
        name = staging_name(spec.episode_id, 0, uuid.uuid4().hex[:12])
        (attempts / name).mkdir()
        (attempts / name / TASK_CONFIG_FILE).write_bytes(task)
        (attempts / name / TRAJ_FILE).write_bytes(line)
        staged.append((spec, name, _result(spec, time.time()).record()))
    queue = list(reversed(staged))

    recorder = ResultRecorder(StorageClient(storage), 60.0)

    async def writer() -> None:
        while queue:
            _, name, record = queue.pop()
            await recorder.record(record, name)

    cpu = _Cpu(os.getpid())
    cpu_s, t0 = cpu.seconds(), time.monotonic()
    await asyncio.gather(*(writer() for _ in range(s.storage_at_once * STUB_RUNNERS)))
    await storage.flush()
    wall_s, cpu_s = time.monotonic() - t0, cpu.seconds() - cpu_s
    await storage.close()
    return _row("storage, step files by runners", "in-process", "episode", len(staged), wall_s,
                cpu_s, staged_files_per_episode=2)


async def _storage_steps(world: _World, run_dir: Path) -> Row:
    target = StorageActor(run_dir, world.cfg.storage)
    await target.start_run({"run": "bench-singletons"})
    await world.attach(None, target)
    try:
        return await _storage_mode(world, target, _Cpu(os.getpid()), "storage",
                                   os.urandom(SCREENSHOT_BYTES), round(STEPS_PER_EPISODE))
    finally:
        await target.close()


# --------------------------------------------------------------------------- loader


def _loader(s: Settings, size: int) -> Row:
    batch = max(8, round(s.episodes_per_s * DRIVER_POLL_S))
    with tempfile.TemporaryDirectory(prefix="bench-singletons-loader-") as tmp:
        loader, outstanding, fill_s = bench_loader.fill_loader(size, Path(tmp), LOADER_TASKS,
                                                               LOADER_ROLLOUTS)
        idle = bench_loader.time_iterations(loader, outstanding, 8, s.loader_iterations)
        busy = bench_loader.time_iterations(loader, outstanding, batch, s.loader_iterations)
    cpu_s = sum(busy["iteration_ms"])
    return _row(f"loader, {size:,} recorded", "in-process", "episode",
                batch * s.loader_iterations, DRIVER_POLL_S * s.loader_iterations, cpu_s,
                results_per_iteration=batch,
                poll_ms_p50=round(1000 * statistics.median(idle["poll_ms"]), 4),
                total_known_ms_p50=round(1000 * statistics.median(idle["total_known_ms"]), 4),
                idle_iteration_ms_p50=round(1000 * statistics.median(idle["iteration_ms"]), 4),
                record_us_per_episode=round(1e6 * sum(busy["record_batch_ms"])
                                            / (batch * s.loader_iterations), 3),
                fill_s=round(fill_s, 2))


# --------------------------------------------------------------------------- endpoints


def _published(replicas: int) -> dict[str, Any]:
    """What a fleet of ``replicas`` publishes (``Supervisor.snapshot``'s shape)."""
    now = time.time()
    return {
        "format": 1, "updated_at": now, "model": "ui-tars-1.5-7b",
        "checkpoint": "/ckpt/step-00012", "model_version": "ckpt-00012",
        "supervisor": {"pid": 4242, "control_url": "http://10.0.0.2:8600",
                       "started_at": now, "state_dir": "/var/fleet", "watch_dir": "/ckpt"},
        "reload": None,
        "endpoints": [{
            "index": i, "url": f"http://10.0.{i // 8}.{i % 8 + 10}:8000/v1", "healthy": True,
            "draining": False, "model_version": "ckpt-00012",
            "checkpoint": "/ckpt/step-00012", "state": "serving", "pid": 10_000 + i,
            "port": 8000, "devices": str(i % 8), "restarts": 0, "reloads": 3,
            "started_at": now, "startup_s": 84.2, "last_exit": None,
            "log": f"/var/fleet/logs/replica-{i}.log"} for i in range(replicas)],
    }


def _serve_endpoints(replicas: int, key: str) -> int:
    """The child process: the control app serving ``replicas`` endpoints until stdin ends."""
    from types import SimpleNamespace

    from cua_rollout.core.http import ThreadedServer
    from cua_rollout.model.fleet.control import ENDPOINTS_PATH, create_app

    supervisor = SimpleNamespace(published=_published(replicas))
    # /endpoints answers on the server's own loop; this one (for /status, /reload) idles.
    app = create_app(supervisor, asyncio.new_event_loop(), "bench-token",  # type: ignore[arg-type]
                     reader_key=key)
    with ThreadedServer(app, "127.0.0.1", 0) as server:
        print(json.dumps({"url": server.url + ENDPOINTS_PATH}), flush=True)
        sys.stdin.read()
    return 0


async def _endpoints(s: Settings) -> list[Row]:
    key = "bench-replica-key"
    child = subprocess.Popen([sys.executable, __file__, "--serve-endpoints", str(s.replicas),
                              key], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        url = json.loads(child.stdout.readline())["url"]
        cpu = _Cpu(child.pid)
        rows = []
        for status, what in ((304, "unchanged, 304"), (200, "the list, 200")):
            run = await _ask_endpoints(s, url, key, status, cpu)
            rows.append(_row(f"endpoints server ({what})", "HTTP", "request", run.units,
                             run.wall_s, run.cpu_s, replicas=s.replicas,
                             clients=s.endpoint_clients, threads=run.threads))
        return rows
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


async def _ask_endpoints(s: Settings, url: str, key: str, want: int, cpu: _Cpu) -> _Window:
    """``s.endpoint_clients`` clients asking as ``model.discovery`` does, each on its own
    connection: with the ETag of their first answer (``want`` 304) or without (200)."""
    import httpx2

    answered = [0]

    async def asker() -> None:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                      timeout=httpx2.Timeout(30.0)) as client:
            first = await client.get(url)
            headers = {"If-None-Match": first.headers["etag"]} if want == 304 else None
            while True:
                r = await client.get(url, headers=headers)
                if r.status_code != want:
                    raise RuntimeError(f"GET {url}: HTTP {r.status_code}, not {want}")
                answered[0] += 1

    async def count() -> int:
        return answered[0]

    askers = [asyncio.ensure_future(asker()) for _ in range(s.endpoint_clients)]
    try:
        await asyncio.sleep(s.warmup_s)
        run = await _window(cpu, count, s.window_s)
    finally:
        for a in askers:
            a.cancel()
        done = await asyncio.gather(*askers, return_exceptions=True)
    errors = [e for e in done if not isinstance(e, asyncio.CancelledError)]
    if errors:
        raise RuntimeError(f"endpoints server: {errors[0]!r}")
    return run


# --------------------------------------------------------------------------- driver


async def _run(s: Settings, only: tuple[str, ...], work: Path, report: Callable[[Row], None],
               ray_call: dict[str, Any]) -> list[Row]:
    """The rows of the components in ``only``; ``ray_call`` gets ``_ray_call``'s figures
    when any Ray row is measured."""
    cfg = _config(work, s)
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        report(row)

    ray_parts = [c for c in ("pool", "storage", "coordinator") if c in only]
    if s.in_process and ray_parts:  # before Ray starts: its processes take no CPU from these
        world = _World(cfg, s, "in-process")
        if "pool" in only:
            add(await _pool(world))
        if "storage" in only:
            add(await _storage_staged(cfg, s, _fresh(work / "staged")))
            add(await _storage_steps(world, _fresh(work / "steps")))
        if "coordinator" in only:  # last: its shutdown closes the stub runners
            add(await _coordinator(world))
    if ray_parts:
        import ray

        _ray_init()
        try:
            world = _World(cfg, s, "Ray actor")
            ray_call.update(await _ray_call(world))
            if "pool" in only:
                add(await _pool(world))
            if "storage" in only:
                for row in await _storage(world, _fresh(work / "run")):
                    add(row)
            if "coordinator" in only:
                add(await _coordinator(world))
        finally:
            ray.shutdown()
    if "loader" in only:
        for size in s.loader_sizes:
            add(_loader(s, size))
    if "endpoints" in only:
        for row in await _endpoints(s):
            add(row)
    return rows


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


_HEADER = ("component", "how", "unit", "measured /s (core)", "max /s", "CPU ms/unit",
           "desktops @4.8 s", "desktops @2.0 s", "10k@2s")


def _cells(row: Row) -> tuple[str, ...]:
    return (row.component, row.how, row.unit,
            f"{row.rate_per_s:,.0f} ({row.cpu_fraction:.3f})", f"{row.max_per_s:,.0f}",
            f"{row.cpu_ms_per_unit:.3f}", f"{row.desktops_at(4.8):,.0f}",
            f"{row.desktops_at(2.0):,.0f}", "yes" if row.meets_target else "no")


def _print_table(rows: list[Row]) -> None:
    table = [_HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(_HEADER))]
    for n, line in enumerate(table):
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(line, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\nan episode = {STEPS_PER_EPISODE:.2f} steps (the sim world's mean, "
          f"bench_rollout); a runner process = {1000 / RUNNER_CPU_MS_PER_STEP:.0f} steps/s "
          f"(README: {RUNNER_CPU_MS_PER_STEP:g} ms of CPU a step), polling the endpoint list "
          "once a second; target: "
          f"{TARGET_DESKTOPS:,} desktops at {TARGET_STEP_S:g} s a step")
    for row in rows:
        detail = ", ".join(f"{k} {v}" for k, v in row.detail.items() if k != "threads")
        print(f"  {row.component} ({row.how}): {detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a CI-sized run (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--only", nargs="+", choices=COMPONENTS, default=list(COMPONENTS))
    parser.add_argument("--desktops", type=int, help="episodes in flight, desktops leased")
    parser.add_argument("--episodes-per-s", type=float, help="the rate offered")
    parser.add_argument("--window-s", type=float, help="the measured window")
    parser.add_argument("--no-in-process", action="store_true",
                        help="only the Ray figures of the coordinator, pool and storage")
    parser.add_argument("--serve-endpoints", nargs=2, metavar=("REPLICAS", "KEY"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_endpoints:
        return _serve_endpoints(int(args.serve_endpoints[0]), args.serve_endpoints[1])
    s = QUICK if args.quick else FULL
    changes: dict[str, Any] = {"in_process": not args.no_in_process}
    for name in ("desktops", "episodes_per_s", "window_s"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
            changes[name] = value
    s = dataclasses.replace(s, **changes)
    if s.desktops < EPISODES_PER_RUNNER * STUB_RUNNERS:
        parser.error(f"--desktops must be at least {EPISODES_PER_RUNNER * STUB_RUNNERS}")

    started = time.monotonic()

    def report(row: Row) -> None:
        if not args.json:
            print(f"  {time.monotonic() - started:5.1f} s  {row.component} ({row.how}): "
                  f"{row.rate_per_s:,.0f} {row.unit}s/s at {row.cpu_fraction:.2f} of a core",
                  flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-singletons-") as tmp:
        ray_call: dict[str, Any] = {}
        rows = asyncio.run(_run(s, tuple(args.only), Path(tmp), report, ray_call))
    out = {
        "assumptions": {
            "steps_per_episode": round(STEPS_PER_EPISODE, 3),
            "steps_per_episode_from": "the mean episode length of the sim world's tasks "
                                      "(benchmarks/bench_rollout.py: median 9, a 12% tail "
                                      "around 20, at most 24)",
            "runner_steps_per_s": round(1000 / RUNNER_CPU_MS_PER_STEP, 1),
            "endpoint_polls_per_runner_process_per_s": 1.0,
            "step_times_s": list(STEP_TIMES_S),
            "target": {"desktops": TARGET_DESKTOPS, "step_s": TARGET_STEP_S},
        },
        "settings": dataclasses.asdict(s),
        "cpus": os.cpu_count(),
        "seconds": round(time.monotonic() - started, 1),
        "rows": [r.as_dict() for r in rows],
        "ray_noop_call": ray_call or None,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print()
        _print_table(rows)
        if ray_call:
            print(f"  a Ray call of a method that does nothing: {ray_call['cpu_ms_per_call']} "
                  f"ms of the callee's CPU ({ray_call['calls_per_s']:,.0f} calls/s at "
                  f"{ray_call['cpu_fraction']} of a core)")
        print(f"\n{out['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
