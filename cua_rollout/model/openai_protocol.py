"""The OpenAI chat-completions wire protocol, defined once for the model client and every server
here (paths; request, reply and error models): the client sends ``chat_request_body`` (encoded
by ``RequestBody``) and reads ``parse_chat_completion``; servers read ``parse_chat_request``,
answer ``completion_body``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cua_rollout.core.screenshot import DataURL

if TYPE_CHECKING:
    from cua_rollout.config import SamplingConfig

__all__ = [
    "CHAT_COMPLETIONS_PATH",
    "HEALTH_PATH",
    "IMAGE_MARK",
    "MODELS_PATH",
    "ChatCompletion",
    "ChatMessage",
    "ChatReply",
    "ChatRequest",
    "Choice",
    "ChoiceLogprobs",
    "ErrorReply",
    "FunctionCall",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "RequestBody",
    "TokenLogprob",
    "ToolCallWire",
    "Usage",
    "chat_request_body",
    "completion_body",
    "completion_json",
    "error_body",
    "models_body",
    "parse_chat_completion",
    "parse_chat_request",
    "served_card",
]

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"  # vLLM's liveness route (not OpenAI's): 200 once the model is loaded


class _Wire(BaseModel):
    """A wire model: fields this project sends or reads; whatever else a server adds (vLLM
    adds many) is kept, not rejected."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- request


class ChatRequest(_Wire):
    """``POST /v1/chat/completions`` as servers read it. The messages stay plain dicts: a
    request holds megabytes of screenshot data URLs, which no server here looks into."""

    model: str | None = None  # vLLM answers with its served model when it is absent
    messages: list[dict[str, Any]]
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logprobs: bool | None = None
    return_token_ids: bool | None = None  # vLLM: prompt and completion token ids in the reply
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"regex": ...} constrains replies
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools
    tool_choice: str | dict[str, Any] | None = None  # "auto", "required", "none" or a named one


