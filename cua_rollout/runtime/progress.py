"""What the user watches during a run: a rich progress bar on a terminal, a status line
every few seconds otherwise (a log file, CI), from the coordinator's statistics."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]

# Status lines when no progress bar is shown (not a terminal, or progress_bar: false).
_STATUS_LINE_INTERVAL_S = 10.0


class Progress:
    """A rich progress bar on a terminal; status lines otherwise."""

    def __init__(self, enabled: bool, total: int, done_before: int) -> None:
        self.live = enabled and sys.stderr.isatty()
        self._last_line = 0.0
        self._bar = None
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("[bold]episodes"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                                 transient=False)
            self._task = self._bar.add_task("episodes", total=total, completed=done_before,
                                            info="")
            self._bar.start()

    def update(self, done: int, total: int, stats: dict[str, Any], note: str = "") -> None:
        rate = stats.get("success_rate")
        desktops = stats.get("desktops") or {}
        info = (f"success {'-' if rate is None else f'{rate:.0%}'}  "
                f"steps/s {stats.get('steps_per_s', 0):.2f}  "
                + (f"desktops busy {desktops.get('leased', 0)}/{sum(desktops.values())}  "
                   if desktops else "")
                + f"model in-flight {stats.get('model_in_flight', 0)}  "
                f"running {stats.get('episodes_in_flight', 0)}"
                + _utilization(stats)
                + (f"  retries {stats['retries']}" if stats.get("retries") else "")
                + (f"  [{note}]" if note else ""))
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total, info=info)
        elif time.monotonic() - self._last_line >= _STATUS_LINE_INTERVAL_S:
            self._last_line = time.monotonic()
            print(f"episodes {done}/{total}  {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _utilization(stats: dict[str, Any]) -> str:
    """The desktops' time split and the model servers' load, when the last sample has them:
    ``desktops acting 31% model 52% pause 5% resetting 2% idle 9%  actions/min 240  servers
    12 run / 3 wait, kv 41%, 850 tok/s``. A run without desktops (text modes) shows its mean
    turn instead: ``turns/min 900, each model 0.41 s tools 0.05 s``."""
    out = ""
    util = stats.get("utilization") or {}
    split = util.get("desktop")
    step = util.get("step_s")
    if split:
        out += (f"  desktops acting {split['acting']:.0%} model {split['model_wait']:.0%} "
                f"pause {split['pause']:.0%} resetting {split['resetting']:.0%} "
                f"idle {split['idle']:.0%}  actions/min {util.get('actions_per_min', 0):.0f}")
    elif step and util.get("window_s"):
        # A text turn is a step: its tool calls are the step's action time.
        out += (f"  turns/min {60.0 * step['steps'] / util['window_s']:.0f}, each model "
                f"{step['model']:.2f} s tools {step['action']:.2f} s")
    servers = (stats.get("model_servers") or {}).get("summary")
    if servers:
        out += f"  servers {servers['running']} run / {servers['waiting']} wait"
        if servers.get("kv_cache_usage") is not None:
            out += f", kv {servers['kv_cache_usage']:.0%}"
        if servers.get("generation_tokens_per_s") is not None:
            out += f", {servers['generation_tokens_per_s']:.0f} tok/s"
        if servers.get("endpoints_up") != servers.get("endpoints"):
            out += f", up {servers['endpoints_up']}/{servers['endpoints']}"
    return out
