"""Routing, retries and endpoint health of the model client, against fake OpenAI servers
on real loopback ports."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import httpx2
import pytest

from cua_rollout.config import ModelConfig, ModelPoolConfig, SamplingConfig
from cua_rollout.core.errors import ContextTooShort, ModelRequestError, ModelUnavailable
from cua_rollout.model.client import ModelServicePool
from cua_rollout.model.fleet.control import ENDPOINTS_PATH, ControlServer
from cua_rollout.model.fleet.state import ENDPOINTS_FILE
from cua_rollout.model.openai_protocol import (
    ChatReply,
    ChatRequest,
    ErrorReply,
    chat_request_body,
    error_body,
    parse_chat_completion,
    parse_chat_request,
)
from tests.doubles.fake_openai import FakeOpenAIServer

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def model_cfg(urls: list[str], **kw) -> ModelConfig:
    base = dict(
        endpoints=urls, retries=3, backoff={"initial_s": 0.01, "max_s": 0.05},
        request_timeout_s=5, connect_timeout_s=1, reprobe_interval_s=0.1,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture
def servers(request):
    started: list[FakeOpenAIServer] = []

    def make(n: int, **kw) -> list[FakeOpenAIServer]:
        new = [FakeOpenAIServer(**kw).start() for _ in range(n)]
        started.extend(new)
        return new

    yield make
    for s in started:
        s.stop()


async def test_generation_fields_and_request_body(servers):
    (srv,) = servers(1, reply=lambda b: "Thought: go\nAction: click(start_box='(1,2)')")
    pool = ModelServicePool(model_cfg([srv.url], name="ui-tars"))
    try:
        sampling = SamplingConfig(temperature=0.0, max_tokens=77, logprobs=True,
                                  return_token_ids=True, seed=5)
        gen = await pool.generate(MESSAGES, "s1", sampling)
    finally:
        await pool.close()
    assert gen.text == "Thought: go\nAction: click(start_box='(1,2)')"
    assert gen.endpoint == srv.url and gen.model_version == "fake-model"
    assert gen.prompt_tokens == 11 and gen.completion_tokens == 4
    assert gen.token_ids == [0, 1, 2, 3] and gen.prompt_token_ids == list(range(11))
    assert gen.logprobs == [-0.5] * 4 and gen.attempts == 1 and gen.latency_s > 0
    body = srv.requests[0]
    assert body["model"] == "ui-tars" and body["messages"] == MESSAGES
    assert body["max_tokens"] == 77 and body["temperature"] == 0.0 and body["seed"] == 5
    assert body["logprobs"] is True and body["return_token_ids"] is True


async def test_a_request_longer_than_the_endpoints_context_is_not_sent(servers):
    (srv,) = servers(1, max_model_len=4096)
    pool = ModelServicePool(model_cfg([srv.url]))
    try:
        with pytest.raises(ContextTooShort) as caught:
            await pool.generate(MESSAGES, "s", least_tokens=(5000, "5 screenshot(s) of 1x1"))
        assert srv.requests == []  # never sent
        error = caught.value
        assert error.fatal and not error.retryable and (error.needed, error.limit) == (5000, 4096)
        assert "5 screenshot(s) of 1x1 need at least 5000 tokens" in str(error)
        assert "agent.history_images" in str(error)
        # One that fits is sent, with the action grammar when asked; the context was asked
        # of the server once.
        await pool.generate(MESSAGES, "s", least_tokens=(4096, "fits"), regex="Thought: a")
        await pool.generate(MESSAGES, "s", least_tokens=(100, "fits"))
    finally:
        await pool.close()
    assert srv.requests[0]["structured_outputs"] == {"regex": "Thought: a"}
    assert "structured_outputs" not in srv.requests[1]


async def test_a_server_that_does_not_say_its_context_is_not_checked(servers):
    (srv,) = servers(1)
    pool = ModelServicePool(model_cfg([srv.url]))
    try:
        await pool.generate(MESSAGES, "s", least_tokens=(10**9, "anything"))
    finally:
        await pool.close()
    assert len(srv.requests) == 1


async def test_credentials_in_an_endpoint_url_are_sent_but_never_recorded(servers):
    """Review L8: ``user:pass@`` in a URL authenticates the request (basic auth) and is
    redacted from what is recorded: the generation's endpoint, statistics, errors."""
    (srv,) = servers(1)
    secret_url = srv.url.replace("http://", "http://alice:s3cret@")
    pool = ModelServicePool(model_cfg([secret_url]))
    try:
        gen = await pool.generate(MESSAGES, "s1")
        srv.faults.append(400)
        with pytest.raises(ModelRequestError) as refused:
            await pool.generate(MESSAGES, "s1")
        stats = pool.stats()
    finally:
        await pool.close()
    assert srv.headers[0]["authorization"].startswith("Basic ")
    redacted = srv.url.replace("http://", "http://***@")
    assert gen.endpoint == redacted and stats["endpoints"][0]["url"] == redacted
    assert "s3cret" not in str(refused.value) and "s3cret" not in repr(stats)


