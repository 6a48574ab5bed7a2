"""OpenAI tool calls from a real vLLM server (CPU build) serving a tiny random Qwen2 text model
built at test time (``cua_rollout.cli.tiny_models``), spoken to over the raw protocol (httpx2):
what the tool-calling agent of the text environments relies on.

A random model writes garbage, so its calls are forced valid: the server runs vLLM's hermes
tool parser (``--enable-auto-tool-choice --tool-call-parser hermes``; without both flags vLLM
refuses ``tool_choice`` "required" and named with a 400) and ``--tool-strict-level parameter``,
so that ``tool_choice="required"`` or a named tool makes the model write
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` with the arguments held to the
tool's JSON schema by structured outputs (xgrammar structural tags). Without that level, a tool
without ``"strict": true`` has its call envelope forced but any JSON value as arguments.

What the tests pin down:
- ``required``: every reply is ``finish_reason == "tool_calls"``, ``content == ""`` and one or
  more calls (several in one reply now and then) whose ``arguments`` string parses to an object
  of the tool's schema; both tools get called; ``parallel_tool_calls: false`` gives one call;
- a named tool: one call of that tool, ``finish_reason == "stop"``;
- ``auto``: the random model writes plain content (no ``<tool_call>``): no calls;
- an argument string that is valid for the grammar but not for ``json.loads`` (raw control
  characters, which a random model writes unless a ``pattern`` keeps them out) loses the call:
  no ``tool_calls``, the raw ``<tool_call>`` text as content, ``finish_reason`` unchanged;
- a second turn carrying the assistant's ``tool_calls`` and ``role: "tool"`` results renders
  them (the tiny template's hermes format) and extends the first turn's prompt tokens;
- ``logprobs`` and ``return_token_ids`` come back beside the calls: the sampled token ids and
  their logprobs, which are those of the grammar-masked distribution (forced tokens: 0.0).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cua_rollout.cli.tiny_models import build_tiny_model
from cua_rollout.config import ModelPoolConfig
from cua_rollout.model.fleet.launch import replica_command, replica_env
from cua_rollout.model.fleet.processes import exit_status, log_tail, spawn, stop_group
from tests.support import run_recorded, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL_NAME = "tiny"
# Deadlines are generous: this machine has 2 cores and other suites run beside this one.
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
# The tools' JSON schemas fill ~800 prompt tokens with the tiny tokenizer, and a forced call
# takes ~100-200 tokens (the grammar lets the random model pad the JSON with whitespace).
MAX_MODEL_LEN = 2048
MAX_TOKENS = 1000
SERVER_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--tool-strict-level", "parameter"]

# Strings are held to a pattern: the grammar of a bare JSON string admits raw control
# characters, which json.loads (vLLM's hermes parser) refuses.
_WORDS = {"type": "string", "pattern": "^[a-z ]{1,20}$"}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object",
                   "properties": {"query": _WORDS,
                                  "top_k": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query", "top_k"], "additionalProperties": False}}}
FINISH = {"type": "function", "function": {
    "name": "finish", "description": "Give the final answer.",
    "parameters": {"type": "object", "properties": {"answer": _WORDS},
                   "required": ["answer"], "additionalProperties": False}}}
TOOLS = [SEARCH, FINISH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is 2 + 2? Use the tools."}]


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tool_vllm() -> Iterator[str]:
    """A vLLM OpenAI server with the hermes tool parser on a tiny random Qwen2 built here;
    its base URL. Started as ``run_model.py`` starts a CPU replica (its command line and
    environment), stopped with its whole process group."""
    if importlib.util.find_spec("vllm") is None:
        unavailable("vLLM is not installed")
    # A short path: vLLM puts its ZeroMQ sockets in TMPDIR (at most 107 bytes a path).
    root = tempfile.mkdtemp(prefix="cua-tools-")
    try:
        work = Path(root)
        model = build_tiny_model(work / "model")
        pool = ModelPoolConfig(max_model_len=MAX_MODEL_LEN, cpu_kv_cache_space_gib=1,
                               reload_in_place=False, extra_args=SERVER_ARGS)
        port = _free_port()
        cmd = replica_command(pool, MODEL_NAME, str(model), port, None)
        env = replica_env(pool, None, work / "tmp")
        log = work / "vllm.log"
        started = time.monotonic()
        proc = spawn(cmd, env, log)
        try:
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(timeout=5.0) as client:
                while True:
                    status = exit_status(proc)
                    assert status is None, f"vLLM exited ({status}):\n{log_tail(log, 40)}"
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    assert time.monotonic() - started < START_TIMEOUT_S, (
                        f"vLLM not healthy after {START_TIMEOUT_S:.0f} s:\n{log_tail(log, 40)}")
                    time.sleep(0.5)
            print(f"vLLM with tool calls healthy after {time.monotonic() - started:.1f} s")
            yield url
        finally:
            asyncio.run(stop_group(proc, graceful=True, orphans_first=True,
                                   timeout_s=STOP_TIMEOUT_S, forced=lambda: False))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def client(tool_vllm: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=tool_vllm, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


# --------------------------------------------------------------------------- helpers


def chat(client: httpx2.Client, **body: Any) -> dict[str, Any]:
    """One chat completion; the reply's JSON (a non-200 fails the test)."""
    request = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS,
               "max_tokens": MAX_TOKENS, **body}
    response = client.post("/v1/chat/completions", json=request)
    assert response.status_code == 200, response.text[:2000]
    return response.json()


