"""Answers as HTTP responses, and client disconnects.

Starlette cancels a streaming response's task when the client disconnects (ASGI spec < 2.4) or
abandons the body iterator when `send` fails (2.4); neither closes the iterator. So streamed
bodies are closed here, however the response ends, shielded from that cancellation: an `await`
inside a cancelled anyio scope would otherwise be cancelled again before it ran.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from handlers.server.driver import Watch
from handlers.server.framing import Answer, Reply, StreamReply

GONE = 499  # a client that went away; never seen by it (nginx's "client closed request")


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


def to_response(answer: Answer) -> Response:
    if isinstance(answer, StreamReply):
        return ClosingStreamingResponse(_stream_body(answer),
                                        media_type=answer.framing.media_type)
    return json_response(answer)


BINARY_HEADER_LENGTH = "Inference-Header-Content-Length"  # Triton's binary tensor data extension


def json_response(reply: Reply) -> Response:
    """The reply's JSON; with a binary tail, the JSON's length goes in Triton's header."""
    if reply.large:
        return LargeJsonResponse(reply)
    return _encoded(reply, reply.body)


def _encoded(reply: Reply, body: bytes) -> Response:
    if not reply.tail:
        return Response(body, reply.status, reply.headers, media_type=reply.media_type)
    headers = {**reply.headers, BINARY_HEADER_LENGTH: str(len(body) - len(reply.tail))}
    return Response(body, reply.status, headers, media_type="application/octet-stream")


# Large bodies encoding at once: each holds its whole body in memory while it waits.
_ENCODERS = anyio.CapacityLimiter(4)
_SEND_BYTES = 1 << 20


class LargeJsonResponse(Response):
    """A reply too large to encode on the event loop: encoded in a worker thread, in pieces
    (orjson holds the GIL for a whole call), when it is sent."""

    def __init__(self, reply: Reply) -> None:  # noqa: D107 (Response renders in __init__)
        self.reply = reply
        self.status_code = reply.status
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await anyio.to_thread.run_sync(self.reply.body_in_pieces, limiter=_ENCODERS)
        whole = _encoded(self.reply, body)
        await send({"type": "http.response.start", "status": whole.status_code,
                    "headers": whole.raw_headers})
        for start in range(0, max(len(body), 1), _SEND_BYTES):  # the loop runs between sends
            await send({"type": "http.response.body", "body": body[start:start + _SEND_BYTES],
                        "more_body": start + _SEND_BYTES < len(body)})


async def _stream_body(reply: StreamReply) -> AsyncIterator[bytes]:
    try:
        async for events in reply.chunks:
            if data := reply.encode(events):
                yield data
        if reply.framing.trailer is not None:
            yield reply.framing.trailer
    finally:
        with anyio.CancelScope(shield=True):
            await reply.chunks.aclose()


def content_type(media_type: str) -> str:
    """The Content-Type header Starlette sends for a media type (text/* is UTF-8)."""
    return f"{media_type}; charset=utf-8" if media_type.startswith("text/") else media_type


def disconnect_watch(request: Request) -> Watch:
    """What returns once the client disconnected; use it only after the body was read (it
    consumes the ASGI receive channel)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return watch
