"""The text episode loop as a component: a real TrajectoryRunner (no desktop pool), StorageActor
and model client over real HTTP to a fake OpenAI server on loopback that replies with tool
calls, and a ``ToolEnv`` of small tools written here. Each test drives one path of the
tool-calling agent (``cua_rollout.agents.tool``) and reads what the episode leaves on disk and
what the model was sent."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.agents.tool import SYSTEM_PROMPTS
from cua_rollout.config import Config, load_config
from cua_rollout.core.errors import ToolError, ToolUnavailable
from cua_rollout.core.types import EpisodeResult, EpisodeSpec
from cua_rollout.envs.tools import ToolSpec, check_arguments
from cua_rollout.runtime.runner import TrajectoryRunner
from cua_rollout.runtime.storage import StorageActor
from cua_rollout.text.benchmark import text_task
from cua_rollout.text.envs import ToolEnv
from cua_rollout.text.metrics import JUDGE_SYSTEM_PROMPT
from tests.doubles.fake_openai import FakeOpenAIServer
from tests.support import run_recorded

QUESTION = "What is six times seven?"
BENCH = "bench"

# --------------------------------------------------------------------------- tools


class _Tool:
    """A tool of a test: counts its closes, records its calls (and when they ran)."""

    def __init__(self, name: str) -> None:
        self.spec = ToolSpec(name=name, description=f"the {name} tool")
        self.calls: list[dict[str, Any]] = []
        self.spans: list[tuple[float, float]] = []  # (started, ended) of each call
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class EchoTool(_Tool):
    def __init__(self, name: str = "echo") -> None:
        super().__init__(name)
        self.spec = ToolSpec(name, "Echo the text back.", {
            "type": "object", "properties": {"text": {"type": "string"}},
            "required": ["text"]})

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        args = check_arguments(self.spec, arguments)
        self.calls.append(args)
        return f"echo: {args['text']}"


class SleepTool(_Tool):
    """Sleeps ``delay_s`` per call; ``started`` is set when a call begins."""

    def __init__(self, name: str, delay_s: float) -> None:
        super().__init__(name)
        self.delay_s = delay_s
        self.started = asyncio.Event()
        self.cancelled = 0

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        t0 = time.monotonic()
        self.calls.append(dict(arguments))
        self.started.set()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.spans.append((t0, time.monotonic()))
        return f"{self.spec.name} slept"


class FailTool(_Tool):
    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        self.calls.append(dict(arguments))
        raise ToolError("fail: the page did not load")


class BrokenTool(_Tool):
    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        raise ToolUnavailable("broken: the sandbox cannot start")


# --------------------------------------------------------------------------- the world

Reply = str | tuple[str, list[tuple[str, str]]]


def call(name: str, **arguments: Any) -> tuple[str, str]:
    """A tool call of a scripted reply: (name, arguments JSON text)."""
    return name, json.dumps(arguments)


def answer(value: Any) -> tuple[str, list[tuple[str, str]]]:
    """A reply calling the answer tool."""
    return "", [call("answer", answer=value)]


def is_judge(body: dict[str, Any]) -> bool:
    return body["messages"][0]["content"] == JUDGE_SYSTEM_PROMPT


@dataclass
class World:
    cfg: Config
    runner: TrajectoryRunner
    storage: StorageActor
    model: FakeOpenAIServer
    replies: list[Reply | Callable[[dict[str, Any]], Reply]]
    tools: list[list[_Tool]] = field(default_factory=list)  # each env's tools, in order
    judge_reply: str = "Correct"

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def agent_requests(self) -> list[dict[str, Any]]:
        """What the episode asked the model (the judge's questions left out)."""
        return [r for r in self.model.requests if not is_judge(r)]

    async def run(self, task: dict[str, Any] | None = None) -> EpisodeResult:
        task = task or make_task()
        return await run_recorded(self.runner, self.storage,
                                  EpisodeSpec(task["id"], BENCH, 0, task))

    def episode_dir(self, task_id: str = "q1") -> Path:
        return self.run_dir / BENCH / task_id / "0"

    def traj(self, task_id: str = "q1") -> list[dict[str, Any]]:
        text = (self.episode_dir(task_id) / "traj.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]

    def messages(self, task_id: str = "q1") -> list[dict[str, Any]]:
        return json.loads((self.episode_dir(task_id) / "messages.json").read_text())

    def tool(self, name: str, env: int = -1) -> Any:
        return next(t for t in self.tools[env] if t.spec.name == name)


def make_task(answer_: Any = "42", metric: str = "numeric_match", *, mode: str = "py",
              task_id: str = "q1", question: str = QUESTION) -> dict[str, Any]:
    return text_task({"id": task_id, "question": question, "answer": answer_}, mode=mode,
                     benchmark=BENCH, metric=metric, variant="normalized", tolerance=1e-6)


def default_tools() -> list[_Tool]:
    return [EchoTool(), FailTool("fail")]


@pytest.fixture
async def make_world(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[World, FakeOpenAIServer]] = []

    async def make(*sets: str, replies: list[Any] | None = None,
                   tools: Callable[[], list[_Tool]] = default_tools) -> World:
        """``replies``: the episode's replies in order (a text, ``(text, calls)``, or a
        function of the request body returning one); past them, "Final answer: 0". The
        judge's questions (JUDGE_SYSTEM_PROMPT) get ``world.judge_reply``."""
        world: World

        def reply(body: dict[str, Any]) -> Reply:
            if is_judge(body):
                return world.judge_reply
            if not world.replies:
                return "Final answer: 0"
            nxt = world.replies.pop(0)
            return nxt(body) if callable(nxt) else nxt

        server = FakeOpenAIServer(reply=reply)
        server.start()
        cfg = load_config(None, [
            f"run.output_dir={tmp_path / 'results'}", f"model.endpoints={json.dumps([server.url])}",
            "model.retries=0", *sets,
        ])
        storage = StorageActor(cfg.run_dir, cfg.storage)
        await storage.start_run({"run": "text-component"})
        envs: list[list[_Tool]] = []

        def text_env(task: dict[str, Any], name: str) -> ToolEnv:
            envs.append(tools())
            return ToolEnv(name, task["mode"], envs[-1])

        runner = TrajectoryRunner(cfg, None, storage, "r0", text_env_factory=text_env)
        world = World(cfg, runner, storage, server, list(replies or []), envs)
        made.append((world, server))
        return world

    yield make
    for world, server in made:
        await world.runner.close()
        await world.storage.close()
        server.stop()


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or []]


# --------------------------------------------------------------------------- the conversation


async def test_tools_go_with_each_request_and_each_call_is_answered_by_its_id(make_world):
    world = await make_world(replies=[
        ("Let me echo it.", [call("echo", text="hi")]),
        ("Done.", [call("answer", answer="42")]),
    ])
    result = await world.run()
    assert (result.status, result.reward, result.steps, result.error) == ("success", 1.0, 2,
                                                                         None)
    assert result.last_action == "answer" and result.desktop is None

    first, second = world.model.requests
    assert tool_names(first) == ["echo", "fail", "answer"]  # the env's tools, then answer
    assert first["tool_choice"] == "auto"
    assert first["tools"][0]["function"]["parameters"]["required"] == ["text"]
    assert first["messages"] == [{"role": "system", "content": SYSTEM_PROMPTS["py"]},
                                 {"role": "user", "content": QUESTION}]
    # The reply and the answer to its call follow in the next request, by the call's id.
    traj = world.traj()
    call_id = traj[0]["response_tool_calls"][0]["id"]
    assert call_id.startswith("call_")
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {
        "role": "assistant", "content": "Let me echo it.",
        "tool_calls": [{"id": call_id, "type": "function",
                        "function": {"name": "echo", "arguments": '{"text": "hi"}'}}]}
    assert second["messages"][3] == {"role": "tool", "tool_call_id": call_id, "name": "echo",
                                     "content": "echo: hi"}
    assert len(second["messages"]) == 4 and tool_names(second) == tool_names(first)
    assert world.tool("echo").calls == [{"text": "hi"}]

    # The result line's text part.
    assert result.text == {
        "mode": "py", "benchmark": BENCH, "metric": "numeric_match", "variant": "normalized",
        "answer": "42", "turns": 2, "tool_calls": 1, "tool_errors": 0, "malformed_calls": 0,
        "unknown_tools": 0, "over_limit": 0, "by_tool": {"echo": 1}}
    assert result.record()["text"]["answer"] == "42"

    # traj.jsonl: one line per turn, the last done with the reward.
    assert [(t["step_num"], t["done"], t["reward"], t["action"]) for t in traj] == [
        (1, False, 0, "echo"), (2, True, 1.0, "answer")]
    assert traj[0]["tool_calls"] == [{
        "id": call_id, "name": "echo", "arguments": '{"text": "hi"}', "output": "echo: hi",
        "returncode": 0, "error": None, "duration_s": traj[0]["tool_calls"][0]["duration_s"]}]
    assert traj[1]["answer"] == "42" and "tool_calls" not in traj[1]
    assert "token_ids" not in traj[0] and "logprobs" not in traj[0]  # not asked for
    assert set(traj[0]["timing"]) >= {"model_s", "env_s", "overhead_s", "step_s"}

    # episode.json and result.txt; the env was closed once.
    episode_dir = world.episode_dir()
    assert (episode_dir / "result.txt").read_text() == "1.0\n"
    record = json.loads((episode_dir / "episode.json").read_text())
    assert (record["status"], record["reward"], record["text"]["turns"]) == ("success", 1.0, 2)
    assert [t.closed for t in world.tools[0]] == [1, 1]


async def test_messages_json_holds_the_whole_conversation(make_world):
    world = await make_world(replies=[
        ("Echo first.", [call("echo", text="hi")]),
        ("Here it is.", [call("answer", answer="42")]),
    ])
    result = await world.run()
    assert result.status == "success"
    messages = world.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool",
                                            "assistant"]
    assert [m["content"] for m in messages] == [SYSTEM_PROMPTS["py"], QUESTION, "Echo first.",
                                               "echo: hi", "Here it is."]