async def test_sticky_sessions_stay_and_spread(servers):
    srvs = servers(3)
    pool = ModelServicePool(model_cfg([s.url for s in srvs]))
    try:
        where: dict[str, set[str]] = {}

        async def episode(sid: str) -> None:
            for _ in range(5):
                gen = await pool.generate(MESSAGES, sid)
                where.setdefault(sid, set()).add(gen.endpoint)

        await asyncio.gather(*(episode(f"ep{i}") for i in range(12)))
    finally:
        await pool.close()
    assert all(len(urls) == 1 for urls in where.values()), where
    per_endpoint = Counter(next(iter(u)) for u in where.values())
    assert sorted(per_endpoint.values()) == [4, 4, 4]
    assert pool.stats()["sticky_hits"] == 12 * 4


async def test_balance_under_skew_moves_sessions_off_a_slow_server(servers):
    fast = servers(3, latency_s=0.01)
    (slow,) = servers(1, latency_s=0.6)
    pool = ModelServicePool(
        model_cfg([s.url for s in [*fast, slow]], sticky_max_extra_outstanding=2)
    )
    try:
        async def episode(sid: str) -> None:
            for _ in range(6):
                await pool.generate(MESSAGES, sid)

        await asyncio.gather(*(episode(f"ep{i}") for i in range(24)))
    finally:
        await pool.close()
    served = {s.url: len(s.requests) for s in [*fast, slow]}
    assert sum(served.values()) == 24 * 6
    # Round robin would give the slow server a quarter; load-aware routing gives it clearly
    # less (it still gets work whenever it has nothing in flight), and sessions moved off it.
    assert served[slow.url] < 0.2 * 24 * 6, served
    assert all(served[s.url] > served[slow.url] for s in fast), served
    assert pool.stats()["sticky_moves"] > 0


async def test_round_robin_and_least_outstanding_policies(servers):
    srvs = servers(2)
    for routing in ("round_robin", "least_outstanding"):
        pool = ModelServicePool(model_cfg([s.url for s in srvs], routing=routing))
        try:
            for _ in range(6):
                await pool.generate(MESSAGES, "same-session")
        finally:
            await pool.close()
    # Neither policy is sticky: one session's requests spread over both servers.
    assert [len(s.requests) for s in srvs] == [6, 6]


async def test_transient_failures_retry_elsewhere(servers):
    bad, good = servers(2)
    bad.faults = [503, "garbage", "drop"]
    pool = ModelServicePool(model_cfg([bad.url, good.url], routing="round_robin"))
    try:
        results = [await pool.generate(MESSAGES, f"s{i}") for i in range(6)]
    finally:
        await pool.close()
    assert all(r.endpoint == good.url for r in results if r.attempts > 1)
    assert sum(r.attempts - 1 for r in results) == 3
    assert pool.stats()["retries"] == 3


async def test_gives_up_after_retries_with_the_last_error(servers):
    (srv,) = servers(1)
    srv.faults = [502] * 10
    pool = ModelServicePool(model_cfg([srv.url], retries=2))
    try:
        with pytest.raises(ModelUnavailable, match=r"after 3 attempts.*HTTP 502"):
            await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()
    assert srv.statuses[502] == 3


async def test_client_error_is_not_retried(servers):
    (srv,) = servers(1)
    srv.faults = [400]
    pool = ModelServicePool(model_cfg([srv.url]))
    try:
        with pytest.raises(ModelRequestError) as info:
            await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()
    assert info.value.status == 400 and info.value.server_message == "fault 400"
    assert len(srv.requests) == 1


async def test_hanging_server_hits_the_deadline_and_the_other_answers(servers):
    hung, ok = servers(2)
    hung.faults = ["hang"]
    pool = ModelServicePool(model_cfg([hung.url, ok.url], routing="round_robin",
                                      request_timeout_s=0.5))
    try:
        gen = await asyncio.wait_for(pool.generate(MESSAGES, "s"), timeout=5)
    finally:
        await pool.close()
    assert gen.endpoint == ok.url and gen.attempts == 2
    assert "timed out" in pool.stats()["endpoints"][0]["last_error"]


