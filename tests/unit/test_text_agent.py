"""The text agent's pure functions (``cua_rollout.agents.tool``): a model reply read into tool calls
and a final answer, the messages of the OpenAI chat wire format, the tool-use counts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cua_rollout.agents.tool import (
    ANSWER_TOOL,
    SYSTEM_PROMPTS,
    AgentCounts,
    ReadReply,
    assistant_message,
    final_answer,
    first_messages,
    read_reply,
    tool_message,
)
from cua_rollout.config import TEXT_MODES
from cua_rollout.envs.contract import StepResult, ToolCall
from cua_rollout.envs.tools import TOOL_FAILED, TOOL_MALFORMED, TOOL_OK, TOOL_UNKNOWN


def _call(name: str, arguments: Any, call_id: str | None = "call_x") -> dict[str, Any]:
    """A tool call as an OpenAI-compatible server returns it."""
    raw: dict[str, Any] = {"type": "function",
                           "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        raw["id"] = call_id
    return raw


# --------------------------------------------------------------------------- read_reply


@pytest.mark.parametrize(("arguments", "answer"), [
    ('{"answer": "Paris"}', "Paris"),
    ('{"answer": "  Paris \\n"}', "Paris"),   # stripped
    ('{"answer": 42}', "42"),                 # a number becomes its text
    ('{"answer": -2.5}', "-2.5"),
    ('{"answer": 0}', "0"),
    ('{"answer": ""}', ""),                   # an empty answer is still an answer
])
def test_answer_tool_call_ends_the_episode(arguments: str, answer: str) -> None:
    reply = read_reply("let me answer", [_call("answer", arguments, "c7")])
    assert reply == ReadReply([], answer, None, ToolCall("c7", "answer", arguments))


def test_answer_tool_wins_over_other_calls_and_the_text() -> None:
    raw = [_call("search", '{"query": "x"}', "c1"), _call("answer", '{"answer": "B"}', "c2")]
    reply = read_reply("<answer>A</answer>", raw)
    assert reply.calls == []  # the other calls are not run: the episode ends
    assert reply.answer == "B"
    assert reply.answer_problem is None
    assert reply.answer_call == ToolCall("c2", "answer", '{"answer": "B"}')


@pytest.mark.parametrize("arguments", [
    '{"answer": ',           # not JSON
    "[1, 2]",                # not an object
    '"Paris"',               # a JSON string, not an object
    '{"text": "Paris"}',     # no answer key
    '{"answer": null}',
    '{"answer": true}',      # a bool is not a number
    '{"answer": ["a"]}',
    '{"answer": {"v": 1}}',
    "",                      # no arguments at all
])
def test_answer_tool_with_bad_arguments_is_a_problem_and_other_calls_are_kept(
        arguments: str) -> None:
    raw = [_call("search", '{"query": "x"}', "c1"), _call("answer", arguments, "c2"),
           _call("fetch", '{"url": "http://a"}', "c3")]
    reply = read_reply("", raw)
    assert reply.calls == [ToolCall("c1", "search", '{"query": "x"}'),
                           ToolCall("c3", "fetch", '{"url": "http://a"}')]
    assert reply.answer is None
    assert reply.answer_problem == ("answer: the arguments must be a JSON object with a "
                                    "string 'answer'")
    assert reply.answer_call == ToolCall("c2", "answer", arguments)


def test_answer_tool_with_bad_arguments_alone_leaves_no_call_but_the_problem() -> None:
    reply = read_reply("Final answer: 3", [_call("answer", "{}", "c1")])
    # The text's answer is not taken: the model must be told its call was wrong.
    assert reply.calls == [] and reply.answer is None
    assert reply.answer_problem is not None
    assert reply.answer_call == ToolCall("c1", "answer", "{}")


@pytest.mark.parametrize(("text", "answer"), [
    ("The capital is <answer>Paris</answer>.", "Paris"),
    ("Some working.\nFinal answer: 12", "12"),
    ("<think>hmm</think>Blue", "Blue"),
    ("", None),
])
@pytest.mark.parametrize("tool_calls", [None, []])
def test_a_reply_without_calls_answers_with_its_text(text: str, answer: str | None,
                                                      tool_calls: list[Any] | None) -> None:
    assert read_reply(text, tool_calls) == ReadReply([], answer)


def test_parallel_calls_come_back_in_the_models_order_and_keep_their_ids() -> None:
    raw = [_call("fetch", '{"url": "u1"}', "id-b"), _call("search", '{"query": "q"}', "id-a"),
           _call("fetch", '{"url": "u2"}', "id-c")]
    reply = read_reply("<answer>not yet</answer>", raw)
    assert reply.calls == [ToolCall("id-b", "fetch", '{"url": "u1"}'),
                           ToolCall("id-a", "search", '{"query": "q"}'),
                           ToolCall("id-c", "fetch", '{"url": "u2"}')]
    assert reply.answer is None  # calls to run: the episode goes on
    assert reply.answer_problem is None and reply.answer_call is None


def test_missing_or_unusable_ids_are_made_from_the_calls_position() -> None:
    raw = [_call("a", "{}", call_id=None), _call("b", "{}", call_id=""),
           {**_call("c", "{}"), "id": 5}, _call("d", "{}", call_id="kept")]
    assert [c.id for c in read_reply("", raw).calls] == ["call_0", "call_1", "call_2", "kept"]


def test_arguments_given_as_an_object_become_their_json_text() -> None:
    raw = [_call("search", {"query": "tea", "top_k": 2}, "c1")]
    (call,) = read_reply("", raw).calls
    assert call.arguments == '{"query": "tea", "top_k": 2}'
    assert json.loads(call.arguments) == {"query": "tea", "top_k": 2}


def test_answer_arguments_given_as_an_object_are_read_too() -> None:
    reply = read_reply("", [_call("answer", {"answer": 7}, "c1")])
    assert reply.answer == "7" and reply.calls == []


@pytest.mark.parametrize(("raw", "expected"), [
    ({"id": "c1", "type": "function"}, ToolCall("c1", "", "")),                 # no function
    ({"id": "c1", "function": "search"}, ToolCall("c1", "", "")),             # not an object
    ({"id": "c1", "function": {"arguments": "{}"}}, ToolCall("c1", "", "{}")),  # no name
    ({"id": "c1", "function": {"name": 3, "arguments": "{}"}}, ToolCall("c1", "", "{}")),
    ({"id": "c1", "function": {"name": "x"}}, ToolCall("c1", "x", "")),         # no arguments
    ({"id": "c1", "function": {"name": "x", "arguments": 5}}, ToolCall("c1", "x", "")),
    ("not a call", ToolCall("call_0", "", "")),
    (None, ToolCall("call_0", "", "")),
])
def test_malformed_calls_are_kept_for_the_environment_to_refuse(raw: Any,
                                                                expected: ToolCall) -> None:
    reply = read_reply("text", [raw])
    assert reply.calls == [expected]
    assert reply.answer is None


def test_without_the_answer_tool_an_answer_call_is_an_ordinary_call() -> None:
    raw = [_call("answer", '{"answer": "Paris"}', "c1")]
    reply = read_reply("<answer>Rome</answer>", raw, answer_tool=False)
    assert reply == ReadReply([ToolCall("c1", "answer", '{"answer": "Paris"}')], None)
    # and a plain reply still answers with its text
    assert read_reply("<answer>Rome</answer>", None, answer_tool=False).answer == "Rome"


# --------------------------------------------------------------------------- final_answer


@pytest.mark.parametrize(("text", "answer"), [
    # <answer> tags: the last one wins, stripped, any case
    ("<answer>1</answer> then <answer> 2 </answer>", "2"),
    ("<ANSWER>x</ANSWER>", "x"),
    ("a <answer>multi\nline</answer> b", "multi\nline"),
    # a tag beats a "Final answer:" line wherever they are
    ("<answer>4</answer>\nFinal answer: 3", "4"),
    # "Final answer:" lines: the last one wins, any case, at the start of a line
    ("Step 1\nFinal answer: 10\nwait\nFinal answer: 11", "11"),
    ("FINAL ANSWER:   x + 1  ", "x + 1"),
    ("  final answer: indented", "indented"),
    ("**Final answer**: 42", "42"),
    ("**Final Answer** : 42", "42"),
    ("Final answer：7", "7"),           # full-width colon
    ("Final answer:\n42", "42"),        # the answer on the next line
    ("The final answer: 5 is wrong", "The final answer: 5 is wrong"),  # not at line start
    # <think> blocks removed, with what they say
    ("<think>Final answer: 1</think>Final answer: 2", "2"),
    ("<think>scratch <answer>1</answer></think>So 5", "So 5"),
    ("<THINK>a</THINK>b<think>c</think>d", "bd"),
    ("<think>multi\nline</think>\n  Done  ", "Done"),
    # an unclosed block: what precedes it
    ("Result 3 <think>maybe 4", "Result 3"),
    ("<think>a</think>B<think>never closed <answer>9</answer>", "B"),
    ("<think>only thinking", None),
    ("<think>a</think>  ", None),
    # the whole text otherwise, stripped
    ("  Paris \n", "Paris"),
    ("", None),
    (None, None),
    (" \n\t ", None),
])
def test_final_answer(text: str | None, answer: str | None) -> None:
    assert final_answer(text) == answer


@pytest.mark.parametrize("text", ["**Final answer:** 42", "**Final answer: 42**"])
def test_final_answer_with_the_colon_inside_bold_markdown(text: str) -> None:
    assert final_answer(text) == "42"


# --------------------------------------------------------------------------- messages


def test_first_messages_are_the_system_prompt_and_the_question() -> None:
    assert first_messages("What is 2+2?", "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"}]


def test_assistant_message_without_calls_has_no_tool_calls_key() -> None:
    assert assistant_message("Paris", []) == {"role": "assistant", "content": "Paris"}
    assert assistant_message("", []) == {"role": "assistant", "content": ""}
    # the API rejects a null content next to no calls: None becomes ""
    assert assistant_message(None, []) == {"role": "assistant", "content": ""}  # type: ignore[arg-type]


def test_assistant_message_carries_the_calls_as_openai_sends_them() -> None:
    calls = [ToolCall("c1", "search", '{"query": "tea"}'), ToolCall("c2", "fetch", "{bad")]
    message = assistant_message("", calls)
    assert message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "search", "arguments": '{"query": "tea"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "fetch", "arguments": "{bad"}},  # as the model wrote it
        ],
    }
    assert json.loads(json.dumps(message)) == message


def test_tool_message_answers_one_call_by_its_id() -> None:
    call = ToolCall("c9", "python", '{"code": "print(1)"}')
    assert tool_message(call, "1\n") == {"role": "tool", "tool_call_id": "c9",
                                         "name": "python", "content": "1\n"}


def test_a_read_reply_round_trips_into_the_next_request() -> None:
    raw = [_call("search", {"query": "q"}, None), _call("fetch", '{"url": "u"}', "f1")]
    reply = read_reply("thinking", raw)
    message = assistant_message("thinking", reply.calls)
    ids = [c["id"] for c in message["tool_calls"]]
    answers = [tool_message(c, "out") for c in reply.calls]
    assert ids == ["call_0", "f1"]
    assert [a["tool_call_id"] for a in answers] == ids


# --------------------------------------------------------------------------- counts


def test_return_codes_are_distinct_and_only_ok_is_ok() -> None:
    codes = [TOOL_OK, TOOL_FAILED, TOOL_MALFORMED, TOOL_UNKNOWN]
    assert codes == [0, 1, 2, 3]
    assert [StepResult("t", code).ok for code in codes] == [True, False, False, False]


def test_agent_counts_count_each_call_by_its_return_code() -> None:
    counts = AgentCounts()
    assert counts.record() == {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0,
                               "unknown_tools": 0, "over_limit": 0, "by_tool": {}}
    for name, code in [("search", TOOL_OK), ("search", TOOL_FAILED), ("fetch", TOOL_OK),
                       ("fetch", TOOL_MALFORMED), ("fetch", TOOL_FAILED),
                       ("nope", TOOL_UNKNOWN), ("search", TOOL_OK)]:
        counts.count(name, StepResult(name, code, "out"))
    counts.over_limit += 2  # the runner counts calls past the cap itself
    assert counts.record() == {"tool_calls": 7, "tool_errors": 2, "malformed_calls": 1,
                               "unknown_tools": 1, "over_limit": 2,
                               "by_tool": {"search": 3, "fetch": 3, "nope": 1}}


def test_agent_counts_record_is_a_copy() -> None:
    counts = AgentCounts()
    counts.count("search", StepResult("search", TOOL_OK))
    record = counts.record()
    record["by_tool"]["search"] = 99
    assert counts.by_tool == {"search": 1}
    json.dumps(record)  # a result line's field


# --------------------------------------------------------------------------- prompts, tool


def test_every_text_mode_has_a_system_prompt_naming_its_tools() -> None:
    assert set(SYSTEM_PROMPTS) == set(TEXT_MODES)
    assert "python tool" in SYSTEM_PROMPTS["py"]
    assert "retrieve tool" in SYSTEM_PROMPTS["rag"]
    assert "search tool" in SYSTEM_PROMPTS["web"] and "fetch tool" in SYSTEM_PROMPTS["web"]
    for mode, prompt in SYSTEM_PROMPTS.items():
        assert "answer tool" in prompt, mode


def test_answer_tool_as_an_openai_tool() -> None:
    tool = ANSWER_TOOL.openai()
    assert tool["type"] == "function"
    assert set(tool) == {"type", "function"}
    function = tool["function"]
    assert set(function) == {"name", "description", "parameters"}
    assert function["name"] == "answer"
    assert function["description"]
    assert function["parameters"] == {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": function["parameters"]
                                  ["properties"]["answer"]["description"]}},
        "required": ["answer"]}
    json.dumps(tool)
