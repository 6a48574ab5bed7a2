"""The text environments: ``ToolEnv`` runs a mode's tools behind the environment contract
(``cua_rollout.envs.contract.TextEnv``), and ``make_text_env`` builds the one of a mode:

- ``math``: no tools; the answer is the final message;
- ``py``: ``python``, a snippet run in the episode's own sandbox (``sandbox.py``);
- ``rag``: ``retrieve``, over the configured corpus with the bundled embedding model
  (``rag.py``; the index is built once per process and shared by its episodes);
- ``web``: ``search`` and ``fetch`` over the configured backend (``web.py``).

``ToolEnv.step`` never raises for the model's mistakes: arguments that are not a JSON object,
an unknown tool, a call the tool refused (``ToolError``) or one past ``tool_timeout_s`` come
back as a ``StepResult`` with the message the model reads and a return code saying which
(``agent.TOOL_*``). A tool that cannot run at all raises ``ToolUnavailable`` (an infra error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cua_rollout.config import RagToolConfig, TextConfig, WebToolConfig
from cua_rollout.core.errors import ConfigError, ToolError
from cua_rollout.envs.contract import StepResult, ToolCall
from cua_rollout.envs.tools import (
    TOOL_FAILED,
    TOOL_MALFORMED,
    TOOL_OK,
    TOOL_UNKNOWN,
    Tool,
    ToolSpec,
)

__all__ = ["ToolEnv", "check_text_modes", "make_text_env"]


class ToolEnv:
    """A text environment of a mode and its tools (``TextEnv``)."""

    def __init__(self, name: str, mode: str, tools: Sequence[Tool], *,
                 tool_timeout_s: float = 60.0) -> None:
        self.name = name
        self.mode = mode
        self._tools = {t.spec.name: t for t in tools}
        if len(self._tools) != len(tools):
            raise ValueError(f"{mode}: two tools share a name")
        self.tools: list[ToolSpec] = [t.spec for t in tools]
        self.tool_timeout_s = tool_timeout_s
        self.task: Mapping[str, Any] | None = None
        self._closed = False

    async def reset(self, task: Mapping[str, Any]) -> str:
        question = task.get("question", task.get("instruction"))
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"task {task.get('id')!r} has no question")
        self.task = task
        return question

    async def step(self, call: ToolCall) -> StepResult:
        started = time.monotonic()

        def result(code: int, output: str, error: str = "") -> StepResult:
            return StepResult(call.name, code, output, error, time.monotonic() - started)

        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            text = f"error: there is no tool named {call.name!r} (tools: {known})"
            return result(TOOL_UNKNOWN, text, text)
        try:
            arguments = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as exc:
            text = f"error: {call.name}: the arguments are not valid JSON ({exc})"
            return result(TOOL_MALFORMED, text, text)
        if not isinstance(arguments, dict):
            text = (f"error: {call.name}: the arguments must be a JSON object, got "
                    f"{type(arguments).__name__}")
            return result(TOOL_MALFORMED, text, text)
        try:
            async with asyncio.timeout(self.tool_timeout_s):
                output = await tool(arguments)
        except ToolError as exc:
            text = f"error: {exc}"
            return result(TOOL_FAILED, text, str(exc))
        except TimeoutError:
            text = f"error: {call.name} did not finish within {self.tool_timeout_s:g} s"
            return result(TOOL_FAILED, text, text)
        return result(TOOL_OK, output)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tool in self._tools.values():
            with contextlib.suppress(Exception):
                await tool.close()


def make_text_env(mode: str, cfg: TextConfig, *, name: str,
                  web_search_url: str | None = None) -> ToolEnv:
    """The environment of ``mode`` with its tools as ``cfg`` sets them. ``web_search_url``:
    the corpus server the driver started (``text.web.serve_corpus``)."""
    tools: list[Tool] = []
    if mode == "math":
        pass
    elif mode == "py":
        from cua_rollout.text.sandbox import PythonTool

        tools.append(PythonTool(cfg.py))
    elif mode == "rag":
        from cua_rollout.text.rag import RetrievalTool, shared_retriever

        rag = _rag_config(cfg)
        tools.append(RetrievalTool(shared_retriever(rag), rag))
    elif mode == "web":
        from cua_rollout.text.web import FetchTool, SearchTool

        web = _web_config(cfg, web_search_url)
        tools += [SearchTool(web), FetchTool(web)]  # each closes its own client
    else:
        raise ConfigError(f"unknown text mode {mode!r}")
    return ToolEnv(name, mode, tools, tool_timeout_s=cfg.tool_timeout_s)


def _rag_config(cfg: TextConfig) -> RagToolConfig:
    """``text.rag``, which the rag mode needs a corpus in."""
    if cfg.rag.corpus is None:
        raise ConfigError("text.rag.corpus is not set: the rag mode needs a corpus (a JSONL "
                          "file of passages or a directory of .txt/.md files)")
    return cfg.rag


def _web_config(cfg: TextConfig, search_url: str | None = None) -> WebToolConfig:
    """``text.web``, its ``search_url`` the served corpus's when given."""
    web = cfg.web
    if search_url:
        web = web.model_copy(update={"search_url": search_url})
    if web.backend == "corpus" and web.search_url is None:
        raise ConfigError("text.web: the corpus backend needs text.web.serve_corpus (a "
                          "directory of pages served for the run) or text.web.search_url")
    return web


def check_text_modes(cfg: Any) -> None:
    """Fail before the run starts, naming the setting, when a text mode its benchmarks use
    cannot run here: the sandbox (``py``), the corpus (``rag``), the backend and its key
    (``web``). ``cfg`` is the run's ``Config``."""
    from cua_rollout.config import secret_from_env

    modes = {b.mode for b in cfg.tasks.text_benchmarks()}
    if "py" in modes:
        from cua_rollout.text.sandbox import sandbox_problem

        problem = sandbox_problem()
        if problem is not None:
            raise ConfigError(f"tasks: the py mode's sandbox cannot run here: {problem}")
    if "rag" in modes:
        corpus = _rag_config(cfg.text).corpus
        if corpus is None or not corpus.exists():
            raise ConfigError(f"text.rag.corpus: {corpus} does not exist")
    if "web" in modes:
        web = cfg.text.web
        if web.serve_corpus is not None and not web.serve_corpus.is_dir():
            raise ConfigError(f"text.web.serve_corpus: {web.serve_corpus} is not a directory")
        if web.serve_corpus is None:
            _web_config(cfg.text)
        secret_from_env(web.api_key_env, "text.web.api_key_env")
