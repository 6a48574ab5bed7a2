"""The project's exceptions, in one tree, so callers can tell transient from permanent failures.

    RolloutError                    base of everything raised on purpose here
    ├── ConfigError                 the YAML config or a --set override is wrong (stops the run)
    ├── FatalSetupError             the run cannot start (Ray, desktops, model endpoints)
    ├── FleetError                  the model fleet cannot start or be controlled (run_model.py)
    ├── ActionParseError            a model reply is not a UI-TARS action (agent-side, not infra)
    ├── ToolError                   a tool call failed in a way the model is told (bad arguments,
    │                               a snippet killed at its limits, a page that did not load)
    ├── InfraError                  something outside the agent broke; the episode may be retried
    │   ├── ModelUnavailable        no model endpoint answered in time (transient)
    │   ├── StorageError            the run's files cannot be written (disk full): stops the run
    │   ├── DesktopError            a desktop request failed or the desktop died (transient)
    │   │   ├── DesktopUnavailable  no desktop could be leased before the deadline (an outage)
    │   │   └── TaskSetupError      a task's setup step failed on the desktop
    │   │       ├── DownloadMissing        a download not cached offline, or refused (4xx)
    │   │       ├── UnsupportedSetupStep   the task names a setup step we do not implement
    │   │       └── BadTaskStep     a step's parameters are wrong or reach outside the task roots
    │   ├── ToolUnavailable         a text environment's tool cannot run at all (its sandbox
    │   │                           cannot start, its index cannot load): not the model's doing
    │   ├── UnsupportedEvaluator    a task names a getter or metric we do not implement
    │   └── EvaluationError         the scoring code failed (OSWorld's evaluator raised)
    │       └── EvaluatorRaised     OSWorld's metric or getter itself raised on its input
    └── ModelRequestError           the model server refused the request (4xx): never retried;
        │                           401/403/404 stop the run (no request can succeed)
        └── ContextTooShort         a request longer than the endpoint's context, stopped
                                    before it is sent (stops the run: every step is as long)

Lower-level errors (httpx, Ray, OS) are translated into these at module boundaries with
``raise ... from exc`` so the cause stays visible.

Each class says how an episode that hit it ends, so no caller keeps an ``except`` ladder:
``retryable`` (another attempt, on another desktop, may succeed), ``blames_desktop``
(the desktop the episode held must be health-checked before it is lent again), ``outage``
(a side of the service is down, not this episode's fault: the episode is requeued without
using an attempt and the coordinator waits for that side to come back) and ``fatal`` (no
episode can succeed until an operator acts: the run stops with one line naming the cause).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ActionParseError",
    "BadTaskStep",
    "ConfigError",
    "ContextTooShort",
    "DesktopError",
    "DesktopUnavailable",
    "DownloadMissing",
    "EvaluationError",
    "EvaluatorRaised",
    "FatalSetupError",
    "FleetError",
    "InfraError",
    "ModelRequestError",
    "ModelUnavailable",
    "RolloutError",
    "StorageError",
    "TaskSetupError",
    "ToolError",
    "ToolUnavailable",
    "UnsupportedEvaluator",
    "UnsupportedSetupStep",
    "one_line",
]


class RolloutError(Exception):
    """Base class of every error this project raises on purpose."""

    retryable: ClassVar[bool] = False
    """Another attempt of the episode may not hit this error (an infrastructure hiccup)."""
    blames_desktop: ClassVar[bool] = False
    """The episode's desktop may be broken: check it before lending it again."""
    outage: str | None = None
    """``"model"`` or ``"desktop"``: that side has no capacity now (a wait, not a result)."""
    fatal: bool = False
    """No retry can fix it (credentials, configuration, a full disk): the run stops."""


class ConfigError(RolloutError):
    """The configuration is invalid; the message names the file and the key path."""

    fatal = True


class FatalSetupError(RolloutError):
    """The run cannot start (Ray, desktops, model endpoints); the message is the one line
    the user sees."""


class ActionParseError(RolloutError):
    """A model reply could not be turned into actions.

    ``text`` is the offending text (the whole reply or the single call that failed), so
    it can be logged and stored with the step.
    """

    def __init__(self, message: str, text: str) -> None:
        super().__init__(f"{message}: {text!r}" if text else message)
        self.reason = message
        self.text = text


class ToolError(RolloutError):
    """A tool call of a text environment failed in a way the model is told, as the tool's
    reply: arguments that do not fit the tool's schema, a snippet killed at its limits, a
    search backend's error, a page that did not load. Never ends the episode by itself; the
    message is what the model reads (one or a few lines, no traceback of ours)."""


class InfraError(RolloutError):
    """Infrastructure (desktop, model server, evaluator) failed: not the agent's fault."""

    retryable = True


