"""The sampling plan of a run: which rollouts of which task start when. Each task is sampled
``tasks.passes`` times, one group of rollouts per pass, planned once its previous group is
final; a group's size is ``rollouts_per_task`` or DART's dynamic number from the task's recent
success, and the checkpoint barrier may hold new groups. Task sources are the loader's.

What the plan holds stays flat however long a service run (``passes: 0``) goes on: per task,
its groups not final yet (the rollouts handed out and finished of each) and counters. A group
whose rollouts are all final is dropped; its rollouts live on in the counters. So a hand-out
looks at each task's open groups only, ``total_known`` is kept up to date as results come in
rather than recounted, and a resumed run's results.jsonl is fed in line by line (``resume``)
with no more memory than that.

A group with an episode that ended ``infra_error`` failed as a whole (the trainer's index never
hands it out): with ``passes`` to count, another pass stands in for it
(``tasks.failed_group_reruns`` per task at most).

Rollout ``i`` of pass ``p`` is rollout number ``p * rollouts_per_task + i`` (its directory), so
a rollout's pass is ``rollout // rollouts_per_task`` and a resumed run finds each group again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from cua_rollout.config import TasksConfig
from cua_rollout.core.errors import ConfigError
from cua_rollout.core.types import SCORED_STATUSES, EpisodeSpec

__all__ = ["ResultLine", "SamplingPlan", "TaskRef", "dynamic_rollout_n"]

logger = logging.getLogger(__name__)

# int(9/sr - 7) must not drop a whole rollout to float error (9/0.6 is 15.000000000000002
# but other rates land just below an integer).
_FORMULA_EPS = 1e-9

# One results.jsonl line as the plan reads it: ((domain, task_id, rollout), status, reward,
# pass_index, group_size), the last three as the line has them (None when it has not).
ResultLine = tuple[tuple[str, str, int], Any, Any, Any, Any]


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


class _Group:
    """A planned pass of one task that is not final yet. ``done`` holds the final rollouts
    of the pass's stride (those of an older, bigger plan too: a resumed run from before
    passes); ``final`` counts those that are the group's own."""

    __slots__ = ("done", "failed", "final", "handed", "pass_index", "pending", "size",
                 "start")

    def __init__(self, pass_index: int, size: int, start: int, done: set[int]) -> None:
        self.pass_index = pass_index
        self.size = size
        self.start = start
        self.done = done
        self.final = sum(1 for r in done if start <= r < start + size)
        self.handed: set[int] = set()
        self.pending = True  # it may have rollouts to hand out
        self.failed = False  # one of its own rollouts ended infra_error: failed as a whole

    def rollouts(self) -> range:
        return range(self.start, self.start + self.size)

    def owns(self, rollout: int) -> bool:
        return self.start <= rollout < self.start + self.size


class _Task:
    """One task's part of the plan: its open groups and counters."""

    __slots__ = ("ahead", "current", "done", "known", "next_pass", "open", "outside",
                 "planned", "planned_rollouts", "replaced", "rewards")

    def __init__(self) -> None:
        self.open: dict[int, _Group] = {}      # pass -> its group, while not final
        # Final rollouts of passes not planned (yet): a resumed run from before passes, or a
        # result for a rollout never handed out. Empty in a run that planned all it ran.
        self.ahead: dict[int, set[int]] = {}
        self.planned = 0            # passes planned (open or final), failed ones replaced
        self.replaced = 0           # failed groups another pass stands in for
        self.planned_rollouts = 0   # their rollouts
        self.next_pass = 0          # one more than the newest planned pass
        self.done = 0               # final rollouts
        self.outside = 0            # final rollouts outside every planned group
        self.known = 0              # total_known()'s share, as of the last change
        self.current = False        # among the tasks of the last set_tasks()
        self.rewards: deque[float] | None = None