async def test_failing_endpoint_is_ejected_and_reprobed_back(servers):
    flaky, good = servers(2)
    flaky.faults = [500] * 3
    flaky.healthy = False
    pool = ModelServicePool(model_cfg([flaky.url, good.url], routing="round_robin",
                                      endpoint_failures_to_eject=3))
    try:
        for i in range(8):
            await pool.generate(MESSAGES, f"s{i}")
        state = {e["url"]: e for e in pool.stats()["endpoints"]}
        assert state[flaky.url]["ejected"] is True
        before = len(flaky.requests)
        for i in range(4):
            await pool.generate(MESSAGES, f"t{i}")
        assert len(flaky.requests) == before  # nothing routed to an ejected endpoint
        flaky.healthy = True
        for _ in range(100):
            if not {e["url"]: e for e in pool.stats()["endpoints"]}[flaky.url]["ejected"]:
                break
            await asyncio.sleep(0.05)
        for i in range(4):
            await pool.generate(MESSAGES, f"u{i}")
        assert len(flaky.requests) > before
    finally:
        await pool.close()


async def test_endpoints_from_state_file_follow_changes(servers, tmp_path):
    a, b = servers(2)
    state = tmp_path / ENDPOINTS_FILE

    def publish(entries):
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"endpoints": entries}))
        os.replace(tmp, state)

    publish([{"url": a.url, "healthy": True, "model_version": "v1"},
             {"url": b.url, "healthy": True, "model_version": "v1", "draining": True}])
    now = [0.0]
    pool = ModelServicePool(model_cfg([]), state_dir=tmp_path, clock=lambda: now[0])
    try:
        gens = [await pool.generate(MESSAGES, f"s{i}") for i in range(3)]
        assert {g.endpoint for g in gens} == {a.url}  # b is draining
        assert {g.model_version for g in gens} == {"v1"}
        publish([{"url": a.url, "healthy": True, "model_version": "v1", "draining": True},
                 {"url": b.url, "healthy": True, "model_version": "v2"}])
        os.utime(state, ns=(1, 10**18))  # a different mtime, whatever the filesystem's clock
        now[0] += 5
        gens = [await pool.generate(MESSAGES, f"t{i}") for i in range(3)]
        assert {(g.endpoint, g.model_version) for g in gens} == {(b.url, "v2")}
    finally:
        await pool.close()


class _Publisher:
    """What the control server reads of a supervisor for ``/endpoints``."""

    def __init__(self, entries: list[dict]) -> None:
        self.pool = ModelPoolConfig(api_key_env="FAKE_POOL_KEY")
        self.replica_key = "sk-pool"
        self.published: dict | None = {"model": "fake", "endpoints": entries}


async def test_endpoints_from_the_control_server_follow_changes_without_a_shared_disk(
        servers, monkeypatch):
    a, b = servers(2)
    publisher = _Publisher([{"url": a.url, "healthy": True, "model_version": "v1"},
                            {"url": b.url, "healthy": False, "model_version": "v1"}])
    control = ControlServer(publisher)  # type: ignore[arg-type]
    url = control.start(asyncio.get_running_loop()) + ENDPOINTS_PATH
    monkeypatch.setenv("FAKE_MODEL_KEY", "sk-pool")
    monkeypatch.setenv("WRONG_MODEL_KEY", "sk-other")
    pool = ModelServicePool(model_cfg([], endpoints_url=url, api_key_env="FAKE_MODEL_KEY"))
    intruder = ModelServicePool(model_cfg([], endpoints_url=url, retries=0,
                                          api_key_env="WRONG_MODEL_KEY"))
    try:
        gens = [await pool.generate(MESSAGES, f"s{i}") for i in range(3)]
        assert {(g.endpoint, g.model_version) for g in gens} == {(a.url, "v1")}
        # A reload's new list reaches the client within a second or so.
        publisher.published = {"endpoints": [
            {"url": a.url, "healthy": True, "model_version": "v1", "draining": True},
            {"url": b.url, "healthy": True, "model_version": "v2"}]}
        await asyncio.sleep(1.6)
        gens = [await pool.generate(MESSAGES, f"t{i}") for i in range(3)]
        assert {(g.endpoint, g.model_version) for g in gens} == {(b.url, "v2")}
        # A client without the pool's key is refused the list, and says so.
        with pytest.raises(ModelUnavailable, match=r"endpoint list is not readable: .*HTTP 401"):
            await intruder.generate(MESSAGES, "v")
        # An unchanged list costs a 304.
        async with httpx2.AsyncClient(headers={"Authorization": "Bearer sk-pool"}) as http:
            first = await http.get(url)
            again = await http.get(url, headers={"If-None-Match": first.headers["etag"]})
        assert first.status_code == 200 and again.status_code == 304
        assert first.json()["endpoints"][1]["model_version"] == "v2"
        # The control server gone: the list read last keeps serving.
        control.stop()
        await asyncio.sleep(1.6)
        assert (await pool.generate(MESSAGES, "u")).endpoint == b.url
    finally:
        await pool.close()
        await intruder.close()
        control.stop()


