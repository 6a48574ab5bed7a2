"""The wire protocol of the desktop service (``cua-rollout desktops serve``), defined once:
its paths, request and reply bodies and error codes. The service (``cua_rollout/service/``)
serves it; its client (``cua_rollout/envs/service_client.py``), the ``remote`` desktop
provider and the Gymnasium environment speak it. It imports nothing but pydantic and the
standard library.

A lease is one desktop lent to one tenant for one task: ``POST /v1/leases`` runs the task's
setup and answers the env id, the screen's size and the first observation; then ``act``,
``observe``, ``evaluate``, ``heartbeat``; ``DELETE`` gives the desktop back (reset and
verified in the background before it is lent again). A lease not heard from for its
``lease_ttl_s`` expires and is reclaimed the same way.

Every request but ``/healthz`` carries ``Authorization: Bearer <tenant token>``. An env id
names the service instance that granted it (``<boot>-<n>``): after a restart the ids of the
old instance answer 410 ``lease_lost``, not 404, so a client knows its lease went with the
old process and must lease again.

A desktop's own traffic (screenshots, files, OSWorld's server API) goes either straight to
the desktop (``access: direct``: ``desktop_url`` is its server, ``desktop_token`` a bearer
token valid for this lease only) or through the service (``access: relay``: ``desktop_url``
is the lease's relay path on the service, which takes the tenant's token).

Errors answer ``ErrorBody`` with the HTTP status of ``ERROR_STATUS[code]``.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ACT_KINDS",
    "ERROR_STATUS",
    "OBSERVATIONS",
    "SPECIAL_ACTIONS",
    "ActReply",
    "ActRequest",
    "DesktopAction",
    "DesktopRow",
    "DesktopsReply",
    "ErrorBody",
    "ErrorCode",
    "EvaluateReply",
    "EvaluateRequest",
    "HeartbeatReply",
    "LeaseInfo",
    "LeaseReply",
    "LeaseRequest",
    "Observation",
    "ObserveRequest",
    "ReleaseReply",
    "ScreenSize",
    "ServicePaths",
    "decode_png",
    "encode_png",
]


class ServicePaths:
    """Every path the service serves (method and bodies in the comment)."""

    HEALTHZ = "/healthz"                                  # GET, no token: {"ok": true}
    STATUS = "/status"                                    # GET: desktops, leases, tenants
    METRICS = "/metrics"                                  # GET: Prometheus text
    LEASES = "/v1/leases"                                 # POST LeaseRequest: LeaseReply (201)
    LEASE = "/v1/leases/{env_id}"                         # GET: LeaseInfo; DELETE: ReleaseReply
    HEARTBEAT = "/v1/leases/{env_id}/heartbeat"           # POST: HeartbeatReply
    ACT = "/v1/leases/{env_id}/act"                       # POST ActRequest: ActReply
    OBSERVE = "/v1/leases/{env_id}/observe"               # POST ObserveRequest: Observation
    SCREENSHOT = "/v1/leases/{env_id}/screenshot"         # GET: the PNG
    EVALUATE = "/v1/leases/{env_id}/evaluate"             # POST EvaluateRequest: EvaluateReply
    RELAY = "/v1/leases/{env_id}/desktop"                 # + the desktop's own path: relayed
    DESKTOPS = "/v1/desktops"                             # GET (operator): DesktopsReply
    DESKTOP_ACTION = "/v1/desktops/{desktop_id}/{action}"  # POST (operator): DesktopAction

    @staticmethod
    def of(template: str, **values: str) -> str:
        """A path of a template with its fields filled in."""
        return template.format(**values)


ErrorCode = Literal[
    "bad_request",          # the body or a field is wrong (names which)
    "unauthorized",         # no token, or a token no tenant holds
    "address_not_allowed",  # the caller's address is not on the allow-list
    "forbidden",            # the env id is another tenant's, or an operator path
    "unknown_env",          # no such env id (never granted, or released/expired)
    "lease_lost",           # granted by an earlier instance of the service (restarted)
    "too_large",            # the body exceeds the service's limit
    "over_quota",           # the tenant's concurrency quota stayed full past the wait
    "no_desktop",           # no desktop became free within the wait
    "desktop_died",         # the leased desktop stopped answering (it is replaced)
    "setup_failed",         # the task's setup failed on the desktop (the lease is released)
    "evaluation_failed",    # the scoring itself failed (timed out, an evaluator we lack)
    "relay_failed",         # a relayed request got no reply from a desktop that still answers
    "unparseable",          # an action the service cannot turn into code (kind, fields)
    "stopping",             # the service is shutting down
]

ERROR_STATUS: dict[str, int] = {
    "bad_request": 400, "unauthorized": 401, "address_not_allowed": 403, "forbidden": 403,
    "unknown_env": 404, "lease_lost": 410, "too_large": 413, "unparseable": 422,
    "over_quota": 429, "no_desktop": 503, "desktop_died": 502, "setup_failed": 502,
    "evaluation_failed": 502, "relay_failed": 502,
    "stopping": 503,
}

OBSERVATIONS = ("screenshot", "a11y_tree", "terminal")
ACT_KINDS = ("pyautogui", "uitars", "computer13", "special")
SPECIAL_ACTIONS = ("WAIT", "DONE", "FAIL")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    # Replies keep fields they do not know: a newer service's replies parse in an older client.
    model_config = ConfigDict(extra="allow")


class ErrorBody(_Reply):
    """Every error's body."""

    error: str                      # one line: what is wrong, naming the field / env / tenant
    code: ErrorCode
    retry_after_s: float | None = None   # over_quota / no_desktop: when asking again may work


