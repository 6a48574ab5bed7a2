"""Routes that record the screen: ``/start_recording`` and ``/end_recording`` (the MP4)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.background import BackgroundTask

from cua_rollout.desktop.errors import AlreadyRecording, NotRecording, RecordingError
from cua_rollout.desktop.protocol import MessageReply, Paths
from cua_rollout.desktop.routes.common import State, json_reply

__all__ = ["router"]

router = APIRouter()


@router.post(Paths.START_RECORDING)
async def start_recording(state: State) -> JSONResponse:
    width, height = await state.screen.size()
    try:
        await state.recorder.start(width, height)
    except RecordingError as exc:
        return _refused(exc)
    return json_reply(MessageReply(status="success", message="Started recording successfully."))


@router.post(Paths.END_RECORDING)
async def end_recording(state: State) -> Response:
    try:
        path = await state.recorder.stop()
    except RecordingError as exc:
        return _refused(exc)
    return FileResponse(
        path,
        media_type="video/mp4",
        filename="recording.mp4",
        background=BackgroundTask(path.unlink, missing_ok=True),
    )


def _refused(exc: RecordingError) -> JSONResponse:
    status = 400 if isinstance(exc, AlreadyRecording | NotRecording) else 500
    return json_reply(MessageReply(status="error", message=exc.message), status)
