"""Rollout throughput, desktop utilization and orchestration overhead of the REAL coordinator,
runners, storage and model client against the simulated world, for three schedules.

    python benchmarks/bench_rollout.py [--quick] [--out FILE.json] [--levels 8 64 ...]
        [--schedules rollout batch ...] [--peer | --no-peer] [--peer-levels 16 64]
        [--peer-window-s 183]

A local Ray cluster is started by this script (``num_cpus`` = the machine's cores, no
dashboard; ``coordinator.runner_num_cpus`` is 0, or 2 CPUs would admit only 8 runners) and
the run's actors are built exactly as ``run.py`` builds them (``start_actors`` /
``stop_actors``): a static desktop pool over sim desktops (benchmarks/sim_world.py, realistic
1920x1080 PNGs of a few hundred KB), a storage actor writing the real results directory, the
coordinator, and runner actors that send every request through the real ``ModelServicePool``
to four sim model servers. The driver polls the coordinator as ``run.py`` does.

Schedules (``coordinator.*``):
  rollout            ``schedule: rollout``: refill a slot the moment its episode ends, with
                     multi-episode runners (ours): ``episodes_per_runner`` = concurrency /
                     cores, i.e. one runner process per core (2 here). A process's event loop
                     is one core at most, so more runners than cores only add ~110 MB and
                     ~1% of a core of Ray upkeep each (measured: 16 runners of 64 at 1024
                     episodes spent ~1.5x the CPU per step of 2 runners of 512); httpx2's
                     per-request pool work stays small in big runners since the model client
                     has a pool per endpoint and each episode one for its desktop.
  actor-per-episode  ``episodes_per_runner: 1``: one runner process per episode slot (the
                     original design). Each process costs ~110 MB and ~0.7 s of CPU to start:
                     both are measured at the smallest level, and levels whose actors would
                     not fit in ``ape_memory_share`` of the free memory or not start within
                     ``ape_start_budget_s`` are recorded as skipped with the extrapolation.
  batch              ``schedule: batch`` (runners as for rollout): the next batch starts when
                     every episode of the current one ended (a coupled, synchronous system).
                     A batch row whose one batch would outlast ``batch_budget_s`` (longest
                     drawn episode x step time) is skipped with that figure.

Tasks: a JSONL file of ``sim task <i>`` instructions (unique; the sim draws each episode's
length from it: median ~9 steps, a 12% tail around 20, at most 24, the same as
``runner.max_steps``), no setup steps, evaluator ``{"func": "infeasible"}``: scored from the
last action without any desktop call (the sim ends every episode with ``finished()``, so every
episode is a scored ``failure`` with reward 0). Evaluation cost is thus left out on purpose:
what is measured is the orchestration, not an evaluator's latency.

Sim latencies (full; quick is ~4x faster): model ``1.0 s + 0.01 s * completion_tokens``
(60 +- 30 tokens: ~1.6 s), action 0.3 s, screenshot 0.05 s, ``action_pause_s`` 0, reset 0.5 s
(off the critical path), no jitter but the reply length, so every step's simulated time is
known exactly from its traj.jsonl line: ~1.95 s unloaded. The model fleet serves at most
``fleet_steps_per_s`` (50): past that, every reply is slower by the same factor (the sim's
per-server ``speed_factor``, as a saturated server's decoding slows all its requests), so a
mean step takes ``max(1.95 s, concurrency / 50)``: 5.1 s at 256 episodes, 20.5 s at 1024.
The orchestration of 50 steps/s is what 2 cores shared with the sim can carry with room to
spare (at ~15 ms of CPU per step, 0.75 of a core): the question measured is whether our
orchestration keeps up with 1024 episodes in flight, not whether 2 cores are a GPU fleet.

Each measurement (row) is a fresh run: actors started, episodes submitted, a warm-up (at
least ``warmup_s`` and until every slot has taken a step) excluded, then a fixed wall-time
window of ``window_s``, and at least two mean step times (``window_for``: slots that start
together step in waves, and a window shorter than a step measures a trough or a crest of
them; rollout, actor-per-episode). The run is then drained as run.py's
Ctrl-C does: nothing new starts, running episodes get ``drain_grace_s`` (or 1.3 mean step
times, so steps running at the window's end finish and count), then the rest is cancelled
(a second Ctrl-C). For batch, a warm-up batch of short episodes (3 steps or fewer) is
followed by one measured batch, from the end of the warm-up batch to the end of its last
episode (its long tail included: that is the point).

Per row (all computed from what the run wrote, the sim's configuration and psutil):
  steps_per_s          steps done in the window / window, each step (a traj.jsonl line: its
                       start is ``action_timestamp - timing.model_s``, its end start +
                       ``timing.step_s``) counted by the share of its time inside the window,
                       so that episodes stepping in lockstep do not alias with the window.
  ideal_steps_per_s    concurrency / mean simulated step time of the steps that start in the
                       window. A step's simulated time is the sim model's latency for its
                       reply (slowdown * (base + per_token_s * its completion_tokens)) + action
                       latency +
                       screenshot latency + action_pause_s (an episode's last step,
                       ``finished()``, has no action and no screenshot): exact, as the sim
                       draws none of these with jitter; computed from the configured values
                       and each step's traj.jsonl line, not from the sim's counters.
  ratio                steps_per_s / ideal_steps_per_s.
  desktop_utilization  the time the concurrency's K desktops spent leased to a live episode:
                       sum over episodes of the overlap of [lease, release] with the window,
                       divided by K * window (lease = ``started_at + lease_wait_s``, release =
                       ``ended_at``, from results.jsonl or episode.json). Warm spares (ready
                       desktops beyond K, absorbing the 0.5 s reset) are extra capacity and not
                       in the denominator; ``desktop_utilization_pool`` divides by the whole
                       pool (K + spares) instead.
  overhead_ms_p50/p99  per step: step wall time (traj ``timing.step_s``) minus its simulated
                       model and env time (the issue's definition: everything that is not the
                       sim, including our JSON, HTTP and parsing on both calls).
                       ``runner_overhead_ms_*``: the runner's own ``timing.overhead_s`` (step
                       time outside the model and desktop calls).
  cpu_ms_per_step      CPU (user + system) in the window of every process of the run: this
                       driver (minus the psutil sampler thread) and every process Ray started
                       (gcs, raylet, agents, workers: the actors), not the sim's processes;
                       divided by the steps in the window.
  peak_rss_mb          the largest sum of RSS of those processes, sampled every second over the
                       whole row (start-up and drain included; shared pages count once per
                       process). ``rss_per_episode_mb``: (peak - the same sum before the row's
                       actors started) / concurrency, fixed costs of the actors included;
                       ``rss_marginal_mb_per_episode``: the peak's growth from the schedule's
                       previous level, per added episode.
  lost, duplicated     submitted episodes that are not in results.jsonl, did not start (no
                       staging directory: it never began) and are not among those the
                       coordinator still holds queued after the drain (so a started episode
                       without a result line counts as cancelled by the drain, as run.py's
                       second Ctrl-C does); and results.jsonl lines beyond one per episode, or
                       of episodes never submitted. Must be 0. Batch rows run every submitted
                       episode to its end: there, lost = submitted - recorded.

Plus ``routing``: benchmarks/bench_routing.py's rows (three policies, four sim endpoints, one
twice as slow).

Plus ``peer`` (issue 17; in the full run, alone with ``--peer``, not with ``--quick``): the
peer's settings as the original system was measured, one row per K in ``--peer-levels``
(16 64). The sim world is started first, in its own processes: K + warm spares desktops
(1920x1080 PNGs; action 1.0 s, screenshot 0.2 s, reset 0.5 s) and four model servers (1.6 s
per generation, never ``finished()``: every episode runs ``runner.max_steps`` 15 steps, each
with an action). Then the REAL command, ``python run.py --config <generated YAML>`` from the
repository root (its own local Ray cluster, no dashboard; ``runner.action_pause_s`` 2.0,
``agent.history_images`` 5, ``agent.history_texts`` 35, ``tasks.rollouts_per_task`` 2,
``coordinator.max_concurrent_episodes`` K, one runner per core, enough tasks to keep K
episodes busy past the window). Counted for ``--peer-window-s`` (183) from the moment the
command is started, start-up included; then run.py gets two SIGINT (its process group is
killed only if it does not exit) and the world is stopped.
  actions              actions completed in the window, from the sim desktops' own counter
                       (an action is counted when its /execute arrives; read at window -
                       1.0 s, as every action takes exactly 1.0 s). ``actions_started``: the
                       counter at the window's end; ``traj_actions``: the same count from the
                       run's traj.jsonl lines (action_timestamp + 1.0 s), a cross-check.
  actions_per_min      actions / window * 60; ``ideal_actions_per_min`` 60 x K / 4.8 (model
                       1.6 + action 1.0 + pause 2.0 + screenshot 0.2); ``ratio`` of the two.
  startup_s            command start to the first action (sampled every 0.2 s), with
                       ``ray_ready_s`` and ``actors_ready_s`` (from run.py's "desktops ready
                       in X s" log line) and ``first_model_request_s`` on the way.
  startup_share        startup_s / window: what the window loses before the first action.
                       ``step_efficiency``: 4.8 s / the steps' mean wall time (traj
                       timing.step_s; ``step_s_p50/p99``). The rest of the loss is the
                       episodes' turnover (an episode's first screenshot, lease, evaluation).
                       The K episodes start, and so step, in lockstep: the count moves in
                       bursts of K actions (1/38 of the ideal at 183 s); ``actions_per_10s``
                       is the timeline.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sim_world import (  # noqa: E402
    DesktopSim,
    EpisodeLengths,
    Latency,
    ModelSim,
    SimWorld,
)
from cua_rollout.core.layout import (  # noqa: E402
    ATTEMPTS_DIR,
    EPISODE_FILE,
    METRICS_FILE,
    RESULTS_FILE,
    TRAJ_FILE,
)
from cua_rollout.core.types import Status  # noqa: E402
from cua_rollout.results import read_jsonl  # noqa: E402

SCHEDULES = ("rollout", "actor-per-episode", "batch")
LEVELS = (8, 64, 256, 1024)
RESULT_KEYS = ("schedule", "concurrency", "steps_per_s", "ideal_steps_per_s", "ratio",
               "desktop_utilization", "overhead_ms_p50", "overhead_ms_p99", "cpu_ms_per_step",
               "peak_rss_mb", "lost", "duplicated")
DOMAIN = "sim"
TERMINAL_ACTIONS = ("DONE", "FAIL")


# Episode lengths the sim model draws from each instruction: median ~9 steps, a 12% tail
# around 20, at most 24 (runner.max_steps is set to the same).
_LENGTHS = EpisodeLengths(median_steps=8, tail_median_steps=20, max_steps=24)
_RESET = Latency(0.5, 0.2)  # a desktop reset (off the critical path: warm spares absorb it)


@dataclasses.dataclass(frozen=True)
class RolloutSetup:
    """One benchmark configuration (``QUICK`` and ``FULL`` below)."""

    levels: tuple[int, ...]
    warmup_s: float                  # least warm-up before the window (rollout, a-p-e)
    window_s: float                  # measured wall time (rollout, a-p-e)
    model_base_s: float              # unloaded model latency without the tokens
    per_token_s: float               # model latency per completion token
    action_s: float                  # /execute of an action
    screenshot_s: float              # /screenshot
    fleet_steps_per_s: float         # the model fleet's rate: caps concurrency / step time
    lengths: EpisodeLengths = _LENGTHS
    output_tokens_mean: int = 60
    output_tokens_jitter: int = 30
    reset: Latency = _RESET
    model_servers: int = 4
    episodes_per_runner: int | None = None  # rollout and batch; None: one runner per core
    history_images: int = 5
    startup_timeout_s: float = 120.0  # every slot must have stepped by then (at least)
    batch_budget_s: float = 150.0     # a batch row whose one batch would last longer: skipped
    ape_memory_share: float = 0.6     # a-p-e rows must fit in this share of free memory
    ape_start_budget_s: float = 60.0  # ... and their actors start within this many seconds
    drain_grace_s: float = 10.0       # episodes running after the window may end normally
    step_files: str = "auto"          # storage.step_files: who writes the step files
    images: str = "inline"            # model.images: screenshots in the body, or by path
    seed: int = 0

    def unloaded_step_s(self) -> float:
        return (self.model_base_s + self.per_token_s * self.output_tokens_mean
                + self.action_s + self.screenshot_s)

    def step_s_for(self, concurrency: int) -> float:
        """Mean simulated step time at this concurrency: unloaded, or slower so that
        ``concurrency / step time`` is the model fleet's rate."""
        return max(self.unloaded_step_s(), concurrency / self.fleet_steps_per_s)

    def window_for(self, concurrency: int) -> float:
        """The measured window at this concurrency: ``window_s``, and at least two mean step
        times. A step's CPU comes at its ends (the request, the reply, the action, the
        screenshot) and slots started together step in waves; a window shorter than a step
        (82 s at 4096) may hold a trough or a crest of them, and its CPU per step says so,
        not what a step costs."""
        return max(self.window_s, 2.0 * self.step_s_for(concurrency))

    def model_factor_for(self, concurrency: int) -> float:
        """How much slower than unloaded the model answers at this concurrency (the sim's
        ``speed_factor`` of every server, which scales a reply's whole latency, as a
        saturated server's decoding does): the mean step then takes ``step_s_for``."""
        model_s = self.model_base_s + self.per_token_s * self.output_tokens_mean
        env_s = self.action_s + self.screenshot_s
        return (self.step_s_for(concurrency) - env_s) / model_s

    def model_s(self, concurrency: int, completion_tokens: int) -> float:
        """The sim model's latency for a reply of ``completion_tokens`` (exact: no jitter
        other than the reply's length)."""
        return self.model_factor_for(concurrency) * (
            self.model_base_s + self.per_token_s * completion_tokens)

    def per_runner(self, concurrency: int) -> int:
        """Episodes per runner (rollout and batch): as many runners as cores, unless set."""
        return _per_runner(concurrency, self.episodes_per_runner)

    def spares_for(self, concurrency: int) -> int:
        return _spares_for(concurrency)


