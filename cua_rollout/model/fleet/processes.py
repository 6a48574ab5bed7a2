"""Replica processes as process groups: spawning one that dies with the supervisor, reading
how it ended, stopping its whole group (SIGTERM, then SIGKILL and /dev/shm cleanup), the tail
of its log, and the sweep of replicas an earlier supervisor of the state dir left running."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cua_rollout.model.fleet.state import read_state

__all__ = [
    "API_SERVER_MODULE",
    "exit_status",
    "group_members",
    "log_tail",
    "replica_process",
    "signal_group",
    "signal_name",
    "spawn",
    "stop_group",
    "sweep_stale_replicas",
    "terminate_tree",
]

log = logging.getLogger(__name__)

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what a replica runs (python -m)

_POLL_S = 0.2                # period of process-exit checks while stopping
_PID_START_SLACK_S = 30.0    # a recorded pid is ours only if the process started this close
_LOG_TAIL_LINES = 15         # lines of a replica's log quoted when it fails
_PROBE_LOG_LINE = re.compile(r'"GET /(health|metrics) HTTP')  # our probes, left out of tails

# Runs first in each replica process: die with the supervisor (PR_SET_PDEATHSIG), then exec
# vLLM, so its command line is exactly the server's (what the stale-replica sweep checks).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


# --------------------------------------------------------------------------- one group


def spawn(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new process group, its output appended to
    ``log_path`` after a header line; on Linux it gets SIGTERM when this process dies."""
    launch = cmd
    if sys.platform.startswith("linux"):
        launch = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *cmd]
    with log_path.open("ab") as logf:
        logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} run_model.py starts: "
                   f"{' '.join(cmd)}\n".encode())
        logf.flush()
        return subprocess.Popen(
            launch, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )


def exit_status(proc: subprocess.Popen[bytes]) -> str | None:
    """How the process ended, or None while it runs. The zombie is left unreaped, so its
    pid (and process group id) cannot be reused before ``stop_group`` has swept the group."""
    if proc.returncode is not None:
        return _describe_returncode(proc.returncode)
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "exited"
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return f"exit code {info.si_status}"
    return f"killed by {signal_name(info.si_status)}"


def _describe_returncode(code: int) -> str:
    return f"exit code {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc."""
    members = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _shm_files(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes map (vLLM's message queues and semaphores)."""
    paths: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find("/dev/shm/")
            if at >= 0:
                paths.add(line[at:].removesuffix(" (deleted)"))
    return paths


def _remove_files(paths: set[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def stop_group(
    proc: subprocess.Popen[bytes],
    *,
    graceful: bool,
    orphans_first: bool,
    timeout_s: float,
    forced: Callable[[], bool],
) -> None:
    """Stop the process group ``proc`` leads and reap ``proc``.

    ``graceful``: SIGTERM the leader first, which shuts a serving vLLM engine down in order.
    ``orphans_first``: once the leader is gone, SIGTERM the rest of the group (the engine
    processes it leaves behind). SIGKILL follows after ``timeout_s``, at once when
    ``forced()``; the /dev/shm files of processes that had to be killed are removed (only a
    clean exit removes them).
    """
    pgid = proc.pid
    deadline = time.monotonic() + timeout_s

    async def until(done: Callable[[], bool], until_t: float) -> None:
        while not done() and time.monotonic() < until_t and not forced():
            await asyncio.sleep(_POLL_S)

    if graceful and exit_status(proc) is None and not forced():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pgid, signal.SIGTERM)
        await until(lambda: exit_status(proc) is not None, deadline)
    if orphans_first and exit_status(proc) is not None and not forced():
        signal_group(pgid, signal.SIGTERM)
        await until(lambda: not group_members(pgid), deadline)
    left = group_members(pgid)
    if left:
        shm = _shm_files(left)
        signal_group(pgid, signal.SIGKILL)  # the leader is unreaped: pgid is still ours
        await until(lambda: not group_members(pgid), float("inf"))
        _remove_files(shm)
    await until(lambda: exit_status(proc) is not None, float("inf"))
    proc.wait()


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` of a replica's log, indented, without our health/metrics probes."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if not _PROBE_LOG_LINE.search(line)]
    return "\n".join("    " + line for line in kept[-lines:])


# --------------------------------------------------------------------------- stale replicas


def replica_process(pid: int, port: int, started_at: float | None) -> Any | None:
    """The psutil process of a replica we recorded, or None if ``pid`` is now something else:
    its command line must name the vLLM API server module and ``--port <port>``, and it must
    have started when we recorded it."""
    import psutil

    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if API_SERVER_MODULE not in cmdline:
        return None
    if not any(a == "--port" and b == str(port) for a, b in itertools.pairwise(cmdline)) and (
        f"--port={port}" not in cmdline
    ):
        return None
    if started_at is not None and abs(created - started_at) > _PID_START_SLACK_S:
        return None
    return proc


def terminate_tree(proc: Any, timeout_s: float) -> None:
    """Stop a replica we did not start in this run (a psutil process, no Popen handle):
    SIGTERM its API server, then its process group; SIGKILL what is left after
    ``timeout_s`` and remove the /dev/shm files of the processes that had to be killed."""
    import psutil

    pid = proc.pid
    deadline = time.monotonic() + timeout_s

    def wait(done: Callable[[], bool], until: float) -> None:
        while not done() and time.monotonic() < until:
            time.sleep(_POLL_S)

    def gone() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        leads_group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    if not leads_group:  # started some other way: stop its tree
        members = [proc, *proc.children(recursive=True)]
        for p in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(members, timeout=timeout_s)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    wait(gone, deadline)
    signal_group(pid, signal.SIGTERM)
    wait(lambda: not group_members(pid), deadline)
    left = group_members(pid)
    if left:
        shm = _shm_files(left)
        signal_group(pid, signal.SIGKILL)
        wait(lambda: not group_members(pid), time.monotonic() + timeout_s)
        _remove_files(shm)


def sweep_stale_replicas(state_dir: Path, stop_timeout_s: float) -> list[int]:
    """Stop the replicas an earlier supervisor of ``state_dir`` left running; their pids.

    Only processes that are provably those replicas are touched (``replica_process``).
    """
    state = read_state(state_dir)
    stopped = []
    for entry in (state or {}).get("endpoints", []):
        pid, port = entry.get("pid"), entry.get("port")
        if not isinstance(pid, int) or not isinstance(port, int) or pid == os.getpid():
            continue
        proc = replica_process(pid, port, entry.get("started_at"))
        if proc is None:
            continue
        log.warning("stopping replica pid %d (port %d) left by an earlier supervisor", pid, port)
        terminate_tree(proc, stop_timeout_s)
        stopped.append(pid)
    return stopped
