"""LMI's streams as the driver's renderers: rolling batch's token lines (`TokenEvents`) and
dynamic batching's `{"outputs": [...]}` lines (`LineEvents`), each step's in one chunk."""

from __future__ import annotations

from collections.abc import Callable

from handlers.engine.base import Pair
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.lmi.dynamic import StreamLines
from handlers.protocols.lmi.formatters import (
    RenderOptions,
    StreamRenderer,
    StreamStyle,
    early_failure,
)
from handlers.protocols.outputs import Event, Renderer


class TokenEvents(Renderer):
    """A request that fails before its first token is an error status; once tokens may have
    gone out, a failure is LMI's error line."""

    event_per_chunk = False

    def __init__(self, opts: RenderOptions, style: StreamStyle) -> None:
        self._lines = StreamRenderer(opts, style)
        self._started = False

    def feed(self, pairs: list[Pair]) -> list[Event]:
        if pairs and not self._started:
            self._started = True
            if (failed := early_failure(pairs[0][1])) is not None:
                raise GenerationError(failed.message, failed.kind)
        return [event for _, output in pairs for event in self._lines.feed(output)]

    def failed(self, error: GenerationError) -> list[Event]:
        return [] if self._lines.done else [self._lines.error(error.message)]

    @property
    def ended(self) -> bool:
        return self._lines.done


class LineEvents(Renderer):
    """A batch that fails before any text is an error status; after text went out, one failed
    input ends the stream with DJL's failure line (`status`: the wire's status of a kind)."""

    event_per_chunk = False

    def __init__(self, inputs: int, status: Callable[[ErrorKind], int]) -> None:
        self._lines = StreamLines(inputs)
        self._status = status
        self._sent = False

    def feed(self, pairs: list[Pair]) -> list[Event]:
        line = self._lines.feed(pairs)
        failure = self._lines.failure
        if line is None:
            if failure is not None and not self._sent:
                raise GenerationError(failure.message, failure.kind)
            return []
        self._sent = True
        return [line]

    def failed(self, error: GenerationError) -> list[Event]:
        return [self._lines.error(error.message, self._status(error.kind))]

    def done(self) -> list[Event]:
        failure = self._lines.failure
        return [] if failure is None else [self._lines.error(failure.message,
                                                             self._status(failure.kind))]

    @property
    def ended(self) -> bool:
        return self._lines.done