async def test_messages_json_keeps_the_tool_calls_and_their_ids(make_world):
    world = await make_world(replies=[
        ("Echo first.", [call("echo", text="hi")]),
        ("Here it is.", [call("answer", answer="42")]),
    ])
    await world.run()
    messages = world.messages()
    ids = [c["id"] for t in world.traj() for c in t["response_tool_calls"]]
    assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"] == ids[0]
    assert messages[4]["tool_calls"][0]["function"] == {"name": "answer",
                                                        "arguments": '{"answer": "42"}'}


async def test_the_system_prompt_setting_and_no_answer_tool(make_world):
    """``text.system_prompt`` replaces the mode's; without the answer tool a call of
    ``answer`` is an unknown tool, and a plain reply ends the episode (its "Final answer:"
    line is the answer, thinking left out)."""
    world = await make_world(
        "text.system_prompt=Be brief.", "text.final_answer_tool=false",
        "text.tool_choice=required",
        replies=[answer("42"),
                 "<think>Final answer: 41</think>Six sevens.\nFinal answer: 42"])
    result = await world.run()
    assert (result.status, result.reward) == ("success", 1.0)
    first, second = world.model.requests
    assert tool_names(first) == ["echo", "fail"] and first["tool_choice"] == "required"
    assert first["messages"][0] == {"role": "system", "content": "Be brief."}
    assert second["messages"][3]["content"].startswith("error: there is no tool named "
                                                       "'answer'")
    assert (result.text["answer"], result.text["unknown_tools"], result.text["turns"]) == (
        "42", 1, 2)
    assert world.messages()[-1]["content"].endswith("Final answer: 42")


