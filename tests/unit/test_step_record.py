"""The one typed traj.jsonl record: OSWorld's fields first, in OSWorld's order; what a kind
of step does not have is not in its line; nothing can be added past the schema."""

import pytest

from cua_rollout.model.client import Generation
from cua_rollout.runtime.trajectory import UNSET, StepRecord

OSWORLD = ["step_num", "action_timestamp", "action", "response", "reward", "done", "info",
           "screenshot_file"]
GENERATED = ["model_endpoint", "model_version", "prompt_tokens", "completion_tokens"]


def _generation(**kw):
    return Generation("Action: wait()", "http://m:1/v1", "v3", 0.1, 120, 9, "stop", 1, **kw)


def test_a_reply_s_record_starts_with_osworld_s_fields_then_what_was_generated():
    line = StepRecord.of_reply(3, _generation(), token_ids=False, logprobs=False).line()
    assert list(line) == [*OSWORLD, *GENERATED]
    assert (line["step_num"], line["response"], line["reward"], line["done"]) == (
        3, "Action: wait()", 0, False)
    assert line["model_version"] == "v3" and line["prompt_tokens"] == 120


def test_token_ids_and_logprobs_are_in_the_line_exactly_when_asked_for():
    generation = _generation(token_ids=[1, 2], prompt_token_ids=None, logprobs=[-0.5, -0.1])
    asked = StepRecord.of_reply(1, generation, token_ids=True, logprobs=True).line()
    assert asked["token_ids"] == [1, 2] and asked["logprobs"] == [-0.5, -0.1]
    # Asked for but not returned by the server: the key is there, with null.
    assert "prompt_token_ids" in asked and asked["prompt_token_ids"] is None
    plain = StepRecord.of_reply(1, generation, token_ids=False, logprobs=False).line()
    assert not {"token_ids", "prompt_token_ids", "logprobs"} & set(plain)


def test_a_desktop_step_and_a_text_turn_keep_their_own_fields_in_one_order():
    desktop = StepRecord.of_reply(1, _generation(), token_ids=False, logprobs=False)
    desktop.observation_file, desktop.thought, desktop.actions = "step_0.png", "t", []
    desktop.parse_retries, desktop.constrained = 0, True
    desktop.images, desktop.image_spans = [{"file": "step_0.png", "tokens": 4}], None
    desktop.timing = {"step_s": 1.0}
    assert list(desktop.line()) == [
        *OSWORLD, "observation_file", "thought", "actions", "parse_retries", "constrained",
        *GENERATED, "images", "image_spans", "timing"]
    text = StepRecord.of_reply(1, _generation(), token_ids=False, logprobs=False)
    text.response_tool_calls, text.answer, text.timing = None, "42", {"step_s": 1.0}
    assert list(text.line()) == [*OSWORLD, "response_tool_calls", *GENERATED, "answer",
                                 "timing"]
    assert text.line()["response_tool_calls"] is None  # set to null is not unset


def test_the_schema_is_closed():
    record = StepRecord(1)
    with pytest.raises(AttributeError):
        record.screenshot = "step_1.png"  # a misspelt key fails where it is written
    assert record.thought is UNSET and "thought" not in record.line()