class ScreenSize(_Reply):
    width: int
    height: int


class LeaseRequest(_Model):
    task: dict[str, Any] | None = None
    """An OSWorld task (``id``, ``instruction``, ``config`` setup steps, ``evaluator``); its
    setup runs before the reply. None: a clean desktop, no setup, nothing to evaluate."""
    wait_s: float | None = Field(default=None, ge=0)
    """How long to wait for quota and a free desktop (None: the service's default; capped by
    its maximum). Past it: 429 ``over_quota`` or 503 ``no_desktop``."""
    access: Literal["direct", "relay"] | None = None
    """How the client reaches the desktop's own server (None: the service's default)."""
    observe: list[Literal["screenshot", "a11y_tree", "terminal"]] = ["screenshot"]
    """What the reply carries of the first observation."""
    label: str = Field(default="", max_length=200)
    """A free label (the client's run, episode): shown in ``/status``."""


class Observation(_Reply):
    screenshot_png_b64: str | None = None
    a11y_tree: str | None = None
    terminal: str | None = None


class LeaseReply(Observation):
    env_id: str
    tenant: str
    desktop_id: str
    screen: ScreenSize
    access: Literal["direct", "relay"]
    desktop_url: str                 # the desktop's own server (direct) or the relay path
    desktop_token: str | None = None  # bearer for desktop_url (direct); None with relay
    lease_ttl_s: float               # silence longer than this ends the lease
    heartbeat_s: float               # how often a client should say it is alive
    expires_at: float                # time.time() seconds, pushed on by every call
    waited_s: float = 0.0            # for quota and a free desktop
    setup_s: float = 0.0             # the task's setup on the desktop


class LeaseInfo(_Reply):
    env_id: str
    tenant: str
    desktop_id: str
    task_id: str | None = None
    label: str = ""
    steps: int = 0
    age_s: float
    expires_at: float


class HeartbeatReply(_Reply):
    env_id: str
    expires_at: float


class ActRequest(_Model):
    """One action. ``pyautogui``: ``code`` runs on the desktop. ``uitars``: ``reply`` is a
    UI-TARS model reply (Thought/Action), parsed by our UI-TARS agent against this desktop's
    screen. ``computer13``: ``action`` is one of OSWorld's computer-13 actions
    (``{"action_type": "CLICK", "x": .., "y": ..}``). ``special``: ``code`` is WAIT, DONE or
    FAIL. A terminal action (DONE, FAIL) runs nothing; ``evaluate`` scores the episode."""

    kind: Literal["pyautogui", "uitars", "computer13", "special"]
    code: str | None = Field(default=None, max_length=200_000)
    reply: str | None = Field(default=None, max_length=200_000)
    action: dict[str, Any] | None = None
    pause_s: float | None = Field(default=None, ge=0, le=60)
    """Pause after the action, before the observation (None: the service's default)."""
    observe: list[Literal["screenshot", "a11y_tree", "terminal"]] = ["screenshot"]
    """What the reply carries of the next observation (none after a terminal action)."""


class ActReply(Observation):
    env_id: str
    step: int                        # this lease's action count, this one included
    executed: str | None = None      # the code that ran (None: nothing ran)
    terminal: Literal["WAIT", "DONE", "FAIL"] | None = None
    returncode: int | None = None
    output: str = ""
    error: str = ""
    parse_error: str | None = None   # a uitars reply that did not parse: nothing ran
    terminal_output: str | None = None  # observe "terminal": here, as ``terminal`` is taken
    expires_at: float


class ObserveRequest(_Model):
    observe: list[Literal["screenshot", "a11y_tree", "terminal"]] = ["screenshot"]


class EvaluateRequest(_Model):
    last_action: Literal["DONE", "FAIL"] | None = None
    """The episode's last action (OSWorld's ``infeasible`` tasks need FAIL to score 1)."""


class EvaluateReply(_Reply):
    env_id: str
    reward: float
    evaluation_error: str | None = None  # the evaluator raised on what the agent left: 0
    evaluation_s: float


class ReleaseReply(_Reply):
    env_id: str
    released: bool
    steps: int
    held_s: float


class DesktopRow(_Reply):
    """One desktop, as ``scripts/desktops.py status`` shows it."""

    id: str
    state: str
    owner: str | None = None
    tenant: str | None = None
    env_id: str | None = None
    lease_age_s: float | None = None
    leases: int = 0
    failures: int = 0
    url: str = ""
    provider: str = ""
    last_error: str | None = None


class DesktopsReply(_Reply):
    desktops: list[DesktopRow]


class DesktopAction(_Reply):
    desktop_id: str
    action: Literal["release", "quarantine", "remove"]
    result: str


def encode_png(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def decode_png(text: str) -> bytes:
    return base64.b64decode(text, validate=True)