async def test_a_mode_without_tools_sends_none(make_world):
    world = await make_world("text.final_answer_tool=false", tools=list,
                             replies=["The product is <answer>42</answer>."])
    result = await world.run(make_task(mode="math"))
    assert (result.status, result.text["answer"], result.text["mode"]) == ("success", "42",
                                                                           "math")
    (request,) = world.model.requests
    assert "tools" not in request and "tool_choice" not in request
    assert request["messages"][0]["content"] == SYSTEM_PROMPTS["math"]


async def test_parallel_calls_run_concurrently_and_are_answered_in_the_models_order(
        make_world):
    world = await make_world(
        tools=lambda: [SleepTool("slow", 0.3), SleepTool("quick", 0.25)],
        replies=[("Both at once.", [call("slow"), call("quick")]), answer("42")])
    result = await world.run()
    assert result.status == "success"
    slow, quick = world.tool("slow"), world.tool("quick")
    # They overlapped: quick started before slow ended, and the turn took about one sleep.
    assert quick.spans[0][0] < slow.spans[0][1] and slow.spans[0][0] < quick.spans[0][1]
    turn = world.traj()[0]
    assert turn["timing"]["env_s"] < 0.5  # one after the other: 0.55 s
    # quick finished first, yet the answers follow the order of the calls.
    messages = world.model.requests[1]["messages"]
    assert [m.get("name") for m in messages[3:]] == ["slow", "quick"]
    assert [c["function"]["name"] for c in messages[2]["tool_calls"]] == ["slow", "quick"]
    assert [m["tool_call_id"] for m in messages[3:]] == [
        c["id"] for c in messages[2]["tool_calls"]]
    assert [c["name"] for c in turn["tool_calls"]] == ["slow", "quick"]
    assert turn["action"] == "slow,quick"