def chat_request_body(
    model: str, messages: list[dict[str, Any]], sampling: SamplingConfig,
    regex: str | None = None, *, tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the client sends: a plain dict (not a ``ChatRequest``), so the messages'
    screenshot data URLs are neither validated nor copied on the client's hot path. The
    optional fields are sent only when they ask for something; ``regex`` constrains the
    reply to match it whole (vLLM's structured outputs); ``tools`` (OpenAI function tools)
    with ``tool_choice`` lets the model call them (``required``: vLLM forces a valid call
    with structured outputs)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "frequency_penalty": sampling.frequency_penalty,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.logprobs:
        body["logprobs"] = True
    if sampling.return_token_ids:
        body["return_token_ids"] = True
    if regex is not None:
        body["structured_outputs"] = {"regex": regex}
    if tools:
        body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
    return body


# Stands in for a data URL while the rest of a body is serialised; letters, digits and
# underscores only, so JSON leaves it as it is, and random, so no prompt text contains it.
IMAGE_MARK = f"cua_image_{uuid.uuid4().hex}_"


class RequestBody:
    """A request body as the pieces of ``json.dumps(body)``: the JSON text around the
    ``DataURL`` strings of the messages' images, and those strings themselves, which JSON
    escaping leaves unchanged. Serialising them again would cost ~1 ms per 500 KB image per
    request, and joining the pieces would hold a copy of every image for as long as the
    request waits for the model. The bytes sent are exactly ``json.dumps(body).encode()``;
    each image is encoded (ASCII, a plain copy) only while it is being sent, and the body can
    be sent again for a retry."""

    def __init__(self, body: dict[str, Any]) -> None:
        urls: list[DataURL] = []
        text = json.dumps({**body, "messages": _mark_images(body["messages"], urls)})
        parts = text.split(IMAGE_MARK) if urls else [text]
        if len(parts) != 2 * len(urls) + 1:  # the mark occurs elsewhere: serialise it all
            self._pieces: list[bytes | DataURL] = [json.dumps(body).encode()]
        else:
            # parts: text, index, text, index, ..., text (the marks are "<IMAGE_MARK>i<IMAGE_MARK>")
            self._pieces = [parts[0].encode()]
            for i, url in enumerate(urls):
                if parts[2 * i + 1] != str(i):
                    self._pieces = [json.dumps(body).encode()]
                    break
                self._pieces += [url, parts[2 * i + 2].encode()]
        self.length = sum(len(p) for p in self._pieces)  # a DataURL is ASCII: 1 byte a char

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece.encode("ascii") if isinstance(piece, str) else piece

    def __bytes__(self) -> bytes:
        return b"".join(p.encode("ascii") if isinstance(p, str) else p for p in self._pieces)


def _mark_images(messages: list[dict[str, Any]], urls: list[DataURL]) -> list[Any]:
    """``messages`` with each ``DataURL`` image replaced by a numbered mark (appended to
    ``urls``); everything else is shared with the caller's messages, not copied."""
    out: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        for part in content:
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else None
            if type(url) is DataURL:
                mark = f"{IMAGE_MARK}{len(urls)}{IMAGE_MARK}"
                parts.append({**part, "image_url": {**image, "url": mark}})
                urls.append(url)
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    """A decoded request body as a ``ChatRequest``; ``ValueError`` saying what is wrong."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise ValueError(f"invalid chat request ({_describe(exc)})") from None


# --------------------------------------------------------------------------- reply


class FunctionCall(_Wire):
    name: str = ""
    arguments: str = ""  # JSON text, as the model wrote it (it may not parse)


class ToolCallWire(_Wire):
    """One tool call of a reply (``message.tool_calls[i]``)."""

    id: str = ""
    type: str = "function"
    function: FunctionCall = FunctionCall()


class ChatMessage(_Wire):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallWire] | None = None


class TokenLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] | None = None


class ChoiceLogprobs(_Wire):
    content: list[TokenLogprob] | None = None


class Choice(_Wire):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM, with return_token_ids


class PromptTokensDetails(_Wire):
    cached_tokens: int | None = None


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletion(_Wire):
    """A chat completion. What the client reads is required (a reply without it is
    malformed); what it does not read has a default, so a terse server is still understood."""

    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str | None = None
    choices: list[Choice] = Field(min_length=1)
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids

    @classmethod
    def build(
        cls,
        text: str,
        *,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str = "stop",
        completion_id: str | None = None,
        created: int | None = None,
        logprobs: Sequence[tuple[str, float]] | None = None,
        token_ids: list[int] | None = None,
        prompt_token_ids: list[int] | None = None,
        cached_tokens: int | None = None,
        tool_calls: Sequence[tuple[str, str]] | None = None,
    ) -> ChatCompletion:
        """A server's completion with one choice holding ``text``; ``logprobs`` is (token,
        logprob) per completion token, ``cached_tokens`` the prompt's prefix-cache hits,
        ``tool_calls`` (name, arguments JSON text) the calls the reply makes (their ids are
        made here; the finish reason becomes ``tool_calls``)."""
        usage = Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None
            else PromptTokensDetails(cached_tokens=cached_tokens),
        )
        calls = None if not tool_calls else [
            ToolCallWire(id=f"call_{uuid.uuid4().hex[:24]}",
                         function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in tool_calls]
        choice = Choice(
            index=0, message=ChatMessage(role="assistant", content=text, tool_calls=calls),
            finish_reason="tool_calls" if calls else finish_reason, token_ids=token_ids,
            logprobs=None if logprobs is None else ChoiceLogprobs(
                content=[TokenLogprob(token=t, logprob=lp) for t, lp in logprobs]
            ),
        )
        return cls(
            id=completion_id or f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()) if created is None else created,
            model=model, choices=[choice], usage=usage, prompt_token_ids=prompt_token_ids,
        )


@dataclass(frozen=True, slots=True)
class ChatReply:
    """What the client takes from a chat completion (its first choice)."""

    text: str
    model: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    logprobs: list[float] | None
    # The reply's tool calls as the wire has them ({"id", "type", "function": {"name",
    # "arguments"}}), None when it makes none.
    tool_calls: list[dict[str, Any]] | None = None


def parse_chat_completion(body: bytes | str | Mapping[str, Any]) -> ChatReply:
    """A reply body, raw (JSON parsed and validated in one pass: faster than ``json.loads``
    alone) or decoded. A malformed one raises ``ValueError`` naming what is missing or wrong
    (for the client: a transient failure, worth another endpoint)."""
    try:
        if isinstance(body, bytes | bytearray | str):
            completion = ChatCompletion.model_validate_json(body)
        else:
            completion = ChatCompletion.model_validate(body)
    except ValidationError as exc:
        raise ValueError(f"not a chat completion ({_describe(exc)})") from None
    choice = completion.choices[0]
    usage = completion.usage or Usage()
    logprobs = None
    if choice.logprobs is not None and choice.logprobs.content is not None:
        logprobs = [t.logprob for t in choice.logprobs.content]
    return ChatReply(
        text=choice.message.content or "",
        model=completion.model,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        finish_reason=choice.finish_reason,
        token_ids=choice.token_ids,
        prompt_token_ids=completion.prompt_token_ids,
        logprobs=logprobs,
        tool_calls=None if not choice.message.tool_calls else [
            call.model_dump() for call in choice.message.tool_calls],
    )


def completion_body(text: str, **fields: Any) -> dict[str, Any]:
    """A server's reply to a chat request, one choice holding ``text`` (``fields``: those of
    ``ChatCompletion.build``); fields that are ``None`` are left out of the body."""
    return ChatCompletion.build(text, **fields).model_dump(exclude_none=True)


def completion_json(text: str, **fields: Any) -> bytes:
    """``completion_body`` serialised, for servers that write their own bytes (the
    benchmarks' simulated servers): pydantic's serialiser is faster than ``json.dumps``."""
    return ChatCompletion.build(text, **fields).model_dump_json(exclude_none=True).encode()


# --------------------------------------------------------------------------- errors


# The OpenAI client's exception names, which vLLM sends as ``type``.
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError",
                403: "PermissionDeniedError", 404: "NotFoundError",
                422: "UnprocessableEntityError", 429: "RateLimitError"}


class ErrorReply(_Wire):
    """An error body as vLLM sends it, ``{"object": "error", "message", "type", "code"}``;
    reading also accepts OpenAI's form, ``{"error": {"message", "type", "code"}}``. (The
    client shows the message through ``cua_rollout.core.http.error_text``, which reads both.)"""

    object: Literal["error"] = "error"
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: int | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unwrap(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data["error"]
        return data


def error_body(status: int, message: str) -> dict[str, Any]:
    """The body of an error reply with HTTP status ``status``, as vLLM writes it."""
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return ErrorReply(message=message, type=kind, code=status).model_dump(exclude_none=True)


# --------------------------------------------------------------------------- models


class ModelCard(_Wire):
    id: str
    object: str = "model"
    owned_by: str | None = None
    max_model_len: int | None = None  # vLLM: the context length it serves
    root: str | None = None           # vLLM: the weights it loaded (a path or a hub id)


def served_card(body: bytes | str, model: str) -> ModelCard | None:
    """From a ``GET /v1/models`` reply: the card of ``model``, else of the only model served;
    None when the reply is not a model list or names neither."""
    try:
        cards = ModelList.model_validate_json(body).data
    except ValidationError:
        return None
    return next((c for c in cards if c.id == model), cards[0] if len(cards) == 1 else None)


class ModelList(_Wire):
    object: str = "list"
    data: list[ModelCard]


def models_body(model: str, owned_by: str | None = None, **extra: Any) -> dict[str, Any]:
    """``GET /v1/models`` of a server serving ``model`` (``extra``: e.g. vLLM's
    ``max_model_len``)."""
    card = ModelCard(id=model, owned_by=owned_by, **extra)
    return ModelList(data=[card]).model_dump(exclude_none=True)


def _describe(exc: ValidationError, most: int = 3) -> str:
    """The first errors of a validation, one short line: ``choices: Field required``."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:most]]
    if len(errors) > most:
        parts.append(f"{len(errors) - most} more")
    return "; ".join(parts)
