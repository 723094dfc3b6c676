"""The Responses API's stream as the driver's renderer: `response.created` and
`response.in_progress` open it, each step's events go in one chunk, a failure after the first
is `response.failed`, and the finished response is kept (`keep`) once the last output is in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from handlers.engine.base import Pair
from handlers.engine.types import RequestOutput
from handlers.protocols.errors import GenerationError
from handlers.protocols.openai_responses.render import ResponsesStream
from handlers.protocols.outputs import Event, Renderer, checked_events


class ResponsesEvents(Renderer):
    event_per_chunk = False

    def __init__(self, stream: ResponsesStream, keep: Callable[[dict[str, Any]], None]) -> None:
        self._stream = stream
        self._keep = keep
        self._started = False

    def feed(self, pairs: list[Pair]) -> list[Event]:
        opening = [] if self._started else self._stream.start()  # numbered first
        self._started = True
        return [Event(event) for event in opening] + checked_events(pairs, self._output_events)

    def _output_events(self, _: int, output: RequestOutput) -> list[Event]:
        return [Event(event) for seq in output.outputs
                for event in self._stream.feed(seq.tokens, seq.finish_reason,
                                               output.prompt_token_count, seq.generated_tokens)]

    def failed(self, error: GenerationError) -> list[Event]:
        return [Event(e) for e in self._stream.fail(f"generation failed: {error.message}")]

    def done(self) -> list[Event]:
        self._keep(self._stream.response)
        return []