# --------------------------------------------------------------------------- ends and scores


@pytest.mark.parametrize(("metric", "reference", "reply", "status", "reward"), [
    ("numeric_match", "42", "It is $42.00", "success", 1.0),
    ("numeric_match", "42", "It is 41.", "failure", 0.0),
    ("exact_match", "Paris", "<answer>paris.</answer>", "success", 1.0),
    ("exact_match", "Paris", "<answer>Lyon</answer>", "failure", 0.0),
])
async def test_a_plain_reply_ends_the_episode_and_is_scored_by_the_metric(
        make_world, metric, reference, reply, status, reward):
    world = await make_world(replies=[reply])
    result = await world.run(make_task(reference, metric))
    assert (result.status, result.reward, result.steps) == (status, reward, 1)
    assert result.text["metric"] == metric and result.text["turns"] == 1
    assert result.text["answer"] == (reply if "<answer>" not in reply
                                     else reply.split("<answer>")[1].split("<")[0])
    (turn,) = world.traj()
    assert (turn["done"], turn["reward"], turn["action"]) == (True, reward, "answer")
    assert (world.episode_dir() / "result.txt").read_text() == f"{reward}\n"
    assert world.messages()[-1] == {"role": "assistant", "content": reply}


async def test_the_models_mistakes_are_answered_to_it_and_counted(make_world):
    """One reply with every mistake: arguments that are not JSON, an answer call without an
    answer, an unknown tool, a call the tool refuses, and one call past the per-turn cap.
    Each is answered, in the model's order, and counted where it belongs."""
    world = await make_world("text.max_tool_calls_per_turn=3", replies=[
        ("Trying things.", [("echo", '{"text": '), call("answer", reply=42),
                            call("nosuch"), call("fail", url="x"), call("echo", text="late")]),
        answer(42),
    ])
    result = await world.run()
    assert (result.status, result.reward) == ("success", 1.0)
    assert result.text["answer"] == "42"  # a number is taken as its text
    counts = {k: result.text[k] for k in ("tool_calls", "tool_errors", "malformed_calls",
                                          "unknown_tools", "over_limit", "by_tool")}
    assert counts == {"tool_calls": 5, "tool_errors": 1, "malformed_calls": 2,
                      "unknown_tools": 1, "over_limit": 1,
                      "by_tool": {"echo": 2, "answer": 1, "nosuch": 1, "fail": 1}}
    messages = world.model.requests[1]["messages"]
    calls = messages[2]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["echo", "answer", "nosuch", "fail",
                                                      "echo"]
    answers = messages[3:]
    assert [m["tool_call_id"] for m in answers] == [c["id"] for c in calls]
    contents = [m["content"] for m in answers]
    assert contents[0].startswith("error: echo: the arguments are not valid JSON")
    assert contents[1] == ("error: answer: the arguments must be a JSON object with a string "
                           "'answer'")
    assert contents[2].startswith("error: there is no tool named 'nosuch'")
    assert contents[3] == "error: fail: the page did not load"
    assert contents[4] == ("error: not run: a reply may make at most 3 tool calls "
                           "(text.max_tool_calls_per_turn)")
    turn = world.traj()[0]
    assert [c["returncode"] for c in turn["tool_calls"]] == [2, 2, 3, 1, 4]
    assert turn["action"] == "echo,answer,nosuch,fail,echo"
    # Neither the malformed call nor the one past the cap reached the tool.
    assert world.tool("echo").calls == [] and world.tool("fail").calls == [{"url": "x"}]


