"""DJL LMI's error bodies: a refusal is `{"error": "<what is wrong>", "code": <status>}`;
a generation that failed is answered with the non-streaming error answer, whose `details` say
`finish_reason: error`."""

from __future__ import annotations

from typing import Any

from handlers.protocols.errors import REFUSALS, ErrorKind, GenerationError, ProtocolError


class LmiError(ProtocolError):
    """A request the LMI protocol refuses."""

    def payload(self, status: int) -> dict[str, Any]:
        return {"error": self.message, "code": status}


class LmiFailure(ProtocolError):
    """A generation that failed (or was aborted) before its answer was sent."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.FAILED) -> None:
        super().__init__(message, kind)

    def payload(self, status: int) -> dict[str, Any]:
        return failure_body(self.message, status)


def generation_error(error: GenerationError) -> ProtocolError:
    """LMI's answer to a generation the driver stopped: a refusal when the driver refused it
    (the server is overloaded, an unknown session), else a failed generation."""
    if error.kind in REFUSALS:
        return LmiError(error.message, error.kind)
    return LmiFailure(error.message, error.kind)


def failure_body(message: str, status: int) -> dict[str, Any]:
    """DJL LMI schema's non-streaming error answer, plus DJL's `error` message and `code`."""
    details = {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None}
    return {"generated_text": "", "details": details, "error": message, "code": status}