def _per_runner(concurrency: int, fixed: int | None) -> int:
    """Episodes per runner: ``fixed``, or as many runners as cores."""
    if fixed is not None:
        return fixed
    return math.ceil(concurrency / (os.cpu_count() or 1))


def _spares_for(concurrency: int) -> int:
    """Warm spares: a reset (0.5 s) is absorbed when spares cover the episodes that end
    within one reset, with margin for bursts."""
    return max(2, math.ceil(concurrency / 16))


QUICK = RolloutSetup(levels=(8, 64), warmup_s=3.0, window_s=6.0, model_base_s=0.2,
                     per_token_s=0.003, action_s=0.1, screenshot_s=0.05,
                     fleet_steps_per_s=50.0, drain_grace_s=3.0, batch_budget_s=25.0,
                     ape_start_budget_s=20.0)
FULL = RolloutSetup(levels=LEVELS, warmup_s=8.0, window_s=20.0, model_base_s=1.0,
                    per_token_s=0.01, action_s=0.3, screenshot_s=0.05,
                    fleet_steps_per_s=50.0, drain_grace_s=5.0, batch_budget_s=100.0,
                    ape_start_budget_s=60.0)


# --------------------------------------------------------------------------- processes


class _ProcessSampler:
    """CPU and RSS of this process and its descendants (Ray's processes), minus the sim's
    processes, sampled every ``interval_s`` in a thread whose own CPU is not counted."""

    def __init__(self, interval_s: float = 1.0) -> None:
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self._me = psutil.Process()
        self._exclude: set[int] = set()
        self._lock = threading.Lock()
        self._cpu: dict[int, float] = {}       # pid -> last seen CPU seconds
        self._names: dict[int, str] = {}
        self._rss: dict[int, int] = {}         # pid -> last RSS (live processes only)
        self._own_cpu_s = 0.0                  # this sampler thread's CPU so far
        self._mark: tuple[dict[int, float], float] | None = None
        self.peak_rss = 0
        self.peak_by_kind: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)

    def start(self) -> _ProcessSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def exclude(self, pids: list[int]) -> None:
        with self._lock:
            self._exclude.update(pids)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> int:
        """Take a sample now; returns the RSS sum in bytes."""
        t0 = time.thread_time()
        psutil = self._psutil
        try:
            procs = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            procs = [self._me]
        with self._lock:
            excluded = set(self._exclude)
        cpu: dict[int, float] = {}
        rss: dict[int, int] = {}
        names: dict[int, str] = {}
        skip_tree: set[int] = set()
        for p in procs:
            try:
                if p.pid in excluded or p.ppid() in excluded or p.ppid() in skip_tree:
                    skip_tree.add(p.pid)
                    continue
                with p.oneshot():
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
                    rss[p.pid] = p.memory_info().rss
                    # Ray renames a worker (ray::IDLE -> ray::TrajectoryRunner) when it
                    # becomes an actor: read the name every time.
                    names[p.pid] = " ".join(p.cmdline())[:120] or p.name()
            except psutil.Error:
                continue
        with self._lock:
            self._cpu.update(cpu)
            self._names.update(names)
            self._rss = rss
            total = sum(rss.values())
            if total > self.peak_rss:
                self.peak_rss = total
                self.peak_by_kind = {}
                for pid, r in rss.items():
                    kind = _process_kind(self._names.get(pid, ""), pid == self._me.pid)
                    self.peak_by_kind[kind] = self.peak_by_kind.get(kind, 0) + r
            if threading.current_thread() is self._thread:
                self._own_cpu_s += time.thread_time() - t0
        return total

    def reset_peak(self) -> int:
        """Start a new peak from now; returns the current RSS sum."""
        with self._lock:
            self.peak_rss = 0
        return self.sample()

    def mark(self) -> None:
        """Start a CPU window now."""
        self.sample()
        with self._lock:
            self._mark = (dict(self._cpu), self._own_cpu_s)

    def cpu_since_mark(self) -> tuple[float, dict[str, float]]:
        """CPU seconds of the run's processes since ``mark`` (processes that started since
        count from zero; ones that ended count up to their last sample), in total and by
        kind of process."""
        self.sample()
        with self._lock:
            assert self._mark is not None
            base, own = self._mark
            by_kind: dict[str, float] = {}
            for pid, c in self._cpu.items():
                kind = _process_kind(self._names.get(pid, ""), pid == self._me.pid)
                by_kind[kind] = by_kind.get(kind, 0.0) + c - base.get(pid, 0.0)
            by_kind["driver"] = by_kind.get("driver", 0.0) - (self._own_cpu_s - own)
            return sum(by_kind.values()), by_kind

    def rss_of(self, needle: str) -> list[int]:
        """RSS of the live processes whose command line contains ``needle``."""
        with self._lock:
            return [r for pid, r in self._rss.items() if needle in self._names.get(pid, "")]


