"""The desktop image's health check (``python -m cua_rollout.desktop.healthcheck``): exit 0 when the
server in this container answers ``/platform`` with the configured token, 1 otherwise."""

from __future__ import annotations

import os
import sys
import urllib.request

from cua_rollout.desktop.protocol import Paths

__all__ = ["main"]


def main() -> int:
    port = os.environ.get("CUA_DESKTOP_PORT") or "5000"
    token = os.environ.get(os.environ.get("CUA_DESKTOP_TOKEN_ENV") or "CUA_DESKTOP_TOKEN")
    request = urllib.request.Request(f"http://127.0.0.1:{port}{Paths.PLATFORM}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=3) as reply:
            return 0 if reply.status == 200 else 1
    except OSError as exc:
        print(f"desktop unhealthy: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
