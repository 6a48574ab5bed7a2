"""What a text environment's tool is: a name, a description and a JSON schema of its arguments
(``ToolSpec``, sent to the model as an OpenAI ``function`` tool), and a coroutine that runs a
call with the decoded arguments and returns the text the model reads next (``Tool``).

A call the model got wrong (arguments that do not fit the schema), or that failed in a way the
model should hear about (a snippet killed at its limits, a page that did not load), raises
``cua_rollout.core.errors.ToolError`` with the message the model reads. A tool that cannot run at
all
(its sandbox cannot start, its index cannot load) raises
``cua_rollout.core.errors.ToolUnavailable``:
the infrastructure's failure, not the model's.

A leaf module: the standard library and the error tree only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from cua_rollout.core.errors import ToolError

__all__ = ["TOOL_FAILED", "TOOL_MALFORMED", "TOOL_OK", "TOOL_OVER_LIMIT", "TOOL_UNKNOWN", "Tool",
           "ToolSpec", "check_arguments"]

# StepResult.returncode of a tool call (the counts a result line keeps come from these).
TOOL_OK = 0          # the tool ran; its output is the model's to read
TOOL_FAILED = 1      # the tool refused or failed (bad values, a page that did not load ...)
TOOL_MALFORMED = 2   # the arguments are not a JSON object
TOOL_UNKNOWN = 3     # no tool of that name
TOOL_OVER_LIMIT = 4  # past text.max_tool_calls_per_turn: not run

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it. ``parameters`` is a JSON schema of an object (the
    subset OpenAI function calling uses: ``properties`` with ``type`` and ``description``,
    ``required``)."""

    name: str
    description: str
    parameters: dict[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []})

    def openai(self) -> dict[str, Any]:
        """The tool as a chat request's ``tools`` entry."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@runtime_checkable
class Tool(Protocol):
    """One tool of a text environment. ``__call__`` may be called concurrently (the model's
    parallel tool calls); ``close`` releases what the tool holds and may be called twice."""

    spec: ToolSpec

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        ...

    async def close(self) -> None:
        ...


def check_arguments(spec: ToolSpec, arguments: Any) -> dict[str, Any]:
    """``arguments`` checked against the spec's schema: an object, its required properties
    present, no unknown ones, each of its declared JSON type (a bool is not a number).
    ``ToolError`` names what is wrong, in the terms the model used."""
    if not isinstance(arguments, dict):
        raise ToolError(f"{spec.name}: the arguments must be a JSON object, got "
                        f"{type(arguments).__name__}")
    properties: dict[str, Any] = spec.parameters.get("properties", {})
    missing = [name for name in spec.parameters.get("required", []) if name not in arguments]
    if missing:
        raise ToolError(f"{spec.name}: missing required argument(s) {', '.join(missing)}")
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        raise ToolError(f"{spec.name}: unknown argument(s) {', '.join(unknown)}; it takes "
                        f"{', '.join(properties) or 'none'}")
    for name, value in arguments.items():
        kind = properties[name].get("type")
        types = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if types is None:
            continue
        if (isinstance(value, bool) and kind != "boolean") or not isinstance(value, types):
            raise ToolError(f"{spec.name}: argument {name} must be a {kind}, got "
                            f"{type(value).__name__}")
    return dict(arguments)
