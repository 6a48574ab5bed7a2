"""``cua-rollout run`` (``python run.py --config C [--set key=value ...]``): roll out episodes.

Validates the config, starts a local Ray cluster or joins ``ray.address``, the desktop pool,
the storage and the coordinator, finds the model endpoints (``model.endpoints``,
run_model.py's state file, or the scripted policy served from this process), then feeds the
coordinator until every episode is done (or forever in service mode), showing progress: a
``Rollout`` (cua_rollout/runtime/driver.py). Ctrl-C stops submitting and lets running
episodes finish; a second Ctrl-C cancels them. Rerunning the same command resumes: episodes
in results.jsonl are not run again.

Exit codes: 0 done, 1 a fatal setup error (one line says why), 2 a bad config or usage,
130 interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from contextlib import ExitStack
from typing import Any

from ray.exceptions import RayError

from cua_rollout.config import Config, add_config_arguments, config_from_args
from cua_rollout.core.errors import ConfigError, FatalSetupError, InfraError, ModelUnavailable
from cua_rollout.results import print_table
from cua_rollout.runtime.driver import Rollout
from cua_rollout.runtime.launch import ray_cause

__all__ = ["EXIT_FATAL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main", "run"]

EXIT_OK, EXIT_FATAL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Interrupts:
    """Ctrl-C (and SIGTERM) as the rollout's drain, then cancel, instead of a
    KeyboardInterrupt mid-call."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            print("\nstopping: no new episodes; running ones finish (Ctrl-C again cancels "
                  "them)", file=sys.stderr, flush=True)
            self.rollout.drain()
        elif self.count == 2:
            print("\ncancelling running episodes", file=sys.stderr, flush=True)
            self.rollout.cancel()


def run(cfg: Config) -> int:
    """Roll out ``cfg`` to its end with the command line's signals, table and exit code."""
    rollout = Rollout(cfg)
    with ExitStack() as stack:
        interrupts = _Interrupts(rollout)
        for sig in (signal.SIGINT, signal.SIGTERM):
            stack.callback(signal.signal, sig, signal.signal(sig, interrupts))
        with rollout:
            for _ in rollout.results():
                pass
    if rollout.status not in ("failed", "stopped"):
        # The per-domain table of the whole run (resumed episodes included), as
        # ``cua-rollout results show`` prints it.
        if rollout.summary is None:
            print(f"{rollout.run_dir}: no finished episodes")
        else:
            print_table(rollout.summary)
    problems = rollout.problems
    if problems:
        print(f"{len(problems)} task(s) could not be loaded or cannot run here:",
              file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
    if rollout.fatal is not None:
        raise FatalSetupError(f"the run stopped: {rollout.fatal}; finished episodes are "
                              "saved, rerun the same command to resume")
    return EXIT_OK if rollout.status == "finished" else EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv))
    logging.basicConfig(level=cfg.run.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(cfg)
    except ConfigError as exc:
        print(f"run.py: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (FatalSetupError, ModelUnavailable, InfraError) as exc:
        print(f"run.py: error: {exc}", file=sys.stderr)
        return EXIT_FATAL
    except RayError as exc:
        # An actor of the run died (or Ray itself): what finished is on disk and the same
        # command resumes from it.
        print(f"run.py: error: the rollout stopped: {ray_cause(exc)}; finished episodes are "
              f"saved, rerun the same command to resume", file=sys.stderr)
        return EXIT_FATAL


if __name__ == "__main__":
    raise SystemExit(main())
