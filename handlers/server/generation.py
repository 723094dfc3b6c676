"""The one generation driver: every route, the DJL entry and the gRPC servicer validate, submit,
collect or stream through it.

A request's life: the engine validates each engine request and the protocol's `Checks` name its
refusals and fit its output length to the context (`validated`: new requests, never edited);
admission; then `complete` (every output folded, a failure raised as GenerationError) or
`stream` (200 once the first events are ready, so a failure before them still gets an error
status; then the protocol's `Renderer` turns each step into events, and a failure into its last
ones).

A `Generation` is one client request's engine requests in flight: admitted against
`job_queue_size`, submitted together (as one job to an engine that runs groups, else merged from
one stream per request), read as groups of `(index, output)` pairs, bounded by the request's
deadline, and aborted when closed unfinished (a client that went away, a failure, a timeout).
The engine raising, or ending a request without finishing it, is a `GenerationError`, once,
here; each protocol says it in its own shape.

Every close runs shielded: a client's disconnect cancels the task that would otherwise
abandon an engine request half-done, holding its batch slot and cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import anyio

from handlers.engine.base import Engine, GroupEngine, Pair, SteppableEngine
from handlers.engine.types import (
    EngineFailure,
    FinishReason,
    GenerationRequest,
    RequestValidationError,
)
from handlers.protocols.checks import Checks
from handlers.protocols.errors import ErrorKind, GenerationError
from handlers.protocols.outputs import UNFINISHED, Event, Folded, Renderer, raise_failure
from handlers.server.framing import Framing, StreamReply
from handlers.server.telemetry import RequestObserver

log = logging.getLogger(__name__)

T = TypeVar("T")
Watch = Callable[[], Awaitable[None]]  # returns once the client has gone away


class ClientGone(Exception):
    """The client went away before its answer was ready; its requests were aborted."""


class Admission:
    """`job_queue_size`: how many client requests the server holds at once, queued or running;
    one more is refused at once (never queued without bound)."""

    def __init__(self, limit: int, on_reject: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.held = 0
        self._on_reject = on_reject  # counts the refusal for /metrics

    def acquire(self) -> None:
        if self.held >= self.limit:
            if self._on_reject is not None:
                self._on_reject()
            raise GenerationError(
                f"the server is at its limit of {self.limit} requests (job_queue_size); "
                "retry later", ErrorKind.OVERLOADED)
        self.held += 1

    def release(self) -> None:
        self.held -= 1


class Generation:
    """One client request's engine requests, from submission to their last output."""

    def __init__(self, engine: Engine, requests: list[GenerationRequest],
                 admission: Admission | None = None, timeout: float | None = None,
                 outcome: Callable[[bool], None] | None = None,
                 observer: RequestObserver | None = None,
                 timeout_source: str = "option.predict_timeout") -> None:
        if admission is not None:
            admission.acquire()
        self._admission = admission
        self._engine = engine
        self.requests = requests
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._timeout_source = timeout_source  # which deadline `timeout` is, for the error
        self._outcome = outcome or (lambda ok: None)  # each engine request's: failed or not
        self._open = set(range(len(requests)))  # requests not finished yet
        self._observer = observer  # what /metrics learns of each output
        if isinstance(engine, GroupEngine):
            self._source = engine.submit(requests)
        else:
            self._source = _merged(engine, requests)
        self._closed = False

    async def next(self) -> list[Pair] | None:
        """The outputs that arrived together; None once every request finished."""
        if not self._open:
            await self.aclose()
            return None
        try:
            with self._deadline_scope():
                pairs = await anext(self._source, None)
        except TimeoutError:
            await self.aclose()
            raise GenerationError(f"the request ran past its deadline of {self._timeout:g} s "
                                  f"({self._timeout_source})", ErrorKind.TIMEOUT) from None
        except GenerationError:
            await self.aclose()
            raise
        except Exception as exc:
            if not isinstance(exc, EngineFailure):  # the engine's supervisor handles those
                self._outcome(False)
            await self.aclose()
            raise GenerationError(str(exc) or type(exc).__name__, crashed=True) from exc
        if pairs is None:
            await self.aclose()
            raise GenerationError(UNFINISHED)
        if self._observer is not None:
            self._observer.outputs(pairs)
        for index, output in pairs:
            if output.finished:
                self._open.discard(index)
                self._outcome(not any(seq.finish_reason == FinishReason.ERROR
                                      for seq in output.outputs))
        return pairs

    async def __aiter__(self) -> AsyncIterator[list[Pair]]:
        try:
            while (pairs := await self.next()) is not None:
                yield pairs
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Abort what is still running and give the admission back (idempotent). Each
        unfinished request is aborted by its id as well: an engine's own clean-up may not get
        to run inside a cancelled task."""
        if self._closed:
            return
        self._closed = True
        if self._observer is not None:
            self._observer.abandoned(self._open)
        with anyio.CancelScope(shield=True):
            await self._source.aclose()
            for index in sorted(self._open):
                await self._engine.abort(self.requests[index].request_id)
        if self._admission is not None:
            self._admission.release()

    def _deadline_scope(self) -> AbstractContextManager:
        """A cancel scope up to the deadline; none at all without one (a scope per output was
        ~10% of the HTTP thread's work at one stream)."""
        if self._deadline is None:
            return nullcontext()
        return anyio.fail_after(max(self._deadline - time.monotonic(), 0))


async def _merged(engine: Engine, requests: list[GenerationRequest]
                  ) -> AsyncIterator[list[Pair]]:
    """The requests' output streams interleaved as their outputs arrive; closing it closes
    every stream (the engine aborts the unfinished requests)."""
    streams = [engine.generate(request) for request in requests]
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield [(0, output)]
        finally:
            with anyio.CancelScope(shield=True):
                await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, done))
        except Exception as exc:
            queue.put_nowait((index, exc))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            pairs = []
            for index, item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is done:
                    running -= 1
                else:
                    pairs.append((index, item))
            if pairs:
                yield pairs
    finally:
        for task in pumps:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pumps, return_exceptions=True)


