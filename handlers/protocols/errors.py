"""Errors in protocol-neutral kinds. A protocol's error class says what went wrong and renders
its own body; which status a kind gets is the wire's business (handlers/server/status.py). The
one body several protocols share, KServe's and Triton's, is here; OpenAI's, which every
chat-shaped protocol answers with, is handlers/protocols/chat/errors.py."""

from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorKind(Enum):
    VALIDATION = "validation"  # the request is malformed, out of range, or too long
    NOT_FOUND = "not_found"  # another model, another route's object
    UNSUPPORTED = "unsupported"  # a part of the protocol this server does not implement
    TOO_LARGE = "too_large"  # the body is over max_request_size
    OVERLOADED = "overloaded"  # admission refused: the server holds job_queue_size requests
    UNAVAILABLE = "unavailable"  # still loading, or shutting down (the request was aborted)
    TIMEOUT = "timeout"  # the request ran past its deadline
    SLOW_BODY = "slow_body"  # the request's body stopped arriving (client_body_timeout)
    FAILED = "failed"  # the engine failed the request
    INTERNAL = "internal"  # a bug
    SESSION = "session"  # a stateful session that is unknown, closed or expired


# What the driver refuses a request with before any engine saw it: said as they are, never as
# a failed generation.
REFUSALS = frozenset({ErrorKind.OVERLOADED, ErrorKind.SESSION})


class ProtocolError(Exception):
    """A request a protocol refuses or fails; subclasses render the protocol's error body."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind

    def payload(self, status: int) -> Any:
        """The error body, as a plain object, for a wire status."""
        raise NotImplementedError


class KServeError(ProtocolError):
    """The error body of KServe's V1 and V2 and of Triton's generate extension:
    `{"error": "<message>"}`."""

    def payload(self, status: int) -> dict[str, Any]:
        return {"error": self.message}

    @classmethod
    def of(cls, error: GenerationError) -> KServeError:
        return cls(error.message, error.kind)


class GenerationError(Exception):
    """Why a generation stopped short, as the generation driver reports it: the engine raised
    (`crashed`), ended the request without finishing it, or the deadline passed (TIMEOUT)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.FAILED,
                 crashed: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.crashed = crashed
