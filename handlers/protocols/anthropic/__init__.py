"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Modules: `requests` (pydantic models), `prepare` (body -> a chat request rendered through the
chat machinery, handlers/protocols/chat/ -> the engine request), `render` (message objects and
stream events, pure), `events` (its checks and stream renderer for the driver), `errors`
(Anthropic's error shape).
"""

from handlers.protocols.anthropic.errors import (
    AnthropicError,
    error_body,
    generation_failed,
    in_anthropic_terms,
    not_a_text_model,
)
from handlers.protocols.anthropic.events import MessageEvents, messages_checks
from handlers.protocols.anthropic.prepare import MessagesJob, count_tokens, prepare_messages
from handlers.protocols.anthropic.render import MessageStream, render_message
from handlers.protocols.anthropic.requests import VERSION_HEADER

__all__ = [
    "VERSION_HEADER",
    "AnthropicError",
    "MessageEvents",
    "MessageStream",
    "MessagesJob",
    "count_tokens",
    "error_body",
    "generation_failed",
    "in_anthropic_terms",
    "messages_checks",
    "not_a_text_model",
    "prepare_messages",
    "render_message",
]