def _process_kind(cmdline: str, driver: bool) -> str:
    if driver:
        return "driver"
    if cmdline.startswith("ray::"):
        return cmdline.split()[0].split(".")[0]  # ray::TrajectoryRunner, ray::IDLE ...
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env",
                 "monitor.py"):
        if name in cmdline:
            return name
    return "other"


# --------------------------------------------------------------------------- one row


@dataclasses.dataclass
class _Row:
    schedule: str
    concurrency: int
    setup: RolloutSetup
    run_dir: Path
    model_factor: float = 1.0
    spares: int = 0
    submitted: list[str] = dataclasses.field(default_factory=list)
    warmup_ids: set[str] = dataclasses.field(default_factory=set)
    window: tuple[float, float] = (0.0, 0.0)
    cpu_s: float = 0.0
    sim_cpu_s: float = 0.0
    cpu_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_window_s: float = 0.0
    queued_left: int = 0
    rss_baseline: int = 0
    peak_rss: int = 0
    peak_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    runner_rss: list[int] = dataclasses.field(default_factory=list)
    startup_s: float = 0.0
    stop_s: float = 0.0
    screenshot_kb: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def _ray_init() -> None:
    import ray

    # Workers of the cluster started here import the project from the repository (as run.py).
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace="bench-rollout",
             logging_level="WARNING", log_to_driver=True)


def _instructions(setup: RolloutSetup, first: int, count: int, *, short: bool = False
                  ) -> list[int]:
    """``count`` task numbers from ``first`` on; ``short``: only those whose drawn episode
    has 3 steps or fewer (the batch schedule's warm-up)."""
    out = []
    i = first
    while len(out) < count:
        if not short or setup.lengths.draw(f"sim task {i}") <= 3:
            out.append(i)
        i += 1
    return out


def _write_tasks(path: Path, numbers: list[int]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i in numbers:
            f.write(json.dumps({"id": f"t{i:07d}", "domain": DOMAIN,
                                "instruction": f"sim task {i}", "config": [],
                                "evaluator": {"func": "infeasible"}}) + "\n")


def _config(row: _Row, tasks: Path, desktop_urls: list[str], reset_command: list[str],
            model_urls: list[str], model_name: str) -> Any:
    from cua_rollout.config import load_config

    s = row.setup
    schedule = "batch" if row.schedule == "batch" else "rollout"
    per_runner = 1 if row.schedule == "actor-per-episode" else s.per_runner(row.concurrency)
    return load_config(None, [*sim_sets(
        row.run_dir, tasks, desktop_urls, reset_command, model_urls, model_name,
        concurrency=row.concurrency, spares=row.spares, per_runner=per_runner,
        schedule=schedule, max_steps=s.lengths.max_steps, history_images=s.history_images,
        action_pause_s=0.0), f"storage.step_files={s.step_files}",
        f"model.images={s.images}"])


def sim_sets(run_dir: Path, tasks: Path, desktop_urls: list[str], reset_command: list[str],
              model_urls: list[str], model_name: str, *, concurrency: int, spares: int,
              per_runner: int, schedule: str, max_steps: int, history_images: int,
              action_pause_s: float) -> list[str]:
    """The ``key=value`` settings of a run on the sim world (static desktops, the sim's model
    servers), as ``--set`` takes them."""
    return [
        f"run.name={run_dir.name}",
        f"run.output_dir={run_dir.parent}",
        f"tasks.source={tasks}",
        f"model.name={model_name}",
        f"model.endpoints={json.dumps(model_urls)}",
        "desktops.provider=static",
        f"desktops.static.urls={json.dumps(desktop_urls)}",
        f"desktops.static.reset_command={json.dumps(reset_command)}",
        "desktops.verify.enabled=false",  # simulated desktops run no real commands
        f"desktops.count={concurrency}",
        f"desktops.warm_spares={spares}",
        f"coordinator.max_concurrent_episodes={concurrency}",
        f"coordinator.episodes_per_runner={per_runner}",
        f"coordinator.schedule={schedule}",
        # Runners wait on I/O; with the default 0.25 CPU each a 2-CPU node would admit only 8
        # runners (actor-per-episode needs one per episode).
        "coordinator.runner_num_cpus=0",
        f"runner.action_pause_s={action_pause_s}",
        f"runner.max_steps={max_steps}",
        f"agent.history_images={history_images}",
        # Each runner process opens at most this many connections to an endpoint (256 by
        # default): past 2 runners x 4 endpoints x 256 = 2,048 episodes, the rest would wait
        # for a connection, not for the model. Routing is not perfectly even: 1.5x.
        "model.max_connections_per_endpoint="
        f"{max(256, math.ceil(1.5 * per_runner / max(1, len(model_urls))))}",
        "monitoring.progress_bar=false",
        "monitoring.metrics_interval_s=2",  # utilization samples inside short windows
    ]


def _model_sim(setup: RolloutSetup, factor: float) -> ModelSim:
    return ModelSim(base_latency_s=setup.model_base_s, per_token_s=setup.per_token_s,
                    speed_factors=(factor,) * setup.model_servers,
                    prefill_s_per_1k_tokens=0.0, capacity=10**6,
                    output_tokens_mean=setup.output_tokens_mean,
                    output_tokens_jitter=setup.output_tokens_jitter,
                    lengths=setup.lengths, seed=setup.seed)


def _episodes_needed(setup: RolloutSetup, concurrency: int, duration_s: float) -> int:
    """Episodes that keep every slot busy for ``duration_s`` (with margin)."""
    step_s = setup.step_s_for(concurrency)
    mean_steps = statistics.fmean(setup.lengths.draw(f"sim task {i}") for i in range(2000))
    return concurrency + math.ceil(1.5 * concurrency * duration_s / (step_s * mean_steps))


def _run_row(row: _Row, desktops: SimWorld, sampler: _ProcessSampler, next_task: int) -> int:
    """Run one measurement; fills ``row``; returns the next unused task number."""
    import ray

    from cua_rollout.runtime.launch import start_actors, stop_actors
    from cua_rollout.runtime.loader import TaskLoader

    s = row.setup
    k = row.concurrency
    row.model_factor = s.model_factor_for(k)
    row.spares = s.spares_for(k)
    row.run_dir.mkdir(parents=True)
    tasks = row.run_dir.parent / f"{row.run_dir.name}.jsonl"
    if row.schedule == "batch":
        warm = _instructions(s, next_task, k, short=True)
        measured = _instructions(s, warm[-1] + 1, k)
        numbers = warm + measured
        row.warmup_ids = {f"{DOMAIN}/t{i:07d}/0" for i in warm}
    else:
        numbers = _instructions(s, next_task,
                                _episodes_needed(s, k, s.warmup_s + s.window_for(k) + 10))
    _write_tasks(tasks, numbers)
    with SimWorld(model_servers=s.model_servers, model=_model_sim(s, row.model_factor)) as world:
        sampler.exclude(world.pids)
        desktops.reset_stats()
        cfg = _config(row, tasks, desktops.desktop_urls[:k + row.spares],
                      desktops.reset_command, world.model_urls, world.model.model)
        row.rss_baseline = sampler.reset_peak()
        started = time.monotonic()
        actors, _ = start_actors(cfg, row.run_dir, None, {"run": row.run_dir.name,
                                                           "bench": row.schedule})
        status = "failed"
        try:
            specs = TaskLoader(cfg.tasks, row.run_dir).poll()
            row.submitted = [spec.episode_id for spec in specs]
            ray.get(actors.coordinator.submit.remote(specs), timeout=60)
            sims = [world, desktops]
            if row.schedule == "batch":
                _measure_batch(row, actors.coordinator, sampler, sims, started)
            else:
                _measure_window(row, actors.coordinator, sampler, sims, started)
                # Steps running at the window's end finish (their time counts).
                _drain(actors.coordinator, max(s.drain_grace_s, 1.3 * s.step_s_for(k)))
            row.queued_left = ray.get(actors.coordinator.stats.remote(),
                                      timeout=60)["episodes_queued"]
            # What the drain cancelled is in the staging area, which the run's end sweeps:
            # kept aside for the analysis (nothing is in flight now).
            with contextlib.suppress(FileNotFoundError):
                (row.run_dir / ATTEMPTS_DIR).rename(row.run_dir / KEPT_ATTEMPTS_DIR)
            status = "finished"
        finally:
            row.peak_rss = sampler.peak_rss
            row.peak_by_kind = dict(sampler.peak_by_kind)
            stopping = time.monotonic()
            stop_actors(actors, status, None)
            row.stop_s = time.monotonic() - stopping
        shots = desktops.stats(sessions=False)["desktops"]
        if shots["totals"]["screenshot"]:
            row.screenshot_kb = shots["bytes_sent"] / 1024 / shots["totals"]["screenshot"]
    return numbers[-1] + 1


# Where a row keeps the staging area as the drain left it (the run's end sweeps it).
KEPT_ATTEMPTS_DIR = ".attempts-after-drain"


def _drain(coordinator: Any, grace_s: float, timeout_s: float = 120.0) -> None:
    """Stop starting episodes and let the running ones end for ``grace_s``; cancel what is
    left (run.py's first and second Ctrl-C) and wait until nothing is in flight. Episodes
    cancelled this late have all started (their staging directory exists)."""
    import ray

    ray.get(coordinator.drain.remote(False, 0.0), timeout=60)
    deadline = time.monotonic() + grace_s
    while _poll(coordinator)["stats"]["episodes_in_flight"]:
        if time.monotonic() > deadline:
            ray.get(coordinator.cancel_all.remote(), timeout=60)
            break
        time.sleep(0.2)
    deadline = time.monotonic() + timeout_s
    while _poll(coordinator)["stats"]["episodes_in_flight"]:
        if time.monotonic() > deadline:
            raise RuntimeError("cancelled episodes did not end")
        time.sleep(0.2)


def _staged_episodes(run_dir: Path) -> set[str]:
    """The episodes with a staging directory left after the drain (``layout.staging_name``:
    the flattened id, the attempt, the nonce)."""
    attempts = run_dir / KEPT_ATTEMPTS_DIR
    if not attempts.is_dir():
        return set()
    return {unquote(p.name.rsplit(".", 2)[0]) for p in attempts.iterdir()
            if p.is_dir() and p.name.count(".") >= 2}


def _poll(coordinator: Any) -> dict[str, Any]:
    import ray

    return ray.get(coordinator.poll.remote(), timeout=60)


def _sim_cpu_s(sims: list[SimWorld]) -> float:
    return sum(sum(w.cpu_s().values()) for w in sims)


def _measure_window(row: _Row, coordinator: Any, sampler: _ProcessSampler,
                    sims: list[SimWorld], started: float) -> None:
    """Warm up (``warmup_s`` and every slot stepped), then a ``window_s`` wall-time window,
    polling like run.py's driver."""
    s = row.setup
    # Every slot's first step needs concurrency / fleet_steps_per_s of the fleet's time
    # (82 s at 4096): the wait scales with it.
    timeout_s = max(s.startup_timeout_s, 3 * s.step_s_for(row.concurrency) + 30)
    deadline = started + timeout_s
    all_stepped: float | None = None
    while True:
        stats = _poll(coordinator)["stats"]
        if all_stepped is None and stats.get("steps", 0) >= row.concurrency:
            all_stepped = time.monotonic() - started
        if all_stepped is not None and time.monotonic() >= started + s.warmup_s:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{row.schedule} at {row.concurrency}: the slots did not all "
                               f"step within {timeout_s:.0f}s ({stats})")
        time.sleep(0.5)
    row.startup_s = all_stepped
    row.runner_rss = sampler.rss_of("TrajectoryRunner")
    sim0 = _sim_cpu_s(sims)
    sampler.mark()
    w0 = time.time()
    end = time.monotonic() + s.window_for(row.concurrency)
    while time.monotonic() < end:
        stats = _poll(coordinator)["stats"]
        if stats["episodes_queued"] == 0:
            row.notes.append("the queue ran dry in the window")
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    row.cpu_s, row.cpu_by_kind = sampler.cpu_since_mark()
    row.sim_cpu_s = _sim_cpu_s(sims) - sim0
    row.window = (w0, time.time())
    row.cpu_window_s = row.window[1] - row.window[0]