def check_arguments(args: Any, schema: dict[str, Any]) -> None:
    """``args`` satisfies ``schema`` (the part of JSON Schema the tools above use)."""
    assert isinstance(args, dict), args
    assert set(args) == set(schema["required"]), args  # all required, nothing else
    for key, spec in schema["properties"].items():
        value = args[key]
        if spec["type"] == "string":
            assert isinstance(value, str) and re.search(spec["pattern"], value), (key, value)
        else:
            assert isinstance(value, int) and not isinstance(value, bool), (key, value)
            assert spec["minimum"] <= value <= spec["maximum"], (key, value)


def check_calls(choice: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The choice's tool calls, each checked against the OpenAI shape and its tool's schema:
    ``(name, parsed arguments)`` in order."""
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] in ("", None), message["content"]
    calls = message.get("tool_calls")
    assert calls, f"no tool calls ({choice['finish_reason']}): {message['content']!r}"
    ids = [call["id"] for call in calls]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), ids
    parsed = []
    for call in calls:
        assert call["type"] == "function", call
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        assert name in SCHEMAS, call
        assert isinstance(arguments, str), call  # a JSON document as a string, as OpenAI's
        args = json.loads(arguments)
        check_arguments(args, SCHEMAS[name])
        parsed.append((name, args))
    return parsed


def detokenize(client: httpx2.Client, token_ids: list[int]) -> str:
    response = client.post("/detokenize", json={"model": MODEL_NAME, "tokens": token_ids})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


# --------------------------------------------------------------------------- tool choice


def test_required_tool_choice_gives_schema_valid_calls_of_both_tools(client):
    """Every reply holds valid calls; over a few seeds both tools are called, and some reply
    holds several calls (the grammar admits one or more)."""
    names: set[str] = set()
    per_reply: list[int] = []
    for seed in range(40):
        reply = chat(client, tool_choice="required", seed=seed)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = check_calls(choice)
        names.update(name for name, _ in calls)
        per_reply.append(len(calls))
        if seed >= 7 and names == set(SCHEMAS) and max(per_reply) > 1:
            break
    assert names == set(SCHEMAS), names
    assert max(per_reply) > 1, f"no reply with parallel calls in {len(per_reply)}"


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(5):
        choice = chat(client, tool_choice="required", parallel_tool_calls=False,
                      seed=seed)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(check_calls(choice)) == 1


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_named_tool_choice_calls_that_tool(client, name):
    for seed in range(3):
        choice = chat(client, tool_choice={"type": "function", "function": {"name": name}},
                      seed=seed)["choices"][0]
        assert choice["finish_reason"] == "stop", choice  # OpenAI's for a named tool
        assert [n for n, _ in check_calls(choice)] == [name]


def test_auto_tool_choice_leaves_a_random_model_to_plain_content(client):
    """``auto`` constrains only what follows a ``<tool_call>`` the model starts itself; a random
    model never does: plain text, no calls."""
    for seed in range(3):
        choice = chat(client, tool_choice="auto", max_tokens=32, seed=seed)["choices"][0]
        assert not choice["message"].get("tool_calls"), choice
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length"), choice


def test_arguments_json_cannot_parse_come_back_as_content(client):
    """With a bare string schema the grammar admits raw control characters in the arguments;
    the parser then keeps no call: no ``tool_calls``, the raw text as content, and
    ``finish_reason`` still ``tool_calls``. An agent must take that as a parse failure."""
    bare = {"type": "function", "function": {
        "name": "finish", "parameters": {
            "type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
            "required": ["answer"], "additionalProperties": False}}}
    for seed in range(6):
        choice = chat(client, tools=[bare], tool_choice="required", parallel_tool_calls=False,
                      seed=seed)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        if message.get("tool_calls"):
            args = json.loads(message["tool_calls"][0]["function"]["arguments"])
            assert set(args) == {"answer"}
        else:
            assert message["content"].startswith("<tool_call>"), message


# --------------------------------------------------------------------------- conversation


def test_tool_results_are_accepted_in_the_next_turn(client):
    """The assistant's calls and a ``role: "tool"`` reply per call (``tool_call_id``) render in
    the next prompt, which extends the first prompt's tokens; the model calls again."""
    first = chat(client, tool_choice="required", seed=3, return_token_ids=True)
    message = first["choices"][0]["message"]
    calls = check_calls(first["choices"][0])
    results = [f"result {i}" for i in range(len(calls))]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
        *({"role": "tool", "tool_call_id": call["id"], "content": result}
          for call, result in zip(message["tool_calls"], results, strict=True)),
    ]
    second = chat(client, messages=messages, tool_choice="required", seed=4,
                  return_token_ids=True)
    check_calls(second["choices"][0])

    before, after = first["prompt_token_ids"], second["prompt_token_ids"]
    assert after[:len(before)] == before
    added = detokenize(client, after[len(before):])
    for name, args in calls:  # the arguments as the parser re-serialised them
        assert f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n' \
               f'</tool_call>' in added, added
    for result in results:
        assert f"<tool_response>\n{result}\n</tool_response>" in added, added
    assert added.endswith("<|im_start|>assistant\n"), added

    # A final answer in plain text after the tool results is accepted as well.
    last = chat(client, messages=messages, tool_choice="none", max_tokens=16, seed=5)
    assert not last["choices"][0]["message"].get("tool_calls")


