"""Routes that move files: ``/list_directory``, ``/file`` (download from the desktop),
``/setup/upload`` and ``/setup/download_file`` (the desktop fetches a URL).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile

from cua_rollout.desktop.errors import (
    DownloadFailed,
    NoSuchPath,
    NotADirectory,
    NotAReadableFile,
    UploadFailed,
)
from cua_rollout.desktop.files import download, list_directory, readable_file, save_upload
from cua_rollout.desktop.protocol import (
    FILE_DATA_FIELD,
    FILE_PATH_FIELD,
    ErrorReply,
    ListDirectoryReply,
    Paths,
)
from cua_rollout.desktop.routes.common import State, json_reply, read_json, text_reply

__all__ = ["router"]

router = APIRouter()


@router.post(Paths.LIST_DIRECTORY)
async def directory_listing(request: Request) -> JSONResponse:
    data = await read_json(request)
    if "path" not in data:
        return json_reply(ErrorReply(error="Missing 'path' parameter"), 400)
    try:
        tree = await asyncio.to_thread(list_directory, data["path"])
    except NotADirectory:
        return json_reply(ErrorReply(error="The provided path is not a directory"), 400)
    return json_reply(ListDirectoryReply(directory_tree=tree))


@router.post(Paths.FILE)
async def get_file(request: Request) -> Response:
    path = (await request.form()).get(FILE_PATH_FIELD)
    if not isinstance(path, str):
        return json_reply(ErrorReply(error=f"{FILE_PATH_FIELD} is required"), 400)
    try:
        found = readable_file(path)
    except NoSuchPath:
        return json_reply(ErrorReply(error="File not found"), 404)
    except NotAReadableFile as exc:
        return json_reply(ErrorReply(error=f"Failed to serve file: {exc}"), 500)
    return FileResponse(found, filename=found.name)


@router.post(Paths.SETUP_UPLOAD)
async def upload(request: Request) -> Response:
    form = await request.form()
    path, data = form.get(FILE_PATH_FIELD), form.get(FILE_DATA_FIELD)
    if not isinstance(path, str) or not isinstance(data, UploadFile):
        error = f"{FILE_PATH_FIELD} and {FILE_DATA_FIELD} are required"
        return json_reply(ErrorReply(error=error), 400)
    try:
        size = await asyncio.to_thread(save_upload, data.file, path)
    except UploadFailed as exc:
        return json_reply(ErrorReply(error=f"Failed to upload file: {exc}"), 500)
    return text_reply(f"File Uploaded: {size} bytes")


@router.post(Paths.SETUP_DOWNLOAD_FILE)
async def download_file(request: Request, state: State) -> PlainTextResponse:
    data = await read_json(request)
    url, path = data.get("url"), data.get("path")
    if not url or not path:
        return text_reply("Path or URL not supplied!", 400)
    try:
        size = await download(
            state.http, str(url), str(path), attempts=state.settings.download_attempts
        )
    except DownloadFailed as exc:
        return text_reply(str(exc), 500)
    return text_reply(f"File downloaded successfully: {size} bytes")