async def test_the_turn_budget_ends_as_max_steps_scored_zero(make_world):
    world = await make_world("text.max_turns=3",
                             replies=[("again", [call("echo", text="x")])] * 5)
    result = await world.run()
    assert (result.status, result.reward, result.steps) == ("max_steps", 0.0, 3)
    assert (result.text["turns"], result.text["answer"], result.text["tool_calls"]) == (
        3, None, 3)
    traj = world.traj()
    assert [(t["step_num"], t["done"], t["reward"]) for t in traj] == [
        (1, False, 0), (2, False, 0), (3, True, 0.0)]
    assert len(world.model.requests) == 3
    assert (world.episode_dir() / "result.txt").read_text() == "0.0\n"


async def test_a_tool_that_cannot_run_is_a_retryable_infra_error(make_world):
    world = await make_world(tools=lambda: [BrokenTool("python")],
                             replies=[("run it", [call("python")])])
    result = await world.run()
    assert (result.status, result.reward, result.retryable) == ("infra_error", None, True)
    assert "ToolUnavailable" in result.error and "sandbox cannot start" in result.error
    assert not (world.episode_dir() / "result.txt").exists()  # never a reward
    record = json.loads((world.episode_dir() / "episode.json").read_text())
    assert record["status"] == "infra_error"
    assert world.tool("python").closed == 1


async def test_a_tool_that_cannot_run_stops_the_other_calls_of_its_turn(make_world):
    world = await make_world(tools=lambda: [BrokenTool("python"), SleepTool("slow", 0.5)],
                             replies=[("run both", [call("slow"), call("python")])])
    result = await world.run()
    assert result.status == "infra_error"
    slow = world.tool("slow")
    assert slow.closed == 1
    # The env is closed: no call of it may still be running.
    assert slow.cancelled == 1 and slow.spans == []


async def test_a_model_outage_mid_episode_is_waited_out_with_the_deadline_stopped(make_world):
    """The model goes down after the first turn for longer than the episode's deadline: the
    episode waits, then completes."""
    world = await make_world("runner.episode_timeout_s=1", "model.outage_wait_s=30",
                             "model.endpoint_failures_to_eject=1")
    server = world.model

    def go_down(body: dict[str, Any]) -> Reply:
        server.healthy = False
        server.faults.extend([503] * 1000)
        return "Echo.", [call("echo", text="hi")]

    world.replies += [go_down, answer("42")]
    running = asyncio.ensure_future(world.run())
    for _ in range(250):
        if world.runner.stats()["model_waiting"]:
            break
        await asyncio.sleep(0.02)
    assert world.runner.stats()["model_waiting"] == 1
    await asyncio.sleep(1.2)  # longer than the episode's deadline
    server.faults.clear()
    server.healthy = True
    result = await asyncio.wait_for(running, 30)
    assert (result.status, result.reward, result.steps) == ("success", 1.0, 2)
    assert result.timing["outage_wait_s"] >= 1.2
    assert server.statuses[503] >= 1
    assert world.traj()[-1]["done"] is True


# --------------------------------------------------------------------------- llm_judgement


@pytest.mark.parametrize(("verdict", "status", "reward"), [("Correct", "success", 1.0),
                                                           ("Incorrect.", "failure", 0.0)])
async def test_llm_judgement_asks_the_runs_own_model(make_world, verdict, status, reward):
    world = await make_world(replies=[answer("Paris, France")])
    world.judge_reply = verdict
    task = make_task("Paris", "llm_judgement", question="Capital of France?")
    result = await world.run(task)
    assert (result.status, result.reward) == (status, reward)
    assert result.text["metric"] == "llm_judgement"
    episode, judged = world.model.requests
    assert not is_judge(episode) and is_judge(judged)
    assert "tools" not in judged
    assert (judged["temperature"], judged["max_tokens"]) == (0.0, 256)
    question = judged["messages"][1]["content"]
    assert "Capital of France?" in question and "Reference answer:\nParis" in question
    assert "Model's answer:\nParis, France" in question
    assert world.traj()[-1]["reward"] == reward


