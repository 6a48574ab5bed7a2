"""``run_model.py serve`` as a child of ``run.py`` (``model_pool.start_with_run``): started
with the run's config, waited for until a replica serves, stopped when the run ends. One
command then runs the whole real path (``configs/demo_vlm.yaml``)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import yaml

from cua_rollout.config import Config
from cua_rollout.core.errors import FatalSetupError
from cua_rollout.model.fleet.processes import log_tail, signal_group, spawn
from cua_rollout.model.fleet.state import read_state

__all__ = ["POOL_CONFIG_FILE", "POOL_LOG_FILE", "PoolChild"]

log = logging.getLogger(__name__)

POOL_CONFIG_FILE = "model_pool.yaml"  # in the run directory: the config the child reads
POOL_LOG_FILE = "model_pool.log"      # in the run directory: the supervisor's output
_POLL_S = 0.5
_REPORT_EVERY_S = 15.0
_KILL_GRACE_S = 15.0   # beyond model_pool.stop_timeout_s, before the supervisor is killed


class PoolChild:
    """The supervisor process of a run-owned model pool. ``start`` it, ``wait_ready``,
    and ``stop`` it (or use it as a context manager: started on entry, stopped on exit)."""

    def __init__(self, cfg: Config, run_dir: Path,
                 report: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.state_dir = Path(cfg.model_pool.state_dir).resolve()
        self.log_path = run_dir / POOL_LOG_FILE
        self.report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def __enter__(self) -> PoolChild:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        config_path = self.run_dir / POOL_CONFIG_FILE
        config_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"),
                                              sort_keys=False))
        cmd = [sys.executable, "-m", "cua_rollout.cli.model", "serve", "--config", str(config_path)]
        self.proc = spawn(cmd, dict(os.environ), self.log_path)
        self.started_at = time.monotonic()
        self.report(f"model pool: starting {self.cfg.model_pool.replicas} replica(s) of "
                    f"{self.cfg.model_pool.checkpoint} (supervisor pid {self.proc.pid}, "
                    f"log {self.log_path})")

    def wait_ready(self) -> float:
        """Wait until a replica of this supervisor is healthy; the seconds it took.
        ``FatalSetupError`` (with the end of its log) when the supervisor exits first or
        ``model_pool.startup_timeout_s`` passes."""
        assert self.proc is not None, "start() first"
        timeout_s = self.cfg.model_pool.startup_timeout_s
        next_report = self.started_at + _REPORT_EVERY_S
        while True:
            elapsed = time.monotonic() - self.started_at
            state = read_state(self.state_dir) or {}
            ours = (state.get("supervisor") or {}).get("pid") == self.proc.pid
            if ours and any(e.get("healthy") for e in state.get("endpoints", [])):
                self.report(f"model pool: ready after {elapsed:.0f} s")
                return elapsed
            code = self.proc.poll()
            if code is not None:
                raise FatalSetupError(
                    f"the model pool (run_model.py serve) exited with code {code} before a "
                    f"replica served; end of {self.log_path}:\n{log_tail(self.log_path)}")
            if elapsed > timeout_s:
                raise FatalSetupError(
                    f"no model replica served within model_pool.startup_timeout_s "
                    f"({timeout_s:g} s); end of {self.log_path}:\n{log_tail(self.log_path)}")
            if time.monotonic() >= next_report:
                self.report(f"model pool: still starting ({elapsed:.0f} s)")
                next_report += _REPORT_EVERY_S
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM the supervisor (it stops its replicas in order); SIGKILL its group if it
        has not ended after ``model_pool.stop_timeout_s`` and a grace (its replicas, set to
        die with it, get SIGTERM then)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(self.cfg.model_pool.stop_timeout_s + _KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("the model pool's supervisor (pid %d) did not stop; killing it",
                        proc.pid)
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
