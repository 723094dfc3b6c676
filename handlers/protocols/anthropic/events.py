"""Anthropic's Messages API through the driver: its checks (the chat machinery's, refusing in
Anthropic's terms) and its stream renderer (each event on its own; a failure after the first,
Anthropic's `error` event)."""

from __future__ import annotations

from collections.abc import Callable

from handlers.engine.base import Pair
from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.anthropic.errors import (
    AnthropicError,
    generation_failed,
    in_anthropic_terms,
)
from handlers.protocols.anthropic.render import MessageContext, MessageStream
from handlers.protocols.chat.admit import checks as chat_checks
from handlers.protocols.chat.requests import GenerationFields
from handlers.protocols.checks import Checks
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.outputs import Event, Renderer, checked_events


def messages_checks(chat: GenerationFields) -> Checks:
    """The chat checks of the request `chat` stands for, refusing in Anthropic's terms."""
    inner = chat_checks(chat, lambda _: "messages")

    def refusal(exc: RequestValidationError, index: int) -> AnthropicError:
        error = inner.refusal(exc, index)
        return AnthropicError(error.message, error.kind)

    def fit(gen: GenerationRequest, max_model_len: int) -> GenerationRequest:
        with in_anthropic_terms():
            return inner.fit(gen, max_model_len)

    return Checks(refusal, fit, inner.shorten)


class MessageEvents(Renderer):
    def __init__(self, context: MessageContext, status: Callable[[ErrorKind], int]) -> None:
        self._stream = MessageStream(context)
        self._status = status

    def feed(self, pairs: list[Pair]) -> list[Event]:
        return checked_events(pairs, lambda _, output: [
            Event(event) for event in self._stream.feed(output)])

    def failed(self, error: GenerationError) -> list[Event]:
        failure = generation_failed(error)
        return [Event(failure.payload(self._status(failure.kind)), failure=failure.message)]