class SamplingPlan:
    """The groups planned, handed out and finished per task, the success-rate windows, and
    the barrier, for the tasks of the last ``set_tasks``. ``barrier`` (newest checkpoint
    first) is asked before a hand-out plans new groups: None lets them start, a reason holds
    them (``waiting`` says it).

    A pass below a task's newest planned one that has no open group is final: a result for
    one of its rollouts is a repeat and changes nothing (a run never hands such a rollout out
    again), except on ``resume``, where a line that makes it not final (an ``infra_error``
    to rerun) opens the group again."""

    def __init__(self, cfg: TasksConfig,
                 barrier: Callable[[], str | None] | None = None) -> None:
        self.cfg = cfg
        self._stride = cfg.rollouts_per_task
        self._tasks: dict[tuple[str, str], _Task] = {}
        self._order: list[tuple[TaskRef, _Task]] = []  # the tasks of set_tasks, in order
        self._known = 0                                  # total_known(), kept on change
        self.barrier = barrier  # the loader may set it after a resume read the plan
        self._barrier_since: float | None = None
        self.waiting: str | None = None  # why new groups are held (the barrier), or None

    # ----------------------------------------------------------------- the tasks

    def set_tasks(self, tasks: Sequence[TaskRef]) -> None:
        """The tasks to sample from now on, in hand-out order (the loader's, after each read
        of its source)."""
        for _, state in self._order:
            state.current = False
        self._order = []
        for t in tasks:
            state = self._state(t.domain, t.task_id)
            state.current = True
            self._order.append((t, state))
        self._known = sum(state.known for _, state in self._order)

    def hand_out(self) -> list[EpisodeSpec]:
        """Episodes to start now: rollouts of groups already planned (a resumed run's), and
        the next group of each task whose groups so far are final. Looks at each task's open
        groups only."""
        specs: list[EpisodeSpec] = []
        may_plan: bool | None = None  # the barrier, asked once per poll and only if needed
        for t, state in self._order:
            if not state.open and self._more_passes(state):
                if may_plan is None:
                    may_plan = self._may_plan()
                if may_plan:
                    self._plan(state, state.next_pass, self._rollouts_for(state))
                    self._update(state)
            for group in state.open.values():
                if group.pending:
                    specs.extend(self._hand_out_group(t, group))
        return specs

    def exhausted(self) -> bool:
        """Every pass of every task planned and handed out."""
        for _, state in self._order:
            if self._more_passes(state):
                return False
            for group in state.open.values():
                if any(r not in group.handed and r not in group.done
                       for r in group.rollouts()):
                    return False
        return True

    def total_known(self) -> int:
        """Episodes of the tasks, finished ones included (the progress total): the groups
        planned, final rollouts outside them, and for passes not planned yet the rollout
        number each task gets now (with passes: 0, only what is planned). Kept up to date as
        things change, so asking costs nothing."""
        return self._known

    def finished(self) -> int:
        """Episodes of the tasks finished so far."""
        return sum(state.done for _, state in self._order)

    def held(self) -> dict[str, int]:
        """What the plan holds in memory: tasks, open groups, and the rollouts remembered one
        by one (those of open groups, handed out or final, and final ones ahead of their
        pass). Flat over a service run's life; everything else is counters."""
        groups = rollouts = 0
        for state in self._tasks.values():
            groups += len(state.open)
            rollouts += sum(len(g.done) + len(g.handed) for g in state.open.values())
            rollouts += sum(len(done) for done in state.ahead.values())
        return {"tasks": len(self._tasks), "open_groups": groups, "rollouts": rollouts}

    # ----------------------------------------------------------------- results

    def record_result(self, record: dict[str, Any]) -> None:
        """An episode is final (a results.jsonl record): its rollout is done, its group may
        be complete, and its reward, when scored, feeds the task's success-rate window (an
        infra error's is not a score). A cancelled episode is not final: it runs again."""
        if record.get("status") == "cancelled":
            return
        state = self._state(record["domain"], record["task_id"])
        if self._finish(state, int(record["rollout"]),
                        failed=record.get("status") == "infra_error"):
            self._score(state, record.get("status"), record.get("reward"))
        self._update(state)

    def resume(self, path: Path, lines: Iterable[ResultLine]) -> None:
        """A resumed run: the lines of ``path`` in file order, as they are read (the last
        line of an episode is the one that counts). A group whose lines say its size is
        planned again as it was; a final line (any but ``infra_error`` when
        ``tasks.rerun_infra_errors``, any at all otherwise; never ``cancelled``) finishes its
        rollout, another one makes it run again."""
        rerun = self.cfg.rerun_infra_errors
        stride = self._stride
        for (domain, task_id, rollout), status, reward, pass_index, size in lines:
            state = self._state(domain, task_id)
            if not (isinstance(size, int) and size > 0):
                size = None  # a run from before passes: its pass 0 is planned anew, as then
            else:
                if not isinstance(pass_index, int) or pass_index < 0:
                    pass_index = rollout // stride
                start = pass_index * stride
                if not start <= rollout < start + size or size > stride:
                    raise ConfigError(
                        f"{path}: rollout {rollout} of {domain}/{task_id} is in pass "
                        f"{pass_index} of {size} rollouts, which tasks.rollouts_per_task="
                        f"{stride} cannot place: resume it with the rollouts_per_task it was "
                        "started with")
                if pass_index not in state.open and pass_index >= state.next_pass:
                    self._plan(state, pass_index, size)
            if (rerun and status == "infra_error") or status == "cancelled":
                self._unfinish(state, rollout, size)  # runs again (a cancelled line is a cut
            elif self._finish(state, rollout,        # straggler, never final)
                              failed=status == "infra_error"):
                self._score(state, status, reward)
        for state in self._tasks.values():
            self._update(state)

    # ----------------------------------------------------------------- DART

    def success_rate(self, task_id: str, domain: str) -> float | None:
        """Mean reward of the task's recent episodes (``None`` before any)."""
        state = self._tasks.get((domain, task_id))
        return _mean(state.rewards) if state is not None else None

    def rollouts_for(self, task_id: str, domain: str) -> int:
        """How many rollouts the task gets now: ``rollouts_per_task``, or fewer by DART's
        formula when dynamic rollouts are on and the task's success rate is high."""
        state = self._tasks.get((domain, task_id))
        return self._rollouts_for(state) if state is not None else self._stride

    # ----------------------------------------------------------------- internals

    def _state(self, domain: str, task_id: str) -> _Task:
        state = self._tasks.get((domain, task_id))
        if state is None:
            state = self._tasks[(domain, task_id)] = _Task()
            state.known = self._known_of(state)
        return state

    def _rollouts_for(self, state: _Task) -> int:
        n = self._stride
        dyn = self.cfg.dynamic_rollouts
        rate = _mean(state.rewards)
        if dyn.enabled and rate is not None:
            reduced = dynamic_rollout_n(rate, threshold=dyn.threshold, min_n=dyn.min_n)
            if reduced is not None:
                n = min(n, reduced)
        return n

    def _plan(self, state: _Task, pass_index: int, size: int) -> None:
        """Pass ``pass_index`` of the task gets a group of ``size`` rollouts; rollouts of it
        already final (ahead) are its own now."""
        start = pass_index * self._stride
        group = _Group(pass_index, size, start, state.ahead.pop(pass_index, set()))
        state.outside -= group.final
        state.planned += 1
        state.planned_rollouts += size
        state.next_pass = max(state.next_pass, pass_index + 1)
        if group.final < size:
            state.open[pass_index] = group

    def _finish(self, state: _Task, rollout: int, *, failed: bool = False) -> bool:
        """Rollout ``rollout`` is final (``failed``: as an infra error); False when it
        already was. A group final with a failed rollout of its own is replaced."""
        pass_index = rollout // self._stride
        group = state.open.get(pass_index)
        if group is not None:
            if rollout in group.done:
                return False
            group.done.add(rollout)
            state.done += 1
            if not group.owns(rollout):
                state.outside += 1
                return True
            group.final += 1
            group.failed = group.failed or failed
            if group.final >= group.size:
                del state.open[pass_index]  # final: from now on only counted
                if group.failed:
                    self._replace(state)
            return True
        if pass_index < state.next_pass:
            return False  # a final group's: counted already
        ahead = state.ahead.setdefault(pass_index, set())
        if rollout in ahead:
            return False
        ahead.add(rollout)
        state.done += 1
        state.outside += 1
        return True

    def _replace(self, state: _Task) -> None:
        """A group of the task failed (an infra error): with passes to count, another pass
        stands in for it, ``tasks.failed_group_reruns`` times per task at most."""
        if self.cfg.passes and state.replaced < self.cfg.failed_group_reruns:
            state.replaced += 1
            state.planned -= 1
            logger.info("a group failed on an infra error: another pass of the task will "
                        "stand in for it (%d of %d)", state.replaced,
                        self.cfg.failed_group_reruns)

    def _unfinish(self, state: _Task, rollout: int, size: int | None) -> None:
        """Resume: rollout ``rollout``'s last line so far is not final, it runs again. In a
        group already final (an earlier line of the episode was), the line's ``size`` opens
        the group again."""
        pass_index = rollout // self._stride
        group = state.open.get(pass_index)
        if group is not None:
            group.pending = True
            if rollout in group.done:
                group.done.discard(rollout)
                state.done -= 1
                if group.owns(rollout):
                    group.final -= 1
                else:
                    state.outside -= 1
            return
        ahead = state.ahead.get(pass_index)
        if ahead is not None and rollout in ahead:
            ahead.discard(rollout)
            if not ahead:
                del state.ahead[pass_index]
            state.done -= 1
            state.outside -= 1
            return
        start = pass_index * self._stride
        if pass_index < state.next_pass and size is not None and start <= rollout < start + size:
            again = _Group(pass_index, size, start, set(range(start, start + size)) - {rollout})
            state.open[pass_index] = again
            state.done -= 1

    def _hand_out_group(self, t: TaskRef, group: _Group) -> list[EpisodeSpec]:
        specs = []
        for rollout in group.rollouts():
            if rollout in group.handed or rollout in group.done:
                continue
            group.handed.add(rollout)
            specs.append(EpisodeSpec(t.task_id, t.domain, rollout, t.task,
                                     pass_index=group.pass_index, group_size=group.size))
        group.pending = False
        return specs

    def _score(self, state: _Task, status: Any, reward: Any) -> None:
        if status in SCORED_STATUSES and isinstance(reward, int | float):
            if state.rewards is None:
                state.rewards = deque(maxlen=self.cfg.dynamic_rollouts.window)
            state.rewards.append(min(1.0, max(0.0, float(reward))))

    def _known_of(self, state: _Task) -> int:
        passes = self.cfg.passes
        unplanned = max(0, passes - state.planned) if passes else 0
        return (state.planned_rollouts + state.outside
                + (unplanned * self._rollouts_for(state) if unplanned else 0))

    def _update(self, state: _Task) -> None:
        """The task's share of ``total_known`` after a change to it."""
        known = self._known_of(state)
        if state.current:
            self._known += known - state.known
        state.known = known

    def _more_passes(self, state: _Task) -> bool:
        return self.cfg.passes == 0 or state.planned < self.cfg.passes

    def _may_plan(self) -> bool:
        """Ask the barrier whether new groups may start; past ``timeout_s`` they start
        anyway (logged)."""
        reason = self.barrier() if self.barrier is not None else None
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


def _mean(window: deque[float] | None) -> float | None:
    return sum(window) / len(window) if window else None
