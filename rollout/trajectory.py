"""What an episode records about its steps: the traj.jsonl line of a step (OSWorld's fields,
then ours), the last request as messages.json (images as the file names they were saved
under), and which screenshots an episode still has to hold. The schema lives here, once; the
episode loop fills it and the storage actor writes it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from model_service_pool import Generation
from rollout.screenshot import Screenshot
from ui_tars_utils import Action, ParsedResponse

__all__ = ["ScreenshotFiles", "action_dict", "step_record"]


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
        # OSWorld's fields
        "step_num": step,
        "action_timestamp": _timestamp(),
        "action": None,
        "response": generation.text,
        "reward": 0,
        "done": False,
        "info": {},
        "screenshot_file": None,
        # ours
        "observation_file": observation_file,
        "thought": parsed.thought if parsed else None,
        "actions": [action_dict(a) for a in parsed.actions] if parsed else [],
        "model_endpoint": generation.endpoint,
        "model_version": generation.model_version,
        "parse_retries": parse_retries,
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "constrained": constrained,
    }
    if token_ids:
        record["token_ids"] = generation.token_ids
        record["prompt_token_ids"] = generation.prompt_token_ids
    if logprobs:
        record["logprobs"] = generation.logprobs
    return record


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
            out.append({"role": message["role"], "content": content})
        return out