async def until_gone(watch: Watch | None, work: Callable[[], Awaitable[T]]) -> T:
    """Await `work()`, cancelling it (ClientGone) if `watch` returns first."""
    if watch is None:
        return await work()
    gone = False
    result: T
    failure: Exception | None = None

    async def watcher(scope: anyio.CancelScope) -> None:
        nonlocal gone
        await watch()
        gone = True
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher, tg.cancel_scope)
        try:
            result = await work()
        except Exception as exc:  # re-raised below as itself, not inside an ExceptionGroup
            failure = exc
        tg.cancel_scope.cancel()
    if gone:
        raise ClientGone
    if failure is not None:
        raise failure
    return result


async def collect(generation: Generation, fold: Callable[[list[Pair]], None],
                  watch: Watch | None = None) -> None:
    """Read the whole generation into `fold`; ClientGone or GenerationError when it stops
    short (its requests are aborted either way)."""
    async def work() -> None:
        async for pairs in generation:
            fold(pairs)

    try:
        await until_gone(watch, work)
    finally:
        await generation.aclose()


async def first(generation: Generation, accept: Callable[[list[Pair]], T | None],
                watch: Watch | None = None) -> T | None:
    """Read until `accept` returns something (what a stream's first chunk needs), so that a
    failure before it still gets an error status; None if the generation ended first. The
    generation stays open for the rest; it is closed if this raises."""
    async def work() -> T | None:
        while (pairs := await generation.next()) is not None:
            if (accepted := accept(pairs)) is not None:
                return accepted
        return None

    try:
        return await until_gone(watch, work)
    except BaseException:
        await generation.aclose()
        raise


def validated(engine: Engine, requests: list[GenerationRequest], checks: Checks
              ) -> list[GenerationRequest]:
    """Each request checked by the engine (its prompt tokenized) and by the protocol, its
    output length fitted; the protocol's error for the first one refused."""
    accepted = []
    for index, request in enumerate(requests):
        try:
            request = _engine_checked(engine, request, checks)
        except RequestValidationError as exc:
            raise checks.refusal(exc, index) from None
        if checks.fit is not None:
            request = checks.fit(request, engine.max_model_len)
        accepted.append(request)
    return accepted


def _engine_checked(engine: Engine, request: GenerationRequest, checks: Checks
                    ) -> GenerationRequest:
    try:
        engine.validate(request)
        return request
    except RequestValidationError as exc:
        if exc.field != "inputs" or checks.shorten is None:
            raise
        shorter = checks.shorten(request, engine.max_model_len)
        if shorter is None:
            raise
        engine.validate(shorter)
        return shorter


async def complete(generation: Generation, watch: Watch | None = None) -> list[Folded]:
    """Every request run to its end and folded (each output stamped with when it arrived);
    GenerationError as soon as one failed (the others are aborted)."""
    folded = [Folded() for _ in generation.requests]

    def fold(pairs: list[Pair]) -> None:
        now = time.monotonic()
        for index, output in pairs:
            raise_failure(output)
            folded[index].add(output, now)

    await collect(generation, fold, watch)
    for acc in folded:
        if (failure := acc.failure()) is not None:
            raise GenerationError(failure.message, failure.kind)
    return folded


async def stream(generation: Generation, renderer: Renderer, framing: Framing,
                 watch: Watch | None = None) -> StreamReply:
    """The answer as a stream that starts once its first events are ready: a failure before
    them raises (GenerationError, or the protocol's refusal) for an error status."""
    opening = await first(generation, lambda pairs: renderer.feed(pairs) or None, watch)
    return StreamReply(events(generation, renderer, opening or []), framing)


async def events(generation: Generation, renderer: Renderer, opening: list[Event] | None = None
                 ) -> AsyncIterator[list[Event]]:
    """The stream's chunks: `opening`, each step's events, the closing ones; a failure on the
    way is the renderer's last events. Closing it aborts what still runs."""
    try:
        for chunk in _chunks(renderer, opening or []):
            yield chunk
        while not renderer.ended and (pairs := await generation.next()) is not None:
            for chunk in _chunks(renderer, renderer.feed(pairs)):
                yield chunk
        for chunk in _chunks(renderer, renderer.done()):
            yield chunk
    except GenerationError as exc:
        log.warning("generation failed mid-stream: %s", exc.message)
        if ending := renderer.failed(exc):
            yield ending
    finally:
        await generation.aclose()


def _chunks(renderer: Renderer, events: list[Event]) -> list[list[Event]]:
    if renderer.event_per_chunk:
        return [[event] for event in events]
    return [events] if events else []


def stepped(engine: SteppableEngine, requests: list[GenerationRequest]) -> Iterator[list[Pair]]:
    """The synchronous driver, for a caller that steps the engine itself (the DJL entry):
    queue validated requests and yield each step's outputs until all of them finished.
    Closing early, or an error in a step, cancels what still runs."""
    position = {request.request_id: i for i, request in enumerate(requests)}
    running = set(position)
    for request in requests:
        engine.add(request)
    try:
        while running:
            if not engine.has_work:
                raise GenerationError(UNFINISHED)
            pairs = [(position[out.request_id], out) for out in engine.step()
                     if out.request_id in position]
            running -= {requests[i].request_id for i, out in pairs if out.finished}
            yield pairs
    finally:
        for request_id in running:
            engine.cancel(request_id)
