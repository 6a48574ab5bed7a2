"""What every route shares: the server's state as a dependency, Flask's reading of a JSON body
(as OSWorld's server reads it), and replies built from the protocol's models.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from cua_rollout.desktop.errors import MalformedJSON, NotAnObject, NotJSON
from cua_rollout.desktop.protocol import ErrorReply, MessageReply
from cua_rollout.desktop.state import ServerState

__all__ = [
    "State",
    "body_error_reply",
    "json_reply",
    "read_json",
    "server_state",
    "text_reply",
]


def server_state(request: Request) -> ServerState:
    """The state of the server that serves ``request`` (set by its lifespan)."""
    return request.app.state.desktop


State = Annotated[ServerState, Depends(server_state)]
"""A route's parameter of this type receives the server's state."""


async def read_json(request: Request) -> dict[str, Any]:
    """The JSON object of the request, refused as Flask's ``request.json`` refuses it:
    raises ``NotJSON``, ``MalformedJSON`` or ``NotAnObject`` (see ``body_error_reply``)."""
    mimetype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if not (
        mimetype == "application/json"
        or (mimetype.startswith("application/") and mimetype.endswith("+json"))
    ):
        raise NotJSON("the request body must be JSON (Content-Type: application/json)")
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise MalformedJSON(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise NotAnObject("the JSON body must be an object")
    return data


async def body_error_reply(request: Request, exc: Exception) -> Response:
    """The answer to a body ``read_json`` refused, with Flask's and OSWorld's status: 415 not
    JSON, 400 malformed, 500 not an object (OSWorld's handlers crash on ``data.get``)."""
    if isinstance(exc, NotAnObject):
        return json_reply(MessageReply(status="error", message=str(exc)), 500)
    return json_reply(ErrorReply(error=str(exc)), 415 if isinstance(exc, NotJSON) else 400)


def json_reply(reply: BaseModel, status_code: int = 200) -> JSONResponse:
    return JSONResponse(reply.model_dump(), status_code=status_code)


def text_reply(text: str, status_code: int = 200) -> PlainTextResponse:
    return PlainTextResponse(text, status_code=status_code)