async def test_a_judge_reply_that_is_no_verdict_is_an_infra_error(make_world):
    world = await make_world(replies=[answer("Paris")])
    world.judge_reply = "I cannot say."
    result = await world.run(make_task("Paris", "llm_judgement"))
    assert (result.status, result.reward) == ("infra_error", None)
    assert "llm_judgement" in result.error and "neither Correct nor Incorrect" in result.error
    assert not (world.episode_dir() / "result.txt").exists()


async def test_llm_judgement_asks_the_judge_of_text_judge_with_its_key(make_world,
                                                                      monkeypatch):
    monkeypatch.setenv("TEXT_EPISODE_JUDGE_KEY", "judge-secret")
    judge = FakeOpenAIServer(model="judge-model", reply=lambda body: "Correct")
    judge.start()
    try:
        world = await make_world(
            f"text.judge.endpoints={json.dumps([judge.url])}", "text.judge.name=judge-model",
            "text.judge.api_key_env=TEXT_EPISODE_JUDGE_KEY", "text.judge.retries=0",
            replies=[answer("Paris")])
        result = await world.run(make_task("Paris", "llm_judgement"))
        assert (result.status, result.reward) == ("success", 1.0)
        (judged,) = judge.requests
        assert judged["model"] == "judge-model" and is_judge(judged)
        assert judge.headers[0]["authorization"] == "Bearer judge-secret"
        # The run's model answered the episode only, without the judge's key.
        assert len(world.model.requests) == 1 and not is_judge(world.model.requests[0])
        assert "authorization" not in world.model.headers[0]
    finally:
        judge.stop()


# --------------------------------------------------------------------------- what a turn keeps


async def test_token_ids_and_logprobs_are_kept_on_each_turn_when_asked(make_world):
    world = await make_world("model.sampling.return_token_ids=true",
                             "model.sampling.logprobs=true", replies=[
                                 ("Echo it now.", [call("echo", text="hi")]),
                                 "Final answer: 42"])
    result = await world.run()
    assert result.status == "success"
    assert all(r["return_token_ids"] is True and r["logprobs"] is True
               for r in world.model.requests)
    first, second = world.traj()
    assert first["token_ids"] == [0, 1, 2] and first["logprobs"] == [-0.5] * 3
    assert second["token_ids"] == [0, 1, 2] and len(second["logprobs"]) == 3
    assert len(first["prompt_token_ids"]) == 11
    assert first["response_tool_calls"][0]["function"]["name"] == "echo"
    assert second["response_tool_calls"] is None


# --------------------------------------------------------------------------- cancellation


async def test_cancelling_a_running_text_episode_closes_its_env(make_world):
    world = await make_world(tools=lambda: [SleepTool("python", 60)],
                             replies=[("run it", [call("python")])])
    running = asyncio.ensure_future(world.run())
    for _ in range(500):
        if world.tools and world.tool("python").started.is_set():
            break
        await asyncio.sleep(0.01)
    assert world.tool("python").started.is_set()
    assert await world.runner.cancel() == 1
    result = await asyncio.wait_for(running, 10)
    assert (result.status, result.reward) == ("cancelled", None)
    tool = world.tool("python")
    for _ in range(200):  # the env is closed by the finish, in the background
        if tool.closed:
            break
        await asyncio.sleep(0.01)
    assert (tool.closed, tool.cancelled) == (1, 1)
    assert world.runner.stats()["active"] == 0


async def test_cancelling_while_its_env_is_made_closes_the_env_once_made(make_world):
    """The env is made in a thread, which a cancel cannot stop: what it makes (a sandbox's
    scratch directory, a web client) is closed when it is done."""
    entered, release = threading.Event(), threading.Event()
    made: list[EchoTool] = []

    def slow_tools() -> list[_Tool]:
        entered.set()
        release.wait(10)
        made.append(EchoTool())
        return list(made)

    world = await make_world(tools=slow_tools)
    running = asyncio.ensure_future(world.run())
    assert await asyncio.to_thread(entered.wait, 10)
    assert await world.runner.cancel() == 1
    result = await asyncio.wait_for(running, 10)
    assert result.status == "cancelled"
    assert not made  # still being made
    release.set()
    for _ in range(500):
        if made and made[0].closed:
            break
        await asyncio.sleep(0.01)
    assert made and made[0].closed == 1
