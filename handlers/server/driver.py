"""The one generation driver: every route, the DJL entry and the gRPC servicer validate,
collect or stream through it.

A request's life: the engine validates each engine request and the protocol's `Checks` name its
refusals and fit its output length to the context (`validated`: new requests, never edited);
admission and submission (`ServerContext.generation`, a `Generation`); then `complete` (every
output folded, a failure raised as GenerationError) or `stream` (200 once the first events are
ready, so a failure before them still gets an error status; then the protocol's `Renderer`
turns each step into events, and a failure into its last ones). `stepped` is the synchronous
driver for a caller that steps the engine itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from itertools import accumulate
from typing import TypeVar

import anyio

from handlers.engine.base import Engine, Pair, SteppableEngine
from handlers.engine.limits import check_limits
from handlers.engine.media import MediaError
from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.checks import Checks
from handlers.protocols.errors import GenerationError
from handlers.protocols.outputs import UNFINISHED, Event, Folded, Renderer, raise_failure
from handlers.server.framing import Framing, StreamReply
from handlers.server.generation import ClientGone, Generation

log = logging.getLogger(__name__)

T = TypeVar("T")
Watch = Callable[[], Awaitable[None]]  # returns once the client has gone away


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


def bounded(requests: list[GenerationRequest], limit: int, checks: Checks) -> None:
    """Refuse, in the protocol's shape, a client request that asks for more than `limit`
    sequences in all (each prompt counts max(n, best_of)), before any is tokenized: naming the
    first prompt past the limit, or `n` / `best_of` for a request of one prompt."""
    counts = [request.params.num_sequences for request in requests]
    if sum(counts) <= limit:
        return
    allowed = (f"a request may ask for at most {limit} (option.max_client_batch_size, "
               "at most job_queue_size)")
    if len(requests) == 1:
        params = requests[0].params
        field = "best_of" if (params.best_of or 0) >= params.n else "n"
        raise checks.refusal(RequestValidationError(
            field, f"{counts[0]} sequences asked for; {allowed}"), 0)
    past = next(i for i, total in enumerate(accumulate(counts)) if total > limit)
    raise checks.refusal(RequestValidationError(
        "inputs", f"{len(requests)} prompts ask for {sum(counts)} sequences; {allowed}"), past)


def validated(engine: Engine, requests: list[GenerationRequest], checks: Checks
              ) -> list[GenerationRequest]:
    """Each request checked by the engine (its prompt tokenized) and by the protocol, its
    output length fitted, then against what any engine can run (engine/limits.py); the
    protocol's error for the first one refused."""
    accepted = []
    for index, request in enumerate(requests):
        request = with_media(request, checks, index)  # read already where the server read them
        try:
            request = _engine_checked(engine, request, checks)
        except RequestValidationError as exc:
            raise checks.refusal(exc, index) from None
        if checks.fit is not None:  # the protocol's own refusal of a length comes first
            request = checks.fit(request, engine.max_model_len)
        try:
            check_limits(request, engine.tokenizer.vocab_size, engine.max_model_len)
        except RequestValidationError as exc:
            raise checks.refusal(exc, index) from None
        accepted.append(request)
    return accepted


def with_media(request: GenerationRequest, checks: Checks, index: int) -> GenerationRequest:
    """The request with its pending media read (fetched, checked, decoded); a part that cannot
    be used is the protocol's refusal naming it."""
    if request.pending_media is None:
        return request
    try:
        media = request.pending_media()
    except MediaError as exc:
        raise checks.refusal(RequestValidationError(exc.where, exc.detail), index) from None
    return replace(request, media=media, pending_media=None)


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
