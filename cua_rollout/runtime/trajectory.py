"""What an episode records about its steps: ``StepRecord``, the one typed traj.jsonl line of a
step (OSWorld's fields, then ours), filled by the episode loop (episode.py) in one place; the
last request as messages.json (images as the file names they were saved under); and which
screenshots an episode still has to hold. The storage actor writes ``StepRecord.line()``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from cua_rollout.core.screenshot import Screenshot
from cua_rollout.model.client import Generation

__all__ = ["UNSET", "ScreenshotFiles", "StepRecord", "discarded_generation", "image_spans",
           "tool_call_record"]

# Of a tool call's output, what its traj.jsonl line keeps (the model read all of it: the
# tools cap their own outputs, so this bounds a line, not what the model saw).
_TOOL_OUTPUT_RECORD_CHARS = 20000


class _Unset:
    """A field a step's line does not have (a text turn has no screenshot files, a desktop
    step no tool calls; token ids only when asked for): left out of ``line()``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def _timestamp() -> str:
    # OSWorld's action_timestamp format.
    return datetime.now().strftime("%Y%m%d@%H%M%S%f")


@dataclass(slots=True, eq=False)
class StepRecord:
    """One step's traj.jsonl line, in the order the line keeps: OSWorld's fields (``step_num``
    ... ``screenshot_file``), then what a desktop agent read from the reply, then what the
    server generated, then the step's images, tool calls, answer and timing. ``UNSET`` fields
    are not in the line. ``reward`` and ``done`` are final on the episode's last line."""

    # OSWorld's fields
    step_num: int
    action_timestamp: str = field(default_factory=_timestamp)
    action: str | None = None               # the code run and the terminal action
    response: str = ""                      # the reply's text
    reward: float | None = 0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # the action's returncode and error
    screenshot_file: str | None = None      # the screenshot observed after the step
    # a desktop agent's reading of the reply
    agent: str = UNSET                      # agent.name of the agent that read it
    action_format: str = UNSET              # how the reply says actions (uitars, pyautogui,
                                            # computer_13, qwen_tool_call, tool_calls)
    observation_file: str | None = UNSET    # the screenshot the step started from
    a11y_tree_file: str = UNSET             # the accessibility tree the request showed
    marks_file: str = UNSET                 # the screenshot with marks the request showed
    thought: str | None = UNSET
    actions: list[dict[str, Any]] = UNSET   # the parsed actions
    parse_retries: int = UNSET              # replies dropped before this one
    constrained: bool = UNSET               # sampled under the action grammar
    # a tool-calling reply
    response_tool_calls: list[dict[str, Any]] | None = UNSET
    # what was generated, where and by which version
    model_endpoint: str | None = None
    model_version: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    token_ids: list[int] | None = UNSET         # sampling.return_token_ids
    prompt_token_ids: list[int] | None = UNSET  # sampling.return_token_ids
    logprobs: list[float] | None = UNSET        # sampling.logprobs
    discarded: list[dict[str, Any]] = UNSET     # unparseable replies asked again
    # the request's images: each one's file and placeholder tokens, and where the server
    # put the placeholders in the prompt's token ids (when it returned them)
    images: list[dict[str, Any]] = UNSET
    image_spans: list[list[int]] | None = UNSET
    # a text turn: each tool call and its result, or the final answer
    tool_calls: list[dict[str, Any]] = UNSET
    answer: str | None = UNSET
    timing: dict[str, float] = UNSET

    @classmethod
    def of_reply(cls, step: int, generation: Generation, *, token_ids: bool,
                 logprobs: bool) -> StepRecord:
        """A step's record as known once the model replied."""
        return cls(step, response=generation.text,
                   **_generated(generation, token_ids=token_ids, logprobs=logprobs))

    def line(self) -> dict[str, Any]:
        """The traj.jsonl line (a dict of the set fields, in order)."""
        return {name: value for name in _FIELDS
                if (value := getattr(self, name)) is not UNSET}


_FIELDS = tuple(f.name for f in fields(StepRecord))


