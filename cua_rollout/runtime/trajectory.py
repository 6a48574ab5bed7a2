"""What an episode records about its steps: the traj.jsonl line of a step (OSWorld's fields,
then ours), the last request as messages.json (images as the file names they were saved
under), and which screenshots an episode still has to hold. The schema lives here, once; the
episode loop fills it and the storage actor writes it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from cua_rollout.agents.uitars import Action, ParsedResponse
from cua_rollout.core.screenshot import Screenshot
from cua_rollout.model.client import Generation

__all__ = ["ScreenshotFiles", "action_dict", "discarded_generation", "image_spans",
           "step_record", "text_step_record", "tool_call_record"]

# Of a tool call's output, what its traj.jsonl line keeps (the model read all of it: the
# tools cap their own outputs, so this bounds a line, not what the model saw).
_TOOL_OUTPUT_RECORD_CHARS = 20000


def _timestamp() -> str:
    # OSWorld's action_timestamp format.
    return datetime.now().strftime("%Y%m%d@%H%M%S%f")


def action_dict(a: Action) -> dict[str, Any]:
    """One parsed action as stored in traj.jsonl."""
    return {"kind": a.kind, "point": a.point, "end_point": a.end_point, "content": a.content,
            "keys": a.keys, "direction": a.direction}


def step_record(step: int, generation: Generation, parsed: ParsedResponse | None,
                parse_retries: int, observation_file: str | None, *,
                token_ids: bool, logprobs: bool, constrained: bool = False) -> dict[str, Any]:
    """A step's traj.jsonl line as known once the model replied; the loop fills ``action``,
    ``info``, ``timing``, ``done``, ``screenshot_file`` (and ``reward`` at the end).
    ``constrained``: the reply was sampled under the action grammar (its logprobs are those
    of the constrained process)."""
    record: dict[str, Any] = {
        **_osworld_fields(step, generation),
        # ours
        "observation_file": observation_file,
        "thought": parsed.thought if parsed else None,
        "actions": [action_dict(a) for a in parsed.actions] if parsed else [],
        "parse_retries": parse_retries,
        "constrained": constrained,
        **_generated(generation, token_ids=token_ids, logprobs=logprobs),
    }
    return record


def _osworld_fields(step: int, generation: Generation) -> dict[str, Any]:
    """OSWorld's fields of a traj.jsonl line, as known once the model replied."""
    return {"step_num": step, "action_timestamp": _timestamp(), "action": None,
            "response": generation.text, "reward": 0, "done": False, "info": {},
            "screenshot_file": None}


def text_step_record(turn: int, generation: Generation, *, token_ids: bool,
                     logprobs: bool) -> dict[str, Any]:
    """A text episode's turn as traj.jsonl keeps it: OSWorld's fields (``action`` is the
    tools called, or ``answer``), the reply's text and tool calls, and what was generated;
    the loop adds ``tool_calls`` (each call and its result), ``answer``, ``timing``."""
    return {
        **_osworld_fields(turn, generation),
        "response_tool_calls": generation.tool_calls,
        **_generated(generation, token_ids=token_ids, logprobs=logprobs),
    }


def tool_call_record(call: Any, result: Any) -> dict[str, Any]:
    """One tool call of a turn and what it returned (``StepResult``)."""
    output = result.output
    if len(output) > _TOOL_OUTPUT_RECORD_CHARS:
        output = output[:_TOOL_OUTPUT_RECORD_CHARS] + "…"
    return {"id": call.id, "name": call.name, "arguments": call.arguments, "output": output,
            "returncode": result.returncode, "error": result.error or None,
            "duration_s": round(result.duration_s, 6)}


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


def discarded_generation(generation: Generation, error: str, *, token_ids: bool,
                         logprobs: bool) -> dict[str, Any]:
    """A reply dropped because it did not parse (the step asked again): kept in its step's
    ``discarded`` list with what the server produced, so a trainer can use or mask it."""
    return {"response": generation.text, "error": error,
            **_generated(generation, token_ids=token_ids, logprobs=logprobs)}


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
    its data URL object (the one every request embeds), so the last request can be stored
    with file names instead of megabytes of base64."""

    def __init__(self) -> None:
        self._files: dict[int, str] = {}  # id(data URL string) -> screenshot file

    def remember(self, shot: Screenshot, name: str | None) -> None:
        if name:
            self._files[id(shot.data_url)] = name

    def file_of(self, shot: Screenshot) -> str | None:
        return self._files.get(id(shot.data_url))

    def forget(self, shot: Screenshot) -> None:
        """The screenshot left the image window: its data URL's id may be reused once the
        string is freed. Only a screenshot whose data URL was made is looked up."""
        if "data_url" in shot.__dict__:
            self._files.pop(id(shot.data_url), None)

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
