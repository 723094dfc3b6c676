"""Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`, the error's type
following its status as Anthropic's API pairs them (400 invalid_request_error, 404
not_found_error, 529 overloaded_error...); the wire's status table is handlers/server/status.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.errors import REFUSALS, ErrorKind, GenerationError, ProtocolError
from handlers.protocols.outputs import Failure

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicError(ProtocolError):
    """A request the Anthropic protocol refuses or fails."""

    def payload(self, status: int) -> dict[str, Any]:
        return error_body(status, self.message)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def model_not_found(model: str, served: str, adapters: Sequence[str] = ()) -> AnthropicError:
    also = f" and its LoRA adapters {', '.join(adapters)}" if adapters else ""
    return AnthropicError(f"model: '{model}' is not served here; this server serves '{served}'"
                          f"{also}", ErrorKind.NOT_FOUND)


def not_a_text_model(model: str) -> AnthropicError:
    return AnthropicError(f"model: '{model}' is an embedding model: this server generates no "
                          "text (option.task=text-embedding)", ErrorKind.NOT_FOUND)


def generation_failed(failure: Failure | GenerationError) -> AnthropicError:
    """A generation that failed: the engine's reason, unless the engine itself crashed (its
    exception is a bug's detail, not the client's business)."""
    if isinstance(failure, GenerationError):
        if failure.crashed:
            return AnthropicError("internal server error", ErrorKind.INTERNAL)
        if failure.kind in REFUSALS:
            return AnthropicError(failure.message, failure.kind)
    return AnthropicError(f"generation failed: {failure.message}", failure.kind)


@contextmanager
def in_anthropic_terms() -> Iterator[None]:
    """The chat machinery's refusals (OpenAIError, handlers/protocols/chat/), as Anthropic's
    errors."""
    try:
        yield
    except OpenAIError as exc:
        raise AnthropicError(exc.message, exc.kind) from None