def _measure_batch(row: _Row, coordinator: Any, sampler: _ProcessSampler,
                   sims: list[SimWorld], started: float) -> None:
    """The warm-up batch, then one measured batch to its last episode."""
    done: set[str] = set()
    deadline = started + row.setup.startup_timeout_s
    while not row.warmup_ids <= done:
        done.update(r["episode_id"] for r in _poll(coordinator)["finished"])
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch at {row.concurrency}: the warm-up batch did not end "
                               f"within {row.setup.startup_timeout_s:.0f}s")
        time.sleep(0.1)
    row.startup_s = time.monotonic() - started
    row.runner_rss = sampler.rss_of("TrajectoryRunner")
    sim0 = _sim_cpu_s(sims)
    sampler.mark()
    w0 = time.time()
    budget = time.monotonic() + 4 * row.setup.batch_budget_s
    while len(done) < len(row.submitted):
        done.update(r["episode_id"] for r in _poll(coordinator)["finished"])
        if time.monotonic() > budget:
            raise RuntimeError(f"batch at {row.concurrency}: the measured batch did not end")
        time.sleep(0.1)
    row.cpu_s, row.cpu_by_kind = sampler.cpu_since_mark()
    row.sim_cpu_s = _sim_cpu_s(sims) - sim0
    row.cpu_window_s = time.time() - w0
    row.window = (w0, time.time())


