"""The text environments (``cua_rollout.text.envs.ToolEnv``) with small real tools written here:
the model's mistakes (unknown tool, arguments that are not a JSON object, a refused or slow
call) come back as results with their return codes, a tool that cannot run raises; the
conformance checker (``cua_rollout.envs.checker.check_text_env``) passes good environments and
names the break of broken ones; the tools' schema check (``cua_rollout.envs.tools``); and the
environments ``make_text_env`` builds from the config, the web one against a real corpus
server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import TextConfig
from cua_rollout.core.errors import ConfigError, ToolError, ToolUnavailable
from cua_rollout.envs.checker import ConformanceError, check_text_env
from cua_rollout.envs.contract import StepResult, TextEnv, ToolCall
from cua_rollout.envs.tools import (
    TOOL_FAILED,
    TOOL_MALFORMED,
    TOOL_OK,
    TOOL_UNKNOWN,
    Tool,
    ToolSpec,
    check_arguments,
)
from cua_rollout.text.envs import ToolEnv, make_text_env
from cua_rollout.text.web_corpus import WebCorpusServer

# --------------------------------------------------------------------------- tools


class _Base:
    def __init__(self, name: str) -> None:
        self.spec = ToolSpec(name=name, description=f"the {name} tool")
        self.calls: list[dict[str, Any]] = []
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class EchoTool(_Base):
    """``echo(text, times?)``: the text, ``times`` times."""

    def __init__(self, name: str = "echo", *, text_required: bool = True) -> None:
        super().__init__(name)
        self.spec = ToolSpec(name=name, description="Repeat the text.", parameters={
            "type": "object",
            "properties": {"text": {"type": "string", "description": "What to repeat."},
                           "times": {"type": "integer", "description": "How often."}},
            "required": ["text"] if text_required else []})

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        args = check_arguments(self.spec, arguments)
        self.calls.append(args)
        return args.get("text", "<nothing>") * args.get("times", 1)


class FailingTool(_Base):
    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        self.calls.append(dict(arguments))
        raise ToolError(f"{self.spec.name}: the page did not load")


class SlowTool(_Base):
    """Never finishes by itself; records that it was cancelled."""

    def __init__(self, name: str = "slow") -> None:
        super().__init__(name)
        self.cancelled = False

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        self.calls.append(dict(arguments))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "never"


class DownTool(_Base):
    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        raise ToolUnavailable(f"{self.spec.name}: the sandbox cannot start")


class CrashTool(_Base):
    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        raise RuntimeError("a bug in the tool")


class BadCloseTool(_Base):
    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        return "ok"

    async def close(self) -> None:
        self.closed += 1
        raise RuntimeError("close failed")


class RendezvousTool(_Base):
    """Each call waits until ``n`` calls have started: only concurrent calls finish."""

    def __init__(self, n: int) -> None:
        super().__init__("meet")
        self.n = n
        self.started = 0
        self.all_in = asyncio.Event()

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        self.started += 1
        if self.started == self.n:
            self.all_in.set()
        await self.all_in.wait()
        return f"met {arguments.get('who')}"


def test_the_test_tools_are_tools() -> None:
    for tool in (EchoTool(), FailingTool("f"), SlowTool(), DownTool("d"), CrashTool("c")):
        assert isinstance(tool, Tool)


def _env(*tools: Any, timeout_s: float = 5.0) -> ToolEnv:
    return ToolEnv("test-env", "py", list(tools), tool_timeout_s=timeout_s)


# --------------------------------------------------------------------------- ToolEnv.step


async def test_a_call_runs_the_tool_with_the_decoded_arguments() -> None:
    echo = EchoTool()
    env = _env(echo)
    result = await env.step(ToolCall("c1", "echo", '{"text": "ab", "times": 3}'))
    assert result.action == "echo"
    assert (result.returncode, result.output, result.error) == (TOOL_OK, "ababab", "")
    assert result.ok
    assert 0 <= result.duration_s < 5
    assert echo.calls == [{"text": "ab", "times": 3}]


@pytest.mark.parametrize("arguments", ["", "   ", "\n"])
async def test_empty_arguments_are_an_empty_object(arguments: str) -> None:
    echo = EchoTool(text_required=False)
    result = await _env(echo).step(ToolCall("c1", "echo", arguments))
    assert (result.returncode, result.output) == (TOOL_OK, "<nothing>")
    assert echo.calls == [{}]


async def test_a_refused_call_is_a_failed_result_with_the_tools_message() -> None:
    fail = FailingTool("fetch")
    result = await _env(fail).step(ToolCall("c1", "fetch", '{"url": "x"}'))
    assert result.returncode == TOOL_FAILED and not result.ok
    assert result.output == "error: fetch: the page did not load"
    assert result.error == "fetch: the page did not load"
    assert fail.calls == [{"url": "x"}]


async def test_arguments_against_the_schema_are_refused_by_the_tool() -> None:
    echo = EchoTool()
    env = _env(echo)
    missing = await env.step(ToolCall("c1", "echo", '{"times": 2}'))
    assert missing.returncode == TOOL_FAILED
    assert missing.output == "error: echo: missing required argument(s) text"
    wrong = await env.step(ToolCall("c2", "echo", '{"text": "a", "times": true}'))
    assert wrong.returncode == TOOL_FAILED
    assert wrong.output == "error: echo: argument times must be a integer, got bool"
    assert echo.calls == []


async def test_a_call_past_the_timeout_is_cancelled_and_failed() -> None:
    slow = SlowTool()
    env = _env(slow, timeout_s=0.2)
    started = time.monotonic()
    result = await env.step(ToolCall("c1", "slow", "{}"))
    elapsed = time.monotonic() - started
    assert result.returncode == TOOL_FAILED
    assert result.output == "error: slow did not finish within 0.2 s"
    assert result.error == result.output
    assert slow.cancelled
    assert 0.2 <= elapsed < 5
    assert result.duration_s >= 0.2


async def test_a_tool_that_cannot_run_raises_tool_unavailable() -> None:
    env = _env(EchoTool(), DownTool("python"))
    with pytest.raises(ToolUnavailable, match="the sandbox cannot start"):
        await env.step(ToolCall("c1", "python", '{"code": "1"}'))
    # the environment still answers other calls
    assert (await env.step(ToolCall("c2", "echo", '{"text": "x"}'))).output == "x"


async def test_an_unknown_tool_names_it_and_the_tools_there_are() -> None:
    env = _env(EchoTool(), FailingTool("fetch"))
    result = await env.step(ToolCall("c1", "browse", '{"url": "x"}'))
    assert result.returncode == TOOL_UNKNOWN and not result.ok
    assert result.output == "error: there is no tool named 'browse' (tools: echo, fetch)"
    assert result.error == result.output
    assert result.action == "browse"
    nameless = await env.step(ToolCall("c2", "", "{}"))
    assert nameless.output == "error: there is no tool named '' (tools: echo, fetch)"
    none = await ToolEnv("m", "math", []).step(ToolCall("c3", "python", "{}"))
    assert none.output == "error: there is no tool named 'python' (tools: none)"


@pytest.mark.parametrize(("arguments", "message"), [
    ('{"text": ', "error: echo: the arguments are not valid JSON ("),
    ("{text: 'a'}", "error: echo: the arguments are not valid JSON ("),
    ('{"text": "a"} trailing', "error: echo: the arguments are not valid JSON ("),
    ("[1, 2]", "error: echo: the arguments must be a JSON object, got list"),
    ('"a"', "error: echo: the arguments must be a JSON object, got str"),
    ("null", "error: echo: the arguments must be a JSON object, got NoneType"),
    ("3", "error: echo: the arguments must be a JSON object, got int"),
])
async def test_malformed_arguments_are_answered_without_running_the_tool(
        arguments: str, message: str) -> None:
    echo = EchoTool()
    result = await _env(echo).step(ToolCall("c1", "echo", arguments))
    assert result.returncode == TOOL_MALFORMED and not result.ok
    assert result.output.startswith(message)
    assert result.error == result.output
    assert echo.calls == []


async def test_parallel_calls_run_concurrently() -> None:
    meet = RendezvousTool(3)
    env = _env(meet, timeout_s=5)
    results = await asyncio.gather(*(env.step(ToolCall(f"c{i}", "meet", json.dumps({"who": i})))
                                     for i in range(3)))
    assert [r.output for r in results] == ["met 0", "met 1", "met 2"]
    assert all(r.returncode == TOOL_OK for r in results)


# --------------------------------------------------------------------------- reset, close


async def test_reset_returns_the_question_and_keeps_the_task() -> None:
    env = _env(EchoTool())
    task = {"id": "q1", "question": "What is 2+2?", "instruction": "other", "answer": "4"}
    assert await env.reset(task) == "What is 2+2?"
    assert env.task is task
    # a task with only an instruction (as desktop tasks) is read by it
    assert await env.reset({"id": "q2", "instruction": "Say hi"}) == "Say hi"


@pytest.mark.parametrize("task", [
    {"id": "q1", "answer": "4"},
    {"id": "q1", "question": "   "},
    {"id": "q1", "question": 7},
    {"id": "q1", "question": None, "instruction": "x"},
])
async def test_reset_rejects_a_task_without_a_question(task: dict[str, Any]) -> None:
    env = _env(EchoTool())
    with pytest.raises(ValueError, match="task 'q1' has no question"):
        await env.reset(task)
    assert env.task is None


async def test_close_closes_every_tool_once_and_is_idempotent() -> None:
    echo, bad, fail = EchoTool(), BadCloseTool("bad"), FailingTool("fail")
    env = _env(echo, bad, fail)
    await env.close()  # a tool whose close raises does not keep the others open
    await env.close()
    assert (echo.closed, bad.closed, fail.closed) == (1, 1, 1)


def test_tool_env_shape_and_duplicate_names() -> None:
    echo, fail = EchoTool(), FailingTool("fetch")
    env = ToolEnv("ep-1", "web", [echo, fail], tool_timeout_s=3)
    assert isinstance(env, TextEnv)
    assert (env.name, env.mode, env.tool_timeout_s) == ("ep-1", "web", 3)
    assert env.tools == [echo.spec, fail.spec]
    with pytest.raises(ValueError, match="two tools share a name"):
        ToolEnv("ep-2", "web", [EchoTool(), EchoTool()])


# --------------------------------------------------------------------------- check_text_env


async def test_the_math_env_passes_the_checker() -> None:
    env = make_text_env("math", TextConfig(), name="x")
    assert (env.name, env.mode, env.tools) == ("x", "math", [])
    assert env.tool_timeout_s == TextConfig().tool_timeout_s
    assert await check_text_env(env) == {"tools": [], "calls": {}}


async def test_a_tool_env_passes_the_checker_and_is_closed() -> None:
    echo, fail = EchoTool(), FailingTool("fetch")
    env = _env(echo, fail)
    observed = await check_text_env(env)
    assert observed["tools"] == ["echo", "fetch"]
    assert observed["calls"]["echo"].returncode == TOOL_OK
    assert observed["calls"]["echo"].output == "conformance check"  # the required text
    assert observed["calls"]["fetch"].returncode == TOOL_FAILED  # a refusal is an output
    assert echo.calls == [{"text": "conformance check"}]  # the wrong calls never ran it
    assert (echo.closed, fail.closed) == (1, 1)


def _spec(name: str = "echo", parameters: Any = None) -> ToolSpec:
    if parameters is None:
        return ToolSpec(name, "d")
    return ToolSpec(name, "d", parameters)


class FakeTextEnv:
    """A text environment broken in the ways the arguments say."""

    def __init__(self, *, tools: list[Any] | None = None, reset_value: Any = "default",
                 step: Any = None) -> None:
        self.name = "fake"
        self.mode = "py"
        self.tools = tools if tools is not None else [_spec()]
        self.reset_value = reset_value
        self._step = step
        self.closed = 0

    async def reset(self, task: Mapping[str, Any]) -> Any:
        return task["question"] if self.reset_value == "default" else self.reset_value

    async def step(self, call: ToolCall) -> Any:
        if self._step is not None:
            return self._step(call)
        if call.name not in {s.name for s in self.tools}:
            return StepResult(call.name, TOOL_UNKNOWN, "error: no such tool", "no such tool")
        try:
            json.loads(call.arguments)
        except ValueError:
            return StepResult(call.name, TOOL_MALFORMED, "error: not JSON", "not JSON")
        if not call.arguments.startswith("{"):
            return StepResult(call.name, TOOL_MALFORMED, "error: not an object", "x")
        return StepResult(call.name, TOOL_OK, "fine")

    async def close(self) -> None:
        self.closed += 1


async def test_the_fake_passes_unbroken() -> None:
    env = FakeTextEnv()
    assert (await check_text_env(env))["tools"] == ["echo"]
    assert env.closed == 2


def _raise_on_unknown(call: ToolCall) -> StepResult:
    if call.name != "echo":
        raise KeyError(call.name)
    return StepResult(call.name, TOOL_OK, "fine")


def _ok_on_everything(call: ToolCall) -> StepResult:
    return StepResult(call.name, TOOL_OK, "fine")


@pytest.mark.parametrize(("env", "message"), [
    (FakeTextEnv(step=_raise_on_unknown),
     "FakeTextEnv raised KeyError (not a cua_rollout.core.errors.RolloutError): "
     "'conformance_check_no_such_"),
    (FakeTextEnv(reset_value=None), "reset() must return the task's question, got None"),
    (FakeTextEnv(reset_value="something else"), "reset() must return the task's question"),
    (FakeTextEnv(tools=[_spec(), _spec()]), "two tools share a name: ['echo', 'echo']"),
    (FakeTextEnv(tools=[_spec(parameters={"type": "string"})]),
     "tool echo: parameters must be an object schema"),
    (FakeTextEnv(tools=[_spec(parameters={"properties": {}})]),
     "tool echo: parameters must be an object schema"),
    (FakeTextEnv(step=_ok_on_everything),
     "step() of a wrong call (conformance_check_no_such_tool '{}') must return a StepResult "
     "that is not ok"),
    (FakeTextEnv(step=lambda call: StepResult(call.name, TOOL_OK, "  ")),
     "step() of tool echo must return a StepResult with an output for the model"),
    (FakeTextEnv(step=lambda call: {"output": "fine"}),
     "step() of tool echo must return a StepResult"),
    (FakeTextEnv(step=lambda call: StepResult(call.name, TOOL_OK, None)),
     "step() of tool echo must return a StepResult with an output"),
])
async def test_broken_envs_fail_the_checker_with_the_break_named(env: FakeTextEnv,
                                                                 message: str) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_text_env(env)
    assert message in str(info.value)
    assert env.closed >= 1  # closed even when it fails


async def test_a_wrong_call_that_reads_ok_names_the_call() -> None:
    env = FakeTextEnv()
    real_step = env.step

    async def step(call: ToolCall) -> StepResult:
        if call.arguments == "{not json":
            return StepResult(call.name, None, "ran anyway")  # returncode None reads ok
        return await real_step(call)

    env.step = step  # type: ignore[method-assign]
    with pytest.raises(ConformanceError, match=r"wrong call \(echo '\{not json'\)"):
        await check_text_env(env)


async def test_an_object_without_the_text_env_shape_fails_the_checker() -> None:
    class NoMode:
        def __init__(self) -> None:
            self.name = "x"
            self.tools: list[ToolSpec] = []

        async def reset(self, task: Any) -> str:
            return "q"

        async def step(self, call: ToolCall) -> StepResult:
            return StepResult("x")

        async def close(self) -> None:
            pass

    with pytest.raises(ConformanceError, match=r"NoMode does not have reset, step, close, "
                                               r"name, mode and tools"):
        await check_text_env(NoMode())


async def test_tools_that_are_not_tool_specs_are_named() -> None:
    env = FakeTextEnv(tools=[_spec().openai()])
    with pytest.raises(ConformanceError, match=r"tools must be cua_rollout\.envs\.tools\.ToolSpec"):
        await check_text_env(env)


async def test_a_tool_env_whose_tool_crashes_fails_the_checker() -> None:
    crash = CrashTool("calc")
    env = _env(EchoTool(), crash)
    with pytest.raises(ConformanceError,
                       match=r"ToolEnv raised RuntimeError \(not a "
                             r"cua_rollout\.core\.errors\.RolloutError\): a bug in the tool"):
        await check_text_env(env)
    assert crash.closed == 1


async def test_a_tool_that_cannot_run_is_an_infra_error_not_a_contract_break() -> None:
    down = DownTool("python")
    env = _env(down)
    with pytest.raises(ToolUnavailable) as info:
        await check_text_env(env)
    assert not isinstance(info.value, ConformanceError)
    assert down.closed == 1


# --------------------------------------------------------------------------- check_arguments


SPEC = ToolSpec("calc", "d", {
    "type": "object",
    "properties": {"s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                   "b": {"type": "boolean"}, "a": {"type": "array"}, "o": {"type": "object"},
                   "any": {"description": "no type"}, "multi": {"type": ["string", "null"]}},
    "required": ["s", "i"]})


def test_check_arguments_accepts_the_declared_types_and_returns_a_copy() -> None:
    args = {"s": "x", "i": 3, "n": 2.5, "b": False, "a": [1], "o": {"k": 1},
            "any": None, "multi": None}
    checked = check_arguments(SPEC, args)
    assert checked == args and checked is not args


@pytest.mark.parametrize(("name", "value"), [("n", 2), ("n", -7), ("n", 0.0), ("b", True),
                                             ("any", [1, {}]), ("multi", 5)])
def test_check_arguments_lenient_cases(name: str, value: Any) -> None:
    assert check_arguments(SPEC, {"s": "x", "i": 1, name: value})[name] == value


@pytest.mark.parametrize("arguments", [[1], "x", None, 3, ("s", "x")])
def test_check_arguments_wants_an_object(arguments: Any) -> None:
    with pytest.raises(ToolError, match=rf"^calc: the arguments must be a JSON object, got "
                                        rf"{type(arguments).__name__}$"):
        check_arguments(SPEC, arguments)


def test_check_arguments_names_the_missing_required_ones() -> None:
    with pytest.raises(ToolError, match=r"^calc: missing required argument\(s\) s, i$"):
        check_arguments(SPEC, {"n": 1})
    with pytest.raises(ToolError, match=r"^calc: missing required argument\(s\) i$"):
        check_arguments(SPEC, {"s": "x", "zzz": 1})  # missing is said before unknown


def test_check_arguments_names_unknown_ones_and_what_it_takes() -> None:
    with pytest.raises(ToolError, match=r"^calc: unknown argument\(s\) q, r; it takes s, i, n, "
                                        r"b, a, o, any, multi$"):
        check_arguments(SPEC, {"s": "x", "i": 1, "q": 1, "r": 2})
    with pytest.raises(ToolError, match=r"^none: unknown argument\(s\) x; it takes none$"):
        check_arguments(ToolSpec("none", "d"), {"x": 1})
    assert check_arguments(ToolSpec("none", "d"), {}) == {}


@pytest.mark.parametrize(("name", "value", "kind", "got"), [
    ("s", 1, "string", "int"),
    ("i", 1.5, "integer", "float"),
    ("i", 2.0, "integer", "float"),
    ("i", True, "integer", "bool"),       # a bool is not an integer
    ("i", "3", "integer", "str"),
    ("n", True, "number", "bool"),
    ("n", "1.5", "number", "str"),
    ("b", 1, "boolean", "int"),
    ("b", "true", "boolean", "str"),
    ("a", {"k": 1}, "array", "dict"),
    ("a", "[]", "array", "str"),
    ("o", [], "object", "list"),
])
def test_check_arguments_names_a_wrong_type(name: str, value: Any, kind: str,
                                            got: str) -> None:
    arguments = {"s": "x", "i": 1, name: value}
    with pytest.raises(ToolError, match=rf"^calc: argument {name} must be a {kind}, got "
                                        rf"{got}$"):
        check_arguments(SPEC, arguments)


def test_tool_spec_defaults_and_openai_shape() -> None:
    spec = ToolSpec("noop", "Does nothing.")
    assert spec.parameters == {"type": "object", "properties": {}, "required": []}
    assert spec.parameters is not ToolSpec("other", "x").parameters  # not one shared dict
    assert spec.openai() == {"type": "function", "function": {
        "name": "noop", "description": "Does nothing.",
        "parameters": {"type": "object", "properties": {}, "required": []}}}
    assert EchoTool().spec.openai()["function"]["parameters"]["required"] == ["text"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


# --------------------------------------------------------------------------- from the config


PAGES = {
    "conformance.html": "<html><head><title>Conformance testing</title></head><body>"
                        "<p>A conformance check drives an environment through its contract."
                        "</p></body></html>",
    "tea.md": "# Green tea\n\nGreen tea is made from unoxidized leaves.\n",
    "notes/fox.txt": "Fox facts\nThe quick brown fox jumps over the lazy dog.\n",
}


@pytest.fixture(scope="module")
def web_server() -> Iterator[WebCorpusServer]:
    root = Path(tempfile.mkdtemp(prefix="cua-textenv-"))
    try:
        for rel, text in PAGES.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        with WebCorpusServer(root) as server:
            yield server
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_the_web_env_from_the_config_passes_the_checker(
        web_server: WebCorpusServer) -> None:
    assert len(web_server.corpus) == 3
    env = make_text_env("web", TextConfig(web={"search_url": web_server.url}), name="w")
    assert (env.name, env.mode) == ("w", "web")
    assert [t.name for t in env.tools] == ["search", "fetch"]
    before = len(web_server.requests)
    observed = await check_text_env(env)
    assert observed["tools"] == ["search", "fetch"]
    search = observed["calls"]["search"]
    assert search.returncode == TOOL_OK
    assert search.output.startswith(
        f"[1] Conformance testing — {web_server.page_url('conformance.html')}")
    assert "Green tea" not in search.output  # it matches neither word
    # the search went over HTTP to the corpus server
    assert web_server.requests[before:] == ["/search?q=conformance+check&k=5"]
    fetch = observed["calls"]["fetch"]  # "conformance check" is not a URL: refused
    assert fetch.returncode == TOOL_FAILED
    assert fetch.output == ("error: fetch: invalid URL 'conformance check': it contains "
                            "spaces or control characters")


async def test_the_web_env_fetches_a_served_page(web_server: WebCorpusServer) -> None:
    env = make_text_env("web", TextConfig(), name="w", web_search_url=web_server.url)
    try:
        call = ToolCall("c1", "fetch", json.dumps({"url": web_server.page_url("notes/fox.txt")}))
        result = await env.step(call)
        assert result.returncode == TOOL_OK, result.output
        assert "The quick brown fox jumps over the lazy dog." in result.output
        found = await env.step(ToolCall("c2", "search", '{"query": "unoxidized", "top_k": 1}'))
        assert found.output.startswith(f"[1] Green tea — {web_server.page_url('tea.md')}")
    finally:
        await env.close()
        await env.close()


def test_the_rag_env_needs_a_corpus() -> None:
    with pytest.raises(ConfigError, match=r"text\.rag\.corpus"):
        make_text_env("rag", TextConfig(), name="r")


def test_the_web_env_needs_a_search_url() -> None:
    with pytest.raises(ConfigError, match=r"text\.web\.serve_corpus .*text\.web\.search_url"):
        make_text_env("web", TextConfig(), name="w")


@pytest.mark.parametrize("mode", ["nope", "desktop", ""])
def test_an_unknown_mode_is_a_config_error(mode: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown text mode {mode!r}"):
        make_text_env(mode, TextConfig(), name="x")
