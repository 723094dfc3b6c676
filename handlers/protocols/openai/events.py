"""OpenAI's streams as the driver's renderer: each chunk an event of its own; a failure after
the first chunk, OpenAI's error object as one more event (before `[DONE]`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from handlers.engine.base import Pair
from handlers.engine.types import RequestOutput
from handlers.protocols.chat.answer import ChatOptions, ResponseContext
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.openai.chat_render import ChatStream
from handlers.protocols.openai.completion_render import CompletionOptions, CompletionStream
from handlers.protocols.outputs import Event, Renderer, checked_events

Chunks = Callable[[int, RequestOutput], list[dict[str, Any]]]  # (prompt index, output) -> chunks
Status = Callable[[ErrorKind], int]  # the wire's status for an error kind


class OpenAIEvents(Renderer):
    def __init__(self, chunks: Chunks, status: Status) -> None:
        self._chunks = chunks
        self._status = status

    def feed(self, pairs: list[Pair]) -> list[Event]:
        return checked_events(pairs, lambda index, output: [
            Event(chunk) for chunk in self._chunks(index, output)])

    def failed(self, error: GenerationError) -> list[Event]:
        failure = OpenAIError(f"generation failed: {error.message}", kind=ErrorKind.FAILED)
        return [Event(failure.payload(self._status(failure.kind)))]


def chat_events(context: ResponseContext, options: ChatOptions, status: Status
                ) -> OpenAIEvents:
    stream = ChatStream(context, options)
    return OpenAIEvents(lambda _, output: stream.feed(output), status)


def completion_events(context: ResponseContext, options: CompletionOptions, status: Status
                      ) -> OpenAIEvents:
    return OpenAIEvents(CompletionStream(context, options).feed, status)