# --------------------------------------------------------------------------- figures


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a results or trajectory file (the result tools' reader)."""
    rows, problems = read_jsonl(path)
    if problems:
        raise RuntimeError(f"unreadable lines in {path}: {problems[0]}")
    return [record for _, record in rows]


def _timestamp_s(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y%m%d@%H%M%S%f").timestamp()


def _percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _utilization_in(run_dir: Path, w0: float, w1: float) -> dict[str, Any] | None:
    """The means of metrics.jsonl's utilization over the samples whose interval lies in
    [w0, w1] (each weighted by its interval), and of the model servers' summary."""
    samples = [x for x in _read_jsonl(run_dir / METRICS_FILE)
               if (x.get("utilization") or {}).get("desktop") and x["t"] <= w1 + 0.5
               and x["t"] - x["utilization"]["window_s"] >= w0 - 0.5]
    if not samples:
        return None
    weights = [x["utilization"]["window_s"] for x in samples]
    total = sum(weights)

    def mean(values: list[float | None]) -> float | None:
        known = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
        return round(sum(v * w for v, w in known) / sum(w for _, w in known), 4) \
            if known else None

    utils = [x["utilization"] for x in samples]
    servers = [(x.get("model_servers") or {}).get("summary") or {} for x in samples]
    return {
        "window_s": round(total, 2),
        "desktop": {state: mean([u["desktop"][state] for u in utils])
                    for state in utils[0]["desktop"]},
        "actions_per_min": mean([u["actions_per_min"] for u in utils]),
        "step_s": {phase: mean([(u["step_s"] or {}).get(phase) for u in utils])
                   for phase in ("model", "action", "pause", "screenshot", "overhead")},
        "model_servers": {key: mean([x.get(key) for x in servers])
                          for key in ("running", "waiting", "generation_tokens_per_s",
                                      "prompt_tokens_per_s", "mean_inference_time_s")},
    }


def _figures(row: _Row) -> dict[str, Any]:
    s = row.setup
    k = row.concurrency
    results = _read_jsonl(row.run_dir / RESULTS_FILE)
    recorded = [r["episode_id"] for r in results]
    episodes: dict[str, dict[str, Any]] = {r["episode_id"]: r for r in results}
    cancelled: set[str] = set()
    steps: list[dict[str, Any]] = []
    # Attempts cancelled by the drain (and any not recorded) are in their staging
    # directories: the runners write them, and only a results line moves one into place.
    staged = _staged_episodes(row.run_dir)
    for path in [*(row.run_dir / DOMAIN).glob(f"*/*/{EPISODE_FILE}"),
                 *(row.run_dir / KEPT_ATTEMPTS_DIR).glob(f"*/{EPISODE_FILE}")]:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record["episode_id"] not in episodes:
            episodes[record["episode_id"]] = record
            if record.get("status") == Status.CANCELLED:
                cancelled.add(record["episode_id"])
    for path in [*(row.run_dir / DOMAIN).glob(f"*/*/{TRAJ_FILE}"),
                 *(row.run_dir / KEPT_ATTEMPTS_DIR).glob(f"*/{TRAJ_FILE}")]:
        # A step cancelled by the drain before its desktop part ended has no timing.
        steps.extend(st for st in _read_jsonl(path) if st.get("timing"))
    for st in steps:
        # The record is made right after the model replied: the step began model_s before.
        st["_start"] = _timestamp_s(st["action_timestamp"]) - st["timing"]["model_s"]
        st["_end"] = st["_start"] + st["timing"]["step_s"]
    if row.schedule == "batch":
        measured = [episodes[e] for e in row.submitted if e not in row.warmup_ids
                    and e in episodes]
        w0 = max(episodes[e]["ended_at"] for e in row.warmup_ids)
        w1 = max(e["ended_at"] for e in measured)
    else:
        w0, w1 = row.window
    window_s = w1 - w0
    in_window = [st for st in steps if w0 <= st["_start"] < w1]
    sim_s = [_sim_step_s(s, k, st) for st in in_window]
    overhead = sorted(st["timing"]["step_s"] - sim for st, sim in zip(in_window, sim_s,
                                                                       strict=True))
    # Where the overhead sits: around the model call, around the desktop calls, in between.
    model_extra = [st["timing"]["model_s"] - s.model_s(k, st["completion_tokens"])
                   for st in in_window]
    env_extra = [st["timing"]["env_s"] - (0.0 if st["action"] in TERMINAL_ACTIONS
                                          else s.action_s + s.screenshot_s)
                 for st in in_window]
    runner_overhead = sorted(st["timing"]["overhead_s"] for st in in_window)
    leased = 0.0
    for e in episodes.values():
        start = e["started_at"] + (e.get("timing") or {}).get("lease_wait_s", 0.0)
        leased += max(0.0, min(e["ended_at"], w1) - max(start, w0))
    steps_per_s = _steps_in(steps, w0, w1) / window_s if window_s > 0 else 0.0
    mean_sim_s = statistics.fmean(sim_s) if sim_s else float("nan")
    ideal = k / mean_sim_s if sim_s else float("nan")
    # CPU is counted over the sampler's window; steps in that same window.
    cpu_steps = _steps_in(steps, *row.window)
    unique = set(recorded)
    submitted = set(row.submitted)
    # Started (its directory exists) but not recorded after the drain: cancelled. An
    # episode cancelled while it was finishing has no episode.json (runner: a cancellation
    # inside _finish skips the remaining writes); it is counted apart.
    unrecorded = submitted - unique
    started = {e for e in unrecorded if e in staged or (row.run_dir / e).is_dir()}
    cancelled_unwritten = started - cancelled
    lost = len(unrecorded) - len(started) - row.queued_left
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    history_mb = s.history_images * (row.screenshot_kb or 0.0) / 1024
    return {
        "schedule": row.schedule,
        "concurrency": k,
        "steps_per_s": round(steps_per_s, 2),
        "ideal_steps_per_s": round(ideal, 2),
        "ratio": round(steps_per_s / ideal, 3) if sim_s else None,
        "desktop_utilization": round(leased / (k * window_s), 3) if window_s > 0 else None,
        "overhead_ms_p50": _ms(_percentile(overhead, 0.50)),
        "overhead_ms_p99": _ms(_percentile(overhead, 0.99)),
        "cpu_ms_per_step": round(1000 * row.cpu_s / cpu_steps, 2) if cpu_steps else None,
        "peak_rss_mb": round(row.peak_rss / 2**20, 1),
        "lost": lost,
        "duplicated": len(recorded) - len(unique) + len(unique - submitted),
        # extras
        "status": "measured",
        "window_s": round(window_s, 2),
        "steps": round(_steps_in(steps, w0, w1), 1),
        "mean_sim_step_s": round(mean_sim_s, 4),
        "model_slowdown": round(row.model_factor, 3),
        "runner_overhead_ms_p50": _ms(_percentile(runner_overhead, 0.50)),
        "runner_overhead_ms_p99": _ms(_percentile(runner_overhead, 0.99)),
        "overhead_ms_mean": _ms(statistics.fmean(overhead)) if overhead else None,
        "model_call_overhead_ms_mean": _ms(statistics.fmean(model_extra))
        if model_extra else None,
        "env_call_overhead_ms_mean": _ms(statistics.fmean(env_extra)) if env_extra else None,
        "desktop_utilization_pool": round(leased / ((k + row.spares) * window_s), 3)
        if window_s > 0 else None,
        "warm_spares": row.spares,
        "cpu_cores_used": round(row.cpu_s / row.cpu_window_s, 2) if row.cpu_window_s else None,
        "sim_cpu_cores_used": round(row.sim_cpu_s / row.cpu_window_s, 2)
        if row.cpu_window_s else None,
        "rss_baseline_mb": round(row.rss_baseline / 2**20, 1),
        "peak_rss_mb_by_process": {kind: round(r / 2**20) for kind, r in sorted(
            row.peak_by_kind.items(), key=lambda kv: -kv[1])},
        "rss_per_episode_mb": round((row.peak_rss - row.rss_baseline) / 2**20 / k, 2),
        "memory_target_mb_per_episode": round(2 * history_mb + 1, 2),
        "screenshot_kb": round(row.screenshot_kb, 1) if row.screenshot_kb else None,
        "cpu_ms_per_step_by_process": {
            kind: round(1000 * c / cpu_steps, 2)
            for kind, c in sorted(row.cpu_by_kind.items(), key=lambda kv: -kv[1])
            if cpu_steps and c > 0.00005 * cpu_steps},
        "runner_processes": len(row.runner_rss),
        "runner_rss_mb_mean": round(statistics.fmean(row.runner_rss) / 2**20, 1)
        if row.runner_rss else None,
        # What the run itself reported (metrics.jsonl) for the window: the desktops' time
        # split, actions/min, the step split, the model servers' load (issue 19).
        "utilization": _utilization_in(row.run_dir, w0, w1),
        "startup_s": round(row.startup_s, 1),
        "stop_s": round(row.stop_s, 1),
        "submitted": len(submitted),
        "recorded": len(unique),
        "cancelled": len(started),
        "cancelled_without_episode_json": len(cancelled_unwritten),
        "queued_left": row.queued_left,
        "statuses": statuses,
        "notes": sorted(set(row.notes)),
    }


def _sim_step_s(setup: RolloutSetup, k: int, step: dict[str, Any]) -> float:
    """The simulated time of a step: the sim model's latency for its reply, and for any step
    but an episode's last (finished(): no action, no screenshot) action + screenshot."""
    model_s = setup.model_s(k, step["completion_tokens"])
    if step["action"] in TERMINAL_ACTIONS:
        return model_s
    return model_s + setup.action_s + setup.screenshot_s  # + action_pause_s, which is 0


def _steps_in(steps: list[dict[str, Any]], w0: float, w1: float) -> float:
    """Steps done in [w0, w1), each counted by the share of its wall time inside: episodes
    that step in lockstep (they all start together) make a count of whole steps depend on
    where the window's edges fall."""
    done = 0.0
    for st in steps:
        inside = min(st["_end"], w1) - max(st["_start"], w0)
        if inside > 0:
            done += inside / max(st["_end"] - st["_start"], 1e-9)
    return done


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


def _skipped(schedule: str, k: int, reason: str, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {key: None for key in RESULT_KEYS}
    row.update(schedule=schedule, concurrency=k, status="skipped", reason=reason, **extra)
    return row


def _skip_reason(schedule: str, k: int, setup: RolloutSetup,
                 measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A skipped row when this measurement would not fit the machine or the time budget."""
    import psutil

    if schedule == "actor-per-episode":
        ape = [r for r in measured if r["schedule"] == schedule and r["status"] == "measured"
               and r.get("runner_rss_mb_mean")]
        if not ape:
            return None  # the smallest level is measured: it gives the per-actor figures
        per_actor_mb = ape[0]["runner_rss_mb_mean"]
        # Until every slot stepped once: the actors' start, then about one step.
        k0 = ape[0]["concurrency"]
        start_s_per_actor = max(0.05, (ape[0]["startup_s"] - setup.step_s_for(k0)) / k0)
        need_mb = k * per_actor_mb
        free_mb = psutil.virtual_memory().available / 2**20
        start_s = k * start_s_per_actor
        extra = {"extrapolated_runner_rss_mb": round(need_mb), "per_actor_rss_mb": per_actor_mb,
                 "extrapolated_startup_s": round(start_s, 1),
                 "free_memory_mb": round(free_mb)}
        if need_mb > setup.ape_memory_share * free_mb:
            return _skipped(schedule, k, f"{k} runner processes x {per_actor_mb:.0f} MB "
                            f"(measured at {ape[0]['concurrency']}) = {need_mb / 1024:.1f} GB "
                            f"> {setup.ape_memory_share:.0%} of the {free_mb / 1024:.1f} GB "
                            "free", **extra)
        if start_s > setup.ape_start_budget_s:
            return _skipped(schedule, k, f"{k} runner processes would take ~{start_s:.0f} s "
                            f"to start ({start_s_per_actor:.2f} s each, measured at "
                            f"{ape[0]['concurrency']}) > the {setup.ape_start_budget_s:.0f} s "
                            "budget", **extra)
    if schedule == "batch":
        step_s = setup.step_s_for(k)
        numbers = _instructions(setup, 10**6, k)
        longest = max(setup.lengths.draw(f"sim task {i}") for i in numbers)
        batch_s = longest * step_s
        if batch_s > setup.batch_budget_s:
            return _skipped(schedule, k, f"one batch of {k} episodes lasts ~{longest} steps x "
                            f"{step_s:.1f} s = {batch_s:.0f} s > the "
                            f"{setup.batch_budget_s:.0f} s budget per batch row",
                            extrapolated_batch_s=round(batch_s))
    return None


# --------------------------------------------------------------------------- the benchmark


def run_rollout_benchmark(
    setup: RolloutSetup,
    *,
    schedules: tuple[str, ...] = SCHEDULES,
    levels: tuple[int, ...] | None = None,
    log: Any = print,
    keep: bool = False,
) -> list[dict[str, Any]]:
    """One row per (schedule, level), measured or skipped with its reason."""
    import ray

    levels = tuple(sorted(levels or setup.levels))
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    rows: list[dict[str, Any]] = []
    desktop_sim = DesktopSim(action_latency=Latency(setup.action_s),
                             screenshot_latency=Latency(setup.screenshot_s),
                             reset_latency=setup.reset, seed=setup.seed)
    top = max(levels)
    sampler = _ProcessSampler()
    started_ray = False
    try:
        with SimWorld(desktops=top + setup.spares_for(top), desktop=desktop_sim) as desktops:
            sampler.exclude(desktops.pids)
            if not ray.is_initialized():
                _ray_init()
                started_ray = True
            sampler.start()
            next_task = 0
            for schedule in schedules:
                for k in levels:
                    skipped = _skip_reason(schedule, k, setup, rows)
                    if skipped is not None:
                        log(f"{schedule} x {k}: skipped: {skipped['reason']}")
                        rows.append(skipped)
                        continue
                    row = _Row(schedule, k, setup, tmp / f"{schedule}-{k}")
                    t0 = time.monotonic()
                    next_task = _run_row(row, desktops, sampler, next_task)
                    figures = _figures(row)
                    previous = [r for r in rows if r["schedule"] == schedule
                                and r.get("status") == "measured"]
                    if previous:
                        grown = figures["peak_rss_mb"] - previous[-1]["peak_rss_mb"]
                        figures["rss_marginal_mb_per_episode"] = round(
                            grown / (k - previous[-1]["concurrency"]), 2)
                    rows.append(figures)
                    if not keep:
                        shutil.rmtree(row.run_dir, ignore_errors=True)
                    log(f"{schedule} x {k}: {figures['steps_per_s']} steps/s "
                        f"(ideal {figures['ideal_steps_per_s']}, ratio {figures['ratio']}), "
                        f"cpu {figures['cpu_ms_per_step']} ms/step, "
                        f"{time.monotonic() - t0:.0f}s")
                    if (util := figures.get("utilization")) is not None:
                        d, servers = util["desktop"], util["model_servers"]
                        log(f"  utilization: desktops leased {d['leased']:.0%} (acting "
                            f"{d['acting']:.0%}, model {d['model_wait']:.0%}, other "
                            f"{d['other']:.0%}), resetting {d['resetting']:.0%}, idle "
                            f"{d['idle']:.0%}; {util['actions_per_min']:.0f} actions/min; "
                            f"servers {_num(servers['running'], 1)} running, "
                            f"{_num(servers['generation_tokens_per_s'], 0)} tok/s")
    finally:
        sampler.stop()
        if started_ray:
            ray.shutdown()
        if keep:
            log(f"run directories kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------- peer settings


_NEVER_FINISHES = EpisodeLengths(median_steps=1000, tail_fraction=0.0, min_steps=1000,
                                 max_steps=1000)
"""The sim model never answers ``finished()`` within ``runner.max_steps``: every episode
runs its ``max_steps`` steps, each with an action."""


@dataclasses.dataclass(frozen=True)
class PeerSetup:
    """The peer's settings (issue 17), as the original system was measured: ``run.py`` on
    the sim world, actions counted for ``window_s`` from the command's start."""

    levels: tuple[int, ...] = (16, 64)
    window_s: float = 183.0          # from the command's start: start-up included
    model_s: float = 1.6             # one generation (no per-token part, no jitter)
    action_s: float = 1.0            # /execute of an action
    pause_s: float = 2.0             # runner.action_pause_s
    screenshot_s: float = 0.2        # /screenshot
    screen_width: int = 1920
    screen_height: int = 1080
    max_steps: int = 15
    rollouts_per_task: int = 2
    history_images: int = 5
    history_texts: int = 35
    model_servers: int = 4
    reset: Latency = _RESET
    episodes_per_runner: int | None = None  # None: one runner per core, as the rows
    running_ray: bool = False        # run.py joins a local cluster started before the clock
    stop_timeout_s: float = 120.0    # run.py's exit after the two Ctrl-C
    seed: int = 0

    def step_s(self) -> float:
        """One step's simulated time: 1.6 + 1.0 + 2.0 + 0.2 = 4.8 s."""
        return self.model_s + self.action_s + self.pause_s + self.screenshot_s

    def ideal_per_min(self, concurrency: int) -> float:
        return 60.0 * concurrency / self.step_s()

    def tasks_for(self, concurrency: int) -> int:
        """Tasks that keep ``concurrency`` episodes busy past the window (x1.5, plus one
        episode per slot), each task being ``rollouts_per_task`` episodes."""
        episode_s = self.max_steps * self.step_s()
        episodes = concurrency + math.ceil(1.5 * concurrency * self.window_s / episode_s)
        return math.ceil(episodes / self.rollouts_per_task)


PEER = PeerSetup()


def _peer_config(setup: PeerSetup, k: int, run_dir: Path, tasks: Path, world: SimWorld,
                 ray_address: str | None = None) -> Path:
    """Write (and validate) the run's YAML config: the rows' sim-world settings with the
    peer's runner, tasks and Ray settings; returns its path."""
    import yaml

    from cua_rollout.config import load_config

    sets = sim_sets(
        run_dir, tasks, world.desktop_urls, world.reset_command, world.model_urls,
        world.model.model, concurrency=k, spares=_spares_for(k),
        per_runner=_per_runner(k, setup.episodes_per_runner), schedule="rollout",
        max_steps=setup.max_steps, history_images=setup.history_images,
        action_pause_s=setup.pause_s)
    sets += [
        f"agent.history_texts={setup.history_texts}",
        f"tasks.rollouts_per_task={setup.rollouts_per_task}",
        f"desktops.screen_width={setup.screen_width}",
        f"desktops.screen_height={setup.screen_height}",
    ]
    if ray_address:
        sets.append(f"ray.address={ray_address}")
    else:
        sets += [f"ray.num_cpus={os.cpu_count() or 1}",
                 "ray.include_dashboard=false"]  # as every benchmark's cluster (no port clash)
    cfg = load_config(None, sets)  # a bad setting fails here, not in the subprocess
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True),
                                   sort_keys=False), encoding="utf-8")
    if load_config(path) != cfg:
        raise RuntimeError(f"{path} does not read back as the config it was written from")
    return path


def _start_marked_cluster(env: dict[str, str], work: Path) -> str:
    """``ray start --head`` (no dashboard) in the row's environment, so that its processes
    carry the row's marker and end with the row; its address. The service mode: a cluster
    kept running, that each ``run.py`` joins (``ray.address``)."""
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(port),
         f"--num-cpus={os.cpu_count() or 1}",
         "--include-dashboard=false", "--disable-usage-stats", "--temp-dir",
         str(work / "r")],
        env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise RuntimeError(f"ray start failed ({out.returncode}): {out.stderr[-2000:]}")
    return f"127.0.0.1:{port}"