async def test_no_endpoints_anywhere_is_a_clear_error(tmp_path):
    with pytest.raises(ModelUnavailable, match="no model endpoints"):
        ModelServicePool(model_cfg([]))
    pool = ModelServicePool(model_cfg([]), state_dir=tmp_path)
    try:
        with pytest.raises(ModelUnavailable, match="no model endpoint is serving"):
            await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()


async def test_api_key_comes_from_the_named_env_var(servers, monkeypatch):
    (srv,) = servers(1)
    monkeypatch.setenv("FAKE_MODEL_KEY", "sk-test")
    pool = ModelServicePool(model_cfg([srv.url], api_key_env="FAKE_MODEL_KEY"))
    try:
        await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()
    assert srv.headers[0]["authorization"] == "Bearer sk-test"


# --------------------------------------------------------------------------- the wire protocol


def test_request_body_is_the_protocols_and_shares_the_messages():
    body = chat_request_body("ui-tars", MESSAGES, SamplingConfig())
    assert list(body) == ["model", "messages", "temperature", "top_p", "max_tokens",
                          "frequency_penalty"]
    assert body["messages"] is MESSAGES  # never copied (nor validated) on the client side
    full = chat_request_body("ui-tars", MESSAGES, SamplingConfig(
        seed=1, logprobs=True, return_token_ids=True))
    assert set(full) <= set(ChatRequest.model_fields)
    request = parse_chat_request(full)
    assert (request.seed, request.logprobs, request.return_token_ids) == (1, True, True)
    with pytest.raises(ValueError, match=r"invalid chat request \(messages: .*list"):
        parse_chat_request({"messages": "x"})


def test_a_vllm_reply_with_fields_we_do_not_know_is_read():
    completion = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                     "token_ids": [5, 6], "logprobs": {"content": [
                         {"token": "a", "logprob": -1, "bytes": [97], "top_logprobs": []}]},
                     "message": {"role": "assistant", "content": None, "tool_calls": [],
                                 "reasoning_content": None}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                  "prompt_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": [1, 2], "kv_transfer_params": None,
    }
    reply = parse_chat_completion(completion)
    assert reply == ChatReply(text="", model="m", prompt_tokens=7, completion_tokens=2,
                              finish_reason="length", token_ids=[5, 6],
                              prompt_token_ids=[1, 2], logprobs=[-1.0])
    terse = parse_chat_completion({"choices": [{"message": {"content": "hi"}}]})
    assert (terse.text, terse.model, terse.prompt_tokens, terse.logprobs) == ("hi", None, 0, None)
    assert parse_chat_completion(json.dumps(completion).encode()) == reply  # raw bytes too
    for bad, missing in (({"choices": []}, "choices"), ({"choices": [{}]}, "choices.0.message"),
                         ([1], "body"), (b"<html>", "body: Invalid JSON")):
        with pytest.raises(ValueError, match=rf"not a chat completion \({missing}: "):
            parse_chat_completion(bad)


def test_error_bodies_in_both_forms():
    flat = error_body(400, "too long")
    assert flat == {"object": "error", "message": "too long", "type": "BadRequestError",
                    "code": 400}
    assert error_body(503, "busy")["type"] == "InternalServerError"
    nested = {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}
    assert ErrorReply.model_validate(nested) == ErrorReply.model_validate(flat)


async def test_a_malformed_reply_is_transient_and_says_what_is_missing(servers):
    (srv,) = servers(1)
    srv.faults = ["garbage", "garbage"]
    pool = ModelServicePool(model_cfg([srv.url], retries=1))
    try:
        with pytest.raises(ModelUnavailable,
                           match=r"malformed reply: not a chat completion \(choices: Field"):
            await pool.generate(MESSAGES, "s")
        assert (await pool.generate(MESSAGES, "s")).text  # the endpoint still serves
    finally:
        await pool.close()
    assert srv.statuses["garbage"] == 2