# --------------------------------------------------------------------------- tokens


def test_token_ids_and_logprobs_come_back_with_tool_calls(client):
    reply = chat(client, tool_choice="required", seed=0, logprobs=True, top_logprobs=1,
                 return_token_ids=True)
    choice = reply["choices"][0]
    calls = check_calls(choice)
    token_ids, logprobs = choice["token_ids"], choice["logprobs"]["content"]
    assert len(token_ids) == len(logprobs) == reply["usage"]["completion_tokens"]
    assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
    assert all(isinstance(t, int) for t in token_ids)
    assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in logprobs)
    # The reply's text exists only as its tokens (the parser took it out of ``content``),
    # the end-of-turn token included.
    text = detokenize(client, token_ids)
    assert text == "".join(e["token"] for e in logprobs)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call><|im_end|>"), text
    for name, _ in calls:
        assert f'"name": "{name}"' in text
    # Logprobs are those of the masked distribution: the grammar's only choice has 0.0.
    assert logprobs[0]["token"] == "<" and logprobs[0]["logprob"] == 0.0, logprobs[0]


# --------------------------------------------------------------------------- the agent


class _EchoTool:
    """A tool whose string argument is held to a pattern (so the random model's calls parse)."""

    def __init__(self) -> None:
        from cua_rollout.envs.tools import ToolSpec

        self.spec = ToolSpec("echo", "Echo a few lowercase words back.", {
            "type": "object",
            "properties": {"text": {"type": "string", "pattern": "^[a-z ]{1,20}$"}},
            "required": ["text"], "additionalProperties": False})
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, arguments: Any) -> str:
        from cua_rollout.envs.tools import check_arguments

        args = check_arguments(self.spec, arguments)
        self.calls.append(args)
        return f"echo: {args['text']}"

    async def close(self) -> None:
        pass


