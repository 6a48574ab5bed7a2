"""Screen recording of the desktop with ffmpeg's x11grab, one recording at a time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from cua_rollout.desktop.errors import AlreadyRecording, NotRecording, RecordingFailed
from cua_rollout.desktop.processes import wait_exit

__all__ = ["Recorder"]

# How often to look whether ffmpeg has started writing.
_POLL_INTERVAL_S = 0.05
_LOG_TAIL_BYTES = 2000


class Recorder:
    """Records ``display`` into ``workdir/recording.mp4`` (H.264, ``fps`` frames per second,
    pointer drawn in). Each server has its own file, so desktops on one machine never share it.

    ``start`` raises ``AlreadyRecording`` or ``RecordingFailed``; ``stop`` raises
    ``NotRecording`` or ``RecordingFailed`` (``cua_rollout.desktop.errors``).
    """

    def __init__(
        self,
        workdir: Path,
        display: str,
        *,
        fps: int,
        start_timeout_s: float,
        stop_timeout_s: float,
    ) -> None:
        self.path = workdir / "recording.mp4"
        self._log_path = workdir / "ffmpeg.log"
        self.display = display
        self.fps = fps
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        # One start or stop at a time: two starts racing must not leave two ffmpegs behind.
        self._lock = asyncio.Lock()

    @property
    def active(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def start(self, width: int, height: int) -> None:
        """Start ffmpeg and return once it writes the file (it has grabbed a frame)."""
        async with self._lock:
            await self._start(width, height)

    async def _start(self, width: int, height: int) -> None:
        if self.active:
            raise AlreadyRecording()
        self._proc = None
        self.path.unlink(missing_ok=True)
        argv = [
            "ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
            "-f", "x11grab", "-draw_mouse", "1", "-framerate", str(self.fps),
            "-video_size", f"{width}x{height}", "-i", self.display,
            # ultrafast: a recording must not take the CPU the desktop's apps need.
            "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
            str(self.path),
        ]  # fmt: skip
        try:
            with open(self._log_path, "wb") as log:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                )
        except OSError as exc:
            raise RecordingFailed(f"Failed to start recording: {exc}") from exc
        deadline = time.monotonic() + self.start_timeout_s
        while not (self.path.exists() and self.path.stat().st_size > 0):
            if proc.poll() is not None:
                raise RecordingFailed(
                    "Failed to start recording. ffmpeg terminated unexpectedly "
                    f"(exit status {proc.returncode}). Error: {self._log_tail()}",
                )
            if time.monotonic() >= deadline:
                proc.kill()
                await wait_exit(proc)
                raise RecordingFailed(
                    f"Failed to start recording: ffmpeg wrote nothing within "
                    f"{self.start_timeout_s:g} s. Error: {self._log_tail()}",
                )
            await asyncio.sleep(_POLL_INTERVAL_S)
        self._proc = proc

    async def stop(self) -> Path:
        """Stop ffmpeg (SIGINT lets it finish the file) and return the finished recording's
        path (the caller deletes it)."""
        async with self._lock:
            return await self._stop()

    async def _stop(self) -> Path:
        proc = self._proc
        self._proc = None
        if proc is None or proc.poll() is not None:
            raise NotRecording()
        proc.send_signal(signal.SIGINT)
        try:
            await wait_exit(proc, self.stop_timeout_s)
        except TimeoutError:
            proc.kill()
            await wait_exit(proc)
            raise RecordingFailed(
                "Recording process was unresponsive and had to be killed. "
                f"Stderr: {self._log_tail()}",
            ) from None
        if not self.path.exists() or self.path.stat().st_size == 0:
            raise RecordingFailed(
                "Recording failed. The output file is missing or empty. "
                f"ffmpeg stderr: {self._log_tail()}",
            )
        # A name of its own, so that a new recording can start while this one is sent.
        finished = self.path.with_name(f"recording-{os.urandom(4).hex()}.mp4")
        self.path.rename(finished)
        return finished

    async def kill(self) -> None:
        """End a recording without keeping it (server shutdown)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            await wait_exit(proc)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log_path.read_bytes()[-_LOG_TAIL_BYTES:].decode("utf-8", "replace")
        return ""
