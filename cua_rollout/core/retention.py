"""The retention marker: what ``storage.retention`` did to one episode's images
(``<episode>/retention.json``), defined once for the sweeper that writes it
(runtime/retention.py) and the readers that explain a missing screenshot (the viewer,
show_result, the trainer's index)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cua_rollout.core.files import write_atomic
from cua_rollout.core.layout import RETENTION_MARKER_FILE

__all__ = ["RetentionMarker", "read_marker", "write_marker"]


@dataclass
class RetentionMarker:
    """``policy`` (``storage.retention.images``, or ``budget`` / ``manual``) acted at ``at``
    (epoch seconds): ``removed`` files are gone, ``reencoded`` maps a file to what replaced
    it (itself for a lossless re-encode), ``bytes_freed`` in all."""

    policy: str
    at: float = field(default_factory=time.time)
    removed: list[str] = field(default_factory=list)
    reencoded: dict[str, str] = field(default_factory=dict)
    reencode: str = "none"
    bytes_freed: int = 0

    @property
    def images_gone(self) -> bool:
        """Whether a reader of the recorded file names finds them changed: removed, or
        replaced by a lossy copy under another name."""
        return bool(self.removed) or any(a != b for a, b in self.reencoded.items())

    def describe(self) -> str:
        """One line for a reader: ``images removed by retention policy <x> at <t>``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))
        parts = []
        if self.removed:
            parts.append(f"{len(self.removed)} image(s) removed by retention policy "
                         f"{self.policy} at {when}")
        if self.reencoded:
            parts.append(f"{len(self.reencoded)} image(s) re-encoded ({self.reencode}) by "
                         f"retention at {when}")
        return "; ".join(parts) or f"retention policy {self.policy} kept the images ({when})"

    def replacement(self, name: str) -> str | None:
        """What stands for file ``name`` now: its re-encoded name, or None when removed."""
        if name in self.removed:
            return None
        return self.reencoded.get(name, name)


def read_marker(episode_dir: str | Path) -> RetentionMarker | None:
    """The episode's marker, or None (no marker; an unreadable one is treated as none: the
    sweeper writes it atomically, so a broken one was not written by it)."""
    try:
        raw: Any = json.loads((Path(episode_dir) / RETENTION_MARKER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("policy"), str):
        return None
    try:
        return RetentionMarker(
            policy=raw["policy"], at=float(raw.get("at") or 0.0),
            removed=[str(x) for x in raw.get("removed") or []],
            reencoded={str(k): str(v) for k, v in (raw.get("reencoded") or {}).items()},
            reencode=str(raw.get("reencode") or "none"),
            bytes_freed=int(raw.get("bytes_freed") or 0))
    except (TypeError, ValueError, AttributeError):
        return None


def write_marker(episode_dir: str | Path, marker: RetentionMarker, *, fsync: bool) -> None:
    """Write (atomically) the episode's marker."""
    write_atomic(Path(episode_dir) / RETENTION_MARKER_FILE,
                 json.dumps(asdict(marker), indent=1).encode(), fsync=fsync)
