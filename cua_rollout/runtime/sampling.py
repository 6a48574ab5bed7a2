"""The sampling plan of a run: which rollouts of which task start when. Each task is sampled
``tasks.passes`` times, one group of rollouts per pass, planned once its previous group is
final; a group's size is ``rollouts_per_task`` or DART's dynamic number from the task's recent
success, and the checkpoint barrier may hold new groups. Task sources are the loader's."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from cua_rollout.config import TasksConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.types import SCORED_STATUSES, EpisodeSpec

__all__ = ["SamplingPlan", "TaskRef", "dynamic_rollout_n"]

logger = logging.getLogger(__name__)

# int(9/sr - 7) must not drop a whole rollout to float error (9/0.6 is 15.000000000000002
# but other rates land just below an integer).
_FORMULA_EPS = 1e-9


def dynamic_rollout_n(success_rate: float, *, threshold: float, min_n: int) -> int | None:
    """DART's rollout number for a task with this recent success rate, or ``None`` when the
    rate is below ``threshold`` (then the configured number applies)."""
    if success_rate < threshold or success_rate <= 0:
        return None
    return max(min_n, int(9 / success_rate - 7 + _FORMULA_EPS))


class TaskRef(Protocol):
    """A loaded task as the plan sees it."""

    @property
    def domain(self) -> str: ...
    @property
    def task_id(self) -> str: ...
    @property
    def task(self) -> dict[str, Any]: ...


class SamplingPlan:
    """The groups planned, handed out and finished per task (``<domain>/<task_id>``), the
    success-rate windows, and the barrier. Rollout ``i`` of pass ``p`` is rollout number
    ``p * rollouts_per_task + i`` (its directory), so a resumed run finds each group again.
    ``barrier`` (newest checkpoint first) is asked before a hand-out plans new groups: None
    lets them start, a reason holds them (``waiting`` says it)."""

    def __init__(self, cfg: TasksConfig,
                 barrier: Callable[[], str | None] | None = None) -> None:
        self.cfg = cfg
        self._handed_out: dict[str, set[int]] = {}
        self._finished: dict[str, set[int]] = {}
        self._planned: dict[str, dict[int, int]] = {}  # task -> {pass: group size}
        self._rewards: dict[str, deque[float]] = {}
        self._barrier = barrier
        self._barrier_since: float | None = None
        self.waiting: str | None = None  # why new groups are held (the barrier), or None
        # total_known() between changes: the driver asks twice a second, a week long (L2).
        self._total: int | None = None

    def changed(self) -> None:
        """The tasks changed: the total is computed again."""
        self._total = None

    def hand_out(self, tasks: Iterable[TaskRef]) -> list[EpisodeSpec]:
        """Episodes to start now: rollouts of groups already planned (a resumed run's), and
        the next group of each task whose groups so far are final."""
        specs: list[EpisodeSpec] = []
        may_plan: bool | None = None  # the barrier, asked once per poll and only if needed
        for t in tasks:
            group = f"{t.domain}/{t.task_id}"
            done = self._finished.setdefault(group, set())
            handed = self._handed_out.setdefault(group, set())
            planned = self._planned.setdefault(group, {})
            if self._more_passes(planned) and all(
                    set(self._rollouts(p, n)) <= done for p, n in planned.items()):
                if may_plan is None:
                    may_plan = self._may_plan()
                if may_plan:
                    planned[max(planned, default=-1) + 1] = self.rollouts_for(t.task_id,
                                                                              t.domain)
                    self._total = None
            for p, n in planned.items():
                for rollout in self._rollouts(p, n):
                    if rollout in handed or rollout in done:
                        continue
                    handed.add(rollout)
                    specs.append(EpisodeSpec(t.task_id, t.domain, rollout, t.task,
                                             pass_index=p, group_size=n))
        return specs

    def exhausted(self, tasks: Iterable[TaskRef]) -> bool:
        """Every pass of every task planned and handed out."""
        for t in tasks:
            group = f"{t.domain}/{t.task_id}"
            planned = self._planned.get(group, {})
            if self._more_passes(planned):
                return False
            handed = self._handed_out.get(group, set()) | self._finished.get(group, set())
            if any(not set(self._rollouts(p, n)) <= handed for p, n in planned.items()):
                return False
        return True

    def record_result(self, record: dict[str, Any]) -> None:
        """An episode is final (a results.jsonl record): its rollout is done, its group may
        be complete, and its reward, when scored, feeds the task's success-rate window (an
        infra error's is not a score). A cancelled episode is not final: it runs again."""
        if record.get("status") == "cancelled":
            return
        task_id, domain = record["task_id"], record["domain"]
        self._finished.setdefault(f"{domain}/{task_id}", set()).add(int(record["rollout"]))
        self._total = None
        reward = record.get("reward")
        if record.get("status") in SCORED_STATUSES and isinstance(reward, int | float):
            self._record_reward(task_id, domain, reward)

    def resume(self, path: Path,
               last: dict[tuple[str, str, int], tuple[Any, Any, Any, Any]]) -> None:
        """A resumed run: each episode's last results line in ``path`` (``(domain, task_id,
        rollout) -> (status, reward, pass_index, group_size)``). Its groups are planned again
        as they were; a final line (any but ``infra_error`` when ``tasks.rerun_infra_errors``,
        any at all otherwise; never ``cancelled``) finishes its rollout."""
        rerun = self.cfg.rerun_infra_errors
        stride = self.cfg.rollouts_per_task
        for (domain, task_id, rollout), (status, reward, pass_index, size) in last.items():
            group = f"{domain}/{task_id}"
            # A group whose results say how big it was is planned again as it was (a run
            # from before passes says nothing: its pass 0 is planned anew, as then).
            if isinstance(size, int) and size > 0:
                if not isinstance(pass_index, int) or pass_index < 0:
                    pass_index = rollout // stride
                if rollout not in self._rollouts(pass_index, size) or size > stride:
                    raise ConfigError(
                        f"{path}: rollout {rollout} of {group} is in pass {pass_index} of "
                        f"{size} rollouts, which tasks.rollouts_per_task={stride} cannot "
                        "place: resume it with the rollouts_per_task it was started with")
                self._planned.setdefault(group, {})[pass_index] = size
            if (rerun and status == "infra_error") or status == "cancelled":
                continue  # runs again (a cancelled line is a cut straggler, never final)
            self._finished.setdefault(group, set()).add(rollout)
            if status in SCORED_STATUSES and isinstance(reward, int | float):
                self._record_reward(task_id, domain, reward)

    def success_rate(self, task_id: str, domain: str) -> float | None:
        """Mean reward of the task's recent episodes (``None`` before any)."""
        window = self._rewards.get(f"{domain}/{task_id}")
        return sum(window) / len(window) if window else None

    def rollouts_for(self, task_id: str, domain: str) -> int:
        """How many rollouts the task gets now: ``rollouts_per_task``, or fewer by DART's
        formula when dynamic rollouts are on and the task's success rate is high."""
        n = self.cfg.rollouts_per_task
        dyn = self.cfg.dynamic_rollouts
        rate = self.success_rate(task_id, domain)
        if dyn.enabled and rate is not None:
            reduced = dynamic_rollout_n(rate, threshold=dyn.threshold, min_n=dyn.min_n)
            if reduced is not None:
                n = min(n, reduced)
        return n

    def total_known(self, tasks: Iterable[TaskRef]) -> int:
        """Episodes of ``tasks``, finished ones included (the progress total): the groups
        planned, and for passes not planned yet the rollout number each task gets now (with
        passes: 0, only what is planned); computed again only after a change."""
        if self._total is not None:
            return self._total
        total = 0
        passes = self.cfg.passes
        for t in tasks:
            group = f"{t.domain}/{t.task_id}"
            planned = self._planned.get(group, {})
            rollouts = {r for p, n in planned.items() for r in self._rollouts(p, n)}
            rollouts |= self._handed_out.get(group, set()) | self._finished.get(group, set())
            unplanned = max(0, passes - len(planned)) if passes else 0
            total += len(rollouts) + unplanned * self.rollouts_for(t.task_id, t.domain)
        self._total = total
        return total

    def finished_of(self, tasks: Iterable[TaskRef]) -> int:
        """Episodes of ``tasks`` finished so far."""
        return sum(len(self._finished.get(f"{t.domain}/{t.task_id}", ())) for t in tasks)

    # ----------------------------------------------------------------- internals

    def _record_reward(self, task_id: str, domain: str, reward: float) -> None:
        self._total = None  # the rate may change a task's rollout number
        window = self._rewards.setdefault(
            f"{domain}/{task_id}", deque(maxlen=self.cfg.dynamic_rollouts.window)
        )
        window.append(min(1.0, max(0.0, float(reward))))

    def _rollouts(self, pass_index: int, size: int) -> range:
        start = pass_index * self.cfg.rollouts_per_task
        return range(start, start + size)

    def _more_passes(self, planned: dict[int, int]) -> bool:
        return self.cfg.passes == 0 or len(planned) < self.cfg.passes

    def _may_plan(self) -> bool:
        """Ask the barrier whether new groups may start; past ``timeout_s`` they start
        anyway (logged)."""
        reason = self._barrier() if self._barrier is not None else None
        if reason is None:
            if self.waiting is not None:
                logger.info("new groups start: %s no longer holds them", self.waiting)
            self.waiting, self._barrier_since = None, None
            return True
        now = time.monotonic()
        if self._barrier_since is None:
            self._barrier_since = now
            logger.info("new groups wait for the newest checkpoint: %s", reason)
        self.waiting = f"waiting for the newest checkpoint: {reason}"
        timeout = self.cfg.checkpoint_barrier.timeout_s
        if timeout and now - self._barrier_since >= timeout:
            logger.warning("new groups start after %.0fs although %s", timeout, reason)
            self._barrier_since = now  # the next hand-out waits its own timeout again
            self.waiting = None
            return True
        return False
