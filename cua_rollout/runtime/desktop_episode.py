"""An episode on a desktop (the loop is episode.py's): lease a desktop from the pool, run the
task's setup, carry out each decision as code on the desktop (then the pause after an
action, a WAIT's wait, the next screenshot), score with the task's evaluator, release the
desktop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from cua_rollout.agents.base import Agent, Decision, make_agent
from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopUnavailable, EvaluatorRaised, one_line
from cua_rollout.core.layout import screenshot_name
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.core.types import DONE, FAIL, WAIT, Status
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import DesktopEnv
from cua_rollout.evaluation import Evaluator
from cua_rollout.runtime.episode import ACTOR_CALL_TIMEOUT_S, Episode, EpisodeEnded, within
from cua_rollout.runtime.pool import Lease
from cua_rollout.runtime.pool_shards import ShardedPool
from cua_rollout.runtime.trajectory import StepRecord

__all__ = ["DesktopEpisode", "open_leased_desktop", "score_task"]


def open_leased_desktop(lease: Lease, cfg: DesktopsConfig) -> DesktopEnv:
    """The leased desktop's client, with a connection of its own (closed by ``close()``),
    and the desktop's own token and ports when its provider gave it some."""
    return RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id,
                                      access=lease.access)


class DesktopEpisode(Episode):
    """One episode on a leased desktop, played by the agent of ``agent.name``."""

    def _make_agent(self) -> Agent:
        return make_agent(self.cfg.agent, instruction=str(self.task.get("instruction", "")),
                          max_tokens=self.cfg.model.sampling.max_tokens)

    async def _open(self) -> DesktopEnv:
        waited = time.monotonic()
        self.lease = await self._lease()
        self.timing["lease_wait_s"] = time.monotonic() - waited
        self._enter("other")
        self.desktop = self.lease.desktop_id
        self.begun = True
        env = self.env = self.r.env_factory(self.lease, self.cfg.desktops)
        return env

    async def _lease(self) -> Lease:
        """A desktop for this attempt, from this node's pool shard first. The pool's own
        deadline is the lease timeout; a pool that does not answer well past it is a desktop
        outage too."""
        timeout_s = self.cfg.desktops.lease_timeout_s
        try:
            return await asyncio.wait_for(
                ShardedPool.of(self.r.desktop_pool).lease(self.owner, timeout_s, self.avoid),
                timeout_s + ACTOR_CALL_TIMEOUT_S)
        except TimeoutError:
            raise DesktopUnavailable(f"the desktop pool did not answer a lease within "
                                     f"{timeout_s + ACTOR_CALL_TIMEOUT_S:.0f}s") from None

    async def _give_back(self, healthy: bool) -> None:
        pool = ShardedPool.of(self.r.desktop_pool)
        if self.lease is not None:  # to the shard that lent it
            await within(pool.release(self.lease, healthy), ACTOR_CALL_TIMEOUT_S,
                         "the desktop pool (release)")
        else:
            # A lease granted after this episode stopped waiting for it (a cancel, a
            # deadline, a call still in transit) must not stay lent to nobody: every shard
            # releases what this owner holds and refuses it any later grant.
            await within(pool.release_owned(self.owner, True), ACTOR_CALL_TIMEOUT_S,
                         "the desktop pool (release_owned)")

    async def _begin(self, env: DesktopEnv) -> Screenshot:
        """The task's setup; its screenshot is step 0's."""
        shot = await env.reset(self.task)
        await self.store_screenshot(
            shot, screenshot_name(0) if self.cfg.runner.save_screenshots else None)
        return shot

    async def _carry_out(self, env: DesktopEnv, decision: Decision, parsed: Any,
                         record: StepRecord, split: dict[str, float]
                         ) -> tuple[bool, Screenshot | None]:
        """The decision's code, the pause after it, a WAIT's wait; then, unless it ended the
        episode (DONE or FAIL), the next screenshot."""
        runner_cfg = self.cfg.runner
        record.action = decision.action
        started = time.monotonic()
        if decision.code is not None:
            self._enter("action")
            result = await env.step(decision.code)
            record.info = {"returncode": result.returncode, "error": result.error or None}
            split["action_s"] = time.monotonic() - started
            # The pause after an action (the env contract's pause_s), timed on its own.
            await self._pause(runner_cfg.action_pause_s, split)
        if decision.terminal == WAIT:
            self._enter("pause")
            t0 = time.monotonic()
            await env.step(WAIT, pause_s=runner_cfg.wait_s)
            split["pause_s"] += time.monotonic() - t0
        if decision.terminal in (DONE, FAIL):
            self.last_action = decision.terminal
            return True, None
        self._enter("screenshot")
        t0 = time.monotonic()
        shot = await env.observe()
        split["screenshot_s"] = time.monotonic() - t0
        return False, shot

    async def _evaluate(self, env: DesktopEnv) -> float:
        """The task's evaluator on the desktop. One that raises on what the agent left (no
        output file, a file that does not parse: ``EvaluatorRaised``) scores 0 with the
        reason kept: the agent's failure. OSWorld's harness lets such an exception end the
        example without a result (rerun as unfinished by its next launch); a rerun meets
        the same leftovers, so we score it where OSWorld's getters' FileNotFoundError
        already scores 0 (docs/osworld.md)."""
        t0 = time.monotonic()
        try:
            reward, self.evaluation_error = await score_task(
                self.r.evaluator, env, self.task, self.last_action,
                self.cfg.runner.evaluation_timeout_s)
        except TimeoutError:
            raise EpisodeEnded(Status.INFRA_ERROR, "evaluation timed out after "
                                f"{self.cfg.runner.evaluation_timeout_s:.0f}s",
                                retryable=True, healthy=False) from None
        finally:
            self.timing["evaluation_s"] = time.monotonic() - t0
        return reward


async def score_task(evaluator: Evaluator, env: DesktopEnv, task: Mapping[str, Any],
                     last_action: str | None, timeout_s: float) -> tuple[float, str | None]:
    """The task's reward in [0, 1] on ``env`` by its evaluator (episodes and the desktop
    service score alike), and why it is 0 when the evaluator raised on what the agent left
    (``EvaluatorRaised``: the agent's failure, scored 0 with the reason kept). Past
    ``timeout_s``: ``TimeoutError``; any other evaluation error is raised."""
    try:
        reward = await asyncio.wait_for(
            evaluator.evaluate(env, task, last_action,  # type: ignore[arg-type]
                               task_id=str(task.get("id", "")) or None),
            timeout_s)
    except EvaluatorRaised as exc:
        return 0.0, one_line(exc)
    return min(1.0, max(0.0, float(reward))), None