async def test_the_tool_calling_agent_runs_a_text_episode_on_real_vllm(tool_vllm, tmp_path):
    """The runner's text episode against the real server: ``text.tool_choice: required``
    forces a schema-valid call each turn (structured outputs), the calls run in the
    environment and their results go back as ``tool`` messages the template renders, and each
    turn's line keeps the reply's tool calls, token ids and logprobs."""
    from cua_rollout.config import load_config
    from cua_rollout.core.types import EpisodeSpec
    from cua_rollout.runtime.runner import TrajectoryRunner
    from cua_rollout.runtime.storage import StorageActor
    from cua_rollout.text.benchmark import text_task
    from cua_rollout.text.envs import ToolEnv

    cfg = load_config(None, [
        f"run.output_dir={tmp_path}", "run.name=vllm-text",
        "model.name=tiny", f"model.endpoints={json.dumps([tool_vllm])}",
        "model.sampling.max_tokens=600", "model.sampling.logprobs=true",
        "model.sampling.return_token_ids=true", "model.sampling.seed=3",
        "text.tool_choice=required", "text.final_answer_tool=false", "text.max_turns=3",
    ])
    tools: list[_EchoTool] = []

    def env(task: dict[str, Any], name: str) -> ToolEnv:
        tools.append(_EchoTool())
        return ToolEnv(name, task["mode"], [tools[-1]])

    storage = StorageActor(cfg.run_dir, cfg.storage)
    await storage.start_run({"run": "vllm-text"})
    runner = TrajectoryRunner(cfg, None, storage, "r0", text_env_factory=env)
    try:
        task = text_task({"id": "q1", "question": "Say hello.", "answer": "hello"},
                         mode="py", benchmark="echo", metric="contains_answer",
                         variant="normalized", tolerance=1e-6)
        result = await run_recorded(runner, storage, EpisodeSpec("q1", "echo", 0, task))
    finally:
        await runner.close()
        await storage.close()
    # Every turn called the tool (required, no answer tool): the turn budget ends it.
    assert result.status == "max_steps", result.error
    assert result.steps == 3 and result.text["turns"] == 3
    lines = [json.loads(x) for x in
             (cfg.run_dir / "echo" / "q1" / "0" / "traj.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert result.text["tool_calls"] == sum(len(x["tool_calls"]) for x in lines) >= 3
    assert result.text["malformed_calls"] == result.text["unknown_tools"] == 0
    assert len(tools[0].calls) == result.text["tool_calls"]
    for line in lines:
        for call in line["tool_calls"]:
            assert call["name"] == "echo" and call["returncode"] == 0
            assert re.fullmatch(r"[a-z ]{1,20}", json.loads(call["arguments"])["text"])
            assert call["output"] == f"echo: {json.loads(call['arguments'])['text']}"
        assert line["response_tool_calls"] and line["token_ids"]
        assert len(line["logprobs"]) == len(line["token_ids"])
        assert line["model_endpoint"] and line["prompt_token_ids"]
    # Each turn's prompt extends the last one's: the tool results went back in the chat.
    for before, after in itertools.pairwise(lines):
        assert after["prompt_token_ids"][:len(before["prompt_token_ids"])] == \
            before["prompt_token_ids"]
        assert len(after["prompt_token_ids"]) > len(before["prompt_token_ids"])
    messages = json.loads((cfg.run_dir / "echo" / "q1" / "0" / "messages.json").read_text())
    assert [m["role"] for m in messages[:4]] == ["system", "user", "assistant", "tool"]