async def test_the_version_of_an_endpoint_we_do_not_launch_is_what_it_reports(servers):
    """model.endpoints: a step's version is model.version, else the weights the server says
    it loaded (vLLM's root in /v1/models), else none, never the served model name."""
    reports, silent = servers(1, model="policy", root="/ckpt/step-300")[0], servers(
        1, model="policy", root=None)[0]
    got = {}
    for name, srv, kw in (("root", reports, {}), ("silent", silent, {}),
                          ("tag", silent, {"version": "run7-step300"})):
        pool = ModelServicePool(model_cfg([srv.url], name="policy", **kw))
        try:
            got[name] = (await pool.generate(MESSAGES, "s")).model_version
        finally:
            await pool.close()
    assert got == {"root": "/ckpt/step-300", "silent": None, "tag": "run7-step300"}


async def test_endpoint_snapshot(servers):
    (srv,) = servers(1)
    srv.faults = [500]
    pool = ModelServicePool(model_cfg([srv.url], retries=0))
    try:
        with pytest.raises(ModelUnavailable):
            await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()
    assert pool.stats()["endpoints"] == [{
        "url": srv.url, "model_version": "fake-model", "draining": False, "outstanding": 0,
        "served": 0, "consecutive_failures": 1, "ejected": False,
        "last_error": "HTTP 500: fault 500", "max_model_len": None, "context_asked": True,
        "published": False,
    }]


# --------------------------------------------------------------------------- outages (review H1)


async def test_a_server_error_on_the_request_is_the_episodes_not_an_outage(servers):
    (srv,) = servers(1)
    srv.faults = [500] * 10
    pool = ModelServicePool(model_cfg([srv.url], retries=2))
    try:
        with pytest.raises(ModelUnavailable) as info:
            await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()
    assert info.value.outage is None  # counts against the episode's attempts


async def test_every_endpoint_down_is_an_outage_waited_out_until_it_returns(servers):
    """A stopped server (connection refused) is an outage, not an episode's failure: the
    error says so at once, and ``wait_until_live`` returns when the server is back on its
    port, whatever the number of waiters (one probe loop)."""
    (srv,) = servers(1)
    srv.stop()
    pool = ModelServicePool(model_cfg([srv.url], retries=5, endpoint_failures_to_eject=2))
    try:
        with pytest.raises(ModelUnavailable, match="no model endpoint is serving") as info:
            await pool.generate(MESSAGES, "s")
        assert info.value.outage == "model"
        assert str(pool.outage_status()) == "0 live, 0 draining, 1 down"
        assert not await pool.wait_until_live(0.3)
        waiters = [asyncio.create_task(pool.wait_until_live(30)) for _ in range(20)]
        await asyncio.sleep(0.5)
        assert pool.outage_status().waiting == 20 and pool.outage_status().since_s > 0
        await asyncio.to_thread(srv.start)  # the same port again
        assert all(await asyncio.gather(*waiters))
        assert pool.outage_status().waiting == 0
        assert (await pool.generate(MESSAGES, "s")).text
    finally:
        await pool.close()


async def test_503_everywhere_is_an_outage(servers):
    (srv,) = servers(1)
    srv.faults = [503] * 10
    pool = ModelServicePool(model_cfg([srv.url], retries=2, endpoint_failures_to_eject=10))
    try:
        with pytest.raises(ModelUnavailable, match=r"after 3 attempts.*HTTP 503") as info:
            await pool.generate(MESSAGES, "s")
    finally:
        await pool.close()
    assert info.value.outage == "model"


async def test_a_single_replica_draining_for_a_reload_is_waited_for(servers, tmp_path):
    """run_model.py's state file marks the only replica draining (a rolling reload with one
    replica): no request is sent anywhere, the caller waits, and is woken when the state file
    shows the replica serving again."""
    (srv,) = servers(1)
    state = tmp_path / ENDPOINTS_FILE

    def publish(**entry):
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"endpoints": [{"url": srv.url, **entry}]}))
        os.replace(tmp, state)

    publish(healthy=True, draining=True, model_version="v1")
    pool = ModelServicePool(model_cfg([]), state_dir=tmp_path)
    try:
        with pytest.raises(ModelUnavailable) as info:
            await pool.generate(MESSAGES, "s")
        assert info.value.outage == "model" and "0 live, 1 draining" in str(info.value)
        waiter = asyncio.create_task(pool.wait_until_live(30))
        await asyncio.sleep(0.4)
        assert not waiter.done() and not srv.requests
        publish(healthy=True, model_version="v2")
        os.utime(state, ns=(1, 10**18))
        assert await waiter
        assert (await pool.generate(MESSAGES, "s")).model_version == "v2"
    finally:
        await pool.close()