def _get_json(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _peer_counts(world: SimWorld) -> tuple[int, int, int]:
    """Actions the sim desktops received so far (counted when the ``/execute`` arrives;
    resets are counted apart), chat requests the sim models received, and those in flight."""
    bases = dict.fromkeys(url.rsplit("/d/", 1)[0] for url in world.desktop_urls)
    actions = sum(_get_json(f"{b}/_sim/stats")["totals"]["action"] for b in bases)
    models = [_get_json(f"{u}/_sim/stats") for u in world.model_urls]
    return (actions, sum(m["requests"] for m in models), sum(m["in_flight"] for m in models))


@dataclasses.dataclass
class _PeerWatch:
    """What the driver saw of one peer row while run.py ran (times from the command's start)."""

    samples: list[tuple[float, int, int, int]] = dataclasses.field(default_factory=list)
    at: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)
    first_request_s: float | None = None
    first_action_s: float | None = None
    exited: int | None = None        # run.py's exit code if it ended inside the window


def _peer_watch(world: SimWorld, proc: Any, t0: float, setup: PeerSetup) -> _PeerWatch:
    """Sample the sim's counters every 0.2 s until the first action, then every second, and
    exactly at ``window - action_s`` and ``window`` (the actions completed and started)."""
    w = _PeerWatch()
    marks = {"completed": setup.window_s - setup.action_s, "started": setup.window_s}
    tick = 0.0
    while True:
        now = time.monotonic() - t0
        pending = {name: t for name, t in marks.items() if name not in w.at}
        if not pending:
            return w
        due = [name for name, t in pending.items() if now >= t]
        if proc.poll() is not None:
            w.exited = proc.returncode
            return w
        if due or now >= tick:
            before = time.monotonic() - t0
            actions, requests, in_flight = _peer_counts(world)
            t = (before + time.monotonic() - t0) / 2
            w.samples.append((round(t, 3), actions, requests, in_flight))
            for name in due:
                w.at[name] = (round(t, 3), actions)
            if w.first_request_s is None and requests:
                w.first_request_s = t
            if w.first_action_s is None and actions:
                w.first_action_s = t
            tick = now + (1.0 if w.first_action_s is not None else 0.2)
            continue
        nxt = min(tick, *pending.values())
        time.sleep(max(0.0, min(0.2, nxt - (time.monotonic() - t0))))