def tool_call_record(call: Any, result: Any) -> dict[str, Any]:
    """One tool call of a turn and what it returned (``StepResult``)."""
    output = result.output
    if len(output) > _TOOL_OUTPUT_RECORD_CHARS:
        output = output[:_TOOL_OUTPUT_RECORD_CHARS] + "…"
    return {"id": call.id, "name": call.name, "arguments": call.arguments, "output": output,
            "returncode": result.returncode, "error": result.error or None,
            "duration_s": round(result.duration_s, 6)}


def discarded_generation(generation: Generation, error: str, *, token_ids: bool,
                         logprobs: bool) -> dict[str, Any]:
    """A reply dropped because it did not parse (the step asked again): kept in its step's
    ``discarded`` list with what the server produced, so a trainer can use or mask it."""
    return {"response": generation.text, "error": error,
            **_generated(generation, token_ids=token_ids, logprobs=logprobs)}


def _generated(generation: Generation, *, token_ids: bool, logprobs: bool) -> dict[str, Any]:
    """What a record keeps of a reply besides its text: where and by which version it was
    made, its token counts, and (when asked for) its token ids and logprobs."""
    out: dict[str, Any] = {"model_endpoint": generation.endpoint,
                           "model_version": generation.model_version,
                           "prompt_tokens": generation.prompt_tokens,
                           "completion_tokens": generation.completion_tokens}
    if token_ids:
        out["token_ids"] = generation.token_ids
        out["prompt_token_ids"] = generation.prompt_token_ids
    if logprobs:
        out["logprobs"] = generation.logprobs
    return out


def image_spans(prompt_token_ids: list[int] | None, counts: list[int]
                ) -> list[list[int]] | None:
    """Where the server put each image's placeholder tokens in the prompt: ``[start,
    length]`` per image, in order, found as runs of one repeated token id of exactly the
    expected lengths (``counts``: each image's token count, as ``image_tokens`` computes
    it). None when the ids do not show exactly those runs of one id (another tokenizer or
    template): nothing is guessed."""
    if not prompt_token_ids or not counts:
        return None
    runs: dict[int, list[list[int]]] = {}  # token id -> its maximal runs [start, length]
    i, n = 0, len(prompt_token_ids)
    while i < n:
        j = i
        while j + 1 < n and prompt_token_ids[j + 1] == prompt_token_ids[i]:
            j += 1
        runs.setdefault(prompt_token_ids[i], []).append([i, j - i + 1])
        i = j + 1
    found = [spans for spans in runs.values() if [length for _, length in spans] == counts]
    return found[0] if len(found) == 1 else None


class ScreenshotFiles:
    """The file each screenshot still in an episode's image window was saved under, keyed by
    its URL object (``Screenshot.url``: the one every request sends, a data URL or a
    ``file://`` URL), so the last request can be stored with file names instead of
    megabytes of base64."""

    def __init__(self) -> None:
        self._files: dict[int, str] = {}  # id(URL string) -> screenshot file

    def remember(self, shot: Screenshot, name: str | None) -> None:
        if name:
            self._files[id(shot.url)] = name

    def file_of(self, shot: Screenshot) -> str | None:
        return self._files.get(id(shot.url))

    def forget(self, shot: Screenshot) -> None:
        """The screenshot left the image window: its URL's id may be reused once the string
        is freed. Only a screenshot whose URL was made is looked up."""
        url = shot.file_url if shot.file_url is not None else shot.__dict__.get("data_url")
        if url is not None:
            self._files.pop(id(url), None)

    def image_files(self, messages: list[dict[str, Any]]) -> list[str | None]:
        """The file of each image of ``messages``, in prompt order (None: not saved)."""
        return [self._files.get(id(part["image_url"]["url"]))
                for message in messages if isinstance(message.get("content"), list)
                for part in message["content"] if part.get("type") == "image_url"]

    def messages_for_disk(self, messages: list[dict[str, Any]] | None
                          ) -> list[dict[str, Any]] | None:
        """``messages`` with each image replaced by the file it was saved under."""
        if messages is None:
            return None
        out = []
        for message in messages:
            content = message["content"]
            if isinstance(content, list):
                content = [
                    {"type": "image_url", "image_url": {
                        "url": self._files.get(id(part["image_url"]["url"]), "<not saved>")}}
                    if part.get("type") == "image_url" else part
                    for part in content
                ]
            out.append({**message, "content": content})  # tool_calls, tool_call_id kept
        return out
