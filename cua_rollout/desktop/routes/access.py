"""``/lease_token`` (not in OSWorld): the holder of the server's own token installs or clears
a second bearer token, one lease's (the desktop service gives each lease a fresh one and
clears it before the desktop is reset). The server's auth (``server.py``) lets only the
server's own token reach this route and accepts the lease token on every other path.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cua_rollout.desktop.protocol import ErrorReply, LeaseTokenRequest, MessageReply, Paths
from cua_rollout.desktop.routes.common import State, json_reply, read_json

__all__ = ["router"]

router = APIRouter()


@router.post(Paths.LEASE_TOKEN)
async def lease_token(request: Request, state: State) -> JSONResponse:
    if not state.settings.token:
        return json_reply(ErrorReply(error="this server takes no token (--token-env): a "
                                           "lease token would grant nothing"), 409)
    try:
        body = LeaseTokenRequest.model_validate(await read_json(request))
    except ValidationError as exc:
        return json_reply(ErrorReply(error=f"not a lease token request: "
                                           f"{exc.errors()[0]['msg']}"), 400)
    state.lease_token = body.token or None
    return json_reply(MessageReply(status="success", message="lease token set"
                                   if state.lease_token else "lease token cleared"))