class ModelUnavailable(InfraError):
    """No model endpoint produced a reply within the retry budget. ``outage``: none was
    reachable at all (every endpoint down, draining or restarting), which is the service's
    state, not this request's; otherwise requests reached a server and failed (5xx, timeouts),
    which counts against the episode's attempts."""

    def __init__(self, message: str, *, outage: bool = False) -> None:
        super().__init__(message)
        self.outage = "model" if outage else None


class StorageError(InfraError):
    """A write of the run's files failed (disk full, I/O error, the storage actor is gone).
    Nothing more can be recorded: the run stops, and a rerun resumes it."""

    retryable = False
    fatal = True


class DesktopError(InfraError):
    """A desktop request failed or the desktop is not healthy."""

    blames_desktop = True


class DesktopUnavailable(DesktopError):
    """No desktop could be leased before the lease deadline: every desktop is busy, resetting
    or quarantined. An outage of the desktop side, not the episode's failure."""

    blames_desktop = False  # no desktop was held
    outage = "desktop"


class TaskSetupError(DesktopError):
    """A task's setup step failed or cannot run here (e.g. a download that is not cached)."""

    blames_desktop = False  # the task's step failed; the desktop answered


class DownloadMissing(TaskSetupError):
    """A file a task downloads cannot be had: not cached while offline, or the server
    refused it (HTTP 4xx). Another attempt would meet the same."""

    retryable = False


class UnsupportedSetupStep(TaskSetupError):
    """A task's ``config`` names a setup step this client does not implement."""

    retryable = False  # every attempt would hit it


class BadTaskStep(TaskSetupError):
    """A setup step's parameters are malformed, or name a host file outside the directories
    tasks may read (``desktops.download_cache_dir``, ``desktops.task_file_roots``)."""

    retryable = False  # every attempt would hit it


class ToolUnavailable(InfraError):
    """A text environment's tool cannot run at all (its sandbox cannot start, its corpus or
    index cannot be read): the infrastructure's failure, not the model's; the episode ends as
    ``infra_error`` and may run again."""


class UnsupportedEvaluator(InfraError):
    """A task's evaluator names a getter or metric that is not implemented."""

    retryable = False  # every attempt would hit it


class EvaluationError(InfraError):
    """The scoring code itself failed on this episode (OSWorld's evaluator raised, or its
    worker process died or could not start): the episode has no score."""

    retryable = False  # the actions are done; another attempt redoes them all


class EvaluatorRaised(EvaluationError):
    """A metric or getter raised on what the agent left (no output file, an empty command
    output, a file it saved that does not parse), natively or in OSWorld's own code (its
    worker answered, with the error): unlike a worker that died, timed out or cannot start,
    or a desktop that did not answer. The episode is the agent's failure (reward 0, the
    reason kept as ``evaluation_error``), not an infra_error."""


class ModelRequestError(RolloutError):
    """The model server rejected the request (HTTP 4xx); retrying cannot help.

    ``status`` is the HTTP status and ``server_message`` the server's own explanation.
    """

    def __init__(self, status: int, server_message: str, endpoint: str = "") -> None:
        where = f" from {endpoint}" if endpoint else ""
        super().__init__(f"model request rejected{where} (HTTP {status}): {server_message}")
        self.status = status
        self.server_message = server_message
        self.endpoint = endpoint
        # A wrong key, no permission, or a model name the server does not serve: every
        # request of the run would get the same answer.
        self.fatal = status in (401, 403, 404)


class ContextTooShort(ModelRequestError):
    """A request needs more tokens than the endpoint's context (``max_model_len``) holds; it
    was not sent, since the server would refuse it (HTTP 400). The run's settings make every
    step about as long, so the run stops: lower ``agent.history_images`` or
    ``agent.max_pixels``, or serve a longer context."""

    def __init__(self, needed: int, limit: int, what: str, endpoint: str = "") -> None:
        super().__init__(400, f"not sent: {what} need at least {needed} tokens, more than the "
                         f"{limit} the endpoint serves (max_model_len); lower "
                         "agent.history_images or agent.max_pixels, or raise the server's "
                         "--max-model-len (model_pool.max_model_len)", endpoint)
        self.needed = needed
        self.limit = limit
        self.fatal = True


class FleetError(RolloutError):
    """The model fleet cannot be started or controlled (its state dir is locked by another
    supervisor, no port is free, its control server does not start)."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an error on one line, for a stop or status line: the error behind
    a Ray wrapper (``.cause``), the first non-empty line of its message (Ray's actor errors
    add pid, address and a list of causes on later lines), cut at ``limit`` characters."""
    cause = getattr(exc, "cause", None) or exc
    line = next((x.strip() for x in str(cause).splitlines() if x.strip()), "")
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{type(cause).__name__}: {line}" if line else type(cause).__name__
