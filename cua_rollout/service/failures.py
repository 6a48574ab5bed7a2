"""An error of the service as a value (vLLM's habit): what the caller did or met, by its
``ErrorCode`` and one line of reason; ``app.py`` turns it into ``ErrorBody`` with its HTTP
status at the edge."""

from __future__ import annotations

from cua_rollout.envs.service_protocol import ERROR_STATUS, ErrorBody, ErrorCode

__all__ = ["Refusal"]


class Refusal(Exception):
    """A request the service answers with an error: ``code``, the reason (naming the field,
    env id, tenant or desktop) and, for a wait that ran out, when to ask again."""

    def __init__(self, code: ErrorCode, reason: str, *, retry_after_s: float | None = None
                 ) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def body(self) -> ErrorBody:
        return ErrorBody(error=self.reason, code=self.code, retry_after_s=self.retry_after_s)
