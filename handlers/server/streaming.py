"""Client disconnects and engine streams: a client that goes away cancels its request.

Starlette cancels a streaming response's task when the client disconnects (ASGI spec < 2.4) or
abandons the body iterator when `send` fails (2.4); neither closes the iterator. So responses
here close their iterators themselves, and every close runs shielded from that cancellation:
an `await` inside a cancelled anyio scope would otherwise be cancelled again before it ran.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from handlers.engine.base import Engine

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, however the response ends."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Await `work()`, cancelling it (ClientDisconnected) if the client disconnects first.

    Call only after the body was read: the watcher consumes the ASGI receive channel.
    """
    gone = False
    result: T
    failure: Exception | None = None

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        try:
            result = await work()
        except Exception as exc:  # re-raised below as itself, not inside an ExceptionGroup
            failure = exc
        tg.cancel_scope.cancel()
    if gone:
        raise ClientDisconnected
    if failure is not None:
        raise failure
    return result


async def cancel_generation(engine: Engine, stream: AsyncIterator, request_id: str) -> None:
    """Close an unfinished engine stream and abort its request (the engine frees its slot)."""
    with anyio.CancelScope(shield=True):
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
        await engine.abort(request_id)
