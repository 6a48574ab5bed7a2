"""A text episode (math, py, rag, web): no desktop; a text environment's tools in its place
(``cua_rollout.text.envs``), a tool-calling conversation held by the ``ToolAgent``
(``cua_rollout.agents.tool``) of up to ``text.max_turns`` replies, scored by the item's
answer metric. The loop and everything else (storage, deadlines, model outages, retries,
results) is episode.py's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any

from cua_rollout.agents.base import Decision
from cua_rollout.agents.tool import ReadReply, ToolAgent
from cua_rollout.core.errors import (
    EvaluationError,
)
from cua_rollout.core.types import (
    EpisodeResult,
    EpisodeSpec,
    Status,
)
from cua_rollout.envs.contract import StepResult
from cua_rollout.envs.tools import TOOL_MALFORMED, TOOL_OVER_LIMIT
from cua_rollout.runtime.episode import Episode, EpisodeEnded, EpisodeHost
from cua_rollout.runtime.trajectory import StepRecord, tool_call_record
from cua_rollout.text.benchmark import task_metric
from cua_rollout.text.metrics import JudgeError, judge, score

__all__ = ["TextEpisode"]

# Of a text episode's final answer, what its results.jsonl line keeps (traj.jsonl has it all).
_ANSWER_RECORD_CHARS = 2000


async def _close_when_made(opening: Awaitable[Any]) -> None:
    """Close the environment ``opening`` makes, when it does (an episode cancelled while
    its environment was being made)."""
    with contextlib.suppress(Exception):
        env = await opening
        await env.close()


async def _all_or_none(calls: list[Awaitable[StepResult]]) -> list[StepResult]:
    """Run a turn's tool calls concurrently; when one raises (a tool that cannot run, a
    cancel), the others are cancelled and awaited before the error goes on: no call outlives
    its episode's environment."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class TextEpisode(Episode):
    """A text episode (math, py, rag, web): no desktop; a text environment's tools in its
    place (``cua_rollout.text.envs``), a tool-calling conversation of up to ``text.max_turns``
    replies (``cua_rollout.agents.tool``), scored by the item's answer metric."""

    agent: ToolAgent

    def __init__(self, runner: EpisodeHost, spec: EpisodeSpec, avoid: list[str]) -> None:
        super().__init__(runner, spec, avoid)
        self.max_steps = self.cfg.text.max_turns  # a turn is a step
        self.answer: str | None = None

    def _make_agent(self) -> ToolAgent:  # type: ignore[override]
        return ToolAgent(self.cfg.text, str(self.task["mode"]))

    async def _give_back(self, healthy: bool) -> None:
        pass  # holds no desktop: its environment is closed with the episode

    def _enter(self, phase: str | None) -> None:
        pass  # the utilization clocks count desktops' time; a text episode holds none

    async def _open(self) -> Any:
        self.begun = True
        # In a thread: the first rag episode of a process builds (or loads) the index.
        opening = asyncio.ensure_future(
            asyncio.to_thread(self.r.text_env, self.task, self.session_id))
        try:
            env = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The thread runs on: the environment it makes (a scratch directory, clients) is
            # closed once made, or nothing would.
            self.r.background.spawn(_close_when_made(opening))
            raise
        self.env = env
        return env

    async def _begin(self, env: Any) -> None:
        """The question and the environment's tools start the agent's conversation."""
        question = await env.reset(self.task)
        self.agent.start(question, env.tools)
        self.last_messages = self.agent.messages
        return None

    async def _carry_out(self, env: Any, decision: Decision, parsed: Any, record: StepRecord,
                         split: dict[str, float]) -> tuple[bool, None]:
        """The reply's answer ends the episode; otherwise its tool calls run concurrently (at
        most ``text.max_tool_calls_per_turn``) and their results join the conversation."""
        reply: ReadReply = parsed
        agent = self.agent
        started = time.monotonic()
        ended = decision.terminal is not None
        if ended:
            self.answer = reply.answer
            agent.answered(record.response, reply)
            self.last_action = record.action = "answer"
            record.answer = reply.answer
        else:
            limit = self.cfg.text.max_tool_calls_per_turn
            run, over = reply.calls[:limit], reply.calls[limit:]
            ran = await _all_or_none([env.step(c) for c in run])
            results: dict[str, StepResult] = {c.id: r for c, r in zip(run, ran, strict=True)}
            skipped = (f"error: not run: a reply may make at most {limit} tool calls "
                       f"(text.max_tool_calls_per_turn)")
            for call in over:
                results[call.id] = StepResult(call.name, TOOL_OVER_LIMIT, skipped, skipped)
            if reply.answer_call is not None and reply.answer_problem is not None:
                text = f"error: {reply.answer_problem}"
                results[reply.answer_call.id] = StepResult(reply.answer_call.name,
                                                           TOOL_MALFORMED, text, text)
            # Answered in the order the model made the calls.
            answered = [c for c in reply.all_calls if c.id in results]
            agent.called(record.response, answered, results)
            record.tool_calls = [tool_call_record(c, results[c.id]) for c in answered]
            self.last_action = record.action = ",".join(c.name for c in answered)
        split["action_s"] = time.monotonic() - started
        return ended, None

    async def _evaluate(self, env: Any) -> float:
        t0 = time.monotonic()
        metric, variant, tolerance = task_metric(self.task)
        try:
            async with asyncio.timeout(self.cfg.runner.evaluation_timeout_s):
                if metric == "llm_judgement":
                    reward = await judge(self.answer, self.task["answer"],
                                         str(self.task.get("question", "")),
                                         ask=self.r.judge_ask, variant=variant)
                else:  # CPU-bound (similarity of long texts): off the loop
                    reward = await asyncio.to_thread(score, metric, self.answer,
                                                     self.task["answer"], variant=variant,
                                                     tolerance=tolerance)
        except TimeoutError:
            raise EpisodeEnded(Status.INFRA_ERROR, "evaluation timed out after "
                                f"{self.cfg.runner.evaluation_timeout_s:.0f}s",
                                retryable=True) from None
        except JudgeError as exc:
            raise EvaluationError(f"llm_judgement: {exc}") from exc
        finally:
            self.timing["evaluation_s"] = time.monotonic() - t0
        return min(1.0, max(0.0, float(reward)))

    def result(self, status: str, error: str | None, retryable: bool,
               reward: float | None) -> EpisodeResult:
        out = super().result(status, error, retryable, reward)
        metric, variant, _ = task_metric(self.task)
        answer = self.answer
        if answer is not None and len(answer) > _ANSWER_RECORD_CHARS:
            answer = answer[:_ANSWER_RECORD_CHARS] + "…"
        out.text = {"mode": self.task.get("mode"), "benchmark": self.task.get("benchmark"),
                    "metric": metric, "variant": variant, "answer": answer,
                    "turns": self.steps, **self.agent.counts.record()}
        return out