def _stop_driver(proc: Any, timeout_s: float) -> tuple[int | None, list[str]]:
    """run.py's Ctrl-C twice (stop starting, cancel the running episodes), by its pid; its
    process group is killed only if it does not exit within ``timeout_s``."""
    import signal
    import subprocess

    notes: list[str] = []
    for _ in range(2):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.5)
    try:
        return proc.wait(timeout=timeout_s), notes
    except subprocess.TimeoutExpired:
        notes.append(f"run.py did not exit {timeout_s:.0f} s after two SIGINT: its process "
                     "group was killed")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group is its own
        proc.wait()
        return None, notes


def _marked_cpu_s(marker: str) -> float:
    """CPU seconds so far of the live processes of the run (run.py and its Ray cluster)."""
    import psutil

    from benchmarks.chaos import marked

    total = 0.0
    for p in marked(marker):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _traj_actions(run_dir: Path, t_end: float, action_s: float) -> tuple[int, list[float]]:
    """Cross-check from the run's files: the actions whose trajectory line says they were
    sent (``action_timestamp``, right after the model's reply) ``action_s`` before
    ``t_end`` or earlier, and the wall time of each step (timing.step_s) of the window."""
    done = 0
    step_s: list[float] = []
    for path in run_dir.glob(f"{DOMAIN}/*/*/{TRAJ_FILE}"):
        for st in _read_jsonl(path):
            if st.get("action") in TERMINAL_ACTIONS or "action_timestamp" not in st:
                continue
            sent = _timestamp_s(st["action_timestamp"])
            if sent + action_s <= t_end:
                done += 1
                if st.get("timing"):
                    step_s.append(st["timing"]["step_s"])
    return done, sorted(step_s)


def run_peer_row(setup: PeerSetup, k: int, *, log: Any = print, keep: bool = False
                 ) -> dict[str, Any]:
    """One peer row: the sim world in its own processes, then ``python run.py --config``
    (its own Ray cluster) started and counted for ``window_s``, then stopped."""
    import subprocess
    import uuid

    import psutil

    from benchmarks.chaos import MARKER_ENV, end_marked

    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    run_dir = work / "results" / f"peer-{k}"
    run_dir.mkdir(parents=True)
    tasks = work / f"peer-{k}.jsonl"
    n_tasks = setup.tasks_for(k)
    _write_tasks(tasks, list(range(n_tasks)))
    desktop = DesktopSim(action_latency=Latency(setup.action_s),
                         screenshot_latency=Latency(setup.screenshot_s),
                         reset_latency=setup.reset, screen_width=setup.screen_width,
                         screen_height=setup.screen_height, seed=setup.seed)
    model = ModelSim(base_latency_s=setup.model_s, per_token_s=0.0,
                     prefill_s_per_1k_tokens=0.0, capacity=10**6, lengths=_NEVER_FINISHES,
                     screen_width=setup.screen_width, screen_height=setup.screen_height,
                     seed=setup.seed)
    marker = f"bench-peer-{k}-{uuid.uuid4().hex[:12]}"
    notes: list[str] = []
    row: dict[str, Any] = {"concurrency": k, "ray": "running" if setup.running_ray else "own"}
    proc = None
    try:
        with SimWorld(desktops=k + _spares_for(k), model_servers=setup.model_servers,
                      desktop=desktop, model=model) as world:
            env = {**os.environ, MARKER_ENV: marker, "RAY_TMPDIR": str(work / "r")}
            if setup.running_ray:  # one token for the cluster and run.py, whatever ~/.ray holds
                env.pop("RAY_AUTH_TOKEN_PATH", None)
                env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex})
            address = _start_marked_cluster(env, work) if setup.running_ray else None
            config = _peer_config(setup, k, run_dir, tasks, world, address)
            driver_log = work / f"peer-{k}.log"
            sim_cpu0 = sum(world.cpu_s().values())
            load0 = os.getloadavg()[0]
            psutil.cpu_percent(None)
            log(f"peer x {k}: run.py --config {config} ({n_tasks} tasks x "
                f"{setup.rollouts_per_task}), counting for {setup.window_s:.0f} s")
            with driver_log.open("wb") as out:
                t0_wall = time.time()
                t0 = time.monotonic()
                proc = subprocess.Popen(
                    [sys.executable, str(ROOT / "run.py"), "--config", str(config)],
                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, env=env)
            try:
                watch = _peer_watch(world, proc, t0, setup)
                run_cpu_s = _marked_cpu_s(marker)
                busy = psutil.cpu_percent(None)
                sim_cpu_s = sum(world.cpu_s().values()) - sim_cpu0
            finally:
                stopping = time.monotonic()
                code, stop_notes = _stop_driver(proc, setup.stop_timeout_s)
                notes += stop_notes
                stop_s = time.monotonic() - stopping
                left = end_marked(marker, grace_s=30.0)
                if left and not setup.running_ray:  # else: the cluster, ended here
                    notes.append(f"processes of the run outlived run.py (killed): {left}")
        if watch.exited is not None:
            notes.append(f"run.py exited ({watch.exited}) inside the window")
        row.update(_peer_figures(setup, k, watch, run_dir, t0_wall))
        row.update(_peer_startup(driver_log, t0_wall))
        row.update({
            "run_exit_code": code, "stop_s": round(stop_s, 1),
            "run_cpu_cores": round(run_cpu_s / setup.window_s, 2),
            "sim_cpu_cores": round(sim_cpu_s / setup.window_s, 2),
            "machine_cpu_busy_pct": busy, "load_avg_at_start": round(load0, 2),
            "tasks": n_tasks, "warm_spares": _spares_for(k),
            "episodes_per_runner": _per_runner(k, setup.episodes_per_runner),
            "notes": notes,
        })
        if watch.exited is not None or code not in (130, 0):
            text = driver_log.read_text(errors="replace").splitlines()
            row["log_tail"] = text[-30:]
        return row
    finally:
        if proc is not None and proc.poll() is None:  # the driver was interrupted early
            _stop_driver(proc, 10.0)
            end_marked(marker, grace_s=10.0)
        if keep:
            log(f"peer x {k}: run directory, config and run.py's log kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _peer_figures(setup: PeerSetup, k: int, w: _PeerWatch, run_dir: Path,
                  t0_wall: float) -> dict[str, Any]:
    window = setup.window_s
    ideal = setup.ideal_per_min(k)
    completed = w.at.get("completed", (None, None))[1]
    started = w.at.get("started", (None, None))[1]
    per_min = 60.0 * completed / window if completed is not None else None
    bins: list[int] = []
    last = 0
    for edge in range(10, int(window) + 10, 10):
        upto = [a for t, a, _, _ in w.samples if t <= edge]
        now = upto[-1] if upto else 0
        bins.append(now - last)
        last = now
    traj_done, step_s = _traj_actions(run_dir, t0_wall + window, setup.action_s)
    results = _read_jsonl(run_dir / RESULTS_FILE) if (run_dir / RESULTS_FILE).exists() else []
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "actions": completed,
        "actions_per_min": round(per_min, 1) if per_min is not None else None,
        "ideal_actions_per_min": round(ideal, 1),
        "ratio": round(per_min / ideal, 3) if per_min is not None else None,
        "startup_s": round(w.first_action_s, 2) if w.first_action_s is not None else None,
        "first_model_request_s": round(w.first_request_s, 2)
        if w.first_request_s is not None else None,
        "window_s": window,
        "actions_started": started,
        "startup_share": round(w.first_action_s / window, 3)
        if w.first_action_s is not None else None,
        "step_efficiency": round(setup.step_s() / statistics.fmean(step_s), 4)
        if step_s else None,
        "actions_per_10s": bins,
        "traj_actions": traj_done,
        "step_s_p50": round(step_s[len(step_s) // 2], 3) if step_s else None,
        "step_s_p99": round(_percentile(step_s, 0.99), 3) if step_s else None,
        "sim_step_s": round(setup.step_s(), 3),
        "episodes_recorded": len(results),
        "statuses": statuses,
        "settings": {"model_s": setup.model_s, "action_s": setup.action_s,
                     "action_pause_s": setup.pause_s, "screenshot_s": setup.screenshot_s,
                     "screen": f"{setup.screen_width}x{setup.screen_height}",
                     "max_steps": setup.max_steps,
                     "rollouts_per_task": setup.rollouts_per_task,
                     "history_images": setup.history_images,
                     "history_texts": setup.history_texts,
                     "model_servers": setup.model_servers},
    }


def _peer_startup(driver_log: Path, t0_wall: float) -> dict[str, Any]:
    """Where the start-up went, from run.py's log line ``N desktops ready in X s`` (logged
    when its actors are up, X after they were created, i.e. after Ray had started)."""
    import re

    pattern = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO run: \d+ "
                         r"desktops ready in ([\d.]+)s")
    for line in driver_log.read_text(errors="replace").splitlines():
        m = pattern.match(line)
        if m:
            ready = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0_wall
            return {"actors_ready_s": round(ready, 1),
                    "ray_ready_s": round(ready - float(m[2]), 1)}
    return {"actors_ready_s": None, "ray_ready_s": None}


def run_peer_benchmark(setup: PeerSetup, *, log: Any = print, keep: bool = False
                       ) -> list[dict[str, Any]]:
    rows = []
    for k in setup.levels:
        t0 = time.monotonic()
        row = run_peer_row(setup, k, log=log, keep=keep)
        rows.append(row)
        log(f"peer x {k}: {row['actions']} actions in {setup.window_s:.0f} s = "
            f"{row['actions_per_min']}/min (ideal {row['ideal_actions_per_min']}, ratio "
            f"{row['ratio']}); start-up: Ray up at {row['ray_ready_s']} s, actors at "
            f"{row['actors_ready_s']} s, first model request at "
            f"{row['first_model_request_s']} s, first action at {row['startup_s']} s; "
            f"{time.monotonic() - t0:.0f}s")
    return rows


# --------------------------------------------------------------------------- output


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def print_table(rows: list[dict[str, Any]], routing: list[dict[str, Any]],
                peer: list[dict[str, Any]] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    if rows:
        _print_rows(console, rows)
    if routing:
        rt = Table(title="routing: 4 sim endpoints, the last one 2x slower")
        for col in ("policy", "req/s", "p50 ms", "p99 ms", "share per endpoint", "max/min",
                    "sticky"):
            rt.add_column(col, justify="left" if col in ("policy", "share per endpoint")
                          else "right")
        for r in routing:
            rt.add_row(r["policy"], str(r["requests_per_s"]), str(r["p50_ms"]),
                       str(r["p99_ms"]), " ".join(f"{x:.2f}" for x in r["share_per_endpoint"]),
                       str(r["imbalance"]), str(r["sticky_rate"]))
        console.print(rt)
    if peer:
        window = peer[0]["window_s"]
        pt = Table(title=f"peer settings: run.py on the sim world, actions in {window:.0f} s "
                   "from the command's start (ideal = 60 x K / 4.8 per min)")
        for col in ("ray", "K", f"actions in {window:.0f} s", "actions/min", "ideal/min", "ratio",
                    "start-up s", "start-up share", "step eff", "step p50 s", "exit"):
            pt.add_column(col, justify="right")
        for r in peer:
            pt.add_row(r.get("ray", "own"), str(r["concurrency"]), _fmt(r["actions"]),
                       _fmt(r["actions_per_min"], ".1f"), _fmt(r["ideal_actions_per_min"], ".1f"),
                       _fmt(r["ratio"], ".3f"), _fmt(r["startup_s"], ".1f"),
                       _fmt(r["startup_share"], ".3f"), _fmt(r["step_efficiency"], ".3f"),
                       _fmt(r["step_s_p50"], ".3f"),
                       _fmt(r["run_exit_code"]))
        console.print(pt)
        for r in peer:
            for note in r["notes"]:
                console.print(f"  peer x {r['concurrency']}: {note}")


def _print_rows(console: Any, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="rollout: real coordinator, runners, storage and model client on the "
                  "sim world")
    for col in ("schedule", "K", "steps/s", "ideal", "ratio", "desk util", "ovh p50 ms",
                "ovh p99 ms", "cpu ms/step", "peak RSS MB", "MB/episode", "lost", "dup"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        if r.get("status") == "skipped":
            table.add_row(r["schedule"], str(r["concurrency"]), "[dim]skipped[/dim]",
                          *[""] * 10)
            continue
        table.add_row(
            r["schedule"], str(r["concurrency"]), _fmt(r["steps_per_s"], ".1f"),
            _fmt(r["ideal_steps_per_s"], ".1f"), _fmt(r["ratio"], ".3f"),
            _fmt(r["desktop_utilization"], ".3f"), _fmt(r["overhead_ms_p50"], ".1f"),
            _fmt(r["overhead_ms_p99"], ".1f"), _fmt(r["cpu_ms_per_step"], ".2f"),
            _fmt(r["peak_rss_mb"], ".0f"), _fmt(r["rss_per_episode_mb"], ".2f"),
            str(r["lost"]), str(r["duplicated"]))
    console.print(table)
    for r in rows:
        if r.get("status") == "skipped":
            console.print(f"  {r['schedule']} x {r['concurrency']} skipped: {r['reason']}")


def save_plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.get("status") == "measured"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    panels = [("steps_per_s", "steps/s (dashed: ideal)"), ("ratio", "ratio to ideal"),
              ("desktop_utilization", "desktop utilization"),
              ("overhead_ms_p99", "overhead per step, ms (p99; dashed: p50)"),
              ("cpu_ms_per_step", "CPU ms per step (all run processes)"),
              ("peak_rss_mb", "peak RSS, MB (all run processes)")]
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for schedule in SCHEDULES:
            pts = sorted((r["concurrency"], r[key]) for r in measured
                         if r["schedule"] == schedule and r[key] is not None)
            if not pts:
                continue
            line = ax.plot(*zip(*pts, strict=True), marker="o", label=schedule)[0]
            twin = {"steps_per_s": "ideal_steps_per_s", "overhead_ms_p99": "overhead_ms_p50"}
            if key in twin:
                ref = sorted((r["concurrency"], r[twin[key]]) for r in measured
                             if r["schedule"] == schedule and r[twin[key]] is not None)
                ax.plot(*zip(*ref, strict=True), linestyle="--", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent episodes")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key in ("steps_per_s", "overhead_ms_p99", "peak_rss_mb"):
            ax.set_yscale("log")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"levels {QUICK.levels}, faster sim, {QUICK.window_s:.0f} s windows "
                        "(and no peer rows unless --peer)")
    parser.add_argument("--out", type=Path, default=Path("bench_rollout.json"),
                        help="JSON results; the PNG plot is written beside it")
    parser.add_argument("--levels", type=int, nargs="+", help="concurrency levels")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--window-s", type=float, help="measured seconds per row")
    parser.add_argument("--warmup-s", type=float, help="least warm-up seconds per row")
    parser.add_argument("--episodes-per-runner", type=int,
                        help="rollout, batch and peer (default: concurrency / cores)")
    parser.add_argument("--no-routing", action="store_true", help="skip the routing part")
    parser.add_argument("--step-files", choices=("auto", "runner", "storage"), default="auto",
                        help="rollout rows' storage.step_files (storage: every step through "
                        "the storage actor, as before issue 33)")
    parser.add_argument("--images", choices=("inline", "file"), default="inline",
                        help="rollout rows' model.images (file: the sim model reads each "
                        "screenshot from the run directory, as vLLM with "
                        "--allowed-local-media-path)")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--peer", action="store_true",
                      help="only the peer-settings rows (run.py on the sim world, issue 17)")
    peer.add_argument("--no-peer", action="store_true",
                      help="skip the peer-settings rows of the full run")
    parser.add_argument("--peer-levels", type=int, nargs="+",
                        help=f"peer rows' concurrency (default {' '.join(map(str, PEER.levels))})")
    parser.add_argument("--peer-window-s", type=float, default=PEER.window_s,
                        help="seconds counted from run.py's start (default %(default)s)")
    parser.add_argument("--peer-running-ray", action="store_true",
                        help="peer rows: run.py joins a local Ray cluster started before the "
                        "clock (a service's cluster kept running) instead of starting its own")
    parser.add_argument("--keep", action="store_true",
                        help="keep each row's results directory (to inspect) in a temp dir")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    setup = dataclasses.replace(
        setup, levels=tuple(args.levels or setup.levels),
        window_s=args.window_s or setup.window_s, warmup_s=args.warmup_s or setup.warmup_s,
        episodes_per_runner=args.episodes_per_runner or setup.episodes_per_runner,
        step_files=args.step_files, images=args.images)
    peer_setup = dataclasses.replace(
        PEER, levels=tuple(args.peer_levels or PEER.levels), window_s=args.peer_window_s,
        running_ray=args.peer_running_ray,
        episodes_per_runner=args.episodes_per_runner or PEER.episodes_per_runner)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    routing: list[dict[str, Any]] = []
    if not args.peer:
        rows = run_rollout_benchmark(setup, schedules=tuple(args.schedules), keep=args.keep)
        if not args.no_routing:
            from benchmarks.bench_routing import run_routing_benchmark

            routing = run_routing_benchmark(quick=args.quick)
    out: dict[str, Any] = {"results": rows, "routing": routing}
    if args.peer or not (args.quick or args.no_peer):
        out["peer"] = run_peer_benchmark(peer_setup, keep=args.keep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    written = [str(args.out)]
    if rows:
        plot = args.out.with_suffix(".png")
        save_plot(rows, plot)
        written.append(str(plot))
    print_table(rows, routing, out.get("peer"))
    print(f"{' and '.join(written)} written in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
